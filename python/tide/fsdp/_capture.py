"""CUDA graph capture, as tide.fsdp meets it: which capture a stream is in, and the one error for
what a graph cannot replay. A captured step records TIDE's collectives (the executor records them
so that every replay runs them again); what the host decides per step (which window a group holds,
where its address maps) is decided once, at capture, and must then hold at every replay."""

from __future__ import annotations

import torch

from .. import _tide


def capture_id(stream: torch.cuda.Stream) -> int:
    """The CUDA graph capture `stream` is in, 0 when none (callers pass the stream they use
    anyway: the current stream costs a Stream object each time it is asked for)."""
    return _tide.cuda_capture_id(stream.cuda_stream)


def not_capturable(path: str, what: str, instead: str) -> RuntimeError:
    """The error for something of a handled group that a CUDA graph cannot replay, raised while
    the graph is captured: before any of it is recorded."""
    return RuntimeError(f"tide.fsdp: param group {path}: {what}, which a CUDA graph cannot replay; "
                        f"{instead}")
