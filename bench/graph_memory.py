"""Graph-memory estimate vs actual, side by side: disposable profile and upstream's heuristic.

For each owner (target, draft) of the toy speculative setup:
  * profile:  vllm_specgraph.profile, every graph captured into a private pool;
  * upstream: vLLM 0.33.0 MRV2's extrapolation, which captures the two largest
    graphs and estimates first + (N - 1) * max(second, 1 MiB);
  * actual:   the production capture afterwards, measured at driver level.
Writes bench/results/graph_memory.{json,md} and prints one summary line.

    python bench/graph_memory.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from vllm_specgraph.demo.model import ToyGraphSet, build_toy_setup
from vllm_specgraph.profile import OwnerGraphs, measure_captures, profile_graph_memory

MIB = 1 << 20
RESULTS = Path(__file__).parent / "results"


def _restricted(owner: str, graph_set: ToyGraphSet, sizes: list[int]) -> OwnerGraphs:
    subset = ToyGraphSet(graph_set.model, sizes, graph_set.workspace, graph_set.channel_pool)
    return OwnerGraphs(owner, subset.capture, subset.warmup, subset.release)


def upstream_estimate(setup) -> dict[str, int]:
    """vLLM 0.33.0's extrapolation, applied per owner (upstream counts no draft graphs)."""
    estimates = {}
    for owner, graph_set in (("target", setup.target), ("draft", setup.draft)):
        sizes = graph_set.batch_sizes
        one = profile_graph_memory([_restricted(owner, graph_set, sizes[:1])])
        two = profile_graph_memory([_restricted(owner, graph_set, sizes[:2])])
        first = one.total_driver_bytes
        second = two.total_driver_bytes - first
        estimates[owner] = first + (len(sizes) - 1) * max(second, MIB)
    return estimates


def main() -> int:
    if not torch.cuda.is_available():
        print("bench/graph_memory.py needs a CUDA GPU", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    setup = build_toy_setup()
    report = profile_graph_memory(
        setup.owners(), channel_pools=[setup.channel_pool], workspace=setup.workspace
    )
    upstream = upstream_estimate(setup)
    actual = measure_captures(
        setup.owners(), torch.cuda.graph_pool_handle(), [setup.channel_pool], []
    )
    rows = []
    for est, act in zip(report.owners, actual, strict=True):
        rows.append(
            {
                "owner": est.owner,
                "graphs": act.num_graphs,
                "actual_mib": act.driver_bytes / MIB,
                "profile_mib": est.driver_bytes / MIB,
                "profile_error_pct": 100 * (est.driver_bytes - act.driver_bytes) / act.driver_bytes,
                "upstream_mib": upstream[est.owner] / MIB,
                "upstream_error_pct": 100
                * (upstream[est.owner] - act.driver_bytes)
                / act.driver_bytes,
            }
        )
    result = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "rows": rows,
        "profile_one_time_mib": report.one_time_bytes / MIB,
        "profile_retained_mib": report.retained_bytes / MIB,
        "profile_retained_allocator_mib": report.retained_allocator_bytes / MIB,
        "profile_seconds": report.wall_seconds,
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "graph_memory.json").write_text(json.dumps(result, indent=2))
    lines = [
        f"Graph memory on {result['device']} (torch {result['torch']}), driver level, MiB",
        "",
        "| owner | graphs | actual | profile | error | upstream heuristic | error |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['owner']} | {r['graphs']} | {r['actual_mib']:.1f} | {r['profile_mib']:.1f} "
            f"| {r['profile_error_pct']:+.2f}% | {r['upstream_mib']:.1f} "
            f"| {r['upstream_error_pct']:+.1f}% |"
        )
    lines.append("")
    lines.append(
        f"Profile: one-time process cost {result['profile_one_time_mib']:.1f} MiB, retained "
        f"after teardown {result['profile_retained_mib']:.2f} MiB (allocator "
        f"{result['profile_retained_allocator_mib']:.2f} MiB), {report.wall_seconds:.2f} s."
    )
    (RESULTS / "graph_memory.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    worst = max(abs(r["profile_error_pct"]) for r in rows)
    worst_upstream = max(abs(r["upstream_error_pct"]) for r in rows)
    print(
        f"graph_memory: profile worst error {worst:.2f}%, upstream heuristic {worst_upstream:.1f}%"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
