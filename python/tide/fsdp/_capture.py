"""CUDA graph capture, as tide.fsdp meets it: which capture a stream is in, the one error for what a
graph cannot replay, and the hook before each replay. A captured step records TIDE's collectives
(the executor records them so that every replay runs them again); what the host decides per step
(which window a group holds, where its address maps) is decided once, at capture, and must then
hold at every replay. docs/DESIGN.md section 4 states the rule (a captured window belongs to its
graphs)."""

from __future__ import annotations

import threading
from typing import Callable

import torch

from .. import _tide


def capture_id(stream: torch.cuda.Stream) -> int:
    """The CUDA graph capture `stream` is in, 0 when none (callers pass the stream they use
    anyway: the current stream costs a Stream object each time it is asked for)."""
    return _tide.cuda_capture_id(stream.cuda_stream)


def current_capture(device: torch.device) -> int:
    """The capture the current stream of `device` is in (0: none, and always 0 off CUDA)."""
    return capture_id(torch.cuda.current_stream(device)) if device.type == "cuda" else 0


def not_capturable(path: str, what: str, instead: str) -> RuntimeError:
    """The error for something of a handled group that a CUDA graph cannot replay, raised while
    the graph is captured: before any of it is recorded."""
    return RuntimeError(f"tide.fsdp: param group {path}: {what}, which a CUDA graph cannot replay; "
                        f"{instead}")


# Before a replay. A replay runs no Python, yet rewrites the windows of the groups it captured:
# parameters FSDP2 holds unsharded on such a window (left by an uncaptured forward or unshard())
# would read what the replay wrote. So torch.cuda.CUDAGraph.replay runs, while tide.fsdp is enabled
# anywhere, each callback registered by the calling thread first (ranks as threads each have
# their own models). A replay through torch._C._CUDAGraph directly is not seen.
_before_replay: dict[int, list[Callable[[], None]]] = {}  # thread id -> callbacks
_lock = threading.Lock()
_stock_replay = None


def _replay(graph, *args, **kwargs):
    for callback in _before_replay.get(threading.get_ident(), ()):
        callback()
    return _stock_replay(graph, *args, **kwargs)


def add_before_replay(callback: Callable[[], None]) -> None:
    """Runs `callback` before every replay this thread launches, until remove_before_replay."""
    global _stock_replay
    with _lock:
        if _stock_replay is None and hasattr(torch.cuda, "CUDAGraph"):
            _stock_replay = torch.cuda.CUDAGraph.replay
            torch.cuda.CUDAGraph.replay = _replay
        _before_replay.setdefault(threading.get_ident(), []).append(callback)


def remove_before_replay(callback: Callable[[], None]) -> None:
    global _stock_replay
    with _lock:
        for thread, callbacks in list(_before_replay.items()):
            if callback in callbacks:
                callbacks.remove(callback)
                if not callbacks:
                    del _before_replay[thread]
        if not _before_replay and _stock_replay is not None:
            torch.cuda.CUDAGraph.replay = _stock_replay
            _stock_replay = None
