# SPDX-License-Identifier: Apache-2.0
"""Summarise the end-to-end runs into bench/results' tables, each row checked.

    python3 summarize.py OUTDIR [--results DIR] [--previous FILE]
    python3 summarize.py --serve OFF.json ON.json --results DIR

From run_llm.py's runs in OUTDIR (OUTDIR/skipped.txt: those that did not run), writes
vllm_graph_memory.{json,md} and vllm_load.{json,md} into DIR (default OUTDIR/bench/results);
--previous (a vllm_graph_memory.json, and the vllm_load.json beside it) carries over the
rows not measured here that name their commit. Exits 0 only if every run ran and every row
measured here passed. ``--serve``: serve.py's two runs in DIR/vllm_serve.{json,md}.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from operator import itemgetter
from pathlib import Path
from typing import Any

MiB = 1 << 20
SIZES = ("tiny", "1b", "8b")
CASES = ("base", "draft", "accept", "ngram", "eagle")
SWITCHES = ("off", "on", "none", "once")  # none: vLLM without the plugin loaded
EST_TOL_FRACTION, EST_TOL_BYTES, RETAINED_MAX_BYTES = 0.01, 2 * MiB, 2 * MiB
ONCE_OVER_MAX_BYTES, ONCE_KV_TOL_FRACTION = 2 * MiB, 0.01  # the capture-once check's
MAX_SLOWDOWN = 0.02  # the load check's: the plugin's share of a step
TOKENS = ("tokens missing", "tokens differ")  # a tokens check's reasons
Run = dict[str, Any]  # one run's JSON, as run_llm.py wrote it
Row = dict[str, Any]  # one row of a table, as its JSON keeps it
Key = tuple[str, str, str]  # (size group, case, switch)
Column = tuple[str, Callable[[Row], str]]  # (header, cell of a row)
size_case = itemgetter("size", "case")  # what a graph-memory row is of
load_key = itemgetter("size", "case", "num_requests")  # what a load row is of


def mem_of(r: Run | None, key: str) -> Any:
    return ((r or {}).get("mem") or {}).get(key)


def diff(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b


def pct(err: float | None, base: float | None) -> float | None:
    return None if err is None or not base else 100.0 * err / base


def ratio(on: float | None, off: float | None) -> float | None:
    return round(on / off, 4) if on and off else None


def latest(runs: list[Run | None]) -> str | None:
    return max((r["measured_utc"] for r in runs if r and r.get("measured_utc")), default=None)


def same_tokens(r: Run | None, off: Run | None) -> bool | None:
    """Whether ``r`` generated the off run's tokens; None where either did not finish."""
    tokens, off_tokens = (x.get("tokens") if x and x.get("ok") else None for x in (r, off))
    return tokens == off_tokens if tokens is not None and off_tokens else None


def checked(*checks: tuple[str, bool | None, str, str]) -> Row:
    """Each (name, outcome, why when unknown, why when false), whether all are true, and
    the status: PASS, or FAIL with the reason of each that is not true."""
    failed = [why[ok is not None] for _, ok, *why in checks if ok is not True]
    status = "PASS" if not failed else "FAIL (" + "; ".join(failed) + ")"
    return {"checks": {c[0]: c[1] for c in checks}, "pass": not failed, "status": status}


def group_of(r: Run) -> str:
    """The size, then ``-compile`` (vLLM's default graph mode) and ``-tpN`` (TP=N)."""
    group = r["size"] + "-compile" * (r.get("graph_mode") == "compile")
    return f"{group}-tp{r['tp']}" if r.get("tp", 1) > 1 else group


def group_order(group: str) -> tuple[int, bool, int]:
    """Size, then FULL graphs before compile, then TP=1 before TP=N."""
    label, _, tp = group.partition("-tp")
    size, *parts = label.split("-")
    return SIZES.index(size), "compile" in parts, int(tp or 1)


def key_order(key: tuple) -> tuple:
    return (group_order(key[0]), CASES.index(key[1]), *key[2:])


def load_runs(outdir: str) -> tuple[dict[Key, Run], dict[Key, list[Run]]]:
    """The runs in ``outdir`` by key, memory and load (a list); FAILED, with its log, if not ok."""
    memory: dict[Key, Run] = {}
    load: dict[Key, list[Run]] = {}
    for path in sorted(glob.glob(os.path.join(outdir, "*.json"))):
        try:
            r = json.loads(Path(path).read_text())
            key = (group_of(r), r["case"], r["plugin"]["switch"])
        except (OSError, ValueError, LookupError, TypeError):
            continue
        if r["size"] not in SIZES or key[1] not in CASES or key[2] not in SWITCHES:
            continue
        if not r.get("ok"):
            error = (r.get("error") or "no error recorded")[:400]
            print(f"FAILED {path.removesuffix('.json')}.log at stage {r.get('stage')}: {error}")
        if r.get("workload") == "load":
            load.setdefault(key, []).append(r)
        else:
            memory[key] = r
    return memory, load


