"""Plot the real-vLLM graph-memory table: what vLLM budgeted for graphs vs what they took.

    python bench/plot_vllm_graph_memory.py [JSON [SIZE ...]]

JSON defaults to bench/results/vllm_graph_memory.json; SIZEs pick the rows to
draw by their size group (tiny, 1b, 8b-compile, ...), by default every group
at vLLM's default capture sizes, allocator and workload (the README's plot).

Reads the JSON that scripts/vllm_e2e/summarize.py writes from the runs on the
GPU machine and writes a PNG next to it: for each (size, speculator), with the
plugin off and on, the bytes vLLM subtracted from the KV-cache budget for
graphs and the bytes then taken (left by the profile + the production
capture). Needs matplotlib; measures nothing itself.
"""

from __future__ import annotations

import json
import os
import sys

MIB = 1 << 20
DETAIL_GROUPS = {"small", "peak", "expandable"}


def _default_group(group: str) -> bool:
    parts = group.split("-")
    return not any(p in DETAIL_GROUPS or p.startswith("util") for p in parts)


def main(path: str, sizes: list[str]) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(path) as f:
        rows = [
            r
            for r in json.load(f)["rows"]
            if r["taken_off_bytes"] is not None
            and r["taken_on_bytes"] is not None
            and (r["size"] in sizes if sizes else _default_group(r["size"]))
        ]
    # A row without the time it was measured comes from older code: say so under it.
    labels = [
        f"{r['size']}\n{r['case']}" + ("" if r.get("measured_utc") else "\n(older code)")
        for r in rows
    ]
    series = [
        ("vLLM 0.33.0: budgeted", "upstream_estimate_bytes", "#bbbbbb", ""),
        ("vLLM 0.33.0: taken", "taken_off_bytes", "#777777", "//"),
        ("with vllm-specgraph: budgeted", "plugin_budget_bytes", "#7fb3d5", ""),
        ("with vllm-specgraph: taken", "taken_on_bytes", "#1f618d", "//"),
    ]
    width = 0.2
    # At most 10 inches wide: legible at the width a README is shown at.
    fig, ax = plt.subplots(figsize=(min(10.0, 0.75 * len(rows) + 2), 4.6))
    for i, (name, key, color, hatch) in enumerate(series):
        xs = [x + (i - 1.5) * width for x in range(len(rows))]
        ax.bar(xs, [r[key] / MIB for r in rows], width, label=name, color=color, hatch=hatch)
    for x, r in enumerate(rows):
        missed = r["budget_minus_taken_off_bytes"] / MIB
        ax.annotate(
            f"{missed:+.0f}",
            (x - width, max(r["upstream_estimate_bytes"], r["taken_off_bytes"]) / MIB),
            ha="center",
            va="bottom",
            fontsize=8,
        )
    ax.set_xticks(range(len(rows)), labels, fontsize=8)
    ax.set_ylabel("MiB (driver level)")
    ax.set_title(
        "CUDA-graph memory: budgeted before the KV cache vs taken\n"
        "(number: vLLM 0.33.0's budget minus taken; negative: KV cache too large)",
        fontsize=10,
    )
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    out = os.path.splitext(path)[0] + ".png"
    fig.savefig(out, dpi=110)
    return out


if __name__ == "__main__":
    args = sys.argv[1:] or ["bench/results/vllm_graph_memory.json"]
    print(main(args[0], args[1:]))
