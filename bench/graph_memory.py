"""Core benchmark (toy model, no vLLM): the disposable profile's estimate vs the actual.

For each owner (target, draft) of the toy speculative setup in
vllm_specgraph/demo/model.py:
  * profile: vllm_specgraph.profile, every graph captured into a private pool;
  * actual:  the production capture afterwards, measured at driver level.
Writes bench/results/graph_memory.{json,md} and prints one summary line. The
comparison with vLLM's own estimate is made on real vLLM, by
scripts/device-vllm-e2e.sh (bench/results/vllm_graph_memory.md).

    python bench/graph_memory.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from vllm_specgraph.demo.model import build_toy_setup
from vllm_specgraph.profile import measure_captures, profile_graph_memory

MIB = 1 << 20
RESULTS = Path(__file__).parent / "results"


def measure() -> dict:
    torch.manual_seed(0)
    setup = build_toy_setup()
    report = profile_graph_memory(
        setup.owners(), channel_pools=[setup.channel_pool], workspace=setup.workspace
    )
    actual = measure_captures(
        setup.owners(), torch.cuda.graph_pool_handle(), [setup.channel_pool], []
    )
    rows = [
        {
            "owner": est.owner,
            "graphs": act.num_graphs,
            "actual_mib": act.driver_bytes / MIB,
            "profile_mib": est.driver_bytes / MIB,
            "profile_error_pct": 100 * (est.driver_bytes - act.driver_bytes) / act.driver_bytes,
        }
        for est, act in zip(report.owners, actual, strict=True)
    ]
    return {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "rows": rows,
        "profile_one_time_mib": report.one_time_bytes / MIB,
        "profile_retained_mib": report.retained_bytes / MIB,
        "profile_retained_allocator_mib": report.retained_allocator_bytes / MIB,
        "profile_seconds": report.wall_seconds,
    }


def render(result: dict) -> list[str]:
    lines = [
        f"Core benchmark (toy model, no vLLM): graph memory on {result['device']} "
        f"(torch {result['torch']}), driver level, MiB",
        "",
        "| owner | graphs | actual | profile | error |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['owner']} | {r['graphs']} | {r['actual_mib']:.1f} | {r['profile_mib']:.1f} "
            f"| {r['profile_error_pct']:+.2f}% |"
        )
    lines.append("")
    lines.append(
        f"Profile: one-time process cost {result['profile_one_time_mib']:.1f} MiB, retained "
        f"after teardown {result['profile_retained_mib']:.2f} MiB (allocator "
        f"{result['profile_retained_allocator_mib']:.2f} MiB), "
        f"{result['profile_seconds']:.2f} s."
    )
    return lines


def main() -> int:
    if not torch.cuda.is_available():
        print("bench/graph_memory.py needs a CUDA GPU", file=sys.stderr)
        return 2
    result = measure()
    lines = render(result)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "graph_memory.json").write_text(json.dumps(result, indent=2))
    (RESULTS / "graph_memory.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    worst = max(abs(r["profile_error_pct"]) for r in result["rows"])
    print(f"graph_memory: profile worst error {worst:.2f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