def estimate_of(r: Run | None) -> float | None:
    """What vLLM's profile returned, else (capture-once: no profile) what the worker kept."""
    est, kept = mem_of(r, "profile_estimate_bytes"), mem_of(r, "worker_cudagraph_memory_estimate")
    return est if est is not None or kept is None or kept < 0 else kept


def owner_figures(report: Any) -> dict[str, dict[str, float | None]]:
    """Per owner, the plugin report's estimated and actual driver bytes."""
    out: dict[str, dict[str, float | None]] = {}
    estimate = (report.get("estimate") or {}).get("owners") if report else None
    for key, owners in (("estimate", estimate), ("actual", (report or {}).get("actual"))):
        for owner in owners or ():
            slot = out.setdefault(owner["owner"], {"estimate": None, "actual": None})
            slot[key] = owner["driver_bytes"]
    return out


def over_budget_bytes(mem: dict[str, Any] | None) -> int | None:
    """What the started instance held at rest beyond vLLM's limit less the activation
    headroom (``requested - headroom``), counted from vLLM's start-up snapshot."""
    mem = mem or {}
    keys = ("init_free_bytes", "free_at_rest_bytes", "requested_bytes", "activation_headroom_bytes")
    if not all(isinstance(mem.get(k), int) for k in keys):
        return None
    held = mem["init_free_bytes"] - mem["free_at_rest_bytes"]
    return held - (mem["requested_bytes"] - mem["activation_headroom_bytes"])


def side_figures(side: str, r: Run | None, budget: float | None) -> Row:
    """One switch's memory and timings. The profile is followed by KV sizing, so what it
    left taken counts as much as what the production capture then took."""
    kept, actual = mem_of(r, "profile_driver_left_taken"), mem_of(r, "capture_actual_bytes")
    taken = kept + actual if kept is not None and actual is not None else None
    return {
        f"actual_{side}_bytes": actual,
        f"retained_{side}_bytes": kept,
        f"taken_{side}_bytes": taken,
        f"budget_minus_taken_{side}_bytes": diff(budget, taken),
        f"over_budget_{side}_bytes": over_budget_bytes((r or {}).get("mem")),
        f"kv_tokens_{side}": (r or {}).get("kv_tokens"),
        f"startup_{side}_s": (r or {}).get("startup_s"),
        f"profile_wall_{side}_s": mem_of(r, "profile_wall_s"),
        f"capture_wall_{side}_s": mem_of(r, "capture_wall_s"),
    }


def build_row(
    size: str, case: str, off: Run | None, on: Run | None, off_switch: str, once: Run | None
) -> Row:
    """One (size group, case): off, on and once side by side, the plugin-on run checked,
    and the once run on its own (``once_status``)."""
    # The plugin returns a budget: graph bytes plus what the profile left with the
    # process (one-time state); its graph estimate is what compares with the capture.
    report = (on or {}).get("plugin_report")
    estimate = (report or {}).get("estimate")
    est_off, budget_on = estimate_of(off), estimate_of(on)
    est_on = sum(o["driver_bytes"] for o in estimate["owners"]) if estimate else budget_on
    commits = [r.get("commit") for r in (off, on, once) if r]
    row: Row = {
        "size": size,
        "case": case,
        "num_capture_sizes": ((on or off or {}).get("resolved") or {}).get("num_capture_sizes"),
        "off_switch": off_switch,
        "upstream_estimate_bytes": est_off,
        "plugin_estimate_bytes": est_on,
        "plugin_budget_bytes": budget_on,
        "tokens_equal_on_off": same_tokens(on, off),
        "owners_on": owner_figures(report),
        "measured_utc": latest([off, on, once]),
        "commit": "/".join(dict.fromkeys(commits)) if commits and all(commits) else None,
    }
    row |= side_figures("off", off, est_off) | side_figures("on", on, budget_on)
    for who, side, est in (("upstream", "off", est_off), ("plugin", "on", est_on)):
        actual = row[f"actual_{side}_bytes"]
        err = diff(est, actual)
        row |= {f"{who}_error_bytes": err, f"{who}_error_pct": pct(err, actual)}
    act, err, kept = row["actual_on_bytes"], row["plugin_error_bytes"], row["retained_on_bytes"]
    est_ok = None if None in (act, err) else abs(err) <= max(EST_TOL_FRACTION * act, EST_TOL_BYTES)
    one_time = (estimate or {}).get("one_time_bytes", 0)  # budgeted, so not retained
    kept_ok = None if kept is None else kept - one_time <= RETAINED_MAX_BYTES
    row |= checked(
        ("estimate", est_ok, "no estimate/actual (on)", f"estimate {pct(err, act) or 0:+.1f} %"),
        ("retained", kept_ok, "no retained figure (on)", f"retained {mib(kept)} MiB"),
        ("tokens", row["tokens_equal_on_off"], *TOKENS),
    )
    if once is not None:  # nothing budgeted: capture-once runs no profile capture
        row |= side_figures("once", once, None)
        row |= once_figures(row, once, off)
    return row


