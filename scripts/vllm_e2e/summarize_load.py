# SPDX-License-Identifier: Apache-2.0
"""The load test's summary: ``bench/results/vllm_load.{json,md}``.

One row per (size group, case) from the ``--workload load`` runs, plugin off
and on, over every round the device script ran (``LOAD_ROUNDS``, the order
reversed every other round): the timed repeats of all runs of a switch are
pooled. The row has generation tokens/s of each switch (median, best and
lowest of the pooled repeats; only ``generate()`` is timed, after a warm-up),
the ratio of the medians on/off, the same ratio per round, the number of runs
of each switch, the mean engine-step time (median over the pooled repeats: a
repeat's wall time over the engine steps vLLM counted) and its ratio, and the
speculative acceptance over the timed repeats of all runs, what speculation
gains over the same size group without a speculator (the ``base`` case, plugin
off), the plugin's own share of a step (``workloads.plugin_share``: the time in
the plugin's functions over a profiled generate's, in each plugin-on run), and
the plugin commit and the time each row was measured. A row passes when every
run's greedy tokens, off and on, are the same and the plugin costs at most the
target: its share of a step is at most ``MAX_SLOWDOWN``. Where a step is bound
by the host (a draft model without graphs launches every kernel from Python),
tokens/s of one switch spread by more than that from repeat to repeat on a
shared host, so on/off of the medians is shown, not checked; a row without a
share measured is checked on it (at least ``1 - MAX_SLOWDOWN``).

Rows an earlier invocation wrote are carried over only if they name the commit
they were measured on; rows from before commits were recorded are dropped.
"""

from __future__ import annotations

import datetime
import json
import os
import statistics
from typing import Any

from results_files import markdown_grid, write_json_and_markdown

RESULTS_NAME = "vllm_load"
SCHEMA = 3
READABLE_SCHEMAS = (3,)
MAX_SLOWDOWN = 0.02

__all__ = ["COLUMNS", "build_row", "markdown", "round_of", "row_cells", "write"]

COLUMNS = (
    "size",
    "case",
    "requests",
    "runs off / on",
    "tokens/s off: median (lowest - best)",
    "tokens/s on: median (lowest - best)",
    "on / off (medians)",
    "on / off per round",
    "engine step ms off / on (median)",
    "step on / off",
    "acceptance off / on",
    "on / no speculator",
    "plugin share of a step (us)",
    "tokens equal (all runs)",
    "check",
    "commit",
    "measured (UTC)",
)

Run = dict[str, Any]


def round_of(run: Run) -> int:
    """The run's round; runs from before rounds existed were the only one."""
    return int(run.get("load_round", 1))


def _ran(runs: list[Run]) -> list[Run]:
    return sorted((r for r in runs if r.get("ok")), key=round_of)


def _repeats(runs: list[Run]) -> list[dict[str, Any]]:
    """Every timed repeat of ``runs``, each with its run's round."""
    return [
        rep | {"round": round_of(r)}
        for r in runs
        for rep in (r.get("load") or {}).get("repeats") or []
    ]


def _known(repeats: list[dict[str, Any]], key: str) -> list[float]:
    return [r[key] for r in repeats if r.get(key) is not None]


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _ratio(on: float | None, off: float | None) -> float | None:
    return round(on / off, 4) if on and off else None


def _rates(repeats: list[dict[str, Any]]) -> dict[str, float | None]:
    rates = _known(repeats, "tokens_per_s")
    return {
        "median": _median(rates),
        "best": max(rates, default=None),
        "lowest": min(rates, default=None),
    }


def _rounds(offs: list[Run], ons: list[Run]) -> list[dict[str, Any]]:
    """Per round: the median tokens/s of its off and on runs, and their ratio;
    the order of off and on alternates, so drift shows as ratios that alternate."""
    out = []
    for n in sorted({round_of(r) for r in offs + ons}):
        off, on = (
            _median(_known(_repeats([r for r in runs if round_of(r) == n]), "tokens_per_s"))
            for runs in (offs, ons)
        )
        out.append(
            {
                "round": n,
                "tokens_per_s_off": off,
                "tokens_per_s_on": on,
                "ratio_on_off": _ratio(on, off),
            }
        )
    return out


