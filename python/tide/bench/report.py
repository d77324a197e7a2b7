"""Tables, JSON and PNG plots for tide-bench."""

from __future__ import annotations

import json
import os
import statistics
import sys


def fsdp_table(summary: dict) -> str:
    s, t, c = summary["stock"], summary["tide"], summary.get("compute_only")
    nodes = summary.get("ranks_per_node")
    transport = f", transport {summary.get('transport', 'auto')}" if summary["device"] == "cuda" else ""
    wire = ", bf16 partials on the wire (lossy)" if summary.get("wire_dtype") == "bf16" else ""
    chunks = f", {summary['chunk_mib']} MiB chunks" if "chunk_mib" in summary else ""
    where = f" (TIDE: nodes of {nodes} ranks{transport}{chunks}{wire})" if nodes else ""
    emulated = (" — SINGLE-GPU EMULATION (ranks share the GPU: times do not compare; copies, memory "
                "and agreement do)" if t.get("ranks_share_gpus") else "")
    experts = f", experts sharded on dim {summary['expert_shard_dim']}" if summary.get("expert_shard_dim") else ""
    lines = [f"# tide-bench fsdp: {summary['model']}{experts}, W = {summary['world']}{where}, {summary['device']}, "
             f"mp {summary['mp']}, median of {summary['steps']} steps after {summary['warmup']} warm-up"
             f"{emulated}",
             f"{'':<34} {'stock FSDP2':>14} {'TIDE':>14} {'TIDE/stock':>11}"
             + (f" {'compute only':>13}" if c else "")]

    def row(label, key, fmt, reference=False):
        a, b = s[key], t[key]
        ratio = f"{b / a:.3f}" if a else "-"
        lines.append(f"{label:<34} {fmt.format(a):>14} {fmt.format(b):>14} {ratio:>11}"
                     + (f" {fmt.format(c[key]) if reference else '-':>13}" if c else ""))

    row("step time (ms)", "step_ms", "{:.2f}", reference=True)
    row("time in collectives (ms)", "collectives_ms", "{:.2f}", reference=True)
    row("layout-conversion copies (MiB)", "layout_copy_mib", "{:.2f}")
    row(f"peak memory (MiB, {s['peak_memory_kind']})", "peak_memory_mib", "{:.1f}")
    if s.get("peak_pss_mib") and t.get("peak_pss_mib"):  # CPU: RSS counts peers' shared windows too
        row("peak memory (MiB, sampled PSS)", "peak_pss_mib", "{:.1f}")
    lines.append(f"{'TIDE window pool (MiB)':<34} {'-':>14} {t['tide_window_mib']:>14.2f}")
    if summary["device"] == "cuda":  # the pool is outside PyTorch's allocator: the honest total
        a, b = s["peak_memory_mib"], t["peak_memory_mib"] + t["tide_window_mib"]
        lines.append(f"{'peak memory + TIDE pool (MiB)':<34} {a:>14.1f} {b:>14.1f} {b / a:>11.3f}")
    if t.get("ranks_share_gpus"):
        lines.append("ranks share GPUs (more ranks than GPUs): single-GPU emulation, HBM-bound, not "
                     "NVLink-bound; stock FSDP2's collectives run over gloo through host memory (its "
                     "reduce-scatter as an in-place all-reduce), so its step and collective times are "
                     "not NCCL's: compare layout copies and memory")
    groups = t.get("param_groups")
    lines.append(f"TIDE handled {t['tide_buckets']}" + (f" of {groups}" if groups else "") + " param groups"
                 + (f"; fell back for {len(t['tide_fallbacks'])} (stock FSDP2 runs them):"
                    if t["tide_fallbacks"] else ""))
    for path, reason in t.get("tide_fallback_groups") or [[None, r] for r in t["tide_fallbacks"]]:
        lines.append(f"  fell back: {path + ': ' if path else ''}{reason}")
    if t.get("shard_dim_copy_mib") or s.get("shard_dim_copy_mib"):
        lines.append(f"  of the layout copies, Shard(dim > 0) re-layout (torch.cat): stock "
                     f"{s['shard_dim_copy_mib']:.2f} MiB, TIDE {t['shard_dim_copy_mib']:.2f} MiB")
    lines.append(f"numerical agreement: max |TIDE - stock| over final parameters = {summary['max_abs_diff']:.3e}")
    if c:
        lines.append(exposed_communication(c, [("stock", s), ("TIDE", t)]))
    if summary["device"] == "cpu":
        lines.append("SM time: n/a on CPU (host executor; no GPU used)")
    elif t.get("sm_cta_us") is not None:
        lines.append(f"SM time of collectives per step and rank: TIDE {t['sm_cta_us']:.0f} CTA*us (cast + "
                     "reduce kernels; copies and flags use none); stock: NCCL's kernels, not measurable "
                     "from here (see tide-bench interference)")
    if t.get("lowered") is not None:
        lowered, runs = t["lowered"]
        lines.append(f"TIDE collectives that lowered their program again in a warm step (all ranks): "
                     f"{lowered} of {runs} (the others reused it: their pointers were the last run's)")
    return "\n".join(lines)


