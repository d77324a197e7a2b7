"""tide-bench collectives: AG and RS size sweep, TIDE vs the stock path, nccl-tests style.

The stock path is what FSDP2 does around its collective: AG = cast shards into a flat buffer
(copy-in) + all_gather_into_tensor + split_with_sizes_copy into per-param tensors (copy-out);
RS = chunk_cat of bf16 gradients into a full-group fp32 buffer (copy-in) + reduce_scatter_tensor.
TIDE runs its own AG/RS programs (host executor on CPU). Buckets are 4 params of equal size.
Every timed configuration is checked: TIDE's result against the stock path's.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist
from torch.distributed.fsdp._fully_shard import _fsdp_collectives  # noqa: F401  (fsdp ops)

import tide
from tide.distributed import store_bootstrap

PARAMS_PER_BUCKET = 4


def _shapes(total_bytes: int, world: int) -> list:
    # bf16 params of (rows, 256) with rows a multiple of W: total_bytes of unsharded bf16
    rows = max(world, (total_bytes // PARAMS_PER_BUCKET // 2 // 256) // world * world)
    return [(rows, 256)] * PARAMS_PER_BUCKET


def _median_ms(fn, iters: int) -> float:
    fn()
    times = []
    for _ in range(iters):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    times.sort()
    return statistics.median(times) * 1e3


def run_sweep(rank: int, world: int, sizes: list, iters: int) -> list:
    rows = []
    for size in sizes:
        shapes = _shapes(size, world)
        specs = [tide.ParamSpec(f"p{i}", list(s), tide.DType.bf16, tide.DType.fp32) for i, s in enumerate(shapes)]
        layout = tide.BucketLayout(specs, tide.Topology.single_node(world))
        boot = store_bootstrap(dist.group.WORLD, f"tide-bench/collectives/{size}")
        window = tide.HostWindow.create(boot, layout.window_bytes)
        executor = tide.HostExecutor(window)
        gen = torch.Generator().manual_seed(rank)
        shard_numel = [p.shard_numel for p in layout.params]
        shards = [torch.randn(n, generator=gen) for n in shard_numel]
        grads = [torch.randn(s, generator=gen).to(torch.bfloat16) for s in shapes]
        ag_prog = tide.plan_all_gather(layout, rank)
        rs_prog = tide.plan_reduce_scatter(layout, rank, tide.ReduceOptions(kind=tide.ReduceKind.sum))
        tide_out = [torch.empty(n) for n in shard_numel]

        flat_in = torch.empty(sum(shard_numel), dtype=torch.bfloat16)
        flat_out = torch.empty(world * sum(shard_numel), dtype=torch.bfloat16)
        per_param = [torch.empty(world * n, dtype=torch.bfloat16) for n in shard_numel]
        rs_in = torch.empty(world * sum(shard_numel))
        rs_out = torch.empty(sum(shard_numel))

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
            stock_ms = _median_ms(stock_fn, iters)
            tide_ms = _median_ms(tide_fn, iters)
            ok = _check(name, layout, window, rank, per_param, rs_out, tide_out)
            rows.append({"collective": name, "bytes": size, "world": world, "stock_ms": stock_ms,
                         "tide_ms": tide_ms, "check": ok})
        dist.barrier()
        del executor, window
    return rows


def _check(name, layout, window, rank, per_param, rs_out, tide_out) -> bool:
    if name == "AG":
        import ctypes
        for p, ref in zip(layout.params, per_param):
            raw = (ctypes.c_uint8 * (ref.numel() * 2)).from_address(window.data_ptr(rank) + p.window_offset)
            if not torch.equal(torch.frombuffer(raw, dtype=torch.bfloat16), ref):
                return False
        return True
    flat = torch.cat(tide_out)
    return bool(torch.allclose(flat, rs_out, rtol=1e-5, atol=1e-5))
