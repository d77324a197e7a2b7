"""A forward + backward step captured in a CUDA graph and replayed, stepped as torchtitan 0.3.0's
``CUDAGraphWrapper`` steps it (``torchtitan/distributed/cudagraph.py``): the first call runs on a
side stream (the warm-up), the second captures into a graph pool with
``capture_error_mode="thread_local"`` on that stream, and every call from the second on copies its
tensors into the captured inputs and replays. The optimizer stays outside, as in torchtitan.

``capture_error_mode="global"`` (a plain ``torch.cuda.graph``'s default) captures on
``torch.cuda.graph``'s own stream into a private pool instead.
"""

from __future__ import annotations

import torch


_SIDE_STREAMS: dict[int, torch.cuda.Stream] = {}


def _side_stream(device: int) -> torch.cuda.Stream:
    """One side stream per device for every step, as torchtitan's graph manager keeps one: torch
    keeps a cuBLAS workspace per stream for the life of the process, so a stream per step would
    grow memory with every capture."""
    if device not in _SIDE_STREAMS:
        _SIDE_STREAMS[device] = torch.cuda.Stream(device)
    return _SIDE_STREAMS[device]


class CapturedStep:
    def __init__(self, fn, capture_error_mode: str = "thread_local"):
        if capture_error_mode not in ("thread_local", "global"):
            raise ValueError(f"capture_error_mode {capture_error_mode!r}: expected 'thread_local' "
                             "(torchtitan's) or 'global' (torch.cuda.graph's default)")
        self.fn, self.mode = fn, capture_error_mode
        self.calls = 0
        self.graph = self.inputs = self.output = None
        self.side = _side_stream(torch.cuda.current_device())

    @property
    def replays(self) -> int:
        return max(self.calls - 1, 0)

    def __call__(self, *inputs):
        self.calls += 1
        if self.calls == 1:  # the warm-up, on the side stream
            self.side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self.side):
                out = self.fn(*inputs)
            torch.cuda.current_stream().wait_stream(self.side)
            return out
        if self.graph is None:
            self.inputs = inputs
            self.graph = torch.cuda.CUDAGraph()
            kwargs = ({"pool": torch.cuda.graph_pool_handle(), "stream": self.side,
                       "capture_error_mode": "thread_local"} if self.mode == "thread_local" else {})
            with torch.cuda.graph(self.graph, **kwargs):
                self.output = self.fn(*self.inputs)
        for mine, new in zip(self.inputs, inputs):
            if isinstance(mine, torch.Tensor) and mine is not new:
                mine.copy_(new)
        self.graph.replay()
        return self.output