def exposed_communication(reference: dict, modes: list) -> str:
    """The line under a table with a compute-only reference: each mode's step time less the
    reference's, the communication that mode leaves exposed."""
    parts = [f"{label} {m['step_ms'] - reference['step_ms']:.2f} ms "
             f"({100 * (m['step_ms'] - reference['step_ms']) / m['step_ms']:.0f} % of its step)"
             for label, m in modes]
    return ("communication exposed per step (step time - compute-only step time): " + ", ".join(parts)
            + "; compute only: the same steps with collectives that move nothing (tide-bench fsdp --help)")


def fsdp_graphs_table(summary: dict) -> str:
    """tide-bench fsdp --cuda-graphs: TIDE run by run against TIDE inside captured steps; with a GPU
    per rank, stock FSDP2 run by run and captured too; the compute-only reference, captured too,
    with --compute-only."""
    e, c, r = summary["tide"], summary["tide_captured"], summary.get("compute_only")
    s, sc = summary.get("stock"), summary.get("stock_captured")
    emulated = (" — SINGLE-GPU EMULATION (ranks share the GPU: HBM-bound, not NVLink-bound)"
                if c.get("ranks_share_gpus") else "")
    columns = [("TIDE run by run", e), ("TIDE captured", c)]
    if s and sc:
        columns += [("stock run by run", s), ("stock captured", sc)]
    if r:
        columns.append(("compute only", r))
    lines = [f"# tide-bench fsdp --cuda-graphs: {summary['model']}, W = {summary['world']}, "
             f"{summary['device']}, mp {summary['mp']}, median of {summary['steps']} steps after "
             f"{summary['warmup']} warm-up{emulated}",
             f"{'':<34}" + "".join(f" {label:>17}" for label, _ in columns) + f" {'TIDE captured/run':>18}"]

    def row(label, value, fmt):
        values = [value(m) for _, m in columns]
        ratio = f"{values[1] / values[0]:.3f}" if values[0] else "-"
        lines.append(f"{label:<34}" + "".join(f" {'-' if v is None else fmt.format(v):>17}" for v in values)
                     + f" {ratio:>18}")

    row("step time (ms)", lambda m: m["step_ms"], "{:.2f}")
    row("host time per step (ms)", lambda m: m["host_ms"], "{:.2f}")
    row("peak memory + TIDE pool (MiB)", lambda m: m["peak_memory_mib"] + m["tide_window_mib"], "{:.1f}")
    lines.append("host time: from the step's start until it returns (forward, backward, optimizer "
                 "issued), not waiting for the GPU; step time waits for it")
    lines.append(f"TIDE handled {c['tide_buckets']} of {c['param_groups']} param groups; "
                 f"{c['replays']} replays of one captured forward + backward per rank; TIDE "
                 f"collectives called from Python in the timed steps: {e['loop_collectives']} run by "
                 f"run, {c['loop_collectives']} captured")
    diffs = summary.get("max_abs_diffs") or {"tide_captured_vs_tide": summary["max_abs_diff"]}
    lines.append("max |difference| over final parameters: " + ", ".join(
        f"{pair.replace('_vs_', ' vs ').replace('_', ' ')} {d:.3e}" + (" (bitwise equal)" if d == 0 else "")
        for pair, d in diffs.items()))
    if r:  # the reference is captured: only captured steps compare with it
        lines.append(exposed_communication(r, [("TIDE captured", c)] + ([("stock captured", sc)] if sc else [])))
    return "\n".join(lines)