def _spec(runs: list[Run]) -> tuple[float | None, float | None]:
    """Acceptance rate and mean acceptance length over the timed repeats of
    every run: the counts added up, as ``workloads.spec_summary`` rounds them."""
    specs = [(r.get("load") or {}).get("spec") or {} for r in runs]
    drafts, draft_tokens, accepted = (
        sum(s.get(key) or 0 for s in specs) for key in ("drafts", "draft_tokens", "accepted_tokens")
    )
    rate = round(accepted / draft_tokens, 4) if draft_tokens else None
    return rate, round(1 + accepted / drafts, 3) if drafts else None


def _lanes(runs: list[Run]) -> str | None:
    lanes = sorted({str(v) for r in runs if (v := (r.get("gpu") or {}).get("visible_devices"))})
    return " ".join(lanes) or None


def _all(runs: list[Run], key: str) -> bool | None:
    return all((r.get("load") or {}).get(key) for r in runs) if runs else None


def compile_source(run: Run) -> str | None:
    """Where the run's torch.compile graphs came from, read from its log (the
    ``_log`` path the summary loader sets): ``compiled`` when vLLM compiled one
    in the process, ``cache`` when it loaded every one from its compile cache,
    None without compilation or without a log."""
    path = run.get("_log")
    if not path or not os.path.exists(path):
        return None
    with open(path, errors="replace") as f:
        log = f.read()
    if "Compiling a graph for compile range" in log:
        return "compiled"
    if "Directly load the compiled graph(s)" in log:
        return "cache"
    return None


def _tokens_differing(offs: list[Run], ons: list[Run]) -> list[str] | None:
    """The runs (``on r2``, ...) whose greedy tokens differ from the first off
    run's: all runs are equal when none does. None without a run of each switch."""
    if not offs or not ons:
        return None
    first = offs[0].get("tokens")
    return [
        f"{switch} r{round_of(r)}"
        for switch, runs in (("off", offs), ("on", ons))
        for r in runs
        if r.get("tokens") != first
    ]


