"""Demo: TIDE-AG and TIDE-RS for one Llama-style decoder-layer bucket over host ranks.

    python -m tide.demo [--world 4] [--hidden 512]

Ranks are processes over POSIX shared memory. Prints the layout, what moved where, the checks
against references, and one table per collective.
"""

import argparse
import multiprocessing as mp
import os
import tempfile
import time

import numpy as np

import tide


def llama_layer(hidden: int) -> list:
    inter, kv = hidden * 7 // 2, hidden // 4
    shapes = [("q_proj", [hidden, hidden]), ("k_proj", [kv, hidden]), ("v_proj", [kv, hidden]),
              ("o_proj", [hidden, hidden]), ("gate_proj", [inter, hidden]),
              ("up_proj", [inter, hidden]), ("down_proj", [hidden, inter]),
              ("input_layernorm", [hidden]), ("post_attention_layernorm", [hidden])]
    return [tide.ParamSpec(n, s, tide.DType.bf16, tide.DType.fp32) for n, s in shapes]


def to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """fp32 -> bf16 bit patterns, round to nearest even (as TIDE and CUDA do)."""
    bits = x.astype(np.float32).view(np.uint32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def bf16_bits_to_float(b: np.ndarray) -> np.ndarray:
    return (b.astype(np.uint32) << 16).view(np.float32)


def full_param(i: int, numel: int) -> np.ndarray:
    return np.random.default_rng(1000 + i).standard_normal(numel, dtype=np.float32)


def grad(i: int, rank: int, numel: int) -> np.ndarray:
    return to_bf16_bits(np.random.default_rng(2000 + 97 * i + rank).standard_normal(numel, dtype=np.float32))


def rank_main(rank: int, world: int, hidden: int, rendezvous: str, queue) -> None:
    layout = tide.BucketLayout(llama_layer(hidden), tide.Topology.single_node(world))
    boot = tide.FileBootstrap(rendezvous, rank, world, 60000)
    window = tide.HostWindow.create(boot, layout.window_bytes)
    executor = tide.HostExecutor(window)
    params = layout.params
    shards = []
    for i, p in enumerate(params):
        start = rank * p.shard_numel
        shards.append(np.ascontiguousarray(full_param(i, p.numel)[start:start + p.valid_numel(rank)]))
    grads = [grad(i, rank, p.numel) for i, p in enumerate(params)]
    outs = [np.zeros(p.valid_numel(rank), np.float32) for p in params]

    ag = tide.plan_all_gather(layout, rank, bucket=0)
    rs = tide.plan_reduce_scatter(layout, rank, tide.ReduceOptions(kind=tide.ReduceKind.avg), bucket=0)
    boot.barrier()
    t0 = time.perf_counter()
    executor.run(ag, [s.ctypes.data for s in shards])
    t1 = time.perf_counter()
    # Check: every param whole, in bf16, in this rank's window, at its own offset.
    win = np.frombuffer((np.ctypeslib.as_array(
        (np.ctypeslib.ctypes.c_uint8 * layout.window_bytes).from_address(window.data_ptr(rank)))),
        dtype=np.uint8)
    ag_ok = all(np.array_equal(win[p.window_offset:p.window_offset + 2 * p.numel].view(np.uint16),
                               to_bf16_bits(full_param(i, p.numel))) for i, p in enumerate(params))
    boot.barrier()
    t2 = time.perf_counter()
    executor.run(rs, [g.ctypes.data for g in grads], [o.ctypes.data for o in outs])
    t3 = time.perf_counter()
    worst = 0.0
    for i, p in enumerate(params):
        start, n = rank * p.shard_numel, p.valid_numel(rank)
        ref = sum(bf16_bits_to_float(grad(i, r, p.numel)[start:start + n]).astype(np.float64)
                  for r in range(world)) / world
        err = np.linalg.norm(outs[i] - ref) / max(np.linalg.norm(ref), 1e-30)
        worst = max(worst, float(err))
    queue.put((rank, ag.bytes_pushed(), t1 - t0, ag_ok, rs.bytes_pushed(), t3 - t2, worst,
               ag.to_string() if rank == 0 else ""))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=4, help="ranks (processes), default 4")
    parser.add_argument("--hidden", type=int, default=512, help="hidden size, default 512")
    args = parser.parse_args(argv)
    if args.world < 1 or args.world > 64:
        parser.error(f"--world {args.world}: expected 1..64")
    if args.hidden < 4 or args.hidden % 4:
        parser.error(f"--hidden {args.hidden}: expected a positive multiple of 4")
    layout = tide.BucketLayout(llama_layer(args.hidden), tide.Topology.single_node(args.world))
    print(layout.describe())
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="tide-demo-") as rendezvous:
        procs = [ctx.Process(target=rank_main, args=(r, args.world, args.hidden, rendezvous, queue))
                 for r in range(args.world)]
        for p in procs:
            p.start()
        results = sorted(queue.get(timeout=300) for _ in procs)
        for p in procs:
            p.join()
    program0 = results[0][7].splitlines()
    print("rank 0's all-gather program (first 14 lines):")
    print("\n".join(program0[:14]) + ("\n  ..." if len(program0) > 14 else ""))
    print("\nwhat moved where: rank r's slot(i, r) of every param i -> the same offset on every peer;")
    print("reduce-scatter: rank r's gradient chunk q -> rank q's vacated slot(i, r), reduced there in fp32\n")
    print(f"{'rank':>4} {'AG bytes pushed':>16} {'AG ms':>8} {'AG bitwise':>10} "
          f"{'RS bytes pushed':>16} {'RS ms':>8} {'RS rel.err vs fp64':>18}")
    ok = True
    for rank, agb, agt, agok, rsb, rst, err, _ in results:
        ok &= agok and err <= 1e-6
        print(f"{rank:>4} {agb:>16} {agt * 1e3:>8.2f} {'ok' if agok else 'WRONG':>10} "
              f"{rsb:>16} {rst * 1e3:>8.2f} {err:>18.2e}")
    print(f"\n{'all checks passed' if ok else 'CHECK FAILED'} (host executor, {args.world} processes, "
          f"shared memory; no GPU used)")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
