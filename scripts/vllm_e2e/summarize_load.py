# SPDX-License-Identifier: Apache-2.0
"""The load test's summary: ``bench/results/vllm_load.{json,md}``.

One row per (size group, case) from the ``--workload load`` runs, plugin off
and on: whether the greedy tokens are equal, generation tokens/s of each (best
and median of the timed repeats; only ``generate()`` is timed, after a warm-up),
their ratio, the mean engine-step time (median over the repeats: a repeat's
wall time over the engine steps vLLM counted) and its ratio, and the
speculative acceptance rate over the timed repeats. A row
passes when the tokens are equal and on/off tokens/s is within the target.
"""

from __future__ import annotations

import datetime
import json
import os
from typing import Any

RESULTS_NAME = "vllm_load"
SCHEMA = 1
RATIO_TOLERANCE = 0.02

__all__ = ["COLUMNS", "build_row", "markdown", "row_cells", "write"]

COLUMNS = (
    "size",
    "case",
    "requests",
    "tokens generated per repeat",
    "tokens/s off (best / median)",
    "tokens/s on (best / median)",
    "on / off (best)",
    "engine step ms off / on (median)",
    "step on / off",
    "acceptance off / on",
    "mean acceptance length off / on",
    "tokens on = off",
    "repeats equal off / on",
    "GPU off / on",
    "check",
)


def _load(run: dict[str, Any] | None) -> dict[str, Any]:
    return (run or {}).get("load") or {}


def build_row(group: str, case: str, off: dict | None, on: dict | None) -> dict[str, Any]:
    lo, ln = _load(off), _load(on)
    best_off, best_on = lo.get("tokens_per_s_best"), ln.get("tokens_per_s_best")
    ratio = round(best_on / best_off, 4) if best_off and best_on else None
    step_off, step_on = lo.get("step_ms_median"), ln.get("step_ms_median")
    step_ratio = round(step_on / step_off, 4) if step_off and step_on else None
    tok_off = off.get("tokens") if off and off.get("ok") else None
    tok_on = on.get("tokens") if on and on.get("ok") else None
    equal = tok_on == tok_off if tok_on is not None and tok_off is not None else None
    row: dict[str, Any] = {
        "size": group,
        "case": case,
        "ran_off": bool(off and off.get("ok")),
        "ran_on": bool(on and on.get("ok")),
        "num_requests": ln.get("num_requests", lo.get("num_requests")),
        "generated_tokens": (ln.get("repeats") or lo.get("repeats") or [{}])[0].get(
            "generated_tokens"
        ),
        "tokens_per_s_off": {"best": best_off, "median": lo.get("tokens_per_s_median")},
        "tokens_per_s_on": {"best": best_on, "median": ln.get("tokens_per_s_median")},
        "ratio_on_off": ratio,
        "step_ms_off": step_off,
        "step_ms_on": step_on,
        "step_ratio_on_off": step_ratio,
        "acceptance_off": (lo.get("spec") or {}).get("acceptance_rate"),
        "acceptance_on": (ln.get("spec") or {}).get("acceptance_rate"),
        "mean_acceptance_length_off": (lo.get("spec") or {}).get("mean_acceptance_length"),
        "mean_acceptance_length_on": (ln.get("spec") or {}).get("mean_acceptance_length"),
        "tokens_equal_on_off": equal,
        "repeats_equal_off": lo.get("repeats_equal"),
        "repeats_equal_on": ln.get("repeats_equal"),
        "gpu_off": ((off or {}).get("gpu") or {}).get("visible_devices"),
        "gpu_on": ((on or {}).get("gpu") or {}).get("visible_devices"),
        "repeats_off": lo.get("repeats"),
        "repeats_on": ln.get("repeats"),
        "measured_utc": (on or off or {}).get("_measured_utc"),
    }
    checks = {
        "tokens": equal,
        "ratio": None if ratio is None else abs(ratio - 1) <= RATIO_TOLERANCE,
    }
    row["checks"] = checks
    row["pass"] = all(v is True for v in checks.values())
    reasons = []
    if equal is None:
        reasons.append("tokens missing")
    elif not equal:
        reasons.append("tokens differ")
    if ratio is None:
        reasons.append("no tokens/s")
    elif not checks["ratio"]:
        reasons.append(f"on/off {ratio:.3f}")
    row["status"] = "PASS" if row["pass"] else "FAIL (" + "; ".join(reasons) + ")"
    return row


