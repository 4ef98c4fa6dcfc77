# SPDX-License-Identifier: Apache-2.0
"""Summarise the end-to-end runs into bench/results' tables, each row checked.

    python3 summarize.py OUTDIR [--results DIR] [--previous FILE]
    python3 summarize.py --serve OFF.json ON.json --results DIR

Reads every OUTDIR/*.json that run_llm.py wrote (and the .log beside it; runs
named in OUTDIR/skipped.txt did not run) and writes DIR/vllm_graph_memory.{json,md}
(DIR defaults to OUTDIR/bench/results): one row per (size group, case), the
plugin off, on and noest side by side (once in a table of its own); the load
runs (every round of a case in one row) go to DIR/vllm_load.{json,md}. With
--previous (an earlier vllm_graph_memory.json; its directory's vllm_load.json
too) the rows this OUTDIR has no run for are carried over if they name the
plugin commit they measured. Exits 0 only if every run ran and every row of this invocation passed.
``--serve`` compares serve.py's two runs into DIR/vllm_serve.{json,md}.

A size group is the size, then ``-small`` (capture sizes), ``-compile`` (vLLM's
default graph mode), ``-expandable`` (allocator), ``-peak`` (workload),
``-utilU`` and ``-tpN``. A tensor-parallel row is checked on every rank and
shows the worst rank's figures.
"""

from __future__ import annotations

import argparse
import datetime
import glob
import json
import os
import statistics
import sys
from typing import Any

MiB = 1 << 20
SIZES = ("tiny", "1b", "8b")
CASES = ("base", "draft", "accept", "ngram", "eagle")
SWITCHES = ("off", "on", "none", "noest", "once")
EST_TOL_FRACTION, EST_TOL_BYTES, RETAINED_MAX_BYTES = 0.01, 2 * MiB, 2 * MiB
ONCE_OVER_MAX_BYTES, ONCE_KV_TOL_FRACTION = 2 * MiB, 0.01  # the capture-once check's
MAX_SLOWDOWN = 0.02  # the load table's: the plugin's share of a step
Run = dict[str, Any]
Key = tuple[str, str, str]  # (size group, case, switch)


def words(text: str, sep: str | None = None) -> tuple[str, ...]:
    return tuple(text.split(sep))


def num(x: Any) -> float | None:
    return x if isinstance(x, int | float) and not isinstance(x, bool) else None


