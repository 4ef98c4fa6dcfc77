# SPDX-License-Identifier: Apache-2.0
"""Summarise the end-to-end runs into bench/results' tables, each row checked.

    python3 summarize.py OUTDIR [--results DIR] [--previous FILE]
    python3 summarize.py --serve OFF.json ON.json --results DIR

Reads the runs run_llm.py wrote to OUTDIR (OUTDIR/skipped.txt names those that did not
run) and writes vllm_graph_memory.{json,md} (a row per size group and case, plugin off
and on side by side; capture-once in a table of its own) and vllm_load.{json,md} (a row
per load case, its rounds pooled) into DIR, by default OUTDIR/bench/results. --previous
(an earlier vllm_graph_memory.json, and the vllm_load.json beside it) carries over the
rows not measured here that name the plugin commit they measured. Exits 0 only if every
run ran and every row measured here passed. ``--serve``: serve.py's two runs side by
side in DIR/vllm_serve.{json,md}. A table is a list of columns, (header, cell of a row),
that ``render`` makes into both its Markdown and the printed summary.
"""

from __future__ import annotations

import argparse
import datetime
import glob
import json
import os
import statistics
import sys
import textwrap
from collections.abc import Callable
from operator import itemgetter
from typing import Any

MiB = 1 << 20
SIZES = ("tiny", "1b", "8b")
CASES = ("base", "draft", "accept", "ngram", "eagle")
SWITCHES = ("off", "on", "none", "once")  # none: vLLM without the plugin loaded
EST_TOL_FRACTION, EST_TOL_BYTES, RETAINED_MAX_BYTES = 0.01, 2 * MiB, 2 * MiB
ONCE_OVER_MAX_BYTES, ONCE_KV_TOL_FRACTION = 2 * MiB, 0.01  # the capture-once check's
MAX_SLOWDOWN = 0.02  # the load check's: the plugin's share of a step
Run = dict[str, Any]  # one run's JSON, as run_llm.py wrote it
Row = dict[str, Any]  # one row of a table, as its JSON keeps it
Key = tuple[str, str, str]  # (size group, case, switch)
Column = tuple[str, Callable[[Row], str]]
size_case = itemgetter("size", "case")  # what a graph-memory row is of


def num(x: Any) -> float | None:
    return x if isinstance(x, int | float) and not isinstance(x, bool) else None


def mem_of(r: Run | None, key: str) -> float | None:
    return num(r["mem"].get(key)) if r and isinstance(r.get("mem"), dict) else None


def diff(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b


def pct(err: float | None, base: float | None) -> float | None:
    return None if err is None or not base else 100.0 * err / base


def utc(timestamp: float | None = None) -> str:
    when = datetime.datetime.fromtimestamp(timestamp, datetime.UTC) if timestamp else None
    return (when or datetime.datetime.now(datetime.UTC)).strftime("%Y-%m-%d %H:%M")


def latest(runs: list[Run | None]) -> str | None:
    return max((r["_measured_utc"] for r in runs if r and r.get("_measured_utc")), default=None)


def same_tokens(r: Run | None, off: Run | None) -> bool | None:
    """Whether ``r`` generated the off run's tokens; None where either did not finish."""
    tokens, off_tokens = (x.get("tokens") if x and x.get("ok") else None for x in (r, off))
    return tokens == off_tokens if tokens is not None and off_tokens else None


def status(checks: dict[str, bool | None], reasons: dict[str, tuple[str, str]]) -> str:
    """PASS, or FAIL with a reason per check that is not true: (when unknown, when false)."""
    failed = [reasons[name][ok is not None] for name, ok in checks.items() if ok is not True]
    return "PASS" if not failed else "FAIL (" + "; ".join(failed) + ")"


# ---- reading the runs --------------------------------------------------------------


def group_of(r: Run) -> str:
    """The size, then ``-compile`` (vLLM's default graph mode) and ``-tpN`` (TP=N)."""
    group = r.get("size", "tiny") + "-compile" * (r.get("graph_mode") == "compile")
    tp = r.get("tp")
    return f"{group}-tp{tp}" if isinstance(tp, int) and tp > 1 else group


def group_order(group: str) -> tuple[int, bool, int]:
    """Size, then FULL graphs before compile, then TP=1 before TP=N."""
    label, _, tp = group.partition("-tp")
    size, *parts = label.split("-")
    order = SIZES.index(size) if size in SIZES else len(SIZES)
    return order, "compile" in parts, int(tp) if tp.isdigit() else 1


def key_order(key: tuple) -> tuple:
    return (group_order(key[0]), CASES.index(key[1]) if key[1] in CASES else 99, *key[2:])


def round_of(run: Run) -> int:
    return int(run.get("load_round", 1))


def load_runs(outdir: str) -> tuple[dict[Key, Run], dict[Key, list[Run]]]:
    """Every run result in ``outdir``: the memory runs by key, the load runs by key in
    round order. A run keeps its files (``_json``, ``_log``) and when it was measured."""
    memory: dict[Key, Run] = {}
    load: dict[Key, list[Run]] = {}
    for path in sorted(glob.glob(os.path.join(outdir, "*.json"))):
        try:
            with open(path) as f:
                r = json.load(f)
        except (OSError, ValueError):
            continue
        if not isinstance(r, dict) or r.get("case") not in CASES:
            continue
        plugin = r.get("plugin")  # runs from before the switch existed loaded no plugin
        switch = plugin.get("switch", "none") if isinstance(plugin, dict) else "none"
        if r.get("size", "tiny") not in SIZES or switch not in SWITCHES:
            continue
        r["_json"], r["_log"] = path, path.removesuffix(".json") + ".log"
        r["_measured_utc"] = r.get("measured_utc") or utc(os.path.getmtime(path))
        key = (group_of(r), r["case"], switch)
        if r.get("workload") == "load":
            load.setdefault(key, []).append(r)
        else:
            memory[key] = r
    for rounds in load.values():
        rounds.sort(key=round_of)
    return memory, load


# ---- the graph-memory rows ---------------------------------------------------------


def estimate_of(r: Run | None) -> float | None:
    """What vLLM's profile returned, else what the worker kept."""
    est = mem_of(r, "profile_estimate_bytes")
    if est is None and (w := mem_of(r, "worker_cudagraph_memory_estimate")) is not None:
        est = w if w >= 0 else None
    return est


def kv_tokens(r: Run | None) -> int | None:
    if r and num(r.get("kv_tokens")) is not None:
        return int(r["kv_tokens"])
    res = (r or {}).get("resolved") or {}
    blocks, size = num(res.get("num_gpu_blocks")), num(res.get("block_size"))
    return int(blocks * size) if blocks is not None and size is not None else None


def owner_figures(report: Any) -> dict[str, dict[str, float | None]]:
    """Per owner, the plugin report's estimated and actual driver bytes."""
    out: dict[str, dict[str, float | None]] = {}
    if isinstance(report, dict):
        estimate = (report.get("estimate") or {}).get("owners")
        for key, owners in (("estimate", estimate), ("actual", report.get("actual"))):
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
        f"retained_{side}_bytes": kept,
        f"taken_{side}_bytes": taken,
        f"budget_minus_taken_{side}_bytes": diff(budget, taken),
        f"over_budget_{side}_bytes": over_budget_bytes((r or {}).get("mem")),
        f"kv_tokens_{side}": kv_tokens(r),
        f"startup_{side}_s": num((r or {}).get("startup_s")),
        f"profile_wall_{side}_s": mem_of(r, "profile_wall_s"),
        f"capture_wall_{side}_s": mem_of(r, "capture_wall_s"),
    }