def once_figures(row: Row, once: Run, off: Run | None) -> Row:
    """The once run's figures and check: FALLBACK where capture-once did not apply (the
    exact profile ran, as for on), else its over budget, tokens and KV tokens checked."""
    outcome, fallback = once.get("capture_once") or {}, once.get("capture_once_fallback")
    out: Row = {"capture_once_fallback": fallback, "tokens_equal_once_off": same_tokens(once, off)}
    out |= {f"{k}_once": outcome.get(k) for k in ("num_blocks", "max_blocks")}
    over, kv_on, kv_once = row["over_budget_once_bytes"], row["kv_tokens_on"], row["kv_tokens_once"]
    enough = None if None in (kv_on, kv_once) else kv_once >= (1 - ONCE_KV_TOL_FRACTION) * kv_on
    under = None if over is None else over <= ONCE_OVER_MAX_BYTES
    kv_pct = pct(diff(kv_once, kv_on), kv_on) or 0
    c = checked(
        ("over_budget", under, "no over-budget figure", f"over budget {mib(over)} MiB"),
        ("tokens", out["tokens_equal_once_off"], *TOKENS),
        ("kv_tokens", enough, "no KV tokens", f"KV tokens {kv_pct:+.1f} % against on"),
    )
    out["once_status"] = f"FALLBACK ({fallback})" if fallback else c["status"]
    return out | {"once_checks": c["checks"]}


def as_rank(r: Run | None, i: int, tp: int) -> Run | None:
    """A run as its rank ``i`` of ``tp`` saw it: at TP=N, the rank's own figures."""
    if r is None or tp == 1:
        return r
    ranks = r.get("ranks") or []
    mine = ranks[i] if i < len(ranks) else {}
    keys = ("mem", "plugin_report", "capture_once", "capture_once_fallback")
    return r | {k: mine.get(k) for k in keys}


def memory_rows(runs: dict[Key, Run]) -> list[Row]:
    """A row per (size group, case), and at TP=N one per rank (``rank``)."""
    rows = []
    for group in sorted({k[0] for k in runs}, key=group_order):
        tp = group_order(group)[-1]
        for case in CASES:
            none = (group, case, "none") in runs and (group, case, "off") not in runs
            off_switch = "none" if none else "off"
            trio = [runs.get((group, case, s)) for s in (off_switch, "on", "once")]
            for i in range(tp) if any(trio) else ():
                off, on, once = (as_rank(r, i, tp) for r in trio)
                row = build_row(group, case, off, on, off_switch, once)
                if tp > 1:
                    row |= {"rank": i, "tp": tp}
                # A once FAIL fails the row; a FALLBACK does not: the exact profile ran
                # and the on checks cover it.
                row["pass"] &= not row.get("once_status", "").startswith("FAIL")
                rows.append(row)
    return rows


ENGINE = "dtype max_num_seqs max_model_len max_num_batched_tokens gpu_memory_utilization"
RUN_FIELDS = (  # what the graph-memory JSON keeps of a run; its own files have the rest
    "ok stage error startup_s generate_s kv_tokens mem spec plugin plugin_report tokens tp"
    " workload gpu commit capture_once capture_once_fallback measured_utc"
)


