# SPDX-License-Identifier: Apache-2.0
"""vLLM's KV-cache budget as its worker computed it, what the instance then held,
and the tight-memory plan that is computed from those figures.

vLLM 0.33.0 (``Worker.determine_available_memory``) sizes the KV cache as

    kv = requested - non_kv - graph_estimate_applied

``requested`` is ``ceil(total * gpu_memory_utilization)``, counted from the
worker's init snapshot (CUDA context, cuBLAS handles and NCCL are taken before
it); ``non_kv`` is what the profile run left taken plus the headroom of its
activation peak; ``graph_estimate_applied`` is what ``profile_cudagraph_memory``
returned, or 0 with ``VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=0``. Once
started, with the allocator cache emptied, the instance should hold at most
``requested - headroom`` more than at the snapshot: the headroom stays free for
the activation peak of a full step. What it holds beyond that (``over budget``)
is taken out of that headroom, and the first step that reaches the peak runs
out of memory when the GPU has no more than ``requested`` free.

The tight-memory plan picks ``gpu_memory_utilization`` so that ``requested``
is the measured free memory at the snapshot minus a margin. A calibration pass
(plugin off and on, at the size's usual utilization, the same full-step
workload) measures, per run, what the instance held over budget at rest and the
driver-level bytes its full step then took; with the limit at the free memory,
the run survives the step only if the margin covers ``step - headroom + over
budget`` (its "need"). The margin lies halfway between the off and on runs'
needs. Run as a script, it writes the plan:

    python3 memory_budget.py plan OFF.json ON.json --out PLAN.json [--margin-mib M]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

MiB = 1 << 20
ESTIMATE_ENV = "VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS"
# When the plugin-off run needs no more than the plugin-on run, the limit cannot
# tell them apart by running out of memory; both then get this much above their need.
SEPARATION_MARGIN_BYTES = 4 * MiB

__all__ = [
    "ESTIMATE_ENV",
    "estimate_applied",
    "failure_kind",
    "need_bytes",
    "over_budget_bytes",
    "step_bytes",
    "tight_plan",
    "worker_budget",
]


def estimate_applied(environ: dict[str, str] | None = None) -> bool:
    """Whether vLLM subtracts its graph estimate, read as ``vllm.envs`` reads it."""
    env = os.environ if environ is None else environ
    return bool(int(env.get(ESTIMATE_ENV, "1")))


def worker_budget(worker: Any, applied: bool) -> dict[str, int]:
    """The budget figures a vLLM worker kept after ``determine_available_memory``.

    Empty when the worker did not profile (``kv_cache_memory_bytes`` was set)."""
    snapshot = getattr(worker, "init_snapshot", None)
    needed = ("requested_memory", "peak_activation_memory", "available_kv_cache_memory_bytes")
    if snapshot is None or not all(hasattr(worker, name) for name in needed):
        return {}
    estimate = int(getattr(worker, "cudagraph_memory_estimate", 0))
    subtracted = estimate if applied else 0
    requested = int(worker.requested_memory)
    return {
        "init_free_bytes": int(snapshot.free_memory),
        "init_total_bytes": int(snapshot.total_memory),
        "requested_bytes": requested,
        "activation_headroom_bytes": int(worker.peak_activation_memory) - subtracted,
        "graph_estimate_applied_bytes": subtracted,
        "non_kv_bytes": requested - int(worker.available_kv_cache_memory_bytes) - subtracted,
    }


def over_budget_bytes(mem: dict[str, Any] | None) -> int | None:
    """What the started instance held beyond ``requested - headroom``, at rest."""
    mem = mem or {}
    keys = ("init_free_bytes", "free_at_rest_bytes", "requested_bytes", "activation_headroom_bytes")
    if not all(isinstance(mem.get(k), int) for k in keys):
        return None
    held = mem["init_free_bytes"] - mem["free_at_rest_bytes"]
    return held - (mem["requested_bytes"] - mem["activation_headroom_bytes"])


def failure_kind(run: dict[str, Any]) -> str:
    """How a run ended, in words: ``ran``, or where it stopped and why."""
    if run.get("ok"):
        return "ran"
    text = f"{run.get('error') or ''}\n{run.get('traceback') or ''}"
    mem = run.get("mem") or {}
    if "Free memory on device" in text:
        return "refused at start-up: free memory below the limit"
    if "out of memory" not in text.lower() and "OutOfMemoryError" not in text:
        return f"failed at stage {run.get('stage')}"
    if run.get("stage") == "generate":
        return "out of memory in the first full step"
    if mem.get("capture_started") and "capture_actual_bytes" not in mem:
        return "out of memory in the production capture"
    if "kv_cache_bytes" in mem:
        return "out of memory after KV sizing, before the capture"
    return "out of memory before KV sizing"


def step_bytes(mem: dict[str, Any] | None) -> int | None:
    """Driver-level bytes the full step took from rest (allocator segments kept,
    kernel modules loaded on first launch, ...): free at rest minus free after it."""
    mem = mem or {}
    keys = ("free_at_rest_bytes", "free_after_step_bytes")
    if not all(isinstance(mem.get(k), int) for k in keys):
        return None
    return mem["free_at_rest_bytes"] - mem["free_after_step_bytes"]


def need_bytes(mem: dict[str, Any] | None) -> int | None:
    """The margin below the free memory a run needs to get through its full step:
    what the step takes beyond the headroom, plus what the run held over budget."""
    over, step = over_budget_bytes(mem), step_bytes(mem)
    if over is None or step is None:
        return None
    return step - (mem or {})["activation_headroom_bytes"] + over


def tight_plan(
    calibration: dict[str, dict[str, Any]], margin_bytes: int | None = None
) -> dict[str, Any]:
    """The utilization at which the KV cache, graphs and one full step fill the GPU.

    ``calibration`` maps a plugin switch (``off``, ``on``) to that run's ``mem``
    figures, taken at the size's usual utilization with the full-step workload.
    The margin left below the free memory is ``margin_bytes`` if given, else
    halfway between the two runs' needs (:func:`need_bytes`), so that the run
    that needs more runs out of memory and the other does not. vLLM refuses a
    limit above the free memory, so the margin is at least 0: when off needs
    none, both should run. When off does not need more than on, both get their
    need plus a few MiB, and what tells them apart is the KV tokens.

    Raises ValueError naming the missing figures when a run lacks them."""
    need: dict[str, int] = {}
    for switch in ("off", "on"):
        value = need_bytes(calibration.get(switch))
        if value is None:
            raise ValueError(
                f"calibration run {switch!r} lacks budget figures (init_free_bytes, "
                "free_at_rest_bytes, free_after_step_bytes, requested_bytes, "
                "activation_headroom_bytes); did it start and run its step?"
            )
        need[switch] = value
    init_free = min(calibration[s]["init_free_bytes"] for s in need)
    total = calibration["off"]["init_total_bytes"]
    if margin_bytes is not None:
        margin, reason = margin_bytes, "margin given"
    elif need["off"] <= 0 < need["off"] - need["on"]:
        # vLLM refuses a limit above the free memory, so no margin is below 0.
        margin = 0
        reason = (
            "off needs no margin (its step left more of the headroom unused than it "
            "held over budget): the limit at the free memory, both should run"
        )
    elif need["off"] > need["on"]:
        margin = max((need["off"] + need["on"]) // 2, 0)
        reason = "halfway between the off and on runs' needs (at least 0)"
    else:
        margin = max(max(need.values()) + SEPARATION_MARGIN_BYTES, 0)
        reason = "off needs no more than on: both should fit; compare KV tokens"
    return {
        "gpu_memory_utilization": (init_free - margin) / total,
        "margin_bytes": margin,
        "reason": reason,
        "init_free_bytes": init_free,
        "init_total_bytes": total,
        "need_bytes": need,
        "over_budget_bytes": {s: over_budget_bytes(calibration[s]) for s in need},
        "step_bytes": {s: step_bytes(calibration[s]) for s in need},
    }


def _main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="tight-memory plan from two calibration runs")
    sub = ap.add_subparsers(dest="command", required=True)
    plan = sub.add_parser("plan")
    plan.add_argument("off", help="run_llm.py result with --plugin off")
    plan.add_argument("on", help="run_llm.py result with --plugin on")
    plan.add_argument("--out", required=True)
    plan.add_argument("--margin-mib", type=float, help="override the computed margin")
    args = ap.parse_args(argv)
    runs = {}
    for switch in ("off", "on"):
        with open(getattr(args, switch)) as f:
            runs[switch] = json.load(f).get("mem") or {}
    margin = None if args.margin_mib is None else int(args.margin_mib * MiB)
    try:
        doc = tight_plan(runs, margin)
    except ValueError as e:
        print(f"no tight plan: {e}", file=sys.stderr)
        return 1
    doc["calibration"] = {"off": args.off, "on": args.on}
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
    print(
        f"tight plan: gpu_memory_utilization={doc['gpu_memory_utilization']!r} "
        f"(margin {doc['margin_bytes'] / MiB:.1f} MiB: {doc['reason']}; need "
        f"off {doc['need_bytes']['off'] / MiB:+.1f} MiB, "
        f"on {doc['need_bytes']['on'] / MiB:+.1f} MiB)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(_main())