def build_row(
    size: str, case: str, off: Run | None, on: Run | None, off_switch: str, once: Run | None = None
) -> Row:
    """One (size group, case): off, on and once side by side, the plugin-on run checked,
    and the once run on its own (``once_status``)."""
    # The plugin returns a budget: graph bytes plus what the profile left with the
    # process (one-time state); its graph estimate is what compares with the capture.
    report = (on or {}).get("plugin_report")
    estimate = report.get("estimate") if isinstance(report, dict) else None
    one_time = estimate["one_time_bytes"] if estimate else 0
    est_off, budget_on = estimate_of(off), estimate_of(on)
    est_on = sum(o["driver_bytes"] for o in estimate["owners"]) if estimate else budget_on
    act_off, act_on = mem_of(off, "capture_actual_bytes"), mem_of(on, "capture_actual_bytes")
    err_on, err_off = diff(est_on, act_on), diff(est_off, act_off)
    prof_wall, cap_wall = mem_of(on, "profile_wall_s"), mem_of(on, "capture_wall_s")
    commits = [r.get("commit") for r in (off, on, once) if r]
    row: Row = {
        "size": size,
        "case": case,
        "num_capture_sizes": ((on or off or {}).get("resolved") or {}).get("num_capture_sizes"),
        "off_switch": off_switch,
        "ran_off": bool(off and off.get("ok")),
        "ran_on": bool(on and on.get("ok")),
        "upstream_estimate_bytes": est_off,
        "plugin_estimate_bytes": est_on,
        "plugin_budget_bytes": budget_on,
        "plugin_kept_bytes": one_time + max(estimate["retained_bytes"], 0) if estimate else None,
        "actual_on_bytes": act_on,
        "actual_off_bytes": act_off,
        "plugin_error_bytes": err_on,
        "plugin_error_pct": pct(err_on, act_on),
        "upstream_error_bytes": err_off,
        "upstream_error_pct": pct(err_off, act_off),
        "kv_cache_off_bytes": mem_of(off, "kv_cache_bytes"),
        "kv_cache_on_bytes": mem_of(on, "kv_cache_bytes"),
        "profile_capture_wall_ratio_on": (
            round(prof_wall / cap_wall, 3) if prof_wall is not None and cap_wall else None
        ),
        "tokens_equal_on_off": same_tokens(on, off),
        "acceptance_off": ((off or {}).get("spec") or {}).get("acceptance_rate"),
        "acceptance_on": ((on or {}).get("spec") or {}).get("acceptance_rate"),
        "owners_on": owner_figures(report),
        "measured_utc": latest([off, on, once]),
        "commit": "/".join(dict.fromkeys(commits)) if commits and all(commits) else None,
    }
    row |= side_figures("off", off, est_off) | side_figures("on", on, budget_on)
    if once is not None:  # nothing budgeted: capture-once runs no profile capture
        row |= side_figures("once", once, None)
    checks: dict[str, bool | None] = {"estimate": None, "retained": None}
    checks["tokens"] = row["tokens_equal_on_off"]
    if err_on is not None and act_on is not None:
        checks["estimate"] = abs(err_on) <= max(EST_TOL_FRACTION * act_on, EST_TOL_BYTES)
    if row["retained_on_bytes"] is not None:  # one-time state is budgeted, not retained
        row["retained_on_beyond_one_time_bytes"] = row["retained_on_bytes"] - one_time
        checks["retained"] = row["retained_on_beyond_one_time_bytes"] <= RETAINED_MAX_BYTES
    row |= {"checks": checks, "pass": all(v is True for v in checks.values())}
    if once is not None:
        row |= once_figures(row, once, off)
    reasons = {
        "estimate": ("no estimate/actual (on)", f"estimate {row['plugin_error_pct'] or 0:+.1f} %"),
        "retained": ("no retained figure (on)", f"retained {mib(row['retained_on_bytes'])} MiB"),
        "tokens": ("tokens missing", "tokens differ"),
    }
    row["status"] = status(checks, reasons)
    return row