def size_meta(group: str, runs: dict[Key, Run]) -> dict[str, Any]:
    """A size group's engine settings, GPU and versions, from its runs."""
    mine = [r for (g, _, _), r in sorted(runs.items()) if g == group]

    def first(key: str) -> Any:
        return next((r[key] for r in mine if r.get(key)), None)

    kw = first("llm_kwargs") or {}
    settings = {"model": os.path.basename(kw.get("model", "")) or None}
    settings |= {k: kw.get(k) for k in (*ENGINE.split(), "tensor_parallel_size")}
    compilation = kw.get("compilation_config") or {}
    settings["capture_sizes"] = compilation.get("cudagraph_capture_sizes", "vLLM default")
    settings["num_capture_sizes"] = (first("resolved") or {}).get("num_capture_sizes")
    meta = {"measured_utc": latest(mine), "gpu": (first("gpu") or {}).get("name")}
    return meta | {"torch": first("torch"), "vllm": first("vllm"), "settings": settings}


def compact_run(key: Key, r: Run) -> dict[str, Any]:
    out = {"size": key[0], "case": key[1]} | {k: r[k] for k in RUN_FIELDS.split() if k in r}
    if "ranks" in r:  # tensor parallel: every rank's figures, without its log lines
        out["ranks"] = [{k: v for k, v in x.items() if k != "plugin_log"} for x in r["ranks"] or []]
    return out


def carry_over(doc: dict[str, Any], path: str | None, key: Callable[[Row], tuple]) -> dict:
    """Adds the rows of the table at ``path`` that ``doc`` has none of (by ``key``) and that
    name their commit (one without is from code older than the record); returns the table."""
    prev = read(path) or {}
    here = {key(r) for r in doc["rows"]}
    for r in [r for r in prev.get("rows") or [] if key(r) not in here]:
        name = "/".join(map(str, key(r)))
        if r.get("commit"):
            doc["rows"].append(r)
            print(f"carried over from {path}: {name}")
        else:
            print(f"dropped from {path}: {name} (no commit: older code)")
    return prev


def finished(runs: list[Run] | None) -> list[Run]:
    return sorted((r for r in runs or [] if r.get("ok")), key=itemgetter("load_round"))


def pooled(s: str, runs: list[Run]) -> Row:
    """Switch ``s``'s figures over its finished runs of every round: their timed repeats
    pooled (each with its run's round), as are their spec-decode counts."""
    reps = [rep | {"round": r["load_round"]} for r in runs for rep in r["load"]["repeats"]]
    speeds = [rep["tokens_per_s"] for rep in reps if rep.get("tokens_per_s") is not None]
    steps = [rep["step_ms"] for rep in reps if rep.get("step_ms") is not None]
    rates = {"median": statistics.median(speeds) if speeds else None}
    rates |= {"best": max(speeds, default=None), "lowest": min(speeds, default=None)}
    spec = [r["load"].get("spec") or {} for r in runs]
    drafted = sum(x.get("draft_tokens") or 0 for x in spec)
    accepted = sum(x.get("accepted_tokens") or 0 for x in spec)
    return {
        f"runs_{s}": len(runs),
        f"tokens_per_s_{s}": rates,
        f"step_ms_{s}": statistics.median(steps) if steps else None,
        f"acceptance_{s}": round(accepted / drafted, 4) if drafted else None,
        f"repeats_{s}": reps,
    }


def build_load_row(
    group: str, case: str, offs: list[Run], ons: list[Run], base_offs: list[Run] | None = None
) -> Row:
    """One (size group, case) from its finished runs of every round, off and on (``base_offs``:
    without a speculator, off). Passes when every run's tokens are the same and the plugin's
    share of a step is at most MAX_SLOWDOWN (else, on/off of the medians >= 1 - it)."""
    offs, ons = finished(offs), finished(ons)
    row = {"size": group, "case": case} | pooled("off", offs) | pooled("on", ons)
    on_rate, off_rate = row["tokens_per_s_on"]["median"], row["tokens_per_s_off"]["median"]
    base_rate = pooled("base", finished(base_offs))["tokens_per_s_base"]["median"]
    shares = [x for r in ons if (x := r["load"].get("plugin_share"))]
    share = max((x["plugin_share"] for x in shares if x["plugin_share"] is not None), default=None)
    us = max((x["plugin_us_per_step"] for x in shares if x["plugin_us_per_step"]), default=None)
    on_off, tokens = ratio(on_rate, off_rate), [r.get("tokens") for r in offs + ons]
    row |= {
        "num_requests": (ons or offs)[0]["load"]["num_requests"] if ons or offs else None,
        "ratio_on_off_median": on_off,
        "step_ratio_on_off": ratio(row["step_ms_on"], row["step_ms_off"]),
        "plugin_share": share,
        "plugin_us_per_step": us,
        "tokens_per_s_no_speculator": base_rate,
        "ratio_on_no_speculator": ratio(on_rate, base_rate),
        "tokens_equal_on_off": all(t == tokens[0] for t in tokens) if offs and ons else None,
        "commit": " ".join(sorted({r["commit"] for r in offs + ons if r.get("commit")})) or None,
        "measured_utc": latest(offs + ons),
    }
    if share is not None:
        speed = ("plugin_share", share <= MAX_SLOWDOWN, "", f"plugin share {share:.2%}")
    else:
        fast = None if on_off is None else on_off >= 1 - MAX_SLOWDOWN
        speed = ("ratio", fast, "no tokens/s", f"on/off {on_off or 0:.3f}")
    return row | checked(("tokens", row["tokens_equal_on_off"], *TOKENS), speed)