def _pair(a: Any, b: Any, fmt: Any = str) -> str:
    return f"{'-' if a is None else fmt(a)} / {'-' if b is None else fmt(b)}"


def row_cells(row: dict[str, Any]) -> list[str]:
    off, on = row["tokens_per_s_off"], row["tokens_per_s_on"]
    return [
        row["size"],
        row["case"],
        "-" if row["num_requests"] is None else str(row["num_requests"]),
        "-" if row["generated_tokens"] is None else f"{row['generated_tokens']:,}",
        _pair(off["best"], off["median"], lambda x: f"{x:,.0f}"),
        _pair(on["best"], on["median"], lambda x: f"{x:,.0f}"),
        "-" if row["ratio_on_off"] is None else f"{row['ratio_on_off']:.3f}",
        _pair(row.get("step_ms_off"), row.get("step_ms_on"), lambda x: f"{x:.2f}"),
        "-" if row.get("step_ratio_on_off") is None else f"{row['step_ratio_on_off']:.3f}",
        _pair(row["acceptance_off"], row["acceptance_on"], lambda x: f"{x:.3f}"),
        _pair(row["mean_acceptance_length_off"], row["mean_acceptance_length_on"]),
        "-" if row["tokens_equal_on_off"] is None else str(row["tokens_equal_on_off"]),
        _pair(row["repeats_equal_off"], row["repeats_equal_on"]),
        _pair(row["gpu_off"], row["gpu_on"]),
        row["status"],
    ]


def markdown(doc: dict[str, Any]) -> str:
    out = [
        "# vLLM 0.33.0 under load: vllm-specgraph off and on",
        "",
        "Real vLLM 0.33.0 (Model Runner V2, FULL CUDA graphs, Triton attention, dummy "
        "weights refilled by name, greedy, `ignore_eos`) through "
        "`scripts/device-vllm-e2e.sh` with `MODE=load`: each run submits all requests "
        "at once (seeded prompt lengths 16 to `max_model_len / 2`, outputs 16 to "
        "`max_model_len / 4`) after a warm-up generate; only `generate()` is timed, "
        "repeated; acceptance is vLLM's spec-decode counters over the timed repeats. "
        "Off and on of one case run one after the other on the same GPU.",
        "",
        "| " + " | ".join(COLUMNS) + " |",
        "|" + "|".join("---" if i < 2 else "---:" for i in range(len(COLUMNS))) + "|",
    ]
    out += ["| " + " | ".join(row_cells(row)) + " |" for row in doc["rows"]]
    out += [
        "",
        f"Check: greedy tokens on equal to off; on/off tokens/s (best repeat) within "
        f"{RATIO_TOLERANCE:.0%}. Measured: "
        + ", ".join(f"{r['size']}/{r['case']} {r.get('measured_utc')} UTC" for r in doc["rows"])
        + ".",
        "",
    ]
    return "\n".join(out)


def write(
    rows: list[dict[str, Any]], results_dir: str, previous: str | None = None
) -> tuple[str, str]:
    """Write the JSON and Markdown, carrying over rows of ``previous`` (an
    earlier vllm_load.json) whose (size, case) this invocation did not run."""
    rows = list(rows)
    if previous and os.path.exists(previous):
        with open(previous) as f:
            prev = json.load(f)
        if prev.get("schema") == SCHEMA:
            here = {(r["size"], r["case"]) for r in rows}
            rows += [r for r in prev.get("rows", []) if (r["size"], r["case"]) not in here]
    doc = {
        "schema": SCHEMA,
        "generated_utc": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M"),
        "ratio_tolerance": RATIO_TOLERANCE,
        "rows": rows,
    }
    os.makedirs(results_dir, exist_ok=True)
    jpath = os.path.join(results_dir, f"{RESULTS_NAME}.json")
    mpath = os.path.join(results_dir, f"{RESULTS_NAME}.md")
    with open(jpath, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    with open(mpath, "w") as f:
        f.write(markdown(doc))
    return jpath, mpath