def once_figures(row: Row, once: Run, off: Run | None) -> Row:
    """The once run's figures and check: FALLBACK where capture-once did not apply (the
    exact profile ran, as for on), else FAIL when over budget at rest by more than 2
    MiB, its tokens differ from off or it has over 1 % fewer KV tokens than on."""
    outcome, fallback = once.get("capture_once") or {}, once.get("capture_once_fallback")
    out: Row = {"ran_once": bool(once.get("ok")), "capture_once_fallback": fallback}
    out |= {f"{k}_once": outcome.get(k) for k in ("num_blocks", "max_blocks", "mapped_bytes")}
    out["tokens_equal_once_off"] = same_tokens(once, off)
    over, kv_on, kv_once = row["over_budget_once_bytes"], row["kv_tokens_on"], row["kv_tokens_once"]
    enough = None if None in (kv_on, kv_once) else kv_once >= (1 - ONCE_KV_TOL_FRACTION) * kv_on
    checks = {
        "over_budget": None if over is None else over <= ONCE_OVER_MAX_BYTES,
        "tokens": out["tokens_equal_once_off"],
        "kv_tokens": enough,
    }
    reasons = {
        "over_budget": ("no over-budget figure", f"over budget {mib(over)} MiB"),
        "tokens": ("tokens missing", "tokens differ"),
        "kv_tokens": (
            "no KV tokens",
            f"KV tokens {pct(diff(kv_once, kv_on), kv_on) or 0:+.1f} % against on",
        ),
    }
    out["once_checks"] = checks
    out["once_status"] = f"FALLBACK ({fallback})" if fallback else status(checks, reasons)
    return out


def as_rank(r: Run | None, i: int) -> Run | None:
    """A tensor-parallel run as its rank ``i`` saw it: the rank's own figures."""
    if r is None:
        return None
    ranks = r.get("ranks") or []
    mine = ranks[i] if i < len(ranks) else {}
    return r | {
        k: mine.get(k) for k in ("mem", "plugin_report", "capture_once", "capture_once_fallback")
    }


def worst_rank_row(ranks: list[Row], tp: int) -> Row:
    """The rank rows as one: the worst rank's figures (failing first, then the larger
    estimate error, then more left taken); a check is false if false on a rank, else
    unknown if unknown on one; the row passes only if every rank does."""

    def badness(i: int) -> tuple:
        err, kept, inf = ranks[i]["plugin_error_bytes"], ranks[i]["retained_on_bytes"], float("inf")
        return (
            ranks[i]["pass"],
            -(inf if err is None else abs(err)),
            -(inf if kept is None else kept),
        )

    worst = min(range(len(ranks)), key=badness)
    row = ranks[worst] | {"tp": tp, "worst_rank": worst}
    row["ranks"] = [
        {k: v for k, v in r.items() if k not in ("size", "case", "off_switch")} | {"rank": i}
        for i, r in enumerate(ranks)
    ]
    each = {name: [r["checks"][name] for r in ranks] for name in row["checks"]}
    row["checks"] = {
        n: False if False in v else None if None in v else True for n, v in each.items()
    }
    row["pass"] = all(r["pass"] for r in ranks)
    failing = [
        f"rank {i}: {r['status'][len('FAIL (') : -1]}" for i, r in enumerate(ranks) if not r["pass"]
    ]
    row["status"] = "PASS" if row["pass"] else "FAIL (" + "; ".join(failing) + ")"
    return row


def memory_rows(runs: dict[Key, Run]) -> list[Row]:
    rows = []
    for group in sorted({k[0] for k in runs}, key=lambda g: (group_order(g), g)):
        tp = group_order(group)[-1]
        for case in CASES:
            has_off = (group, case, "off") in runs
            off_switch = "none" if (group, case, "none") in runs and not has_off else "off"
            off, on, once = (runs.get((group, case, s)) for s in (off_switch, "on", "once"))
            if not (off or on or once):
                continue
            if tp == 1:
                row = build_row(group, case, off, on, off_switch, once)
            else:
                n = max(tp, *(len((r or {}).get("ranks") or []) for r in (off, on)))
                per_rank = [
                    build_row(
                        group, case, as_rank(off, i), as_rank(on, i), off_switch, as_rank(once, i)
                    )
                    for i in range(n)
                ]
                row = worst_rank_row(per_rank, tp)
            # A once FAIL fails the row (on any rank); a FALLBACK does not: the exact
            # profile ran and the on checks cover it.
            for x in [row, *row.get("ranks", [])]:
                row["pass"] &= not x.get("once_status", "").startswith("FAIL")
            rows.append(row)
    return rows


def size_meta(group: str, runs: dict[Key, Run], outdir: str) -> dict[str, Any]:
    """A size group's engine settings, machine and versions, from its runs."""
    mine = [r for (g, _, _), r in sorted(runs.items()) if g == group]

    def first(key: str) -> Any:
        return next((r[key] for r in mine if r.get(key)), None)

    smi = None
    if os.path.exists(gpu_txt := os.path.join(outdir, "gpu.txt")):
        with open(gpu_txt) as f:
            smi = "; ".join(line.strip() for line in f if line.strip()) or None
    kw, res = first("llm_kwargs") or {}, first("resolved") or {}
    engine = ("dtype", "max_num_seqs", "max_model_len", "max_num_batched_tokens")
    settings = {"model": os.path.basename(str(kw.get("model", ""))) or None}
    settings |= {k: kw.get(k) for k in (*engine, "gpu_memory_utilization")}
    compilation = kw.get("compilation_config") or {}
    settings["capture_sizes"] = compilation.get("cudagraph_capture_sizes", "vLLM default")
    settings["num_capture_sizes"] = res.get("num_capture_sizes")
    if kw.get("tensor_parallel_size", 1) > 1:
        settings["tensor_parallel_size"] = kw["tensor_parallel_size"]
    mtimes = [os.path.getmtime(r["_json"]) for r in mine if os.path.exists(r.get("_json", ""))]
    return {
        "measured_utc": utc(max(mtimes)) if mtimes else None,
        "gpu": (first("gpu") or {}).get("name"),
        "nvidia_smi": smi,
        "torch": first("torch"),
        "vllm": first("vllm"),
        "settings": settings,
    }