def load_rows(runs: dict[Key, list[Run]]) -> list[Row]:
    """A row per (size group, case, requests per generate): runs of another request count
    are never pooled; a case whose runs all stopped before their repeats makes a row alone."""
    by: dict[tuple, dict[str, list[Run]]] = {}  # (group, case, requests): switch: runs
    for (group, case, switch), rs in runs.items():
        for r in rs:
            n = (r.get("load") or {}).get("num_requests")
            by.setdefault((group, case, n), {}).setdefault(switch, []).append(r)
    counted = {k[:2] for k in by if k[2] is not None}
    rows = []
    for g, c, n in sorted(by, key=lambda k: key_order((*k[:2], k[2] or 0))):
        if n is None and (g, c) in counted:  # its failed runs, beside rows of runs that ran
            continue
        base = None if c == "base" else by.get((g, "base", n), {}).get("off")
        switches = by[g, c, n]
        rows.append(build_load_row(g, c, switches.get("off", []), switches.get("on", []), base))
    return rows


def serve_row(off: Run, on: Run) -> Row:
    """serve.py's off and on runs side by side, and whether they pass."""
    checks = {
        "both ran": bool(off.get("ok") and on.get("ok")),
        "tokens equal": off.get("tokens") is not None and off.get("tokens") == on.get("tokens"),
        "plugin lines in the server log": bool(on.get("log_ok") and off.get("log_ok")),
        "clean shutdown": bool(off.get("clean_shutdown") and on.get("clean_shutdown")),
    }
    failed = [name for name, ok in checks.items() if not ok]
    row = {k: on.get(k) for k in ("size", "case", "graph_mode", "requests", "commit")}
    pairs = ("startup_s", "seconds", "shutdown_s", "gpu_left_mib")
    row |= {k: [off.get(k), on.get(k)] for k in pairs} | {"measured_utc": on.get("measured_utc")}
    row |= {"log_lines_on": on.get("log_lines"), "checks": checks}
    return row | {"check": "PASS" if not failed else f"FAIL ({', '.join(failed)})"}


def show(value: Any, fmt: Callable[[Any], str] = str) -> str:
    return "-" if value is None else fmt(value)


def mib(x: float | None) -> str:
    return show(x, lambda b: f"{b / MiB:.1f}")


F1, F2, F3, COUNT = "{:.1f}".format, "{:.2f}".format, "{:.3f}".format, "{:,}".format
UP_PLUGIN = "upstream plugin"  # a row's upstream (off) and plugin (on) figures


def cell(*keys: str, fmt: Callable[[Any], str] = str, sep: str = " / ") -> Callable[[Row], str]:
    """A cell of the row's ``keys``, each formatted ("-" where missing), joined by ``sep``."""
    return lambda row: sep.join(show(row.get(k), fmt) for k in keys)


def sides(template: str, fmt: Callable[[Any], str], switches: str = "off on") -> Callable:
    """The cell of ``template`` filled in with each of ``switches``."""
    return cell(*(template.format(s) for s in switches.split()), fmt=fmt)


def render(columns: list[Column], rows: list[Row]) -> list[str]:
    """The Markdown table of ``rows``, a column of figures only right-aligned."""
    header, body = [h for h, _ in columns], [[c(row) for _, c in columns] for row in rows]
    words = [any(ch.isalpha() for line in body for ch in line[i]) for i in range(len(columns))]
    lines = ["| " + " | ".join(line) + " |" for line in (header, *body)]
    return [lines[0], "|" + "|".join("---" if w else "---:" for w in words) + "|", *lines[1:]]


def case_cell(row: Row) -> str:
    off = "" if row.get("off_switch", "off") == "off" else f" (off={row['off_switch']})"
    return row["case"] + off + (f" [rank {row['rank']}]" if "rank" in row else "")


