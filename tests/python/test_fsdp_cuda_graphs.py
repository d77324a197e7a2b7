"""tide.fsdp under CUDA graph capture, stepped as torchtitan 0.3.0 steps by default (warm-up steps
on a side stream, then one capture with ``torch.cuda.graph(..., capture_error_mode="thread_local")``):
TIDE's collectives cannot be captured yet, so the capture must fail with TIDE's own error naming
the param group, on every rank, never an opaque CUDA error or a stale replay; eager steps before it
train as usual. W = 2 ranks as processes sharing one GPU (gloo between them). Skips without CUDA.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.distributed.fsdp import fully_shard

import fsdp_harness as h
import tide
import tide.fsdp

pytestmark = pytest.mark.skipif(not (tide.cuda_built and torch.cuda.is_available()),
                                reason="needs a CUDA build of TIDE and a GPU")


def capture_a_step(rank: int, world: int, device) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.ReLU()) for _ in range(4)]).to(device)
    for block in model:
        fully_shard(block)
    fully_shard(model)
    handle = tide.fsdp.enable(model, timeout_ms=60000)
    x = torch.randn(8, 64, device=device)
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):  # torchtitan's warm-up steps
        for _ in range(2):
            model(x).sum().backward()
    torch.cuda.current_stream(device).wait_stream(side)
    torch.cuda.synchronize(device)
    eager_all_gathers = handle.counts()["all_gathers"]
    graph = torch.cuda.CUDAGraph()
    error = ""
    try:
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            model(x).sum().backward()
    except Exception as e:  # noqa: BLE001 - reported to the test
        chain = [e]
        while chain[-1].__context__ is not None:
            chain.append(chain[-1].__context__)
        error = " <- ".join(f"{type(c).__name__}: {c}" for c in chain)
    return {"error": error, "eager_all_gathers": eager_all_gathers, "buckets": len(handle.buckets),
            "fallbacks": handle.fallbacks}


def test_capture_reaching_a_tide_collective_raises_naming_the_group():
    for rank, r in enumerate(h.run_processes(2, capture_a_step, device_type="cuda")):
        assert r["buckets"] == 4 and r["fallbacks"] == [], r  # the 4 blocks (the root holds no params)
        assert r["eager_all_gathers"] > 0, r  # the warm-up steps ran through TIDE
        assert "TIDE's collectives cannot be captured yet" in r["error"], f"rank {rank}: {r['error']}"
        assert "tide.fsdp: param group 0: its all-gather" in r["error"], f"rank {rank}: {r['error']}"