def build_row(
    group: str,
    case: str,
    offs: list[Run],
    ons: list[Run],
    base_offs: list[Run] | None = None,
) -> dict[str, Any]:
    """The row of one (size group, case) from its runs, off and on, of every
    round; a run that did not finish (or was skipped) adds nothing.
    ``base_offs``: the same group's runs without a speculator, plugin off."""
    offs, ons = _ran(offs), _ran(ons)
    base_rate = _rates(_repeats(_ran(base_offs or [])))["median"]
    reps_off, reps_on = _repeats(offs), _repeats(ons)
    rates_off, rates_on = _rates(reps_off), _rates(reps_on)
    ratio = _ratio(rates_on["median"], rates_off["median"])
    step_off, step_on = _median(_known(reps_off, "step_ms")), _median(_known(reps_on, "step_ms"))
    shares = [(r.get("load") or {}).get("plugin_share") or {} for r in ons]
    share = max(
        (s["plugin_share"] for s in shares if s.get("plugin_share") is not None), default=None
    )
    share_us = max(
        (s["plugin_us_per_step"] for s in shares if s.get("plugin_us_per_step")), default=None
    )
    differing = _tokens_differing(offs, ons)
    equal = None if differing is None else not differing
    sources = {
        f"{switch} r{round_of(r)}": source
        for switch, runs in (("off", offs), ("on", ons))
        for r in runs
        if (source := compile_source(r))
    }
    (acceptance_off, length_off), (acceptance_on, length_on) = _spec(offs), _spec(ons)
    first_load = (ons or offs or [{}])[0].get("load") or {}
    row: dict[str, Any] = {
        "size": group,
        "case": case,
        "runs_off": len(offs),
        "runs_on": len(ons),
        "num_requests": first_load.get("num_requests"),
        "generated_tokens": ((reps_on or reps_off or [{}])[0]).get("generated_tokens"),
        "tokens_per_s_off": rates_off,
        "tokens_per_s_on": rates_on,
        "ratio_on_off_median": ratio,
        "rounds": _rounds(offs, ons),
        "step_ms_off": step_off,
        "step_ms_on": step_on,
        "step_ratio_on_off": _ratio(step_on, step_off),
        "acceptance_off": acceptance_off,
        "acceptance_on": acceptance_on,
        "mean_acceptance_length_off": length_off,
        "mean_acceptance_length_on": length_on,
        # Every run's tokens, off and on, of every round, against each other.
        "tokens_equal_on_off": equal,
        "tokens_differing": differing,
        # torch.compile's graphs made in the run or loaded from vLLM's cache:
        # kernels compiled anew may round differently from those loaded.
        "compile_sources": sources or None,
        "repeats_equal_off": _all(offs, "repeats_equal"),
        "repeats_equal_on": _all(ons, "repeats_equal"),
        "plugin_share": share,
        "plugin_us_per_step": share_us,
        "tokens_per_s_no_speculator": base_rate,
        "ratio_on_no_speculator": _ratio(rates_on["median"], base_rate),
        "gpu_off": _lanes(offs),
        "gpu_on": _lanes(ons),
        "commit": " ".join(sorted({r["commit"] for r in offs + ons if r.get("commit")})) or None,
        "repeats_off": reps_off,
        "repeats_on": reps_on,
        "measured_utc": max(
            (r["_measured_utc"] for r in offs + ons if r.get("_measured_utc")), default=None
        ),
    }
    checks: dict[str, bool | None] = {"tokens": equal}
    if share is not None:
        checks["plugin_share"] = share <= MAX_SLOWDOWN
    else:
        checks["ratio"] = None if ratio is None else ratio >= 1 - MAX_SLOWDOWN
    row["checks"] = checks
    row["pass"] = all(v is True for v in checks.values())
    reasons = []
    if equal is None:
        reasons.append("tokens missing")
    elif differing:
        reason = f"tokens differ: {', '.join(differing)} from off r{round_of(offs[0])}"
        if len(set(sources.values())) > 1:
            reason += " (torch.compile: " + ", ".join(f"{k} {v}" for k, v in sources.items()) + ")"
        reasons.append(reason)
    if share is not None and not checks["plugin_share"]:
        reasons.append(f"plugin share {share:.2%}")
    elif share is None and ratio is None:
        reasons.append("no tokens/s")
    elif share is None and not checks["ratio"]:
        reasons.append(f"on/off {ratio:.3f}")
    row["status"] = "PASS" if row["pass"] else "FAIL (" + "; ".join(reasons) + ")"
    return row


def _pair(a: Any, b: Any, fmt: Any = str) -> str:
    return f"{'-' if a is None else fmt(a)} / {'-' if b is None else fmt(b)}"


def _rate(x: float) -> str:
    return f"{x:,.0f}"