def owners_cell(row: Row) -> str:
    owners = (row.get("owners_on") or {}).items()
    return "; ".join(f"{k} {mib(v['estimate'])} / {mib(v['actual'])}" for k, v in owners) or "-"


def rates_text(r: dict[str, float | None]) -> str:
    return show(r["median"], lambda m: f"{m:,.0f} ({r['lowest']:,.0f} - {r['best']:,.0f})")


def off_on(key: str) -> Callable[[Row], str]:
    """A serve row's [off, on] pair: seconds to a tenth, MiB whole."""
    return lambda row: " / ".join(show(v, F1 if isinstance(v, float) else str) for v in row[key])


MEMORY: list[Column] = [
    ("size", cell("size")),
    ("capture sizes", cell("num_capture_sizes")),
    ("case", case_cell),
    ("graph estimate upstream / plugin MiB", sides("{}_estimate_bytes", mib, UP_PLUGIN)),
    ("plugin budget (on) MiB", cell("plugin_budget_bytes", fmt=mib)),
    ("actual off / on MiB", sides("actual_{}_bytes", mib)),
    ("error upstream / plugin %", sides("{}_error_pct", "{:+.1f}".format, UP_PLUGIN)),
    ("error upstream / plugin MiB", sides("{}_error_bytes", mib, UP_PLUGIN)),
    ("retained after profile off / on MiB", sides("retained_{}_bytes", mib)),
    ("budget - (retained + actual) off / on MiB", sides("budget_minus_taken_{}_bytes", mib)),
    ("over budget at rest off / on MiB", sides("over_budget_{}_bytes", mib)),
    ("KV tokens off / on", sides("kv_tokens_{}", COUNT)),
    ("start-up s off / on", sides("startup_{}_s", F1)),
    ("profile s off / on", sides("profile_wall_{}_s", F1)),
    ("capture s off / on", sides("capture_wall_{}_s", F1)),
    ("tokens on = off", cell("tokens_equal_on_off")),
    ("per owner est. / actual (on) MiB", owners_cell),
    ("measured (UTC), commit", cell("measured_utc", "commit", sep=", ")),
    ("check", cell("status")),
]
ONCE: list[Column] = [
    ("size", cell("size")),
    ("case", cell("case")),
    ("KV tokens off / on / once", sides("kv_tokens_{}", COUNT, "off on once")),
    ("start-up s off / on / once", sides("startup_{}_s", F1, "off on once")),
    ("over budget at rest on / once MiB", sides("over_budget_{}_bytes", mib, "on once")),
    ("KV blocks backed / reserved (once)", cell("num_blocks_once", "max_blocks_once", fmt=COUNT)),
    ("tokens once = off", cell("tokens_equal_once_off")),
    ("check", cell("once_status")),
]
LOAD: list[Column] = [
    ("size", cell("size")),
    ("case", cell("case")),
    ("requests", cell("num_requests")),
    ("runs off / on", cell("runs_off", "runs_on")),
    ("tokens/s off: median (lowest - best)", cell("tokens_per_s_off", fmt=rates_text)),
    ("tokens/s on: median (lowest - best)", cell("tokens_per_s_on", fmt=rates_text)),
    ("on / off (medians)", cell("ratio_on_off_median", fmt=F3)),
    ("engine step ms off / on (median)", sides("step_ms_{}", F2)),
    ("step on / off", cell("step_ratio_on_off", fmt=F3)),
    ("acceptance off / on", sides("acceptance_{}", F3)),
    ("on / no speculator", cell("ratio_on_no_speculator", fmt=F3)),
    ("plugin share of a step", cell("plugin_share", fmt="{:.3%}".format)),
    ("plugin us per step", cell("plugin_us_per_step", fmt="{:.0f}".format)),
    ("tokens equal (all runs)", cell("tokens_equal_on_off")),
    ("check", cell("status")),
    ("measured (UTC), commit", cell("measured_utc", "commit", sep=", ")),
]
SERVE: list[Column] = [
    ("size", cell("size")),
    ("graphs", cell("graph_mode")),
    ("speculator", cell("case")),
    ("requests, all at once", cell("requests")),
    ("ready after s off / on", off_on("startup_s")),
    ("completions s off / on", off_on("seconds")),
    ("SIGINT to exit s off / on", off_on("shutdown_s")),
    ("GPU MiB left off / on", off_on("gpu_left_mib")),
    ("check", cell("check")),
    ("measured (UTC), commit", cell("measured_utc", "commit", sep=", ")),
]