RUN_FIELDS = (  # what the graph-memory JSON keeps of a run; its own files have the rest
    "ok stage error startup_s init_s generate_s kv_tokens mem spec plugin plugin_report tokens"
    " tp workload load gpu commit capture_once capture_once_fallback"
)


def compact_run(key: Key, r: Run) -> dict[str, Any]:
    out = {"size": key[0], "case": key[1], "plugin": key[2]}
    out |= {k: r[k] for k in RUN_FIELDS.split() if k in r} | {"measured_utc": r["_measured_utc"]}
    if "ranks" in r:  # tensor parallel: every rank's figures, without its log lines
        out["ranks"] = [{k: v for k, v in x.items() if k != "plugin_log"} for x in r["ranks"] or []]
    return out


def carried(
    rows: list[Row], previous: list[Row], key: Callable[[Row], tuple], source: str
) -> list[Row]:
    """The rows of ``previous`` that ``rows`` has none for (by ``key``) and that name the
    plugin commit they measured; a row without one is from code older than the record."""
    here, out = {key(r) for r in rows}, []
    for r in previous:
        name = "/".join(map(str, key(r)))
        if key(r) in here:
            continue
        if r.get("commit"):
            out.append(r)
            print(f"carried over from {source}: {name}")
        else:
            print(f"dropped from {source}: {name} (no commit: older code)")
    return out


def carry_over(doc: dict[str, Any], prev: dict[str, Any], source: str) -> None:
    """Add the rows ``carried`` from ``prev``, with their runs and size groups' settings."""
    doc["rows"] += carried(doc["rows"], prev.get("rows") or [], size_case, source)
    rows, runs = {size_case(r) for r in doc["rows"]}, {size_case(r) for r in doc["runs"]}
    doc["runs"] += [r for r in prev.get("runs") or [] if size_case(r) in rows - runs]
    sizes = prev.get("sizes") or {}
    doc["sizes"] = {g: sizes[g] for g, _ in rows if g in sizes} | doc["sizes"]


# ---- the load rows -----------------------------------------------------------------


def ratio(on: float | None, off: float | None) -> float | None:
    return round(on / off, 4) if on and off else None


def load_of(r: Run) -> dict[str, Any]:
    return r.get("load") or {}


def finished(runs: list[Run] | None) -> list[Run]:
    return sorted((r for r in runs or [] if r.get("ok")), key=round_of)


def repeats_of(runs: list[Run]) -> list[dict[str, Any]]:
    """Every timed repeat of ``runs``, each with its run's round."""
    return [rep | {"round": round_of(r)} for r in runs for rep in load_of(r).get("repeats") or []]


def rates(repeats: list[dict[str, Any]]) -> dict[str, float | None]:
    values = [r["tokens_per_s"] for r in repeats if r.get("tokens_per_s") is not None]
    best, lowest = max(values, default=None), min(values, default=None)
    return {"median": statistics.median(values) if values else None, "best": best, "lowest": lowest}


def switch_figures(s: str, runs: list[Run]) -> Row:
    """One switch's figures over its finished runs of every round, their repeats pooled;
    acceptance counts only the timed repeats."""
    reps = repeats_of(runs)
    steps = [r["step_ms"] for r in reps if r.get("step_ms") is not None]
    counts = [load_of(r).get("spec") or {} for r in runs]
    drafts, draft_tokens, accepted = (
        sum(c.get(k) or 0 for c in counts) for k in ("drafts", "draft_tokens", "accepted_tokens")
    )
    gpus = {str(v) for r in runs if (v := (r.get("gpu") or {}).get("visible_devices"))}
    return {
        f"runs_{s}": len(runs),
        f"tokens_per_s_{s}": rates(reps),
        f"step_ms_{s}": statistics.median(steps) if steps else None,
        f"acceptance_{s}": round(accepted / draft_tokens, 4) if draft_tokens else None,
        f"mean_acceptance_length_{s}": round(1 + accepted / drafts, 3) if drafts else None,
        f"repeats_equal_{s}": all(load_of(r).get("repeats_equal") for r in runs) if runs else None,
        f"gpu_{s}": " ".join(sorted(gpus)) or None,
        f"repeats_{s}": reps,
    }


def per_round(offs: list[Run], ons: list[Run]) -> list[dict[str, Any]]:
    """Each round's median tokens/s off and on, and on/off of them."""
    out = []
    for n in sorted({round_of(r) for r in offs + ons}):
        off, on = (
            rates(repeats_of([r for r in rs if round_of(r) == n]))["median"] for rs in (offs, ons)
        )
        out.append(
            {
                "round": n,
                "tokens_per_s_off": off,
                "tokens_per_s_on": on,
                "ratio_on_off": ratio(on, off),
            }
        )
    return out


def compile_source(run: Run) -> str | None:
    """Where the run's torch.compile graphs came from, read from its log: compiled in
    the process, or all loaded from vLLM's compile cache."""
    if not run.get("_log") or not os.path.exists(run["_log"]):
        return None
    with open(run["_log"], errors="replace") as f:
        log = f.read()
    if "Compiling a graph for compile range" in log:
        return "compiled"
    return "cache" if "Directly load the compiled graph(s)" in log else None


def token_agreement(offs: list[Run], ons: list[Run]) -> Row:
    """Whether every run's tokens equal the first off run's, the runs that differ, and
    where each run's compiled graphs came from (kernels compiled anew may round otherwise)."""
    tagged = [(f"{s} r{round_of(r)}", r) for s, rs in (("off", offs), ("on", ons)) for r in rs]
    differing = None
    if offs and ons:
        differing = [tag for tag, r in tagged if r.get("tokens") != offs[0].get("tokens")]
    sources = {tag: src for tag, r in tagged if (src := compile_source(r))}
    return {
        "tokens_equal_on_off": None if differing is None else not differing,
        "tokens_differing": differing,
        "compile_sources": sources or None,
    }