def collectives_table(rows: list) -> str:
    out = [f"{'coll':<5} {'W':>3} {'bytes':>12} {'stock ms':>10} {'TIDE ms':>10} {'stock algbw':>12} "
           f"{'TIDE algbw':>11} {'TIDE busbw':>11} {'TIDE/stock':>11} {'check':>6}",
           f"{'':<5} {'':>3} {'':>12} {'':>10} {'':>10} {'(GB/s)':>12} {'(GB/s)':>11} {'(GB/s)':>11}"]
    for r in rows:
        alg_s = r["bytes"] / r["stock_ms"] / 1e6
        alg_t = r["bytes"] / r["tide_ms"] / 1e6
        bus_t = alg_t * (r["world"] - 1) / r["world"]  # nccl-tests convention for AG and RS
        out.append(f"{r['collective']:<5} {r['world']:>3} {r['bytes']:>12} {r['stock_ms']:>10.3f} "
                   f"{r['tide_ms']:>10.3f} {alg_s:>12.2f} {alg_t:>11.2f} {bus_t:>11.2f} "
                   f"{r['tide_ms'] / r['stock_ms']:>11.3f} {'ok' if r['check'] else 'WRONG':>6}")
    return "\n".join(out)


def write_json(path: str, payload: dict) -> None:
    with open(path, "w") as f:
        json.dump(payload, f, indent=2, sort_keys=True)


def fsdp_plots(summary: dict, plot_dir: str) -> list:
    """The headline (layout-conversion copy bytes per step, stock vs TIDE), the step-time breakdown
    and memory, as PNGs in plot_dir, values on the bars; returns the paths written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(plot_dir, exist_ok=True)
    modes = ["stock", "tide"]
    labels = ["stock FSDP2", "TIDE"]
    coll = [summary[m]["collectives_ms"] for m in modes]
    rest = [max(summary[m]["step_ms"] - summary[m]["collectives_ms"], 0.0) for m in modes]
    paths = []
    emulated = " (single-GPU emulation)" if summary["tide"].get("ranks_share_gpus") else ""

    fig, ax = plt.subplots(figsize=(5, 4))
    copies = [summary[m]["layout_copy_mib"] for m in modes]
    bars = ax.bar(labels, copies, color=["tab:gray", "tab:blue"])
    ax.bar_label(bars, labels=[f"{c:,.1f} MiB" for c in copies], padding=2)
    ax.set_ylabel("MiB read + written per step and rank")
    ax.set_title(f"layout-conversion copies per step\n{summary['model']}, W={summary['world']}{emulated}",
                 fontsize=9)
    ax.set_ylim(0, max(copies + [1.0]) * 1.15)
    fig.tight_layout()
    paths.append(os.path.join(plot_dir, "fsdp_layout_copies.png"))
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(5, 4))
    ax.bar(labels, rest, label="compute and other")
    bars = ax.bar(labels, coll, bottom=rest, label="collectives (incl. layout copies)")
    ax.bar_label(bars, labels=[f"{r + c:.1f} ms" for r, c in zip(rest, coll)], padding=2)
    ax.set_ylabel("ms per step (median)")
    ax.set_title(f"step time\nW={summary['world']}, {summary['device']}{emulated}", fontsize=9)
    ax.legend()
    fig.tight_layout()
    paths.append(os.path.join(plot_dir, "fsdp_step_time.png"))
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(5, 4))
    memory = [summary[m]["peak_memory_mib"] + (summary[m]["tide_window_mib"] if summary["device"] == "cuda"
                                               else 0.0) for m in modes]
    bars = ax.bar(labels, memory)
    ax.bar_label(bars, labels=[f"{v:,.0f} MiB" for v in memory], padding=2)
    ax.set_ylabel(f"MiB ({summary['stock']['peak_memory_kind']})")
    ax.set_title("peak memory per rank" + (" (TIDE: + window pool)" if summary["device"] == "cuda" else ""))
    fig.tight_layout()
    paths.append(os.path.join(plot_dir, "fsdp_memory.png"))
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)
    return paths


def interference_summary(results: list) -> dict:
    """The slowest rank's median and mean GEMM time per background, and the slowdowns."""
    def worst(key):
        per_rank = [(statistics.median(r[key]), statistics.fmean(r[key])) for r in results]
        return max(per_rank)

    alone = worst("alone")
    rows = {}
    for key, label in (("alone", "alone"), ("tide", "beside TIDE-RS"),
                       ("nccl", "beside NCCL reduce_scatter fp32")):
        median, mean = worst(key)
        rows[key] = {"label": label, "median_us": median, "mean_us": mean,
                     "slowdown_median": median / alone[0] - 1.0, "slowdown_mean": mean / alone[1] - 1.0}
    return {"world": results[0]["world"], "gpu": results[0]["gpu"], "rows": rows,
            "tflops_alone": min(r["tflops"] for r in results),
            "tide_sm_cta_us": sum(r["tide_sm_cta_us"] for r in results),
            "overlapped": all(r["tide_overlapped"] and r["nccl_overlapped"] for r in results)}