VLLM = "real vLLM 0.33.0 (Model Runner V2, Triton attention, dummy weights)"
MEMORY_NOTE = (
    f"Each run of {VLLM} in its own process; off: the plugin loaded with `VLLM_SPECGRAPH=0`, "
    "on: `VLLM_PLUGINS=specgraph`; `-compile`: vLLM's default torch.compile, else FULL "
    "graphs; `-tpN`: a row per rank (the columns: `docs/vllm-e2e.md`). Check (on): "
    f"|estimate - actual| <= max({EST_TOL_FRACTION:.0%} of actual, {EST_TOL_BYTES / MiB:.0f} "
    f"MiB); at most {RETAINED_MAX_BYTES / MiB:.0f} MiB beyond the one-time state still taken "
    "when the profile returned; greedy tokens equal to off."
)
ONCE_NOTE = (
    "Capture once (`PLUGIN=once`): no profile capture. Check: FALLBACK (the reason) where "
    "capture-once did not apply and the exact profile ran; else over budget at rest <= "
    f"{ONCE_OVER_MAX_BYTES / MiB:.0f} MiB, greedy tokens equal to off and at most "
    f"{ONCE_KV_TOL_FRACTION:.0%} fewer KV tokens than on."
)
LOAD_NOTE = (
    f"`MODE=load`: {VLLM}, off and on of a case on one GPU in rounds of alternating order, "
    "the timed repeats of all rounds of a switch pooled; no speculator: the group's `base` "
    "case, off (the columns: `docs/vllm-e2e.md`). Check: every run's greedy tokens, off and "
    f"on, are the same, and the plugin takes at most {MAX_SLOWDOWN:.0%} of a step (its own "
    "functions under cProfile; in brackets, microseconds per step), else (no share measured) "
    "on/off of the medians."
)
LABELS = {"model": "", "dtype": "", "num_capture_sizes": "capture sizes: "}  # in a size bullet


def memory_markdown(doc: dict[str, Any]) -> list[str]:
    out = ["# vLLM 0.33.0 CUDA-graph memory: vllm-specgraph off and on", "", MEMORY_NOTE, ""]
    for group, meta in doc["sizes"].items():
        settings = {k: v for k, v in (meta.get("settings") or {}).items() if v is not None}
        settings.pop("capture_sizes", None)  # the list itself is in the JSON
        shown = ", ".join(f"{LABELS.get(k, k + ' ')}{v}" for k, v in settings.items())
        out.append(
            f"* `{group}` ({shown}): last measured {meta.get('measured_utc')} UTC on "
            f"{meta.get('gpu') or 'an unrecorded GPU'}, torch {meta.get('torch')}, vLLM "
            f"{meta.get('vllm')}."
        )
    out += ["", *render(MEMORY, doc["rows"])]
    if doc.get("skipped"):
        out += ["", f"Not run (the script's time budget ran out): {', '.join(doc['skipped'])}."]
    if once := [row for row in doc["rows"] if "once_status" in row]:
        out += ["", ONCE_NOTE, "", *render(ONCE, once)]
    return out


def read(path: str | None) -> dict[str, Any] | None:
    """An earlier table or a serve.py run; None if absent."""
    return json.loads(Path(path).read_text()) if path and os.path.exists(path) else None


def write(results: str, name: str, doc: dict[str, Any], markdown: list[str]) -> None:
    os.makedirs(results, exist_ok=True)
    Path(results, f"{name}.json").write_text(json.dumps(doc, indent=1) + "\n")
    Path(results, f"{name}.md").write_text("\n".join(markdown) + "\n")
    print(f"wrote {results}/{name}.json and .md ({len(doc['rows'])} rows)")


def print_table(title: str, columns: list[Column], rows: list[Row]) -> None:
    if rows:
        print("-" * 72, title, *render(columns, rows), sep="\n")


def speculative_tokens_equal(runs: dict[Key, Run]) -> bool | None:
    """Whether every speculative case's greedy tokens equal those of the base case of its
    size group and switch (None: nothing compared); a case that differs is printed."""
    equal = None
    for (group, case, switch), r in sorted(runs.items(), key=lambda kv: key_order(kv[0])):
        same = None if case == "base" else same_tokens(r, runs.get((group, "base", switch)))
        if same is False:
            print(f"tokens of {group} {case} {switch} differ from its base case's")
        equal = equal if same is None else same and equal is not False
    return equal


