# SPDX-License-Identifier: Apache-2.0
"""The tight-memory rows of the summary: what each plugin switch did at the
utilization that ``memory_budget.py plan`` computed from the calibration runs.

One row per (size group, case): the plan (utilization, margin, the off and on
runs' needs), then per switch how the run ended (``memory_budget.failure_kind``),
its KV tokens, what it held over budget at rest and what its full step took.
The row passes when the plugin-on run ran to the end.
"""

from __future__ import annotations

from typing import Any

import memory_budget
from results_files import markdown_grid

MiB = 1 << 20
SWITCHES = ("off", "on", "noest")

__all__ = ["COLUMNS", "build_rows", "markdown_lines", "row_cells"]

COLUMNS = (
    "size",
    "case",
    "gpu_memory_utilization",
    "margin MiB",
    "need off / on MiB (calibration)",
    "off",
    "on",
    "noest",
    "KV tokens off / on / noest",
    "over budget at rest off / on / noest MiB",
    "full step took off / on / noest MiB",
    "check",
)


def _kv_tokens(run: dict[str, Any]) -> int | None:
    value = run.get("kv_tokens")
    return int(value) if isinstance(value, int | float) else None


def switch_figures(run: dict[str, Any] | None) -> dict[str, Any] | None:
    """One switch's tight run, in the row's terms; None when it did not run."""
    if run is None:
        return None
    mem = run.get("mem") or {}
    return {
        "outcome": memory_budget.failure_kind(run),
        "ok": bool(run.get("ok")),
        "kv_tokens": _kv_tokens(run),
        "over_budget_bytes": memory_budget.over_budget_bytes(mem),
        "step_bytes": memory_budget.step_bytes(mem),
        "init_free_bytes": mem.get("init_free_bytes"),
        "requested_bytes": mem.get("requested_bytes"),
        "measured_utc": run.get("_measured_utc"),
    }


def build_rows(runs: dict[tuple[str, str, str], dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows from the tight runs, keyed (group, case, switch) as in summarize.py."""
    rows = []
    for group, case in sorted({(g, c) for g, c, _ in runs}):
        by_switch = {s: runs.get((group, case, s)) for s in SWITCHES}
        plan = next((r["tight"] for r in by_switch.values() if r and r.get("tight")), {})
        figures = {s: switch_figures(r) for s, r in by_switch.items()}
        on = figures["on"]
        row = {
            "size": group,
            "case": case,
            "gpu_memory_utilization": plan.get("gpu_memory_utilization"),
            "margin_bytes": plan.get("margin_bytes"),
            "reason": plan.get("reason"),
            "need_bytes": plan.get("need_bytes") or {},
            "switches": figures,
            "pass": bool(on and on["ok"]),
        }
        row["status"] = (
            "PASS" if row["pass"] else "FAIL (on: " + (on["outcome"] if on else "not run") + ")"
        )
        rows.append(row)
    return rows


def _mib(x: Any) -> str:
    return "-" if not isinstance(x, int | float) else f"{x / MiB:+.1f}"


def _triple(row: dict[str, Any], key: str, fmt: Any) -> str:
    cells = []
    for s in SWITCHES:
        fig = row["switches"].get(s)
        value = None if fig is None else fig.get(key)
        cells.append("-" if value is None else fmt(value))
    return " / ".join(cells)


def row_cells(row: dict[str, Any]) -> list[str]:
    util = row["gpu_memory_utilization"]
    need = row["need_bytes"]
    outcome = [
        (row["switches"].get(s) or {}).get("outcome", "not run") for s in ("off", "on", "noest")
    ]
    return [
        row["size"],
        row["case"],
        "-" if util is None else f"{util:.6f}",
        "-" if row["margin_bytes"] is None else f"{row['margin_bytes'] / MiB:.1f}",
        f"{_mib(need.get('off'))} / {_mib(need.get('on'))}",
        *outcome,
        _triple(row, "kv_tokens", lambda x: f"{x:,}"),
        _triple(row, "over_budget_bytes", _mib),
        _triple(row, "step_bytes", lambda x: f"{x / MiB:.1f}"),
        row["status"],
    ]


def markdown_lines(rows: list[dict[str, Any]]) -> list[str]:
    """The tight-memory section of vllm_graph_memory.md."""
    if not rows:
        return []
    out = [
        "## Tight memory: the limit at the free memory",
        "",
        "`gpu_memory_utilization` is set so that vLLM's limit is the free memory it "
        "measured at start-up minus a margin, computed from a calibration pass (plugin "
        "off and on at the usual utilization, same workload): a run needs "
        "`full step - activation headroom + over budget at rest` below the free "
        "memory, and the margin is halfway between the off and on runs' needs "
        "(`scripts/vllm_e2e/memory_budget.py`). Every run then prefills one full "
        "step (`max_num_seqs` prompts adding up to `max_num_batched_tokens`) and "
        "decodes 16 tokens. Off: upstream's estimate; on: the plugin's budget; "
        "noest: `VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=0` (nothing subtracted "
        "for graphs).",
        "",
    ]
    out += markdown_grid(COLUMNS, (row_cells(row) for row in rows), text_columns=2)
    out += [
        "",
        "Over budget at rest: driver-level bytes the started instance held beyond "
        "vLLM's limit minus the activation headroom (negative: unused). Full step "
        "took: driver-level free memory at rest minus after the first generate "
        "(allocator segments kept, kernels loaded on first launch). Check: the "
        "plugin-on run ran to the end.",
        "",
    ]
    return out