def build_load_row(
    group: str, case: str, offs: list[Run], ons: list[Run], base_offs: list[Run] | None = None
) -> Row:
    """One (size group, case) from its runs of every round, off and on; a run that
    did not finish adds nothing. ``base_offs``: the group's runs without a
    speculator, plugin off. Passes when every run's tokens are the same and the
    plugin's share of a step is at most MAX_SLOWDOWN (without a measured share:
    on/off of the median tokens/s at least 1 - MAX_SLOWDOWN)."""
    offs, ons = finished(offs), finished(ons)
    row = {"size": group, "case": case} | switch_figures("off", offs) | switch_figures("on", ons)
    on_rate, off_rate = row["tokens_per_s_on"]["median"], row["tokens_per_s_off"]["median"]
    base_rate = rates(repeats_of(finished(base_offs)))["median"]
    shares = [load_of(r).get("plugin_share") or {} for r in ons]
    row |= {
        "num_requests": load_of((ons or offs or [{}])[0]).get("num_requests"),
        "generated_tokens": (row["repeats_on"] or row["repeats_off"] or [{}])[0].get(
            "generated_tokens"
        ),
        "ratio_on_off_median": ratio(on_rate, off_rate),
        "rounds": per_round(offs, ons),
        "step_ratio_on_off": ratio(row["step_ms_on"], row["step_ms_off"]),
        # The plugin's share of a step: its own functions' time under cProfile.
        "plugin_share": max(
            (x["plugin_share"] for x in shares if x.get("plugin_share") is not None), default=None
        ),
        "plugin_us_per_step": max(
            (x["plugin_us_per_step"] for x in shares if x.get("plugin_us_per_step")), default=None
        ),
        "tokens_per_s_no_speculator": base_rate,
        "ratio_on_no_speculator": ratio(on_rate, base_rate),
        "commit": " ".join(sorted({r["commit"] for r in offs + ons if r.get("commit")})) or None,
        "measured_utc": latest(offs + ons),
    }
    row |= token_agreement(offs, ons)
    check_load_row(row, f"off r{round_of(offs[0])}" if offs else "off")
    return row


def check_load_row(row: Row, first_off: str) -> None:
    share, on_off = row["plugin_share"], row["ratio_on_off_median"]
    checks: dict[str, bool | None] = {"tokens": row["tokens_equal_on_off"]}
    if share is not None:
        checks["plugin_share"] = share <= MAX_SLOWDOWN
    else:
        checks["ratio"] = None if on_off is None else on_off >= 1 - MAX_SLOWDOWN
    differ = f"tokens differ: {', '.join(row['tokens_differing'] or ())} from {first_off}"
    if len(set((sources := row["compile_sources"] or {}).values())) > 1:
        differ += " (torch.compile: " + ", ".join(f"{k} {v}" for k, v in sources.items()) + ")"
    reasons = {
        "tokens": ("tokens missing", differ),
        "plugin_share": ("", f"plugin share {share or 0:.2%}"),
        "ratio": ("no tokens/s", f"on/off {on_off or 0:.3f}"),
    }
    row |= {"checks": checks, "pass": all(v is True for v in checks.values())}
    row["status"] = status(checks, reasons)


def load_rows(runs: dict[Key, list[Run]]) -> list[Row]:
    """One row per (size group, case, requests per generate): runs of another request
    count are never pooled; a case whose runs all stopped before their repeats makes a
    row alone."""

    def requests(r: Run) -> int | None:
        return load_of(r).get("num_requests")

    def of(group: str, case: str, switch: str, n: int | None) -> list[Run]:
        return [r for r in runs.get((group, case, switch), []) if requests(r) == n]

    measured = {(g, c, requests(r)) for (g, c, _), rs in runs.items() for r in rs}
    keys = {k for k in measured if k[2] is not None}
    keys |= {k for k in measured if k[2] is None and not any(m[:2] == k[:2] for m in keys)}
    return [
        build_load_row(
            g,
            c,
            of(g, c, "off", n),
            of(g, c, "on", n),
            None if c == "base" else of(g, "base", "off", n),
        )
        for g, c, n in sorted(keys, key=lambda k: key_order((*k[:2], k[2] or 0)))
    ]


def load_doc(rows: list[Row], previous: str | None) -> dict[str, Any]:
    """This invocation's load rows, then those ``carried`` from the vllm_load.json beside
    ``previous``."""
    path = previous and os.path.join(os.path.dirname(previous), "vllm_load.json")
    if prev := read(path, (3,)):
        rows = rows + carried(
            rows, prev.get("rows") or [], itemgetter("size", "case", "num_requests"), path
        )
    return {"schema": 3, "generated_utc": utc(), "max_slowdown": MAX_SLOWDOWN, "rows": rows}


# ---- vllm serve --------------------------------------------------------------------


def serve_row(off: Run, on: Run) -> Row:
    """serve.py's off and on runs side by side, and whether they pass."""
    checks = {
        "both ran": bool(off.get("ok") and on.get("ok")),
        "tokens equal": off.get("tokens") is not None and off.get("tokens") == on.get("tokens"),
        "plugin lines in the server log": bool(on.get("log_ok") and off.get("log_ok")),
        "clean shutdown": bool(off.get("clean_shutdown") and on.get("clean_shutdown")),
    }
    failed = [name for name, ok in checks.items() if not ok]
    row = {k: on.get(k) for k in ("size", "case", "graph_mode", "requests")}
    row |= {
        k: [off.get(k), on.get(k)] for k in ("startup_s", "seconds", "shutdown_s", "gpu_left_mib")
    }
    row |= {"log_lines_on": on.get("log_lines"), "checks": checks}
    row["check"] = "PASS" if not failed else "FAIL (" + ", ".join(failed) + ")"
    return row | {"commit": on.get("commit"), "measured_utc": on.get("measured_utc")}


# ---- tables ------------------------------------------------------------------------


def show(value: Any, fmt: Callable[[Any], str] = str) -> str:
    return "-" if value is None else fmt(value)


def mib(x: float | None) -> str:
    return show(x, lambda b: f"{b / MiB:.1f}")


