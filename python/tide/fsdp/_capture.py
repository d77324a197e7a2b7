"""CUDA graph capture, as tide.fsdp meets it: which capture a stream is in, and the one error for
what a graph cannot replay. A captured step records TIDE's collectives (the executor records them
so that every replay runs them again); what the host decides per step (which window a group holds,
where its address maps) is decided once, at capture, and must then hold at every replay."""

from __future__ import annotations

import torch

from .. import _tide


def capture_id(device: torch.device) -> int:
    """The CUDA graph capture the current stream of `device` is in, 0 when none."""
    return _tide.cuda_capture_id(torch.cuda.current_stream(device).cuda_stream)


def not_capturable(path: str, what: str, instead: str) -> RuntimeError:
    """The error for something of a handled group that a CUDA graph cannot replay, raised while
    the graph is captured: before any of it is recorded."""
    return RuntimeError(f"tide.fsdp: param group {path}: {what}, which a CUDA graph cannot replay; "
                        f"{instead}")
