"""Per-call cost of workspace views: owner lanes vs vLLM 0.33.0's WorkspaceManager.

Eager decode calls ``get_simultaneous`` in every layer of every step, so its
Python overhead is on the hot path (CUDA graph replays skip it). Both managers
run side by side in one process on the CPU (the cost is host-side), in steady
state (no growth), with two lanes and the draft lane selected.
Writes bench/results/lanes_overhead.{json,md} and prints one summary line.

    .venv/bin/python bench/lanes_overhead.py
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from vllm_specgraph.lanes import LaneWorkspace, use_owner

RESULTS = Path(__file__).parent / "results"
REQUESTS = (((64, 4096), torch.bfloat16), ((64, 12288), torch.bfloat16), ((65,), torch.int32))
CALLS = 20_000
REPEATS = 5


def _best_us_per_call(fn: Callable[[], object]) -> float:
    for _ in range(1_000):
        fn()
    best = float("inf")
    for _ in range(REPEATS):
        start = time.perf_counter()
        for _ in range(CALLS):
            fn()
        best = min(best, time.perf_counter() - start)
    return best / CALLS * 1e6


def main() -> int:
    try:
        from vllm.v1.worker.workspace import WorkspaceManager, use_workspace_lane
    except ImportError:
        print("bench/lanes_overhead.py needs vLLM 0.33.0 (make test installs it)", file=sys.stderr)
        return 2
    import vllm

    torch.manual_seed(0)
    device = torch.device("cpu")
    if not torch.accelerator.is_available():
        # vLLM's first (growing) call empties the accelerator cache, which a CPU-only
        # torch refuses; it never runs in the steady state measured here.
        torch.accelerator.empty_cache = lambda: None
    ours = LaneWorkspace(device)
    upstream = WorkspaceManager(device, num_lanes=2)
    with use_owner("draft"):
        ours_us = _best_us_per_call(lambda: ours.get_simultaneous(*REQUESTS))
    with use_workspace_lane(1):
        upstream_us = _best_us_per_call(lambda: upstream.get_simultaneous(*REQUESTS))
    result = {
        "vllm": vllm.__version__,
        "torch": torch.__version__,
        "calls": CALLS,
        "views_per_call": len(REQUESTS),
        "vllm_specgraph_us": ours_us,
        "vllm_workspace_manager_us": upstream_us,
        "ratio": ours_us / upstream_us,
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "lanes_overhead.json").write_text(json.dumps(result, indent=2))
    table = "\n".join(
        [
            f"get_simultaneous, {len(REQUESTS)} views, steady state, best of {REPEATS} x "
            f"{CALLS} calls (torch {torch.__version__}, vLLM {vllm.__version__}, CPU)",
            "",
            "| manager | us per call |",
            "|---|---:|",
            f"| vllm_specgraph LaneWorkspace | {ours_us:.2f} |",
            f"| vLLM 0.33.0 WorkspaceManager | {upstream_us:.2f} |",
        ]
    )
    (RESULTS / "lanes_overhead.md").write_text(table + "\n")
    print(table)
    print(
        f"lanes_overhead: {ours_us:.2f} us vs vLLM {upstream_us:.2f} us per call "
        f"({result['ratio']:.2f}x)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
