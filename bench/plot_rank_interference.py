#!/usr/bin/env python3
"""Plots the TSV of `tide_bench_cuda rank-interference`: the reduce budget's trade-off.

    python3 bench/plot_rank_interference.py rank_interference.tsv rank_interference.png

x: GEMM mean slowdown (%), y: the TIDE-RS rank model's loaded RS time over today's unloaded one;
one point per swept budget (marker: tiles per CTA, colour: priority), the fixed cases labelled,
the target box (<= 10 %, <= 1.2x) shaded. Exits 0 with a message when matplotlib is missing.
"""
import csv
import sys


def main() -> int:
    if len(sys.argv) != 3:
        print(__doc__)
        return 2
    tsv, png = sys.argv[1], sys.argv[2]
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"# PNG: matplotlib not available; plot {tsv} yourself")
        return 0
    with open(tsv) as f:
        rows = [r for r in csv.DictReader((line for line in f if not line.startswith("#")), delimiter="\t")]
    tide = [r for r in rows if r["kind"] == "tide" and float(r["rs_loaded_vs_ref"]) > 0]
    fig, ax = plt.subplots(figsize=(9, 6))
    ax.fill_between([-5, 10], 0, 1.2, color="tab:green", alpha=0.12, label="target")
    markers = {"0": "s", "1": "o", "4": "^"}
    colours = {"normal": "tab:red", "low": "tab:blue"}
    for r in tide:
        x, y = float(r["gemm_slowdown_mean_pct"]), float(r["rs_loaded_vs_ref"])
        ax.scatter(x, y, marker=markers.get(r["tiles_per_cta"], "D"), color=colours.get(r["priority"], "k"), s=36)
        ax.annotate(r["budget"].replace(",priority=", "\n").replace("ctas=", "").replace("tiles=", "t"),
                    (x, y), fontsize=6, xytext=(3, 2), textcoords="offset points")
    for r in tide:
        if r["budget"] == "default":
            ax.scatter(float(r["gemm_slowdown_mean_pct"]), float(r["rs_loaded_vs_ref"]), marker="*", s=200,
                       color="gold", edgecolor="k", zorder=5, label="today's default")
    ax.set_xlabel("GEMM mean slowdown beside the rank's RS (%)")
    ax.set_ylabel("RS time beside the GEMM / today's unloaded RS time")
    ax.set_title("TIDE-RS reduce budget (one rank of W=8, one GPU): markers = tiles/CTA "
                 "(square persistent, circle 1, triangle 4); red normal, blue low priority", fontsize=8)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=130)
    print(f"# wrote {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