def interference_table(summary: dict) -> str:
    lines = [f"# tide-bench interference: bf16 GEMM 2048x1024x16384 on each of {summary['world']} GPUs "
             f"({summary['gpu']}), one rank per GPU; slowest rank",
             f"{'GEMM':<36} {'median us':>10} {'slowdown':>9} {'mean':>9}"]
    for row in summary["rows"].values():
        slow = "" if row["label"] == "alone" else f"{100 * row['slowdown_median']:+.1f}%"
        mean = "" if row["label"] == "alone" else f"{100 * row['slowdown_mean']:+.1f}%"
        lines.append(f"{row['label']:<36} {row['median_us']:>10.1f} {slow:>9} {mean:>9}")
    lines.append(f"background: a 256 MiB bf16 gradient per rank (TIDE-RS: bf16 -> fp32 shard, reduce "
                 f"kernel {summary['tide_sm_cta_us']:.0f} CTA*us per RS over all ranks; NCCL: the same "
                 f"as an fp32 buffer, avg); GEMM alone {summary['tflops_alone']:.0f} TFLOP/s")
    if not summary["overlapped"]:
        lines.append("WARNING: a background finished before the timed GEMMs did; figures partly alone")
    return "\n".join(lines)


def host_cost_table(results: list, shares_gpu: bool) -> str:
    """The slowest rank's median host time per step, stock vs TIDE, and per param group."""
    groups = results[0]["groups"]
    stock = max(r["stock_ms"] for r in results)
    mine = max(r["tide_ms"] for r in results)
    where = "ranks sharing one GPU" if shares_gpu else "one rank per GPU"
    return "\n".join([
        f"# tide-bench host-cost: {groups} param groups of {results[0]['linears']} Linear(64) each "
        f"({2 * results[0]['linears']} params), {len(results)} ranks "
        f"({where}); host time of forward + backward, median of the slowest rank",
        f"{'':<34} {'ms/step':>9} {'us/group':>9}",
        f"{'stock FSDP2 (no-op collectives)':<34} {stock:>9.2f} {1000 * stock / groups:>9.1f}",
        f"{'TIDE':<34} {mine:>9.2f} {1000 * mine / groups:>9.1f}",
        f"TIDE / stock: {mine / stock:.2f}x (stock's collectives cost nothing here: a lower bound on "
        "stock's host time)",
        f"TIDE remapped a bucket's fixed address {max(r['tide_remaps'] for r in results) / results[0]['steps']:.1f} "
        f"times per timed step ({results[0]['tide_all_gathers'] / results[0]['steps']:.0f} all-gathers; "
        "on CUDA each remap waits on the host for the params' last readers)"])


