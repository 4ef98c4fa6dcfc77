"""Plot the all-reduce latency table: core vs NCCL by size, eager and graph-replayed.

    python bench/plot_allreduce.py [JSON]

JSON defaults to bench/results/allreduce.json, which bench/allreduce.py writes on a
two-GPU machine; the PNG lands next to it. Needs matplotlib; measures nothing itself.
"""

from __future__ import annotations

import json
import os
import sys

STYLES = {
    "core": ("core (default config)", "#1f618d", "o", "-"),
    "one_shot": ("one-shot (forced)", "#7fb3d5", "^", "--"),
    "two_shot": ("two-shot (forced)", "#48c9b0", "v", "--"),
    "nccl": ("NCCL", "#777777", "s", "-"),
}


def _size(nbytes: int) -> str:
    return f"{nbytes >> 20}M" if nbytes >= 1 << 20 else f"{nbytes >> 10}K"


def main(path: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(path) as f:
        result = json.load(f)
    rows = result["rows"]
    sizes = [r["bytes"] for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for ax, mode, title in ((axes[0], "eager_us", "eager"), (axes[1], "graph_us", "graph replay")):
        for variant, (label, color, marker, line) in STYLES.items():
            us = [r[mode][variant] for r in rows]
            ax.plot(sizes, us, line, color=color, marker=marker, markersize=4, label=label)
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [_size(n) for n in sizes], fontsize=7)
        ax.minorticks_off()
        ax.set_yscale("log")
        ax.set_xlabel("message size (bytes)")
        ax.set_title(title, fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("us per all-reduce (slower rank)")
    axes[1].legend(fontsize=8, loc="upper left")
    fig.suptitle(
        f"All-reduce, {result['world_size']} x {result['device']}, {result['dtype']}, "
        f"torch {result['torch']}, NVLink multicast off",
        fontsize=10,
    )
    fig.tight_layout()
    out = os.path.splitext(path)[0] + ".png"
    fig.savefig(out, dpi=110)
    return out


if __name__ == "__main__":
    print(main(sys.argv[1] if len(sys.argv) > 1 else "bench/results/allreduce.json"))
