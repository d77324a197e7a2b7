"""tide-bench interference: a one-wave bf16 GEMM alone, beside TIDE-RS and beside NCCL's
reduce-scatter, on every GPU at once (one rank per GPU, ranks launched by tide-bench).

The background collective is enqueued on its own stream, enough runs to outlast the timed GEMMs
three times over (the same count on every rank); the GEMMs are timed with CUDA events. Reported:
the median and the mean GEMM time per rank (TIDE-RS's reduce kernel runs only part of each
collective, so it slows some GEMMs and not others: the median alone can hide it)."""

from __future__ import annotations

import math
import statistics

import torch
import torch.distributed as dist

from .. import _tide
from ..distributed import store_bootstrap

M, N, K = 2048, 1024, 16384
GRAD_MIB = 256


def _time_each(stream, iters, fn) -> list:
    pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
             for _ in range(iters)]
    with torch.cuda.stream(stream):
        for start, end in pairs:
            start.record(stream)
            fn()
            end.record(stream)
    stream.synchronize()
    return [1000.0 * s.elapsed_time(e) for s, e in pairs]  # microseconds


def _agree_max(value: int) -> int:
    t = torch.tensor([value], device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def run_interference(rank: int, world: int, opts: dict) -> dict:
    iters = opts["iters"]
    gen = torch.Generator(device="cuda").manual_seed(7 + rank)
    a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, generator=gen)
    b = torch.randn(K, N, device="cuda", dtype=torch.bfloat16, generator=gen)
    c = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
    gemm_stream, background = torch.cuda.Stream(), torch.cuda.Stream()

    def gemm():
        torch.matmul(a, b, out=c)

    _time_each(gemm_stream, 10, gemm)  # warm-up (cuBLAS picks its kernel)
    alone = _time_each(gemm_stream, iters, gemm)
    alone_median = statistics.median(alone)

    # TIDE-RS: a 256 MiB bf16 gradient per rank -> fp32 shard, average, W ranks on this host.
    cols = 1024
    rows = GRAD_MIB * 2**20 // 2 // cols
    layout = _tide.BucketLayout([_tide.ParamSpec("w", [rows, cols], _tide.DType.bf16, _tide.DType.fp32)],
                                _tide.Topology.single_node(world))
    p = layout.params[0]
    grad = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16, generator=gen)
    out = torch.empty(p.valid_rows(rank) * cols, device="cuda", dtype=torch.float32)
    window = _tide.CudaWindow.create(store_bootstrap(dist.group.WORLD, "tide/interference"),
                                     layout.window_bytes)
    executor = _tide.CudaExecutor(window, background.cuda_stream)
    program = _tide.plan_reduce_scatter(layout, rank, _tide.ReduceOptions(), 1)
    executor.enable_stats(True)
    executor.run(program, [grad.data_ptr()], [out.data_ptr()])
    tide_sm = executor.stats().reduce_cta_us
    executor.enable_stats(False)
    tide_times, tide_overlap = _beside_checked(gemm_stream, background, iters, alone_median, gemm,
                                               lambda: executor.run(program, [grad.data_ptr()],
                                                                    [out.data_ptr()]))
    executor.synchronize()
    dist.barrier()
    executor = window = None  # windows are freed only after every rank is done (barrier above)

    # NCCL: the same gradient as stock FSDP2's fp32 full-group buffer, averaged.
    full = torch.randn(p.shard_numel * world, device="cuda", dtype=torch.float32, generator=gen)
    shard = torch.empty(p.shard_numel, device="cuda", dtype=torch.float32)
    nccl_times, nccl_overlap = _beside_checked(
        gemm_stream, background, iters, alone_median, gemm,
        lambda: dist.reduce_scatter_tensor(shard, full, op=dist.ReduceOp.AVG))
    return {"rank": rank, "world": world, "alone": alone, "tide": tide_times, "nccl": nccl_times,
            "tide_overlapped": tide_overlap, "nccl_overlapped": nccl_overlap, "tide_sm_cta_us": tide_sm,
            "tflops": 2.0 * M * N * K / (alone_median * 1e-6) / 1e12, "gpu": torch.cuda.get_device_name()}


def _beside_checked(gemm_stream, background, iters, alone_median, gemm, once) -> tuple:
    """GEMM times while `once` runs back to back on `background`, and whether the background was
    still running when the last timed GEMM ended (else the figure is partly the GEMM alone)."""
    _time_each(background, 1, once)
    one = statistics.median(_time_each(background, 3, once))
    runs = _agree_max(math.ceil(3 * iters * alone_median / one) + 2)
    start = torch.cuda.Event(enable_timing=True)
    done = torch.cuda.Event(enable_timing=True)
    gemm_done = torch.cuda.Event(enable_timing=True)
    start.record(background)
    with torch.cuda.stream(background):
        for _ in range(runs):
            once()
        done.record(background)
    times = _time_each(gemm_stream, iters, gemm)
    gemm_done.record(gemm_stream)
    torch.cuda.synchronize()
    return times, gemm_done.elapsed_time(done) > 0
