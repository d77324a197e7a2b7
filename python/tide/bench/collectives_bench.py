"""tide-bench collectives: AG and RS size sweep, TIDE vs the stock path, nccl-tests style.

The stock path is what FSDP2 does around its collective: AG = cast shards into a flat buffer
(copy-in) + all_gather_into_tensor + split_with_sizes_copy into per-param tensors (copy-out);
RS = chunk_cat of bf16 gradients into a full-group fp32 buffer (copy-in) + reduce_scatter_tensor.
TIDE runs its own AG/RS programs: the host executor and gloo on CPU; on GPUs the CUDA executor
(copy engines, cast/reduce kernels) and NCCL for the stock path, one rank per GPU. With more ranks
than GPUs (one GPU: two ranks share it) the stock collective runs over gloo, through host memory:
single-GPU emulation, where the checks compare and the times do not. Buckets are 4
params of equal size. Every timed configuration is checked: TIDE's result against the stock path's.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

import tide
from tide.distributed import store_bootstrap
from tide.fsdp import _fsdp2  # noqa: F401  (it imports FSDP2's collectives, which register torch.ops.fsdp)
from tide.fsdp._memory import bytes_at

PARAMS_PER_BUCKET = 4


def _shapes(total_bytes: int, world: int) -> list:
    # bf16 params of (rows, 256) with rows a multiple of W: total_bytes of unsharded bf16
    rows = max(world, (total_bytes // PARAMS_PER_BUCKET // 2 // 256) // world * world)
    return [(rows, 256)] * PARAMS_PER_BUCKET


def _median_ms(fn, iters: int, cuda: bool) -> float:
    """Median wall time of fn over `iters` runs, each started together on every rank (barrier) and,
    on GPUs, ended when this rank's device work is done."""
    fn()
    times = []
    for _ in range(iters):
        dist.barrier()
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    times.sort()
    return statistics.median(times) * 1e3


def _window_and_executor(boot, window_bytes: int, cuda: bool):
    if cuda:
        window = tide.CudaWindow.create(boot, window_bytes)
        return window, tide.CudaExecutor(window, torch.cuda.current_stream().cuda_stream)
    window = tide.HostWindow.create(boot, window_bytes)
    return window, tide.HostExecutor(window)


def run_sweep(rank: int, world: int, device_type: str, sizes: list, iters: int) -> list:
    cuda = device_type == "cuda"
    shared_gpu = cuda and dist.get_backend() == "gloo"  # see launch.backend_for
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    rows = []
    for size in sizes:
        shapes = _shapes(size, world)
        specs = [tide.ParamSpec(f"p{i}", list(s), tide.DType.bf16, tide.DType.fp32) for i, s in enumerate(shapes)]
        layout = tide.BucketLayout(specs, tide.Topology.single_node(world))
        boot = store_bootstrap(dist.group.WORLD, f"tide-bench/collectives/{size}")
        window, executor = _window_and_executor(boot, layout.window_bytes, cuda)
        gen = torch.Generator().manual_seed(rank)
        shard_numel = [p.shard_numel for p in layout.params]
        shards = [torch.randn(n, generator=gen).to(device) for n in shard_numel]
        grads = [torch.randn(s, generator=gen).to(torch.bfloat16).to(device) for s in shapes]
        ag_prog = tide.plan_all_gather(layout, rank)
        rs_prog = tide.plan_reduce_scatter(layout, rank, tide.ReduceOptions(kind=tide.ReduceKind.sum))
        tide_out = [torch.empty(n, device=device) for n in shard_numel]

        flat_in = torch.empty(sum(shard_numel), dtype=torch.bfloat16, device=device)
        flat_out = torch.empty(world * sum(shard_numel), dtype=torch.bfloat16, device=device)
        per_param = [torch.empty(world * n, dtype=torch.bfloat16, device=device) for n in shard_numel]
        rs_in = torch.empty(world * sum(shard_numel), device=device)
        rs_out = torch.empty(sum(shard_numel), device=device)

        def stock_ag():
            torch.cat([s.to(torch.bfloat16) for s in shards], out=flat_in)                   # copy-in
            dist.all_gather_into_tensor(flat_out, flat_in)
            torch.ops.fsdp.split_with_sizes_copy(flat_out.view(world, -1), shard_numel, dim=1,
                                                 out=[t.view(world, -1) for t in per_param])  # copy-out

        def stock_rs():
            torch.ops.fsdp.chunk_cat(grads, dim=0, num_chunks=world, out=rs_in.view(world, -1))  # copy-in
            dist.reduce_scatter_tensor(rs_out, rs_in)

        def tide_ag():
            executor.run(ag_prog, [s.data_ptr() for s in shards])

        def tide_rs():
            executor.run(rs_prog, [g.data_ptr() for g in grads], [o.data_ptr() for o in tide_out])

        for name, stock_fn, tide_fn in (("AG", stock_ag, tide_ag), ("RS", stock_rs, tide_rs)):
            stock_ms = _median_ms(stock_fn, iters, cuda)
            tide_ms = _median_ms(tide_fn, iters, cuda)
            if cuda:
                torch.cuda.synchronize()
            ok = _check(name, layout, window, rank, per_param, rs_out, tide_out, device)
            rows.append({"collective": name, "bytes": size, "world": world, "stock_ms": stock_ms,
                         "tide_ms": tide_ms, "check": ok, "ranks_share_gpus": shared_gpu})
        dist.barrier()
        del executor, window
    return rows


def _check(name, layout, window, rank, per_param, rs_out, tide_out, device) -> bool:
    if name == "AG":  # TIDE's gathered params, in its window, against stock's copy-out
        for p, ref in zip(layout.params, per_param):
            ptr, nbytes = window.data_ptr(rank) + p.window_offset, ref.numel() * 2
            raw = bytes_at(ptr, nbytes, device)
            if not torch.equal(raw.view(torch.bfloat16), ref):
                return False
        return True
    flat = torch.cat(tide_out)
    return bool(torch.allclose(flat, rs_out, rtol=1e-5, atol=1e-5))