def _ratio_cell(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def _rates_cell(rates: dict[str, float | None]) -> str:
    """``median (lowest - best)``; rows of schema 1 kept no lowest repeat."""
    median, lowest, best = rates.get("median"), rates.get("lowest"), rates.get("best")
    cell = "-" if median is None else _rate(median)
    if best is not None:
        cell += f" ({'best ' if lowest is None else _rate(lowest) + ' - '}{_rate(best)})"
    return cell


def _share_cell(share: float | None, us_per_step: float | None) -> str:
    if share is None:
        return "-"
    return f"{share:.3%}" + ("" if us_per_step is None else f" ({us_per_step:.0f})")


def _rounds_cell(rounds: list[dict[str, Any]] | None) -> str:
    if not rounds:
        return "-"
    return ", ".join(f"r{r['round']} {_ratio_cell(r['ratio_on_off'])}" for r in rounds)


def row_cells(row: dict[str, Any]) -> list[str]:
    return [
        row["size"],
        row["case"],
        "-" if row["num_requests"] is None else str(row["num_requests"]),
        _pair(row["runs_off"], row["runs_on"]),
        _rates_cell(row["tokens_per_s_off"]),
        _rates_cell(row["tokens_per_s_on"]),
        _ratio_cell(row["ratio_on_off_median"]),
        _rounds_cell(row["rounds"]),
        _pair(row["step_ms_off"], row["step_ms_on"], lambda x: f"{x:.2f}"),
        _ratio_cell(row["step_ratio_on_off"]),
        _pair(row["acceptance_off"], row["acceptance_on"], lambda x: f"{x:.3f}"),
        _ratio_cell(row["ratio_on_no_speculator"]),
        _share_cell(row["plugin_share"], row["plugin_us_per_step"]),
        "-" if row["tokens_equal_on_off"] is None else str(row["tokens_equal_on_off"]),
        row["status"],
        row["commit"] or "-",
        row["measured_utc"] or "-",
    ]


def markdown(doc: dict[str, Any]) -> str:
    out = [
        "# vLLM 0.33.0 under load: vllm-specgraph off and on",
        "",
        "Real vLLM 0.33.0 (Model Runner V2, Triton attention, dummy weights refilled by "
        "name, greedy, `ignore_eos`; FULL CUDA graphs with compilation off, or, in the "
        "`-compile` size groups, vLLM's default torch.compile with FULL_AND_PIECEWISE "
        "graphs) through "
        "`scripts/device-vllm-e2e.sh` with `MODE=load`: each run submits all requests "
        "at once (seeded prompt lengths 16 to `max_model_len / 2`, outputs 16 to "
        "`max_model_len / 4`) after a warm-up generate; only `generate()` is timed, "
        "repeated; acceptance is vLLM's spec-decode counters over the timed repeats. "
        "Off and on of one case run one after the other on the same GPU, in rounds "
        "whose order alternates (off, on; on, off; ...); with several GPUs the rounds "
        "run at once, one per GPU; on one GPU every run is pinned to the same cores. "
        "The timed repeats of every run of a switch are pooled. Per round: on/off of "
        "that round's medians. `draft`: a 2-layer draft model, which rarely agrees with "
        "the target; `accept`: the draft model with the target's own config and "
        "weights, which nearly always does; on / no speculator: plugin-on tokens/s over "
        "the size group's plugin-off tokens/s without a speculator.",
        "",
    ]
    out += markdown_grid(COLUMNS, (row_cells(row) for row in doc["rows"]), text_columns=2)
    out += [
        "",
        "Check: every run's greedy tokens, off and on, in every round, are the same, "
        f"and the plugin costs at most {MAX_SLOWDOWN:.0%} of a step: its share is the "
        "time in the plugin's own Python functions over a profiled generate's (cProfile; "
        "measured at TP=1, where the plugin runs in the profiled process), with the "
        "microseconds per engine step it makes. Host-bound "
        "steps (a draft model without graphs) spread by more than that from repeat to "
        "repeat, so on/off of the medians is shown with each switch's lowest and best "
        "repeat, and checked only where no share was measured. Where tokens differ "
        "under torch.compile, the check names where each run's compiled graphs came "
        "from: compiled in the run, or loaded from vLLM's compile cache.",
        "",
    ]
    return "\n".join(out)


def write(
    rows: list[dict[str, Any]], results_dir: str, previous: str | None = None
) -> tuple[str, str]:
    """Write the JSON and Markdown, carrying over rows of ``previous`` (an
    earlier vllm_load.json of this schema) whose (size, case, requests) this
    invocation did not run and that name their commit."""
    rows = list(rows)
    if previous and os.path.exists(previous):
        with open(previous) as f:
            prev = json.load(f)
        if prev.get("schema") in READABLE_SCHEMAS:
            here = {(r["size"], r["case"], r["num_requests"]) for r in rows}
            rows += [
                r
                for r in prev.get("rows", [])
                if (r["size"], r["case"], r["num_requests"]) not in here and r.get("commit")
            ]
    doc = {
        "schema": SCHEMA,
        "generated_utc": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M"),
        "max_slowdown": MAX_SLOWDOWN,
        "rows": rows,
    }
    return write_json_and_markdown(results_dir, RESULTS_NAME, doc, markdown(doc))