def mib(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{x / MiB:.{digits}f}"


def mem_of(r: Run | None, key: str) -> float | None:
    return num(r["mem"].get(key)) if r and isinstance(r.get("mem"), dict) else None


def now_utc() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M")


def group_of(r: Run, kind: str) -> str:
    group = r.get("size", "tiny")
    for key, plain in (("capture", "default"), ("graph_mode", "full"), ("allocator", "default")):
        if r.get(key) not in (None, plain):
            group += f"-{r[key]}"
    group += "-peak" * (kind == "memory" and r.get("workload") == "peak")
    group += f"-util{r['utilization']}" if r.get("utilization") is not None else ""
    tp = r.get("tp")
    return f"{group}-tp{tp}" if isinstance(tp, int) and tp > 1 else group


def group_order(group: str) -> tuple:
    label, _, tp = group.partition("-tp")
    size, *parts = label.split("-")
    flags = [p in parts for p in ("compile", "peak")] + [any(p.startswith("util") for p in parts)]
    order = SIZES.index(size) if size in SIZES else 99
    return (order, *flags, "small" in parts, "expandable" in parts, int(tp) if tp.isdigit() else 1)


def key_order(key: tuple) -> tuple:
    return (group_order(key[0]), CASES.index(key[1]) if key[1] in CASES else 99, *key[2:])


def round_of(run: Run) -> int:
    return int(run.get("load_round", 1))


def load_runs(outdir: str) -> tuple[dict[Key, Run], dict[Key, list[Run]]]:
    """Every run result in ``outdir``: the memory runs by key, the load runs by key
    in round order."""
    memory: dict[Key, Run] = {}
    load: dict[Key, list[Run]] = {}
    for path in sorted(glob.glob(os.path.join(outdir, "*.json"))):
        try:
            with open(path) as f:
                r = json.load(f)
        except (OSError, ValueError):
            continue
        if (
            not isinstance(r, dict)
            or r.get("case") not in CASES
            or r.get("size", "tiny") not in SIZES
        ):
            continue
        plugin = r.get("plugin")  # runs from before the switch existed loaded no plugin
        switch = plugin.get("switch", "none") if isinstance(plugin, dict) else "none"
        r["_json"], r["_log"] = path, path[: -len(".json")] + ".log"
        when = datetime.datetime.fromtimestamp(os.path.getmtime(path), datetime.UTC)
        r["_measured_utc"] = r.get("measured_utc") or when.strftime("%Y-%m-%d %H:%M")
        kind = "load" if r.get("workload") == "load" else "memory"
        key = (group_of(r, kind), r["case"], switch)
        if kind == "load":
            load.setdefault(key, []).append(r)
        else:
            memory[key] = r
    for rounds in load.values():
        rounds.sort(key=round_of)
    return memory, load


# ---- the graph-memory table ----------------------------------------------------


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


def pct(err: float | None, base: float | None) -> float | None:
    return None if err is None or not base else 100.0 * err / base


def diff(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b


def status(checks: dict[str, bool | None], reasons: dict[str, tuple[str, str]]) -> str:
    """PASS, or FAIL with a reason per check: (when unknown, when false)."""
    failed = [
        reasons[name][checks[name] is not None] for name in checks if checks[name] is not True
    ]
    return "PASS" if not failed else "FAIL (" + "; ".join(failed) + ")"


def build_row(
    size: str,
    case: str,
    off: Run | None,
    on: Run | None,
    off_switch: str,
    noest: Run | None = None,
    once: Run | None = None,
) -> dict:
    """One (size group, case): off, on, noest and once side by side, the plugin-on run
    checked, and the once run on its own (``once_status``)."""
    # The plugin returns a budget: graph bytes plus what the profile left with the
    # process (one-time state); its graph estimate is what compares with the capture.
    report = (on or {}).get("plugin_report")
    estimate = report.get("estimate") if isinstance(report, dict) else None
    graphs_on = sum(o["driver_bytes"] for o in estimate["owners"]) if estimate else None
    one_time = estimate["one_time_bytes"] if estimate else 0
    kept_on = one_time + max(estimate["retained_bytes"], 0) if estimate else None
    est_off, budget_on = estimate_of(off), estimate_of(on)
    est_on = graphs_on if graphs_on is not None else budget_on
    act_off, act_on = mem_of(off, "capture_actual_bytes"), mem_of(on, "capture_actual_bytes")
    err_on, err_off = diff(est_on, act_on), diff(est_off, act_off)
    prof_wall, cap_wall = mem_of(on, "profile_wall_s"), mem_of(on, "capture_wall_s")
    tok_off, tok_on, tok_noest = (
        r.get("tokens") if r and r.get("ok") else None for r in (off, on, noest)
    )
    some = on or off or noest or {}
    commits = [r.get("commit") for r in (off, on, noest, once) if r]
    row: dict[str, Any] = {
        "size": size,
        "case": case,
        "capture": some.get("capture", "default"),
        "num_capture_sizes": (some.get("resolved") or {}).get("num_capture_sizes"),
        "off_switch": off_switch,
        "ran_off": bool(off and off.get("ok")),
        "ran_on": bool(on and on.get("ok")),
        "ran_noest": bool(noest and noest.get("ok")) if noest else None,
        "upstream_estimate_bytes": est_off,
        "plugin_estimate_bytes": est_on,
        "plugin_budget_bytes": budget_on,
        "plugin_kept_bytes": kept_on,
        "actual_on_bytes": act_on,
        "actual_off_bytes": act_off,
        "plugin_error_bytes": err_on,
        "plugin_error_pct": pct(err_on, act_on),
        "upstream_error_bytes": err_off,
        "upstream_error_pct": pct(err_off, act_off),
        "noest_estimate_applied_bytes": mem_of(noest, "graph_estimate_applied_bytes"),
        "actual_noest_bytes": mem_of(noest, "capture_actual_bytes"),
        "kv_cache_off_bytes": mem_of(off, "kv_cache_bytes"),
        "kv_cache_on_bytes": mem_of(on, "kv_cache_bytes"),
        "profile_capture_wall_ratio_on": (
            round(prof_wall / cap_wall, 3) if prof_wall is not None and cap_wall else None
        ),
        "tokens_equal_on_off": (tok_on == tok_off) if tok_on is not None and tok_off else None,
        "tokens_equal_noest_off": (
            (tok_noest == tok_off) if tok_noest is not None and tok_off else None
        ),
        "acceptance_off": ((off or {}).get("spec") or {}).get("acceptance_rate"),
        "acceptance_on": ((on or {}).get("spec") or {}).get("acceptance_rate"),
        "owners_on": owner_figures(report),
        "measured_utc": max(
            (r["_measured_utc"] for r in (off, on, noest, once) if r and r.get("_measured_utc")),
            default=None,
        ),
        "commit": "/".join(dict.fromkeys(commits)) if commits and all(commits) else None,
    }
    for side, r, budget in (
        ("off", off, est_off),
        ("on", on, budget_on),
        ("noest", noest, 0 if noest is not None else None),
        *[("once", once, None)] * (once is not None),  # nothing budgeted: no profile capture
    ):
        # The profile is followed by KV sizing, so what it left taken counts as much
        # as what the production capture then took.
        kept, actual = mem_of(r, "profile_driver_left_taken"), mem_of(r, "capture_actual_bytes")
        taken = kept + actual if kept is not None and actual is not None else None
        row[f"retained_{side}_bytes"] = kept
        row[f"taken_{side}_bytes"] = taken
        row[f"budget_minus_taken_{side}_bytes"] = diff(budget, taken)
        row[f"over_budget_{side}_bytes"] = over_budget_bytes((r or {}).get("mem"))
        row[f"kv_tokens_{side}"] = kv_tokens(r)
        row[f"startup_{side}_s"] = num((r or {}).get("startup_s"))
        row[f"profile_wall_{side}_s"] = mem_of(r, "profile_wall_s")
        row[f"capture_wall_{side}_s"] = mem_of(r, "capture_wall_s")
    checks: dict[str, bool | None] = {"estimate": None, "retained": None}
    checks["tokens"] = row["tokens_equal_on_off"]
    if err_on is not None and act_on is not None:
        checks["estimate"] = abs(err_on) <= max(EST_TOL_FRACTION * act_on, EST_TOL_BYTES)
    if row["retained_on_bytes"] is not None:  # one-time state is budgeted, not retained
        row["retained_on_beyond_one_time_bytes"] = row["retained_on_bytes"] - one_time
        checks["retained"] = row["retained_on_beyond_one_time_bytes"] <= RETAINED_MAX_BYTES
    row["checks"] = checks
    row["pass"] = all(v is True for v in checks.values())
    if once is not None:
        once_row(row, once, tok_off)
    row["status"] = status(
        checks,
        {
            "estimate": (
                "no estimate/actual (on)",
                f"estimate {row['plugin_error_pct'] or 0:+.1f} %",
            ),
            "retained": (
                "no retained figure (on)",
                f"retained {mib(row['retained_on_bytes'])} MiB",
            ),
            "tokens": ("tokens missing", "tokens differ"),
        },
    )
    return row


def once_row(row: dict, once: Run, tok_off: Any) -> None:
    """The once run's figures and check: FALLBACK where capture-once did not apply (the
    exact profile ran, as for on), else FAIL when over budget at rest by more than 2
    MiB, its tokens differ from off or it has over 1 % fewer KV tokens than on."""
    outcome, fallback = once.get("capture_once") or {}, once.get("capture_once_fallback")
    row |= {"ran_once": bool(once.get("ok")), "capture_once_fallback": fallback}
    row |= {f"{k}_once": outcome.get(k) for k in ("num_blocks", "max_blocks", "mapped_bytes")}
    tok_once = once.get("tokens") if once.get("ok") else None
    row["tokens_equal_once_off"] = tok_once == tok_off if tok_once is not None and tok_off else None
    over, kv_on, kv_once = (
        row[k] for k in ("over_budget_once_bytes", "kv_tokens_on", "kv_tokens_once")
    )
    checks = {"over_budget": None if over is None else over <= ONCE_OVER_MAX_BYTES}
    checks["tokens"] = row["tokens_equal_once_off"]
    enough = None if None in (kv_on, kv_once) else kv_once >= (1 - ONCE_KV_TOL_FRACTION) * kv_on
    checks["kv_tokens"] = enough
    fewer = f"KV tokens {pct(diff(kv_once, kv_on), kv_on) or 0:+.1f} % against on"
    reasons = {"over_budget": ("no over-budget figure", f"over budget {mib(over)} MiB")}
    reasons |= {"tokens": ("tokens missing", "tokens differ"), "kv_tokens": ("no KV tokens", fewer)}
    row["once_checks"] = checks
    row["once_status"] = f"FALLBACK ({fallback})" if fallback else status(checks, reasons)


def build_tp_row(
    size: str,
    case: str,
    off: Run | None,
    on: Run | None,
    off_switch: str,
    tp: int,
    noest: Run | None = None,
    once: Run | None = None,
) -> dict:
    """Each rank's off/on pair checked like a TP=1 row: the row shows the worst rank
    (failing first, then the larger estimate error, then more left taken) and
    passes only if every rank does."""

    def rank(r: Run | None, i: int) -> Run | None:
        ranks = (r or {}).get("ranks") or []
        one = ranks[i] if i < len(ranks) else {}
        keys = ("mem", "plugin_report", "capture_once", "capture_once_fallback")
        return None if r is None else r | {k: one.get(k) for k in keys}

    n = max(len((off or {}).get("ranks") or []), len((on or {}).get("ranks") or []), tp)
    subs = [
        build_row(size, case, rank(off, i), rank(on, i), off_switch, rank(noest, i), rank(once, i))
        | {"rank": i}
        for i in range(n)
    ]

    def worst_first(sub: dict) -> tuple:
        err, kept = sub.get("plugin_error_bytes"), sub.get("retained_on_bytes")
        inf = float("inf")
        return (
            sub["pass"],
            -(abs(err) if err is not None else inf),
            -(kept if kept is not None else inf),
        )

    row = dict(worst := min(subs, key=worst_first)) | {"tp": tp, "worst_rank": worst["rank"]}
    row.pop("rank")
    row["ranks"] = [
        {k: v for k, v in s.items() if k not in ("size", "case", "off_switch")} for s in subs
    ]
    for name in row["checks"]:
        values = [s["checks"][name] for s in subs]
        row["checks"][name] = False if False in values else None if None in values else True
    row["pass"] = all(s["pass"] for s in subs)
    failing = [
        f"rank {s['rank']}: {s['status'][len('FAIL (') : -1]}" for s in subs if not s["pass"]
    ]
    row["status"] = "PASS" if row["pass"] else "FAIL (" + "; ".join(failing) + ")"
    return row


def memory_rows(runs: dict[Key, Run]) -> list[dict]:
    rows = []
    for size in sorted(sorted({k[0] for k in runs}), key=group_order):
        tp = group_order(size)[-1]
        for case in CASES:
            has_off = (size, case, "off") in runs
            off_switch = "none" if (size, case, "none") in runs and not has_off else "off"
            switches = (off_switch, "on", "noest", "once")
            off, on, noest, once = (runs.get((size, case, s)) for s in switches)
            if not (off or on or noest or once):
                continue
            if tp > 1:
                rows.append(build_tp_row(size, case, off, on, off_switch, tp, noest, once))
            else:
                rows.append(build_row(size, case, off, on, off_switch, noest, once))
            # A once FAIL fails the row (on any rank); a FALLBACK does not: the exact
            # profile ran and the on checks cover it.
            for x in [row := rows[-1], *row.get("ranks", [])]:
                row["pass"] &= not x.get("once_status", "").startswith("FAIL")
    return rows


def size_meta(size: str, runs: dict[Key, Run], outdir: str) -> dict:
    mine = [r for (s, _, _), r in sorted(runs.items()) if s == size]

    def first(key: str, kind: type = dict) -> Any:
        found = (r[key] for r in mine if isinstance(r.get(key), kind) and (kind is dict or r[key]))
        return next(found, None)

    smi = None
    if os.path.exists(gpu_txt := os.path.join(outdir, "gpu.txt")):
        with open(gpu_txt) as f:
            smi = "; ".join(line.strip() for line in f if line.strip()) or None
    kw, res = first("llm_kwargs") or {}, first("resolved") or {}
    mtimes = [os.path.getmtime(r["_json"]) for r in mine if os.path.exists(r.get("_json", ""))]
    when = datetime.datetime.fromtimestamp(max(mtimes), datetime.UTC) if mtimes else None
    settings = {"model": os.path.basename(str(kw.get("model", ""))) or None}
    settings |= {k: kw.get(k) for k in SETTINGS[1:6]}
    settings["capture_sizes"] = (kw.get("compilation_config") or {}).get(
        "cudagraph_capture_sizes", "vLLM default"
    )
    settings["num_capture_sizes"] = res.get("num_capture_sizes")
    if any(r.get("allocator") == "expandable" for r in mine):
        settings["allocator"] = "expandable segments"
    if kw.get("tensor_parallel_size", 1) > 1:
        settings["tensor_parallel_size"] = kw["tensor_parallel_size"]
    return {
        "measured_utc": when.strftime("%Y-%m-%d %H:%M") if when else None,
        "gpu": (first("gpu") or {}).get("name"),
        "nvidia_smi": smi,
        "torch": first("torch", str),
        "vllm": first("vllm", str),
        "settings": settings,
    }


RUN_FIELDS = "ok stage error startup_s init_s generate_s kv_tokens mem spec plugin plugin_report"
RUN_FIELDS += " tokens tp capture workload load gpu commit capture_once capture_once_fallback"
RUN_FIELDS = words(RUN_FIELDS)


def compact_run(key: Key, r: Run) -> dict:
    out = {"size": key[0], "case": key[1], "plugin": key[2]}
    out |= {k: r[k] for k in RUN_FIELDS if k in r}
    out["measured_utc"] = r.get("_measured_utc")
    if "ranks" in r:  # tensor parallel: every rank's figures, without its log lines
        out["ranks"] = [{k: v for k, v in x.items() if k != "plugin_log"} for x in r["ranks"] or []]
    return out


def carry_over(doc: dict, prev: dict, source: str) -> None:
    """Add the rows (and group settings) of ``prev`` whose (size group, case) this
    invocation has no row for and that name the plugin commit they measured; a row
    without one is from code older than the record and is dropped."""
    here = {(r["size"], r["case"]) for r in doc["rows"]}
    for r in prev.get("rows") or []:
        if (r["size"], r["case"]) in here:
            continue
        if r.get("commit"):
            doc["rows"].append(r)
            print(f"carried over from {source}: {r['size']}/{r['case']}")
        else:
            print(f"dropped from {source}: {r['size']}/{r['case']} (no commit: older code)")
    kept = {(r["size"], r["case"]) for r in doc["rows"]}
    here_runs = {(r["size"], r["case"]) for r in doc["runs"]}
    doc["runs"] += [
        r
        for r in prev.get("runs") or []
        if (r["size"], r["case"]) not in here_runs and (r["size"], r["case"]) in kept
    ]
    for group, meta in (prev.get("sizes") or {}).items():
        if group in {size for size, _ in kept}:
            doc["sizes"].setdefault(group, meta)


# ---- the load table --------------------------------------------------------------


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def ratio(on: float | None, off: float | None) -> float | None:
    return round(on / off, 4) if on and off else None


def load_of(r: Run) -> dict[str, Any]:
    return r.get("load") or {}


def repeats_of(runs: list[Run]) -> list[dict[str, Any]]:
    """Every timed repeat of ``runs``, each with its run's round."""
    return [
        rep | {"round": round_of(r)}
        for r in runs
        for rep in (r.get("load") or {}).get("repeats") or []
    ]


def known(repeats: list[dict[str, Any]], key: str) -> list[float]:
    return [r[key] for r in repeats if r.get(key) is not None]


def rates(repeats: list[dict[str, Any]]) -> dict[str, float | None]:
    values = known(repeats, "tokens_per_s")
    return {
        "median": median(values),
        "best": max(values, default=None),
        "lowest": min(values, default=None),
    }


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


def build_load_row(
    group: str, case: str, offs: list[Run], ons: list[Run], base_offs: list[Run] | None = None
) -> dict[str, Any]:
    """One (size group, case) from its runs of every round, off and on; a run that
    did not finish adds nothing. ``base_offs``: the group's runs without a
    speculator, plugin off. Passes when every run's tokens are the same and the
    plugin's share of a step is at most MAX_SLOWDOWN (without a measured share:
    on/off of the median tokens/s at least 1 - MAX_SLOWDOWN)."""
    runs = {
        s: sorted((r for r in rs if r.get("ok")), key=round_of)
        for s, rs in (("off", offs), ("on", ons))
    }
    offs, ons = runs["off"], runs["on"]
    base_rate = rates(repeats_of([r for r in base_offs or [] if r.get("ok")]))["median"]
    reps = {s: repeats_of(rs) for s, rs in runs.items()}
    rate = {s: rates(reps[s]) for s in runs}
    step = {s: median(known(reps[s], "step_ms")) for s in runs}
    on_off = ratio(rate["on"]["median"], rate["off"]["median"])
    shares = [load_of(r).get("plugin_share") or {} for r in ons]
    share = max(
        (x["plugin_share"] for x in shares if x.get("plugin_share") is not None), default=None
    )
    share_us = max(
        (x["plugin_us_per_step"] for x in shares if x.get("plugin_us_per_step")), default=None
    )
    tagged = [(f"{s} r{round_of(r)}", r) for s, rs in runs.items() for r in rs]
    differing = None  # the runs whose tokens differ from the first off run's
    if offs and ons:
        differing = [tag for tag, r in tagged if r.get("tokens") != offs[0].get("tokens")]
    sources = {tag: src for tag, r in tagged if (src := compile_source(r))}
    spec = {}  # acceptance rate and mean length over the timed repeats of every run
    for s, rs in runs.items():
        counts = [load_of(r).get("spec") or {} for r in rs]
        drafts, draft_tokens, accepted = (
            sum(c.get(k) or 0 for c in counts)
            for k in ("drafts", "draft_tokens", "accepted_tokens")
        )
        spec[s] = (
            round(accepted / draft_tokens, 4) if draft_tokens else None,
            round(1 + accepted / drafts, 3) if drafts else None,
        )
    rounds = []
    for n in sorted({round_of(r) for r in offs + ons}):
        off, on = (
            median(known(repeats_of([r for r in rs if round_of(r) == n]), "tokens_per_s"))
            for rs in (offs, ons)
        )
        rounds.append(
            {
                "round": n,
                "tokens_per_s_off": off,
                "tokens_per_s_on": on,
                "ratio_on_off": ratio(on, off),
            }
        )
    equal = None if differing is None else not differing
    gpus = {
        s: {str(v) for r in rs if (v := (r.get("gpu") or {}).get("visible_devices"))}
        for s, rs in runs.items()
    }
    row: dict[str, Any] = {"size": group, "case": case, "runs_off": len(offs), "runs_on": len(ons)}
    row["num_requests"] = load_of((ons or offs or [{}])[0]).get("num_requests")
    row["generated_tokens"] = (reps["on"] or reps["off"] or [{}])[0].get("generated_tokens")
    row |= {"tokens_per_s_off": rate["off"], "tokens_per_s_on": rate["on"]}
    row |= {"ratio_on_off_median": on_off, "rounds": rounds}
    row |= {"step_ms_off": step["off"], "step_ms_on": step["on"]}
    row["step_ratio_on_off"] = ratio(step["on"], step["off"])
    row |= {"acceptance_off": spec["off"][0], "acceptance_on": spec["on"][0]}
    row |= {f"mean_acceptance_length_{s}": spec[s][1] for s in runs}
    row |= {"tokens_equal_on_off": equal, "tokens_differing": differing}
    row["compile_sources"] = sources or None  # kernels compiled anew may round otherwise
    row |= {
        f"repeats_equal_{s}": all(load_of(r).get("repeats_equal") for r in rs) if rs else None
        for s, rs in runs.items()
    }
    row |= {"plugin_share": share, "plugin_us_per_step": share_us}
    row["tokens_per_s_no_speculator"] = base_rate
    row["ratio_on_no_speculator"] = ratio(rate["on"]["median"], base_rate)
    row |= {f"gpu_{s}": " ".join(sorted(gpus[s])) or None for s in runs}
    row["commit"] = " ".join(sorted({r["commit"] for r in offs + ons if r.get("commit")})) or None
    row |= {f"repeats_{s}": reps[s] for s in runs}
    row["measured_utc"] = max(
        (r["_measured_utc"] for r in offs + ons if r.get("_measured_utc")), default=None
    )
    checks: dict[str, bool | None] = {"tokens": equal}
    if share is not None:
        checks["plugin_share"] = share <= MAX_SLOWDOWN
    else:
        checks["ratio"] = None if on_off is None else on_off >= 1 - MAX_SLOWDOWN
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
    elif share is None and on_off is None:
        reasons.append("no tokens/s")
    elif share is None and not checks["ratio"]:
        reasons.append(f"on/off {on_off:.3f}")
    row["status"] = "PASS" if row["pass"] else "FAIL (" + "; ".join(reasons) + ")"
    return row


def load_rows(runs: dict[Key, list[Run]]) -> list[dict]:
    """One row per (size group, case, requests per generate): runs of another request
    count are never pooled; a run that stopped before its repeats counts toward its
    case's rows, or makes a row alone."""

    def requests_of(r: Run) -> int | None:
        return (r.get("load") or {}).get("num_requests")

    def of(group: str, case: str, switch: str, n: int | None) -> list[Run]:
        return [r for r in runs.get((group, case, switch), []) if requests_of(r) == n]

    measured = {(g, c, requests_of(r)) for (g, c, _), rs in runs.items() for r in rs}
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


# ---- vllm serve ------------------------------------------------------------------


def serve_row(off: Run, on: Run) -> dict[str, Any]:
    """serve.py's off and on runs side by side, and whether they pass."""
    checks = {
        "both ran": bool(off.get("ok") and on.get("ok")),
        "tokens equal": off.get("tokens") is not None and off.get("tokens") == on.get("tokens"),
        "plugin lines in the server log": bool(on.get("log_ok") and off.get("log_ok")),
        "clean shutdown": bool(off.get("clean_shutdown") and on.get("clean_shutdown")),
    }
    failed = [name for name, ok in checks.items() if not ok]
    pairs = {
        k: [off.get(k), on.get(k)] for k in ("startup_s", "seconds", "shutdown_s", "gpu_left_mib")
    }
    return (
        {k: on.get(k) for k in ("size", "case", "graph_mode", "requests")}
        | pairs
        | {
            "log_lines_on": on.get("log_lines"),
            "checks": checks,
            "check": "PASS" if not failed else "FAIL (" + ", ".join(failed) + ")",
            "commit": on.get("commit"),
            "measured_utc": on.get("measured_utc"),
        }
    )


# ---- Markdown --------------------------------------------------------------------


def values(vals: list[Any], f: Any = str, keep: int = 2) -> str:
    """``a / b [/ c]``; trailing missing values past ``keep`` are left out."""
    while len(vals) > keep and vals[-1] is None:
        vals = vals[:-1]
    return " / ".join("-" if v is None else f(v) for v in vals)


def grid(columns: tuple[str, ...], rows: list[list[str]], text_columns: int) -> list[str]:
    """Header, alignment (the first ``text_columns`` left, the rest right), rows."""
    align = "|".join("---" if i < text_columns else "---:" for i in range(len(columns)))
    rows = [list(columns), *rows]
    lines = ["| " + " | ".join(cells) + " |" for cells in rows]
    return [lines[0], f"|{align}|", *lines[1:]]


MEMORY_COLUMNS = words(
    "size|capture sizes|case|"
    "graph estimate upstream (off) / plugin (on) / none (noest) MiB|"
    "plugin budget (on) MiB|actual off / on MiB|error upstream / plugin % (MiB)|"
    "retained after profile off / on MiB|"
    "budget - (retained + actual) off / on / noest MiB|"
    "over budget at rest off / on / noest MiB|KV tokens off / on / noest|"
    "start-up s off / on|profile / capture s off; on|tokens on = off (noest = off)|"
    "per owner est. / actual (on) MiB|measured (UTC), commit|check",
    "|",
)


def memory_cells(row: dict) -> list[str]:
    g = row.get
    sides = ("off", "on", "noest")

    def err(side: str) -> str:
        e, p = g(f"{side}_error_bytes"), g(f"{side}_error_pct")
        return "-" if e is None else (f"{p:+.1f} % " if p is not None else "") + f"({e / MiB:+.1f})"

    def walls(s: str) -> str:
        return values([g(f"profile_wall_{s}_s"), g(f"capture_wall_{s}_s")], lambda x: f"{x:.1f}")

    tokens = "-" if g("tokens_equal_on_off") is None else str(g("tokens_equal_on_off"))
    tokens += "" if g("tokens_equal_noest_off") is None else f" ({g('tokens_equal_noest_off')})"
    n, owners = g("num_capture_sizes"), g("owners_on")
    return [
        row["size"],
        f"{g('capture', 'default')}" + ("" if n is None else f" ({n})"),
        row["case"]
        + ("" if g("off_switch", "off") == "off" else f" (off={row['off_switch']})")
        + (f" [rank {row['worst_rank']} of {row['tp']}]" if "worst_rank" in row else ""),
        values(
            [
                g("upstream_estimate_bytes"),
                g("plugin_estimate_bytes"),
                g("noest_estimate_applied_bytes"),
            ],
            mib,
        ),
        mib(g("plugin_budget_bytes")),
        values([g("actual_off_bytes"), g("actual_on_bytes")], mib),
        values([err("upstream"), err("plugin")]),
        values([g("retained_off_bytes"), g("retained_on_bytes")], mib),
        values([g(f"budget_minus_taken_{s}_bytes") for s in sides], mib),
        values([g(f"over_budget_{s}_bytes") for s in sides], mib),
        values([g(f"kv_tokens_{s}") for s in sides], lambda x: f"{x:,}"),
        values([g("startup_off_s"), g("startup_on_s")], lambda x: f"{x:.1f}"),
        f"{walls('off')}; {walls('on')}",
        tokens,
        "; ".join(
            f"{k} {mib(v.get('estimate'))} / {mib(v.get('actual'))}" for k, v in owners.items()
        )
        if owners
        else "-",
        f"{g('measured_utc') or '-'}, {g('commit') or '-'}",
        row["status"],
    ]


ONCE_COLUMNS = words(
    "size|case|KV tokens off / on / once|start-up s off / on / once|"
    "over budget at rest on / once MiB|KV blocks backed / reserved (once)|tokens once = off|check",
    "|",
)


def once_cells(row: dict) -> list[str]:
    g, sides = row.get, ("off", "on", "once")
    return [
        row["size"],
        row["case"],
        values([g(f"kv_tokens_{s}") for s in sides], lambda x: f"{x:,}", 3),
        values([g(f"startup_{s}_s") for s in sides], lambda x: f"{x:.1f}", 3),
        values([g("over_budget_on_bytes"), g("over_budget_once_bytes")], mib),
        values([g("num_blocks_once"), g("max_blocks_once")], lambda x: f"{x:,}"),
        "-" if g("tokens_equal_once_off") is None else str(g("tokens_equal_once_off")),
        row["once_status"],
    ]


ONCE_NOTES = (
    "Capture once: the plugin on with `VLLM_SPECGRAPH_PROFILE=capture-once` (`PLUGIN=once`): "
    "no profile capture; the KV cache over a range reserved for the most blocks, backed "
    "after warm-up and the production capture up to the KV budget less what they took. "
    "Check: FALLBACK (the reason) where capture-once did not apply and the exact profile "
    f"ran; else over budget at rest <= {ONCE_OVER_MAX_BYTES / MiB:.0f} MiB, greedy tokens "
    f"equal to off and at most {ONCE_KV_TOL_FRACTION:.0%} fewer KV tokens than on."
)
MEMORY_NOTES = (
    "Upstream estimate: the return of `GPUModelRunner.profile_cudagraph_memory`. "
    "Plugin estimate: the graph bytes of the plugin's report; plugin budget: what "
    "the plugin returns to vLLM, the graphs plus what the profile left with the "
    "process (one-time state, such as kernels loaded by the first capture, that a "
    "second pass showed is not taken again). None: the `noest` run, plugin off and "
    "`VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=0`, so vLLM subtracts nothing for "
    "graphs. Actual: the return of `capture_model` for the production capture "
    "(driver-level free memory before minus after). Errors are estimate minus "
    "actual, in % of actual (MiB). Retained: driver-level bytes still taken when "
    "the profile returned; the check allows the plugin's one-time bytes, which its "
    "budget holds. Budget - (retained + actual): what vLLM subtracted for graphs "
    "from the KV-cache budget, minus what the profile left taken and the "
    "production capture then took; negative means the KV cache was sized too "
    "large by that much. Over budget at rest: what the started instance held "
    "(driver level, allocator cache emptied) beyond vLLM's limit minus its "
    "activation headroom (`gpu_memory_utilization * total - headroom`, counted "
    "from vLLM's start-up snapshot); positive bytes come out of the headroom the "
    "first full step needs. KV tokens: `num_gpu_blocks * block_size`. Start-up: "
    "the `LLM(...)` constructor. Profile / capture: the profile call and the "
    "production `capture_model` call, in seconds. Per owner: the plugin's own "
    "report (`runner.specgraph_profile`). Capture sizes: the set (`default`: the "
    "size's own, vLLM's default for 1b; `small`: 1, 2, 4, 8, 16, 32) and the "
    "number of sizes vLLM resolved."
)
SETTINGS = words(
    "model dtype max_num_seqs max_model_len max_num_batched_tokens gpu_memory_utilization"
    " num_capture_sizes tensor_parallel_size allocator"
)
LABELS = dict(model="", dtype="", num_capture_sizes="capture sizes: ", allocator="allocator: ")


def memory_markdown(doc: dict) -> str:
    out = ["# vLLM 0.33.0 CUDA-graph memory: vllm-specgraph off and on", ""]
    out.append(
        "Real vLLM 0.33.0 (Model Runner V2, Triton attention, dummy weights) through "
        "`scripts/device-vllm-e2e.sh`; every run in its own process. Size groups ending in "
        "`-compile`: vLLM's default graph mode (torch.compile, FULL_AND_PIECEWISE graphs); "
        "the others: compilation off, FULL graphs. "
        "Off: the plugin is loaded with `VLLM_SPECGRAPH=0` (patches nothing), so the "
        "estimate is upstream's. On: `VLLM_PLUGINS=specgraph`."
    )
    out.append("")
    for size, meta in doc["sizes"].items():
        st = meta.get("settings") or {}
        parts = [f"{LABELS.get(k, k + ' ')}{st[k]}" for k in SETTINGS if st.get(k) is not None]
        where = meta.get("nvidia_smi") or meta.get("gpu") or "an unrecorded GPU"
        out.append(
            f"* `{size}` ({', '.join(parts)}): last measured {meta.get('measured_utc')} UTC "
            f"on {where}, torch {meta.get('torch')}, vLLM {meta.get('vllm')}."
        )
    out += ["", *grid(MEMORY_COLUMNS, [memory_cells(row) for row in doc["rows"]], 3), ""]
    if doc.get("skipped"):
        out += [f"Not run (the script's time budget ran out): {', '.join(doc['skipped'])}.", ""]
    t = doc["targets"]
    out.append(
        f"Check (plugin on): |estimate - actual| <= max({t['estimate_tolerance_fraction']:.0%}"
        f" of actual, {t['estimate_tolerance_bytes'] / MiB:.0f} MiB); driver-level memory "
        f"still taken after the profile returned <= {t['retained_max_bytes'] / MiB:.0f} MiB; "
        "greedy tokens equal to the plugin-off run."
    )
    if once := [row for row in doc["rows"] if "once_status" in row]:
        out += ["", ONCE_NOTES, "", *grid(ONCE_COLUMNS, [once_cells(row) for row in once], 2)]
    return "\n".join([*out, "", MEMORY_NOTES]) + "\n"


LOAD_COLUMNS = words(
    "size|case|requests|runs off / on|tokens/s off: median (lowest - best)|"
    "tokens/s on: median (lowest - best)|on / off (medians)|on / off per round|"
    "engine step ms off / on (median)|step on / off|acceptance off / on|"
    "on / no speculator|plugin share of a step (us)|tokens equal (all runs)|check|commit|"
    "measured (UTC)",
    "|",
)


def load_cells(row: dict[str, Any]) -> list[str]:
    def r3(x: float | None) -> str:
        return "-" if x is None else f"{x:.3f}"

    def rates_cell(rates: dict[str, float | None]) -> str:  # schema 1 kept no lowest repeat
        median, lowest, best = rates.get("median"), rates.get("lowest"), rates.get("best")
        cell = "-" if median is None else f"{median:,.0f}"
        if best is not None:
            cell += f" ({'best ' if lowest is None else f'{lowest:,.0f} - '}{best:,.0f})"
        return cell

    share, us = row["plugin_share"], row["plugin_us_per_step"]
    rounds = ", ".join(f"r{r['round']} {r3(r['ratio_on_off'])}" for r in row["rounds"] or [])
    return [
        row["size"],
        row["case"],
        "-" if row["num_requests"] is None else str(row["num_requests"]),
        f"{row['runs_off']} / {row['runs_on']}",
        rates_cell(row["tokens_per_s_off"]),
        rates_cell(row["tokens_per_s_on"]),
        r3(row["ratio_on_off_median"]),
        rounds or "-",
        values([row["step_ms_off"], row["step_ms_on"]], lambda x: f"{x:.2f}"),
        r3(row["step_ratio_on_off"]),
        values([row["acceptance_off"], row["acceptance_on"]], r3),
        r3(row["ratio_on_no_speculator"]),
        "-" if share is None else f"{share:.3%}" + ("" if us is None else f" ({us:.0f})"),
        "-" if row["tokens_equal_on_off"] is None else str(row["tokens_equal_on_off"]),
        row["status"],
        row["commit"] or "-",
        row["measured_utc"] or "-",
    ]


def load_markdown(doc: dict[str, Any]) -> str:
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
        *grid(LOAD_COLUMNS, [load_cells(row) for row in doc["rows"]], 2),
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


def serve_markdown(rows: list[dict[str, Any]]) -> str:
    def pair(vals: list[Any]) -> str:
        return values(vals, lambda v: f"{v:.1f}" if isinstance(v, float) else f"{v}")

    head = (
        "| size | graphs | speculator | requests, all at once | ready after s off / on "
        "| completions s off / on | SIGINT to exit s off / on | GPU MiB left off / on "
        "| check | measured (UTC), commit |\n|---|---|---|---:|---:|---:|---:|---:|---|---|\n"
    )
    lines = [
        f"| {r['size']} | {r['graph_mode']} | {r['case']} | {r['requests']} "
        f"| {pair(r['startup_s'])} | {pair(r['seconds'])} | {pair(r['shutdown_s'])} "
        f"| {pair(r['gpu_left_mib'])} | {r['check']} | {r['measured_utc']}, {r['commit']} |"
        for r in rows
    ]
    return head + "\n".join(lines) + "\n"


def write(results: str, name: str, doc: dict[str, Any], markdown: str, end: str = "\n") -> None:
    os.makedirs(results, exist_ok=True)
    with open(os.path.join(results, f"{name}.json"), "w") as f:
        f.write(json.dumps(doc, indent=1) + end)
    with open(os.path.join(results, f"{name}.md"), "w") as f:
        f.write(markdown)
    print(f"wrote {results}/{name}.json and .md ({len(doc['rows'])} rows)")


# ---- printing --------------------------------------------------------------------


def figures(m: dict) -> str:
    return (
        f"graph memory MiB: estimate={mib(num(m.get('profile_estimate_bytes')))}"
        f" actual={mib(num(m.get('capture_actual_bytes')))} | after profiling still taken "
        f"(driver): {mib(num(m.get('profile_driver_left_taken')))}"
        f" | KV cache MiB: {mib(num(m.get('kv_cache_bytes')))}"
    )


def print_run(tag: str, r: Run) -> None:
    """One run: what it resolved, its figures, the plugin's state, each rank's at TP > 1
    (the device script printed the run's log lines as it ended)."""
    m, res = r.get("mem") or {}, r.get("resolved") or {}
    if not r.get("ok"):
        print(f"[{tag}] FAILED at stage {r.get('stage')}: {(r.get('error') or '')[:400]}")
        for line in (r.get("traceback") or "").strip().splitlines()[-6:]:
            print(f"    {line[:200]}")
    else:
        runner = res.get("runner_class", "?").rsplit(".", 1)[-1]
        print(
            f"[{tag}] ok  runner={runner} spec={res.get('spec_method')} speculator="
            f"{res.get('speculator_class')} cg={res.get('cudagraph_mode')} sizes="
            f"{res.get('num_capture_sizes')} attn={res.get('attn_backend')}"
        )
        print(
            f"    timings s: import={r.get('import_s')} startup={r.get('startup_s')} profile="
            f"{m.get('profile_wall_s')} capture={m.get('capture_wall_s')} generate="
            f"{r.get('generate_s')} | shim ops called: {r.get('shim_calls')} | KV tokens "
            f"{kv_tokens(r)} | spec decode: {r.get('spec')}"
        )
    if m or (r.get("ok") and "ranks" not in r):
        print(f"    {figures(m)}")
    if once := r.get("capture_once_fallback") or r.get("capture_once"):
        print(f"    capture-once: {once}")
    for who, x in [("", r)] + [(f"rank {x.get('rank')} ", x) for x in r.get("ranks") or []]:
        p = x.get("plugin") if isinstance(x.get("plugin"), dict) else {}
        if who:
            print(
                f"    {who}(pid {x.get('pid')}, {x.get('start_method')}): "
                f"{figures(x.get('mem') or {})} | env: {x.get('env')} | shim ops called: "
                f"{x.get('shim_calls')}"
            )
        if p:
            print(
                f"    {who}plugin: switch={p.get('switch')} env={p.get('env')} loaded="
                f"{p.get('loaded')} as expected={p.get('loaded_as_expected')} from="
                f"{p.get('module_file')} wrappers intact="
                f"{p.get('wrappers_intact', x.get('wrappers_intact'))}"
                f" report={'yes' if x.get('plugin_report') else 'no'}"
            )


def compare_tokens(runs: dict[Key, Run]) -> bool | None:
    """Greedy speculative outputs against the baseline of the same size group and
    switch (the -peak groups sample, so they are left out); None: nothing compared."""
    all_eq: bool | None = None
    for size in sorted(sorted({k[0] for k in runs}), key=group_order):
        for switch in SWITCHES if "peak" not in size.partition("-tp")[0].split("-") else ():
            base = runs.get((size, "base", switch))
            if not base or not base.get("ok"):
                continue
            bt = base["tokens"]
            print(
                f"baseline {size}/{switch}: {len(bt)} prompts, {sum(map(len, bt))} tokens; "
                f"first: {bt[0][:12]}"
            )
            for case in CASES[1:]:
                if (r := runs.get((size, case, switch))) and r.get("ok"):
                    same = r["tokens"] == bt
                    all_eq = same if all_eq is None else all_eq and same
                    diff = [
                        i for i, (a, b) in enumerate(zip(bt, r["tokens"], strict=False)) if a != b
                    ]
                    print(
                        f"TOKENS {size} {switch} {case} == base: {same}"
                        + ("" if same else f" (prompts differing: {diff})")
                    )
    return all_eq


def print_rows(label: str, rows: list[dict], columns: tuple, cells: Any, first: int) -> None:
    """Each row's check, then its cells from column ``first`` on."""
    for r in rows:
        named = dict(zip(columns, cells(r), strict=True))
        print(f"[{label}{r['size']}/{r['case']}] {named['check']}")
        for col in columns[first:-1]:
            print(f"    {col}: {named[col]}")


def read(path: str | None, schemas: tuple[int, ...] | None = None) -> dict | None:
    """An earlier table of a schema this module reads, or a serve.py run; None if absent."""
    if not path or not os.path.exists(path):
        return None
    with open(path) as f:
        doc = json.load(f)
    return doc if schemas is None or doc.get("schema") in schemas else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("outdir", nargs="?")
    ap.add_argument("--results", help="where to write the tables (default OUTDIR/bench/results)")
    ap.add_argument("--previous", help="an earlier vllm_graph_memory.json to carry rows from")
    ap.add_argument("--serve", nargs=2, metavar=("OFF", "ON"), help="serve.py's two results")
    args = ap.parse_args(argv)
    if args.serve:
        off, on = ((read(p) or {"ok": False, "error": f"no result in {p}"}) for p in args.serve)
        row, title = serve_row(off, on), "# `vllm serve`: vllm-specgraph off and on\n\n"
        text = serve_markdown([row])
        write(args.results, "vllm_serve", {"rows": [row]}, title + text, end="")
        print(text + f"plugin lines in the on run's server log: {row['log_lines_on']}")
        return 0 if row["check"] == "PASS" else 1
    results = args.results or os.path.join(args.outdir, "bench", "results")
    memory, load = load_runs(args.outdir)
    skipped: list[str] = []
    if os.path.exists(path := os.path.join(args.outdir, "skipped.txt")):
        with open(path) as f:
            skipped = [line.strip() for line in f if line.strip()]
    title = "vLLM 0.33.0 end-to-end on the GPU (MRV2, Triton attention)"
    print("=" * 72, title, "=" * 72, sep="\n")
    if not memory and not load:
        print(f"no run results in {args.outdir}")
    every = [(key, memory[key]) for key in sorted(memory, key=key_order)]
    for key in sorted(load, key=key_order):
        every += [((*key, "load", f"round {round_of(r)}"), r) for r in load[key]]
    for key, r in every:
        print_run("/".join(key), r)
    spec_eq = compare_tokens(memory)

    rows = memory_rows(memory)
    targets = {"estimate_tolerance_fraction": EST_TOL_FRACTION}
    targets |= {"estimate_tolerance_bytes": EST_TOL_BYTES, "retained_max_bytes": RETAINED_MAX_BYTES}
    doc = {"schema": 2, "generated_utc": now_utc(), "targets": targets}
    doc["sizes"] = {s: size_meta(s, memory, args.outdir) for s in sorted({k[0] for k in memory})}
    doc |= {"rows": list(rows), "runs": [compact_run(k, r) for k, r in sorted(memory.items())]}
    doc["skipped"] = skipped
    if prev := read(args.previous, (1, 2)):  # schema 1 lacks newer fields: shown as "-"
        carry_over(doc, prev, args.previous)
    doc["sizes"] = dict(sorted(doc["sizes"].items(), key=lambda kv: group_order(kv[0])))
    doc["rows"].sort(key=lambda r: key_order((r["size"], r["case"])))
    print("-" * 72, "plugin off vs on (MiB unless stated)", sep="\n")
    rows.sort(key=lambda r: key_order((r["size"], r["case"])))
    print_rows("", rows, MEMORY_COLUMNS, memory_cells, 3)
    print_rows("once ", [r for r in rows if "once_status" in r], ONCE_COLUMNS, once_cells, 2)
    write(results, "vllm_graph_memory", doc, memory_markdown(doc))

    if loads := load_rows(load):
        print_rows("load ", loads, LOAD_COLUMNS, load_cells, 2)
        all_loads = list(loads)
        previous = args.previous and os.path.join(os.path.dirname(args.previous), "vllm_load.json")
        if prev := read(previous, (3,)):  # rows of this schema that name their commit
            here = {(r["size"], r["case"], r["num_requests"]) for r in loads}
            for r in prev.get("rows", []):
                if r.get("commit") and (r["size"], r["case"], r["num_requests"]) not in here:
                    all_loads.append(r)
        load_doc = {"schema": 3, "generated_utc": now_utc(), "max_slowdown": MAX_SLOWDOWN}
        load_doc["rows"] = all_loads
        write(results, "vllm_load", load_doc, load_markdown(load_doc))
    if skipped:
        print(f"skipped for lack of time: {' '.join(skipped)}")
    ran = bool(every) and not skipped and all(r.get("ok") for _, r in every)
    mine = rows + loads  # this invocation's rows decide
    passed = sum(r["pass"] for r in mine)
    print(
        f"SUMMARY: all runs ok={ran} ({sum(bool(r.get('ok')) for _, r in every)}/{len(every)}),"
        f" rows PASS={passed}/{len(mine)}, speculative outputs equal baseline={spec_eq}"
    )
    return 0 if ran and mine and passed == len(mine) else 1


if __name__ == "__main__":
    sys.exit(main())