def cell(*keys: str, fmt: Callable[[Any], str] = str) -> Callable[[Row], str]:
    """A cell of the row's ``keys``, each formatted ("-" where missing), joined by " / "."""
    return lambda row: " / ".join(show(row.get(k), fmt) for k in keys)


def sides(template: str, switches: tuple[str, ...] = ("off", "on")) -> list[str]:
    return [template.format(s) for s in switches]


def render(columns: list[Column], rows: list[Row], text: bool = False) -> list[str]:
    """The table of ``rows``: Markdown, or with ``text`` the same cells as plain text for
    the printed summary, each column as wide as its widest cell under its header wrapped
    to that width. A column with a letter in a cell holds words and is left-aligned, one
    without holds figures and is right-aligned."""
    header, body = [h for h, _ in columns], [[c(row) for _, c in columns] for row in rows]
    words = [any(ch.isalpha() for line in body for ch in line[i]) for i in range(len(columns))]
    if not text:
        lines = ["| " + " | ".join(line) + " |" for line in (header, *body)]
        return [lines[0], "|" + "|".join("---" if w else "---:" for w in words) + "|", *lines[1:]]
    widths = [
        max([len(w) for w in h.split()] + [len(line[i]) for line in body])
        for i, h in enumerate(header)
    ]
    wrapped = [textwrap.wrap(h, n) for h, n in zip(header, widths, strict=True)]
    heads = [[h[j] if j < len(h) else "" for h in wrapped] for j in range(max(map(len, wrapped)))]
    return [
        "  ".join(
            c.ljust(n) if w else c.rjust(n) for c, n, w in zip(cells, widths, words, strict=True)
        ).rstrip()
        for cells in (*heads, *body)
    ]


def case_cell(row: Row) -> str:
    off = "" if row.get("off_switch", "off") == "off" else f" (off={row['off_switch']})"
    rank = f" [rank {row['worst_rank']} of {row['tp']}]" if "worst_rank" in row else ""
    return row["case"] + off + rank


def errors_cell(row: Row) -> str:
    def error(side: str) -> str:
        e, p = row.get(f"{side}_error_bytes"), row.get(f"{side}_error_pct")
        return "-" if e is None else ("" if p is None else f"{p:+.1f} % ") + f"({e / MiB:+.1f})"

    return f"{error('upstream')} / {error('plugin')}"


def walls_cell(row: Row) -> str:
    walls = [
        cell(*sides(f"{{}}_wall_{s}_s", ("profile", "capture")), fmt="{:.1f}".format)
        for s in ("off", "on")
    ]
    return "; ".join(w(row) for w in walls)


def owners_cell(row: Row) -> str:
    owners = (row.get("owners_on") or {}).items()
    return (
        "; ".join(f"{k} {mib(v.get('estimate'))} / {mib(v.get('actual'))}" for k, v in owners)
        or "-"
    )


def provenance(row: Row) -> str:
    return f"{row.get('measured_utc') or '-'}, {row.get('commit') or '-'}"


MEMORY: list[Column] = [
    ("size", cell("size")),
    ("capture sizes", cell("num_capture_sizes")),
    ("case", case_cell),
    (
        "graph estimate upstream (off) / plugin (on) MiB",
        cell("upstream_estimate_bytes", "plugin_estimate_bytes", fmt=mib),
    ),
    ("plugin budget (on) MiB", cell("plugin_budget_bytes", fmt=mib)),
    ("actual off / on MiB", cell(*sides("actual_{}_bytes"), fmt=mib)),
    ("error upstream / plugin % (MiB)", errors_cell),
    ("retained after profile off / on MiB", cell(*sides("retained_{}_bytes"), fmt=mib)),
    (
        "budget - (retained + actual) off / on MiB",
        cell(*sides("budget_minus_taken_{}_bytes"), fmt=mib),
    ),
    ("over budget at rest off / on MiB", cell(*sides("over_budget_{}_bytes"), fmt=mib)),
    ("KV tokens off / on", cell(*sides("kv_tokens_{}"), fmt="{:,}".format)),
    ("start-up s off / on", cell(*sides("startup_{}_s"), fmt="{:.1f}".format)),
    ("profile / capture s off; on", walls_cell),
    ("tokens on = off", cell("tokens_equal_on_off")),
    ("per owner est. / actual (on) MiB", owners_cell),
    ("measured (UTC), commit", provenance),
    ("check", cell("status")),
]
ONCE_SIDES = ("off", "on", "once")
ONCE: list[Column] = [
    ("size", cell("size")),
    ("case", cell("case")),
    ("KV tokens off / on / once", cell(*sides("kv_tokens_{}", ONCE_SIDES), fmt="{:,}".format)),
    ("start-up s off / on / once", cell(*sides("startup_{}_s", ONCE_SIDES), fmt="{:.1f}".format)),
    (
        "over budget at rest on / once MiB",
        cell(*sides("over_budget_{}_bytes", ONCE_SIDES[1:]), fmt=mib),
    ),
    (
        "KV blocks backed / reserved (once)",
        cell("num_blocks_once", "max_blocks_once", fmt="{:,}".format),
    ),
    ("tokens once = off", cell("tokens_equal_once_off")),
    ("check", cell("once_status")),
]


def rates_cell(key: str) -> Callable[[Row], str]:
    def rates_of(row: Row) -> str:
        r = row.get(key) or {}
        return show(r.get("median"), lambda m: f"{m:,.0f} ({r['lowest']:,.0f} - {r['best']:,.0f})")

    return rates_of


def rounds_cell(row: Row) -> str:
    rounds = row.get("rounds") or []
    return (
        ", ".join(f"r{r['round']} {show(r['ratio_on_off'], '{:.3f}'.format)}" for r in rounds)
        or "-"
    )


def share_cell(row: Row) -> str:
    share, us = row.get("plugin_share"), row.get("plugin_us_per_step")
    return "-" if share is None else f"{share:.3%}" + ("" if us is None else f" ({us:.0f})")