def serve_main(off_path: str, on_path: str, results: str) -> int:
    off, on = (read(p) or {"ok": False, "error": f"no result in {p}"} for p in (off_path, on_path))
    row = serve_row(off, on)
    table = render(SERVE, [row])
    write(results, "vllm_serve", {"rows": [row]}, ["# `vllm serve`: plugin off and on", "", *table])
    print(*table, f"plugin lines in the on run's server log: {row['log_lines_on']}", sep="\n")
    return 0 if row["check"] == "PASS" else 1


def memory_doc(
    memory: dict[Key, Run], rows: list[Row], skipped: list[str], previous: str | None
) -> dict[str, Any]:
    """This invocation's graph-memory ``rows``, then those carried over from ``previous``
    with their runs and their size groups' settings."""
    targets = {"estimate_tolerance_fraction": EST_TOL_FRACTION}
    targets |= {"estimate_tolerance_bytes": EST_TOL_BYTES, "retained_max_bytes": RETAINED_MAX_BYTES}
    doc = {
        "schema": 2,
        "generated_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
        "targets": targets,
        "sizes": {g: size_meta(g, memory) for g in {k[0] for k in memory}},
        "rows": list(rows),
        "runs": [compact_run(k, r) for k, r in sorted(memory.items())],
        "skipped": skipped,
    }
    prev = carry_over(doc, previous, size_case)
    groups, measured = {size_case(r) for r in doc["rows"]}, {size_case(r) for r in doc["runs"]}
    doc["runs"] += [r for r in prev.get("runs") or [] if size_case(r) in groups - measured]
    sizes = prev.get("sizes") or {}
    doc["sizes"] = {g: sizes[g] for g, _ in groups if g in sizes} | doc["sizes"]
    doc["sizes"] = dict(sorted(doc["sizes"].items(), key=lambda kv: group_order(kv[0])))
    doc["rows"].sort(key=lambda r: key_order(size_case(r)))
    return doc


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("outdir", nargs="?")
    ap.add_argument("--results", help="where to write the tables (default OUTDIR/bench/results)")
    ap.add_argument("--previous", help="an earlier vllm_graph_memory.json to carry rows from")
    ap.add_argument("--serve", nargs=2, metavar=("OFF", "ON"), help="serve.py's two results")
    args = ap.parse_args(argv)
    if args.serve:
        return serve_main(*args.serve, args.results)
    results = args.results or os.path.join(args.outdir, "bench", "results")
    print("=" * 72, "vLLM 0.33.0 end-to-end on the GPU (MRV2, Triton attention)", sep="\n")
    memory, load = load_runs(args.outdir)
    every = [*memory.values(), *(r for rounds in load.values() for r in rounds)]
    spec_equal = speculative_tokens_equal(memory)
    path = os.path.join(args.outdir, "skipped.txt")
    skipped = Path(path).read_text().split() if os.path.exists(path) else []
    rows, loads = memory_rows(memory), load_rows(load)
    doc = memory_doc(memory, rows, skipped, args.previous)
    print_table("plugin off vs on (this invocation's rows)", MEMORY, rows)
    print_table("capture once", ONCE, [r for r in rows if "once_status" in r])
    write(results, "vllm_graph_memory", doc, memory_markdown(doc))
    print_table("under load", LOAD, loads)
    load_doc = {"schema": 3, "generated_utc": doc["generated_utc"], "max_slowdown": MAX_SLOWDOWN}
    load_doc["rows"] = list(loads)
    beside = args.previous and os.path.join(os.path.dirname(args.previous), "vllm_load.json")
    carry_over(load_doc, beside, load_key)
    if load_doc["rows"]:
        title = "# vLLM 0.33.0 under load: vllm-specgraph off and on"
        markdown = [title, "", LOAD_NOTE, "", *render(LOAD, load_doc["rows"])]
        write(results, "vllm_load", load_doc, markdown)
    if skipped:
        print(f"skipped for lack of time: {' '.join(skipped)}")
    ran = bool(every) and not skipped and all(r.get("ok") for r in every)
    mine = rows + loads  # this invocation's rows decide
    passed = sum(r["pass"] for r in mine)
    print(
        f"SUMMARY: all runs ok={ran} ({sum(bool(r.get('ok')) for r in every)}/{len(every)}),"
        f" rows PASS={passed}/{len(mine)}, speculative outputs equal baseline={spec_equal}"
    )
    return 0 if ran and mine and passed == len(mine) else 1


if __name__ == "__main__":
    sys.exit(main())
