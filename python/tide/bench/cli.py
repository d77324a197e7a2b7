"""tide-bench: what TIDE does on this machine, stock FSDP2 vs TIDE side by side.

  tide-bench fsdp         train an embedded model (Llama-style, Qwen3-MoE-style, Wan-style DiT)
                          with stock FSDP2 and with TIDE
  tide-bench collectives  AG / RS size sweep, TIDE vs the stock path (copy-in + collective + copy-out)
  tide-bench interference a one-wave GEMM alone and beside each reduce-scatter (needs a GPU)
  tide-bench host-cost    host time per step in FSDP2's communication path, stock vs TIDE (GPU)

Ranks are spawned processes by default (`--world`); under torchrun the launched ranks are used.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

import torch

from . import mps, report
from .launch import ranks_share_gpus, run_ranks, run_torchrun, under_torchrun
from .model import PRESETS

MIB = 2**20


def _positive(name):
    def parse(text):
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"--{name} {text!r}: expected a positive integer") from None
        if value < 1:
            raise argparse.ArgumentTypeError(f"--{name} {value}: expected a positive integer")
        return value
    return parse


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tide-bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--world", type=_positive("world"), default=None,
                        help="ranks to spawn (default: 4 on CPU, the GPU count on several GPUs, 2 "
                             "ranks sharing the GPU on one; ignored under torchrun)")
    common.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    common.add_argument("--json", metavar="PATH", help="also write the results as JSON")

    f = sub.add_parser("fsdp", parents=[common], help="train with stock FSDP2 and with TIDE")
    f.add_argument("--model", choices=sorted(PRESETS), default=None,
                   help="embedded model (default: cpu on CPU, 8b-layers on GPUs). Llama-style: tiny, "
                        "cpu, 8b-layers, 70b-layers; Qwen3-30B-A3B-style MoE: qwen3-moe-layers, "
                        "qwen3-moe-tiny; Wan2.2-14B-style DiT: wan-layers, wan-tiny")
    f.add_argument("--layers", type=_positive("layers"), default=None,
                   help="decoder layers / DiT blocks (default: the model's)")
    f.add_argument("--expert-shard-dim", type=int, choices=(0, 1), default=0,
                   help="MoE models: the dim FSDP2 shards the grouped expert tensors on (1: "
                        "torchtitan's shard_placement_fn when the FSDP degree exceeds the expert "
                        "count; each layer's experts are their own param group either way)")
    f.add_argument("--experts-as-modules", action="store_true",
                   help="MoE models: each expert a module of three nn.Linear, as Hugging Face MoE "
                        "models keep them (a layer's experts group then holds 3 x experts params)")
    f.add_argument("--float8", action="store_true",
                   help="train the layers' linears in float8 (torchao): TIDE with fp8 all-gather on, "
                        "stock FSDP2 with it off (the reference); Llama models")
    f.add_argument("--steps", type=_positive("steps"), default=5)
    f.add_argument("--warmup", type=int, default=1)
    f.add_argument("--batch", type=_positive("batch"), default=4)
    f.add_argument("--seq", type=_positive("seq"), default=128)
    f.add_argument("--mp", choices=("fp32", "bf16"), default=None,
                   help="fp32 everywhere, or bf16 params + fp32 reduce (default: fp32 on CPU, bf16 on GPUs)")
    f.add_argument("--ranks-per-node", type=_positive("ranks-per-node"), default=None,
                   help="declare nodes of this many consecutive ranks: TIDE runs its across-node "
                        "programs between them (CPU: virtual nodes over the host transport)")
    f.add_argument("--transport", choices=("auto", "ipc", "nccl"), default="auto",
                   help="with --ranks-per-node on GPUs: what carries TIDE's steps between nodes "
                        "(auto: CUDA IPC on one host, else NCCL)")
    f.add_argument("--chunk-mib", type=_positive("chunk-mib"), default=16,
                   help="network chunk size across nodes, MiB (with --ranks-per-node)")
    f.add_argument("--wire-dtype", choices=("fp32", "bf16"), default="fp32",
                   help="with --ranks-per-node: the dtype of reduce-scatter partial sums between "
                        "nodes (bf16 is lossy: each partial is rounded before it is sent)")
    f.add_argument("--cuda-graphs", action="store_true",
                   help="compare TIDE run by run with TIDE inside captured steps (forward + backward "
                        "in a CUDA graph, replayed, as torchtitan steps on GPUs); with a GPU per rank, "
                        "stock FSDP2 over NCCL run by run and captured too (ranks sharing a GPU run "
                        "stock over gloo, which cannot be captured: there, stock vs TIDE is the run "
                        "without this flag)")
    f.add_argument("--mps", action="store_true",
                   help="ranks sharing a GPU run as clients of a private MPS server (started before "
                        "them, stopped after): their kernels then run side by side as on separate "
                        "GPUs, instead of time-slicing the GPU, which inflates waits for peers")
    f.add_argument("--compute-only", action="store_true",
                   help="also run a compute-only reference: stock FSDP2's same steps with collectives "
                        "that move nothing (each group's first all-gather is real and its unsharded "
                        "params then stay allocated; later all-gathers copy and send nothing; "
                        "reduce-scatters send nothing and give each sharded param a zero gradient, so "
                        "the optimizer still steps every param). Its step time is the model's compute, "
                        "FSDP2's hooks and the optimizer: a mode's step time minus it is the "
                        "communication that mode leaves exposed. With --cuda-graphs its steps are captured "
                        "too, and only the captured steps compare with it. Its memory and final "
                        "params compare with nothing")
    f.add_argument("--plot-dir", metavar="DIR", help="write PNG plots (step-time breakdown, memory) here")
    f.add_argument("--no-progress", action="store_true")

    c = sub.add_parser("collectives", parents=[common], help="AG/RS size sweep, TIDE vs stock path")
    c.add_argument("--min-bytes", type=_positive("min-bytes"), default=256 * 1024)
    c.add_argument("--max-bytes", type=_positive("max-bytes"), default=16 * MIB)
    c.add_argument("--iters", type=_positive("iters"), default=10)

    i = sub.add_parser("interference", parents=[common], help="one-wave GEMM beside each reduce-scatter (GPU)")
    i.add_argument("--iters", type=_positive("iters"), default=30, help="timed GEMMs per case (>= 20)")

    h = sub.add_parser("host-cost", parents=[common], help="host time per step, stock vs TIDE (GPU)")
    h.add_argument("--layers", type=_positive("layers"), default=32, help="param groups (blocks)")
    h.add_argument("--linears", type=_positive("linears"), default=2,
                   help="nn.Linear layers per block, 2 params each (192: 384-param groups)")
    h.add_argument("--steps", type=_positive("steps"), default=30, help="timed steps")
    h.add_argument("--warmup", type=_positive("warmup"), default=5)
    return p


def _resolve_device(args, parser) -> str:
    if args.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is visible")
    return args.device


def _launch(args, device, fn, *fn_args):
    if under_torchrun():
        return run_torchrun(device, fn, *fn_args)
    return run_ranks(args.world, device, fn, *fn_args)


def _fsdp(args, parser, device) -> int:
    from .fsdp_bench import compare, run_mode

    if args.warmup < 0:
        parser.error(f"--warmup {args.warmup}: expected >= 0")
    model_name = args.model or ("cpu" if device == "cpu" else "8b-layers")
    cfg = PRESETS[model_name]
    if args.layers is not None:
        cfg = dataclasses.replace(cfg, layers=args.layers)
    if args.experts_as_modules:
        if not hasattr(cfg, "experts_as_modules"):
            parser.error(f"--experts-as-modules: model {model_name} has no experts (the MoE models: "
                         "qwen3-moe-layers, qwen3-moe-tiny)")
        if args.expert_shard_dim != 0:
            parser.error("--experts-as-modules with --expert-shard-dim 1: expected the experts' "
                         "nn.Linear weights sharded on dim 0")
        cfg = dataclasses.replace(cfg, experts_as_modules=True)
    try:
        cfg.validate()
    except ValueError as e:
        parser.error(f"--model {model_name}: {e}")
    _check_expert_sharding(args, parser, model_name, cfg)
    if args.cuda_graphs:
        if device != "cuda":
            parser.error(f"--cuda-graphs: device {device}: expected cuda (CUDA graphs need a GPU)")
        if args.plot_dir:
            parser.error("--cuda-graphs with --plot-dir: the plots compare stock FSDP2 with TIDE")
        if args.ranks_per_node and args.ranks_per_node < args.world:
            parser.error(f"--cuda-graphs with --ranks-per-node {args.ranks_per_node} < --world "
                         f"{args.world}: programs across nodes cannot be captured")
        if hasattr(cfg, "capturable"):  # routing without a host read of the expert counts
            cfg = dataclasses.replace(cfg, capturable=True)
    if args.float8:
        _check_float8(args, parser, model_name, cfg)
        if args.compute_only:  # torchao's pre-all-gather hook computes the fp8 weight and its scale
            parser.error("--compute-only with --float8: float8 weights are cast and scaled in FSDP2's "
                         "all-gather, which the compute-only reference does not run")
    if args.mps:
        if device != "cuda":
            parser.error(f"--mps: device {device}: expected cuda (an MPS server serves GPU ranks)")
        if under_torchrun():
            parser.error("--mps under torchrun: torchrun started the ranks; start an MPS server before it")
    if not under_torchrun():
        _refuse_fallback_configuration(args, parser, device)
    _require_matplotlib(args, parser)
    mp = args.mp or ("fp32" if device == "cpu" else "bf16")
    opts = {"device": device, "mp": mp, "steps": args.steps, "warmup": args.warmup, "batch": args.batch,
            "ranks_per_node": args.ranks_per_node, "chunk_bytes": args.chunk_mib * MIB,
            "wire_dtype": args.wire_dtype,
            "transport": args.transport, "expert_shard_dim": args.expert_shard_dim,
            "seq": args.seq, "progress": not args.no_progress, "float8": args.float8,
            "cuda_graphs": args.cuda_graphs}
    print(f"tide-bench fsdp: model {model_name} ({cfg.params() / 1e6:.1f} M params), device {device}, "
          f"mp {mp}, {args.world} ranks", file=sys.stderr)
    # The pair compared first (max_abs_diff) leads: stock vs TIDE, or TIDE run by run vs captured.
    if not args.cuda_graphs:
        modes = ("stock", "tide")
    elif ranks_share_gpus(device, args.world):
        modes = ("tide", "tide-captured")
    else:
        modes = ("tide", "tide-captured", "stock", "stock-captured")
    if args.compute_only:
        modes += ("compute-only",)
    mps_state = mps.MpsState(requested=args.mps)
    if args.mps and not ranks_share_gpus(device, args.world):
        mps_state.requested, mps_state.why = False, "each rank has a GPU of its own"
    with mps.private_server(mps_state):
        runs = {mode: _launch(args, device, run_mode, mode, cfg, opts) for mode in modes}
    if runs[modes[0]] is None:  # a torchrun rank other than 0
        return 0
    if device == "cuda" and ranks_share_gpus(device, args.world):
        print(f"tide-bench fsdp: {mps_state.describe()}", file=sys.stderr)

    def merged(runs):
        out = {}
        for k in ("step_ms", "host_ms", "collectives_ms", "peak_memory_mib"):
            values = [r[k] for r in runs]  # the slowest / largest rank
            out[k] = max(values) if None not in values else None
        out["replays"] = runs[0]["replays"]
        out["loop_collectives"] = runs[0]["loop_collectives"]
        out["layout_copy_mib"] = runs[0]["layout_copy_bytes"] / MIB
        out["shard_dim_copy_mib"] = runs[0]["shard_dim_copy_bytes"] / MIB
        for k in ("peak_memory_kind", "tide_buckets", "tide_fallbacks", "tide_fallback_groups",
                  "param_groups", "ranks_share_gpus", "tide_step_all_gather_bytes", "tide_gather_bytes",
                  "tide_param_bytes", "tide_extension_groups", "tide_float8_casts"):
            out[k] = runs[0][k]
        out["tide_window_mib"] = max(r["tide_window_mib"] for r in runs)
        pss = [r.get("peak_pss_mib") for r in runs]
        out["peak_pss_mib"] = max(pss) if all(v is not None for v in pss) else None  # the largest rank
        sm = [r["sm_cta_us"] for r in runs if r.get("sm_cta_us") is not None]
        out["sm_cta_us"] = sum(sm) / len(sm) if sm else None  # per rank, averaged
        lowered = [r["lowered"] for r in runs if r.get("lowered") is not None]
        out["lowered"] = [sum(v[0] for v in lowered), sum(v[1] for v in lowered)] if lowered else None
        return out

    summary = {"model": model_name, "family": cfg.family, "config": cfg.as_dict(), "params": cfg.params(),
               "expert_shard_dim": args.expert_shard_dim, "world": len(runs[modes[0]]), "device": device,
               "mp": mp, "float8": args.float8, "steps": args.steps, "warmup": args.warmup, "batch": args.batch, "seq": args.seq,
               "ranks_per_node": args.ranks_per_node, "transport": args.transport,
               "chunk_mib": args.chunk_mib, "wire_dtype": args.wire_dtype,
               "max_abs_diff": compare(runs[modes[0]], runs[modes[1]]), "torch": torch.__version__,
               "mps": dataclasses.asdict(mps_state), "modes": [m.replace("-", "_") for m in modes]}
    if "stock-captured" in runs:  # every pair a user compares: "b_vs_a" is max |b - a|
        summary["max_abs_diffs"] = {
            f"{b}_vs_{a}".replace("-", "_"): compare(runs[a], runs[b])
            for a, b in (("tide", "tide-captured"), ("stock", "stock-captured"), ("stock", "tide"))}
    for mode in modes:  # "stock", "stock_captured", "tide", "tide_captured", "compute_only"
        summary[mode.replace("-", "_")] = merged(runs[mode])
    print(report.fsdp_graphs_table(summary) if args.cuda_graphs else report.fsdp_table(summary))
    if args.float8 and not args.cuda_graphs:
        t = summary["tide"]
        print(f"float8 (torchao, fp8 all-gather on under TIDE, off under stock): TIDE handled "
              f"{t['tide_buckets']}/{t['param_groups']} groups, {t['tide_extension_groups']} with float8 "
              f"weights, {t['tide_float8_casts']} of them cast by TIDE into its window; one all-gather of every group: {t['tide_gather_bytes'] / MIB:.2f} MiB as gathered "
              f"vs {t['tide_param_bytes'] / MIB:.2f} MiB in the params' {mp} "
              f"({t['tide_gather_bytes'] / max(t['tide_param_bytes'], 1):.2f}x); all-gather bytes in one "
              f"step {t['tide_step_all_gather_bytes'] / MIB:.2f} MiB; layout copies "
              f"{t['layout_copy_mib']:.2f} MiB; max |TIDE fp8 on - stock fp8 off| = {summary['max_abs_diff']:.3g}")
    if args.json:
        report.write_json(args.json, summary)
    if args.plot_dir:
        for path in report.fsdp_plots(summary, args.plot_dir):
            print(f"plot: {path}")
    return 0


def _check_float8(args, parser, model_name, cfg) -> None:
    if cfg.family != "llama":
        parser.error(f"--float8: model {model_name} is not a Llama model (the float8 presets: tiny, cpu, "
                     "8b-layers, 70b-layers)")
    try:
        import torchao.float8  # noqa: F401
    except ImportError:
        parser.error("--float8 needs torchao (pip install torchao; float8 training is pure Python)")
    # torchao's float8 weights all-gather their local shard unpadded: every rank's must be as large.
    rows = {"dim": cfg.dim, "hidden": cfg.hidden, "kv_heads x head_dim": cfg.kv_heads * (cfg.dim // cfg.heads)}
    for name, n in rows.items():
        if n % args.world:
            parser.error(f"--float8: {model_name}'s {name} {n} is not divisible by --world {args.world} "
                         "(torchao's fp8 all-gather needs even shards)")


def _check_expert_sharding(args, parser, model_name, cfg) -> None:
    if args.expert_shard_dim == 0:
        return
    if not hasattr(cfg, "experts"):
        parser.error(f"--expert-shard-dim {args.expert_shard_dim}: model {model_name} has no expert "
                     "tensors (the MoE models: qwen3-moe-layers, qwen3-moe-tiny)")
    # FSDP2 shards dims > 0 evenly only: w1/w3 [E, dim, hidden] on dim, w2 [E, hidden, dim] on hidden
    for name in ("dim", "expert_hidden"):
        if getattr(cfg, name) % args.world:
            parser.error(f"--expert-shard-dim 1: FSDP2 shards dim 1 evenly only, and {model_name}'s "
                         f"{name} {getattr(cfg, name)} is not divisible by --world {args.world}")


def _refuse_fallback_configuration(args, parser, device) -> None:
    """Refuses, before anything runs, a configuration in which TIDE would handle no param group:
    the same decisions tide.fsdp.enable takes per group, on the ranks this command spawns (all on
    this host, rank r on GPU r % GPUs, as launch.py places them)."""
    from .. import _tide
    from ..fsdp import topology_for, transport_for

    if args.world < 2:
        parser.error(f"--world {args.world}: FSDP needs at least 2 ranks to compare collectives")
    if device == "cuda" and not _tide.cuda_built:
        parser.error("--device cuda: this build of TIDE has no CUDA transport (built without nvcc)")
    if args.ranks_per_node is not None and args.world % args.ranks_per_node:
        parser.error(f"--ranks-per-node {args.ranks_per_node} does not divide --world {args.world}: "
                     "TIDE needs as many ranks on every node and would fall back for every group")
    topology, reason = topology_for(list(range(args.world)), args.ranks_per_node)
    if not reason:
        gpus = torch.cuda.device_count() if device == "cuda" else 0
        placements = [("this-host", f"gpu{r % gpus}" if gpus else "", f"rank{r}") for r in range(args.world)]
        _, reason = transport_for(placements, device, topology, args.transport)
    if reason:
        parser.error(f"--ranks-per-node {args.ranks_per_node} --transport {args.transport} --world "
                     f"{args.world} on {device}: TIDE would fall back for every group: {reason}")


def _require_matplotlib(args, parser) -> None:
    if getattr(args, "plot_dir", None):
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            parser.error("--plot-dir needs matplotlib: pip install matplotlib")


def _collectives(args, parser, device) -> int:
    from .collectives_bench import run_sweep

    if device == "cuda":
        from .. import _tide
        if not _tide.cuda_built:
            parser.error("collectives: this build of TIDE has no CUDA transport (built without nvcc)")
    if args.min_bytes > args.max_bytes:
        parser.error(f"--min-bytes {args.min_bytes} > --max-bytes {args.max_bytes}")
    sizes, size = [], args.min_bytes
    while size <= args.max_bytes:
        sizes.append(size)
        size *= 4
    results = _launch(args, device, run_sweep, device, sizes, args.iters)
    if results is None:
        return 0
    rows = results[0]
    for other in results[1:]:  # the slowest rank's times
        for r, o in zip(rows, other):
            r["stock_ms"], r["tide_ms"] = max(r["stock_ms"], o["stock_ms"]), max(r["tide_ms"], o["tide_ms"])
            r["check"] = r["check"] and o["check"]
    if device == "cpu":
        where = "host executor and gloo: memory-bound on this host, not a network figure"
    elif rows and rows[0]["ranks_share_gpus"]:
        where = ("single-GPU emulation: ranks share the GPU, the stock collective is gloo through host "
                 "memory, TIDE's CUDA executor is HBM-bound, not NVLink-bound: times do not compare, "
                 "the checks and the layout copies do")
    else:
        where = "CUDA executor vs NCCL, one rank per GPU; wall time per call incl. launches"
    print(f"# tide-bench collectives, W = {rows[0]['world'] if rows else '-'}, {device} ({where})")
    print(report.collectives_table(rows))
    if args.json:
        report.write_json(args.json, {"device": device, "rows": rows, "torch": torch.__version__})
    return 0 if all(r["check"] for r in rows) else 1


def main(argv=None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    device = _resolve_device(args, parser)
    if args.world is None:  # one GPU: two ranks share it (single-GPU emulation)
        args.world = 4 if device == "cpu" else max(torch.cuda.device_count(), 2)
    if args.command == "fsdp":
        return _fsdp(args, parser, device)
    if args.command == "collectives":
        return _collectives(args, parser, device)
    if args.command == "host-cost":
        return _host_cost(args, parser, device)
    return _interference(args, parser, device)


def _host_cost(args, parser, device) -> int:
    from .. import _tide
    from .host_cost_bench import run_host_cost

    if device != "cuda" or not _tide.cuda_built:
        parser.error("host-cost needs a GPU and a CUDA build of TIDE (on CPU TIDE's host transport "
                     "copies synchronously: its host time would include its collectives)")
    if args.world < 2:
        parser.error(f"--world {args.world}: needs 2 ranks or more")
    opts = {"layers": args.layers, "linears": args.linears, "steps": args.steps, "warmup": args.warmup}
    results = _launch(args, device, run_host_cost, opts)
    if results is None:
        return 0
    print(report.host_cost_table(results, ranks_share_gpus(device, args.world)))
    if args.json:
        report.write_json(args.json, {"rows": results, "torch": torch.__version__})
    return 0


def _interference(args, parser, device) -> int:
    from .. import _tide
    from .interference_bench import run_interference

    if device != "cuda":
        parser.error("interference needs a CUDA GPU (a one-wave GEMM beside each reduce-scatter); "
                     "none is visible here")
    if not _tide.cuda_built:
        parser.error("interference: this build of TIDE has no CUDA transport (built without nvcc)")
    if args.iters < 20:
        parser.error(f"--iters {args.iters}: expected >= 20 (medians of at least 20 runs)")
    if args.world < 2 and not under_torchrun():
        parser.error(f"--world {args.world}: needs 2 ranks or more, one per GPU")
    if not under_torchrun() and args.world > torch.cuda.device_count():
        parser.error(f"--world {args.world}: interference runs one rank per GPU and this machine "
                     f"has {torch.cuda.device_count()}")
    results = _launch(args, device, run_interference, {"iters": args.iters})
    if results is None:
        return 0
    summary = report.interference_summary(results)
    print(report.interference_table(summary))
    if args.json:
        report.write_json(args.json, summary)
    return 0 if summary["overlapped"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