LOAD: list[Column] = [
    ("size", cell("size")),
    ("case", cell("case")),
    ("requests", cell("num_requests")),
    ("runs off / on", cell("runs_off", "runs_on")),
    ("tokens/s off: median (lowest - best)", rates_cell("tokens_per_s_off")),
    ("tokens/s on: median (lowest - best)", rates_cell("tokens_per_s_on")),
    ("on / off (medians)", cell("ratio_on_off_median", fmt="{:.3f}".format)),
    ("on / off per round", rounds_cell),
    ("engine step ms off / on (median)", cell("step_ms_off", "step_ms_on", fmt="{:.2f}".format)),
    ("step on / off", cell("step_ratio_on_off", fmt="{:.3f}".format)),
    ("acceptance off / on", cell("acceptance_off", "acceptance_on", fmt="{:.3f}".format)),
    ("on / no speculator", cell("ratio_on_no_speculator", fmt="{:.3f}".format)),
    ("plugin share of a step (us)", share_cell),
    ("tokens equal (all runs)", cell("tokens_equal_on_off")),
    ("check", cell("status")),
    ("commit", cell("commit")),
    ("measured (UTC)", cell("measured_utc")),
]


def off_on(key: str) -> Callable[[Row], str]:
    """A serve row's [off, on] pair: seconds to a tenth, MiB whole."""

    def figure(v: Any) -> str:
        return f"{v:.1f}" if isinstance(v, float) else str(v)

    return lambda row: " / ".join(show(v, figure) for v in row[key])


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
    ("measured (UTC), commit", provenance),
]

MEMORY_INTRO = (
    "Real vLLM 0.33.0 (Model Runner V2, Triton attention, dummy weights) through "
    "`scripts/device-vllm-e2e.sh`, every run in its own process. Off: the plugin loaded "
    "with `VLLM_SPECGRAPH=0`, so it patches nothing; on: `VLLM_PLUGINS=specgraph`. Size "
    "groups ending in `-compile`: vLLM's default graph mode (torch.compile, "
    "FULL_AND_PIECEWISE graphs); the others: compilation off, FULL graphs."
)
MEMORY_NOTES = (
    "Estimates: upstream's is what `GPUModelRunner.profile_cudagraph_memory` returned; the "
    "plugin's, the graph bytes of its report (`runner.specgraph_profile`), and its budget "
    "adds what the profile left with the process: one-time state, such as kernels the first "
    "capture loaded. Actual: what the production `capture_model` took at driver level; "
    "error: estimate minus actual. Retained: driver-level bytes still taken when the "
    "profile returned (the check allows the plugin's one-time bytes, which its budget "
    "holds). Budget - (retained + actual) below 0: the KV cache was sized too large by that "
    "much. Over budget at rest: what the started instance held (allocator cache emptied) "
    "beyond `gpu_memory_utilization * total` less the activation headroom; positive bytes "
    "come out of the headroom the first full step needs. KV tokens: `num_gpu_blocks * "
    "block_size`; start-up: the `LLM(...)` constructor."
)
ONCE_NOTES = (
    "Capture once (`PLUGIN=once`, `VLLM_SPECGRAPH_PROFILE=capture-once`): no profile "
    "capture; the KV cache over a range reserved for the most blocks, backed after warm-up "
    "and the production capture up to the KV budget less what they took. Check: FALLBACK "
    "(the reason) where capture-once did not apply and the exact profile ran; else over "
    f"budget at rest <= {ONCE_OVER_MAX_BYTES / MiB:.0f} MiB, greedy tokens equal to off "
    f"and at most {ONCE_KV_TOL_FRACTION:.0%} fewer KV tokens than on."
)
LOAD_INTRO = (
    "Real vLLM 0.33.0 (Model Runner V2, Triton attention, dummy weights refilled by name) "
    "through `scripts/device-vllm-e2e.sh` with `MODE=load`; `-compile`: vLLM's default "
    "torch.compile with FULL_AND_PIECEWISE graphs, else FULL graphs. Each run submits all "
    "its requests at once (seeded prompts of 16 to `max_model_len / 2` tokens, 16 to "
    "`max_model_len / 4` out, greedy, `ignore_eos`) and times `generate()`, repeated, after "
    "a warm-up. Off and on of a case run one after the other on one GPU, in rounds of "
    "alternating order; the timed repeats of all rounds of a switch are pooled, as are "
    "vLLM's spec-decode counters for the acceptance. `draft`: a 2-layer draft model, which "
    "rarely agrees with the target; `accept`: the target's config and weights as draft "
    "model, which nearly always does; no speculator: the size group's `base` case, plugin off."
)
LOAD_CHECK = (
    "Check: every run's greedy tokens, off and on, are the same, and the plugin takes at "
    f"most {MAX_SLOWDOWN:.0%} of a step: the time in its own Python functions over a "
    "profiled generate's (cProfile at TP=1, where the plugin runs in the profiled process; "
    "in brackets, microseconds per engine step). Host-bound steps spread by more than that "
    "from repeat to repeat, so on/off of the medians is checked only where no share was "
    "measured. Where tokens differ under torch.compile, the check names where each run's "
    "compiled graphs came from: compiled in the run, or vLLM's compile cache."
)
# How a size group's bullet names its settings; the capture-size list itself is in the JSON.
LABELS = {"model": "", "dtype": "", "num_capture_sizes": "capture sizes: "}


def size_bullet(group: str, meta: dict[str, Any]) -> str:
    settings = meta.get("settings") or {}
    shown = [
        f"{LABELS.get(k, k + ' ')}{v}"
        for k, v in settings.items()
        if v is not None and k != "capture_sizes"
    ]
    where = meta.get("nvidia_smi") or meta.get("gpu") or "an unrecorded GPU"
    return (
        f"* `{group}` ({', '.join(shown)}): last measured {meta.get('measured_utc')} UTC on "
        f"{where}, torch {meta.get('torch')}, vLLM {meta.get('vllm')}."
    )