# The modes scripts/multi_gpu.sh reads from each `tide-bench fsdp --cuda-graphs --compute-only`
# JSON (one GPU per rank), and the fields it reads of each (merged per mode alike by tide-bench).
EXPOSURE_MODES = ("stock", "stock_captured", "tide", "tide_captured", "compute_only")
EXPOSURE_FIELDS = ("step_ms", "host_ms", "peak_memory_mib", "tide_window_mib")


def exposure_rows(paths: list, expect: tuple = EXPOSURE_MODES) -> str:
    """A Markdown row per `tide-bench fsdp` JSON: each expected mode's step time, the captured
    modes' exposed communication (step - compute-only), host time and peak memory (TIDE's pool
    included), and the runs' agreement. A JSON without an expected mode or field is an error
    naming both: the script that reads it would otherwise print a row of nothing."""
    from .fsdp_bench import MODES
    unknown = [m for m in expect if m.replace("_", "-") not in MODES]
    if unknown:
        raise ValueError(f"modes {unknown}: expected some of {[m.replace('-', '_') for m in MODES]}")
    lines = ["| model | W | tokens/GPU | " + " | ".join(f"{m} ms" for m in expect)
             + " | exposed (ms) | host ms | peak MiB | max abs diffs |",
             "|---" * (len(expect) + 7) + "|"]
    for path in paths:
        with open(path) as f:
            d = json.load(f)
        for key in ("model", "world", "batch", "seq", "max_abs_diff"):
            if key not in d:
                raise ValueError(f"{path}: no field {key!r}")
        for m in expect:
            missing = [k for k in EXPOSURE_FIELDS if k not in d.get(m, {})]
            if m not in d or missing:
                raise ValueError(f"{path}: mode {m!r} " + (f"has no fields {missing}" if m in d else
                                 f"absent (modes there: {d.get('modes')})"))
        ref = d.get("compute_only")
        exposed = ", ".join(f"{m} {d[m]['step_ms'] - ref['step_ms']:.2f}" for m in expect
                            if m.endswith("_captured") and ref) or "-"
        ms = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
        host = ", ".join(f"{m} {ms(d[m]['host_ms'])}" for m in expect if m != "compute_only")
        peak = ", ".join(f"{m} {d[m]['peak_memory_mib'] + d[m]['tide_window_mib']:.0f}" for m in expect)
        first, second = (d.get("modes") or ["first", "second"])[:2]  # max_abs_diff's pair
        diffs = d.get("max_abs_diffs") or {f"{second}_vs_{first}": d["max_abs_diff"]}
        lines.append(f"| {d['model']} | {d['world']} | {d['batch'] * d['seq']} | "
                     + " | ".join(ms(d[m]["step_ms"]) for m in expect)
                     + f" | {exposed} | {host} | {peak} | "
                     + ", ".join(f"{k} {v:.1e}" for k, v in diffs.items()) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    """python -m tide.bench.report exposure [--expect MODES] JSON...: exposure_rows's table."""
    import argparse
    parser = argparse.ArgumentParser(prog="python -m tide.bench.report")
    sub = parser.add_subparsers(dest="command", required=True)
    e = sub.add_parser("exposure", help="a Markdown row per tide-bench fsdp JSON")
    e.add_argument("--expect", default=",".join(EXPOSURE_MODES),
                   help=f"comma-separated modes each JSON must hold (default: {','.join(EXPOSURE_MODES)})")
    e.add_argument("json", nargs="+")
    args = parser.parse_args(argv)
    try:
        print(exposure_rows(args.json, tuple(args.expect.split(","))))
    except (OSError, ValueError) as err:
        print(f"python -m tide.bench.report: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