def memory_markdown(doc: dict[str, Any]) -> str:
    t = doc["targets"]
    out = ["# vLLM 0.33.0 CUDA-graph memory: vllm-specgraph off and on", "", MEMORY_INTRO, ""]
    out += [size_bullet(group, meta) for group, meta in doc["sizes"].items()]
    out += ["", *render(MEMORY, doc["rows"]), ""]
    if doc.get("skipped"):
        out += [f"Not run (the script's time budget ran out): {', '.join(doc['skipped'])}.", ""]
    out.append(
        f"Check (plugin on): |estimate - actual| <= max({t['estimate_tolerance_fraction']:.0%}"
        f" of actual, {t['estimate_tolerance_bytes'] / MiB:.0f} MiB); driver-level memory "
        f"still taken after the profile returned <= {t['retained_max_bytes'] / MiB:.0f} MiB; "
        "greedy tokens equal to the plugin-off run."
    )
    if once := [row for row in doc["rows"] if "once_status" in row]:
        out += ["", ONCE_NOTES, "", *render(ONCE, once)]
    return "\n".join([*out, "", MEMORY_NOTES]) + "\n"


def load_markdown(doc: dict[str, Any]) -> str:
    title = "# vLLM 0.33.0 under load: vllm-specgraph off and on"
    return "\n".join([title, "", LOAD_INTRO, "", *render(LOAD, doc["rows"]), "", LOAD_CHECK, ""])


# ---- main --------------------------------------------------------------------------


def read(path: str | None, schemas: tuple[int, ...] | None = None) -> dict[str, Any] | None:
    """An earlier table of a schema this module reads, or a serve.py run; None if absent."""
    if not path or not os.path.exists(path):
        return None
    with open(path) as f:
        doc = json.load(f)
    return doc if schemas is None or doc.get("schema") in schemas else None


def write(results: str, name: str, doc: dict[str, Any], markdown: str) -> None:
    os.makedirs(results, exist_ok=True)
    with open(os.path.join(results, f"{name}.json"), "w") as f:
        f.write(json.dumps(doc, indent=1) + "\n")
    with open(os.path.join(results, f"{name}.md"), "w") as f:
        f.write(markdown)
    print(f"wrote {results}/{name}.json and .md ({len(doc['rows'])} rows)")


def print_table(title: str, columns: list[Column], rows: list[Row]) -> None:
    if rows:
        print("-" * 72, title, *render(columns, rows, text=True), sep="\n")


def speculative_tokens_equal(runs: dict[Key, Run]) -> bool | None:
    """Whether every speculative case's greedy tokens equal those of the base case of its
    size group and switch (None: nothing compared); a case that differs is printed."""
    equal = None
    for (group, case, switch), r in sorted(runs.items(), key=lambda kv: key_order(kv[0])):
        base = runs.get((group, "base", switch))
        if case != "base" and (same := same_tokens(r, base)) is not None:
            equal = same if equal is None else equal and same
            if not same:
                print(f"tokens of {group} {case} {switch} differ from its base case's")
    return equal


def serve_main(off_path: str, on_path: str, results: str) -> int:
    off, on = (
        (read(p) or {"ok": False, "error": f"no result in {p}"}) for p in (off_path, on_path)
    )
    row = serve_row(off, on)
    markdown = ["# `vllm serve`: vllm-specgraph off and on", "", *render(SERVE, [row])]
    write(results, "vllm_serve", {"rows": [row]}, "\n".join(markdown) + "\n")
    print(*render(SERVE, [row], text=True), sep="\n")
    print(f"plugin lines in the on run's server log: {row['log_lines_on']}")
    return 0 if row["check"] == "PASS" else 1


def memory_doc(
    memory: dict[Key, Run], rows: list[Row], outdir: str, skipped: list[str], previous: str | None
) -> dict[str, Any]:
    """This invocation's graph-memory ``rows``, then those carried over from ``previous``."""
    targets = {"estimate_tolerance_fraction": EST_TOL_FRACTION}
    targets |= {"estimate_tolerance_bytes": EST_TOL_BYTES, "retained_max_bytes": RETAINED_MAX_BYTES}
    doc = {
        "schema": 2,
        "generated_utc": utc(),
        "targets": targets,
        "sizes": {g: size_meta(g, memory, outdir) for g in sorted({k[0] for k in memory})},
        "rows": list(rows),
        "runs": [compact_run(k, r) for k, r in sorted(memory.items())],
        "skipped": skipped,
    }
    if prev := read(previous, (1, 2)):  # schema 1 lacks newer fields: shown as "-"
        carry_over(doc, prev, previous)
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
    print(
        "=" * 72, "vLLM 0.33.0 end-to-end on the GPU (MRV2, Triton attention)", "=" * 72, sep="\n"
    )
    memory, load = load_runs(args.outdir)
    every = [*memory.values(), *(r for rounds in load.values() for r in rounds)]
    if not every:
        print(f"no run results in {args.outdir}")
    for r in sorted(every, key=lambda r: r["_json"]):
        if not r.get("ok"):  # named by its log, which has the rest
            error = (r.get("error") or "no error recorded")[:400]
            print(f"FAILED {r['_log']} at stage {r.get('stage')}: {error}")
    spec_equal = speculative_tokens_equal(memory)
    skipped: list[str] = []
    if os.path.exists(path := os.path.join(args.outdir, "skipped.txt")):
        with open(path) as f:
            skipped = [line.strip() for line in f if line.strip()]

    rows, loads = memory_rows(memory), load_rows(load)
    doc = memory_doc(memory, rows, args.outdir, skipped, args.previous)
    print_table("plugin off vs on (this invocation's rows)", MEMORY, rows)
    print_table("capture once", ONCE, [r for r in rows if "once_status" in r])
    write(results, "vllm_graph_memory", doc, memory_markdown(doc))
    print_table("under load", LOAD, loads)
    if (load_table := load_doc(loads, args.previous))["rows"]:
        write(results, "vllm_load", load_table, load_markdown(load_table))
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
