# SPDX-License-Identifier: Apache-2.0
"""Summarise the run_llm.py results: one block per run (with vLLM's own log
lines), greedy-token comparisons, then one table with vllm-specgraph off and on
side by side per (size, case), checked against the targets.

    python3 summarize.py OUTDIR [--results DIR] [--previous FILE]

Reads every OUTDIR/*.json written by run_llm.py (SIZE-CASE-PLUGIN[-...].json,
and the older CASE.json of runs with plugins off) and the .log next to it. Runs
named in OUTDIR/skipped.txt (the device script's runs that did not fit its time
budget) count as not run. Writes DIR/vllm_graph_memory.json and .md (DIR
defaults to OUTDIR/bench/results): the off/on/noest table of the smoke runs;
the load runs (``workload`` load; every round of a case in one row) go to
DIR/vllm_load.json and .md (``summarize_load.py``).
With --previous (an earlier vllm_graph_memory.json; its directory's
vllm_load.json too), the rows of (size group, case) pairs that this OUTDIR has
no run for are carried over, each with the date and commit it was measured
on, so that several invocations end in one table. Exits 0 only if every run ran
and every row passed.

Size groups: the size, ``-small`` for the small capture-size set, ``-tpN`` at
tensor parallelism N (e.g. ``1b``, ``1b-small``, ``tiny-tp2``).

Tensor-parallel runs (``tp`` > 1 in the result, ``--tp`` of run_llm.py) carry
one record per rank under ``ranks``. They form their own group, ``SIZE-tpN``
(e.g. ``tiny-tp2``), next to the TP=1 rows of that size. Their row is checked
on every rank and shows the worst rank's figures; every rank's figures are in
the row's ``ranks`` in the JSON.
"""

from __future__ import annotations

import argparse
import datetime
import glob
import json
import os
import re
import sys
from typing import Any, TypedDict

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import memory_budget  # noqa: E402  (this directory, made importable just above)
import summarize_load  # noqa: E402
import summarize_table  # noqa: E402
from results_files import write_json_and_markdown  # noqa: E402

MiB = 1 << 20
SIZES = ("tiny", "1b", "8b")
CASES = ("base", "draft", "accept", "ngram", "eagle")
SPEC_CASES = ("draft", "accept", "ngram", "eagle")
SWITCHES = ("off", "on", "none", "noest")
RESULTS_NAME = "vllm_graph_memory"
SCHEMA = 2
READABLE_SCHEMAS = (1, 2)  # rows of schema 1 lack the newer fields: shown as "-"
# Targets for the plugin-on run of every (size, case).
EST_TOL_FRACTION = 0.01
EST_TOL_BYTES = 2 * MiB
RETAINED_MAX_BYTES = 2 * MiB
LOG_PATTERNS = (
    r"CUDA graph pool memory: .*",
    r"Graph capturing finished in .*",
    r"Available KV cache memory: .*",
    r"GPU KV cache size: .*",
    r"Model loading took .*",
)
PLUGIN_LOG_PREFIX = "SPECGRAPH-LOG"
PLUGIN_LOG_SHOWN = 8
# Plausible field names in the plugin's report for an owner's estimate and actual.

Run = dict[str, Any]
Key = tuple[str, str, str]


class Kinds(TypedDict):
    """The runs of each table (:func:`kind_of`), keyed (size group, case,
    plugin switch); a load case runs each switch once per round, so its key
    holds a list, in round order."""

    memory: dict[Key, Run]
    load: dict[Key, list[Run]]


def mib(x: float | None, digits: int = 1) -> str:
    if x is None:
        return "-"
    return f"{x / MiB:.{digits}f}"


def num(x: Any) -> float | None:
    return x if isinstance(x, int | float) and not isinstance(x, bool) else None


def group_of(
    size: str,
    tp: Any,
    capture: Any = "default",
    workload: Any = "smoke",
    allocator: Any = "default",
    graph_mode: Any = "full",
    utilization: Any = None,
) -> str:
    """The table's size label: the size, then ``-small`` for the small
    capture-size set, ``-compile`` for vLLM's default graph mode (torch.compile,
    FULL_AND_PIECEWISE), ``-expandable`` for runs with the allocator's expandable
    segments, ``-peak`` for the full-step workload, ``-utilU`` for a
    ``gpu_memory_utilization`` the run was given, ``-tpN`` at TP=N > 1."""
    group = size
    if capture not in (None, "default"):
        group += f"-{capture}"
    if graph_mode not in (None, "full"):
        group += f"-{graph_mode}"
    if allocator not in (None, "default"):
        group += f"-{allocator}"
    if workload == "peak":
        group += "-peak"
    if utilization is not None:
        group += f"-util{utilization}"
    return group if not isinstance(tp, int) or tp <= 1 else f"{group}-tp{tp}"


def split_group(group: str) -> tuple[str, int]:
    """(the label without its TP part, TP)."""
    size, _, tp = group.partition("-tp")
    return size, int(tp) if tp.isdigit() else 1


def group_order(group: str) -> tuple[int, bool, bool, bool, bool, bool, int]:
    label, tp = split_group(group)
    size, *parts = label.split("-")
    return (
        SIZES.index(size) if size in SIZES else 99,
        "compile" in parts,
        "peak" in parts,
        any(part.startswith("util") for part in parts),
        "small" in parts,
        "expandable" in parts,
        tp,
    )


def kind_of(r: Run) -> str:
    """Which table a run belongs to: ``load`` or ``memory``."""
    return "load" if r.get("workload") == "load" else "memory"


def load_runs(outdir: str) -> Kinds:
    """Every run result in ``outdir``, by kind."""
    runs = Kinds(memory={}, load={})
    for path in sorted(glob.glob(os.path.join(outdir, "*.json"))):
        try:
            with open(path) as f:
                r = json.load(f)
        except (OSError, ValueError):
            continue
        if not isinstance(r, dict) or r.get("case") not in CASES:
            continue
        if r.get("size", "tiny") not in SIZES:
            continue
        plugin = r.get("plugin")
        # Runs from before the plugin switch existed had VLLM_PLUGINS= (nothing loaded).
        switch = plugin.get("switch", "none") if isinstance(plugin, dict) else "none"
        r["_json"] = path
        r["_log"] = path[: -len(".json")] + ".log"
        # The run's own clock; a result from before runs kept it: the file's time.
        when = datetime.datetime.fromtimestamp(os.path.getmtime(path), datetime.UTC)
        r["_measured_utc"] = r.get("measured_utc") or when.strftime("%Y-%m-%d %H:%M")
        kind = kind_of(r)
        group = group_of(
            r.get("size", "tiny"),
            r.get("tp"),
            r.get("capture"),
            r.get("workload") if kind == "memory" else None,  # the load table implies its own
            r.get("allocator"),
            r.get("graph_mode"),
            r.get("utilization"),
        )
        key = (group, r["case"], switch)
        if kind == "load":
            runs["load"].setdefault(key, []).append(r)
        else:
            runs[kind][key] = r
    for rounds in runs["load"].values():
        rounds.sort(key=summarize_load.round_of)
    return runs


def key_order(key: Key) -> tuple:
    return (group_order(key[0]), CASES.index(key[1]), key[2])


def every_run(kinds: Kinds) -> list[tuple[str, Key, Run]]:
    """(kind, key, run) of every run: the memory and load runs, each by key, a
    load key's runs in round order."""
    memory = kinds["memory"]
    out = [("memory", key, memory[key]) for key in sorted(memory, key=key_order)]
    load = kinds["load"]
    return out + [("load", key, r) for key in sorted(load, key=key_order) for r in load[key]]


def mem_of(r: Run | None, key: str) -> float | None:
    if not r or not isinstance(r.get("mem"), dict):
        return None
    return num(r["mem"].get(key))


def estimate_of(r: Run | None) -> float | None:
    """What vLLM's profile returned; else what the worker kept (if the profile
    method was replaced by something the wrapper did not see)."""
    est = mem_of(r, "profile_estimate_bytes")
    if est is None:
        w = mem_of(r, "worker_cudagraph_memory_estimate")
        est = w if w is not None and w >= 0 else None
    return est


def kv_tokens(r: Run | None) -> int | None:
    if not r:
        return None
    if num(r.get("kv_tokens")) is not None:
        return int(r["kv_tokens"])
    res = r.get("resolved") or {}
    blocks, bs = num(res.get("num_gpu_blocks")), num(res.get("block_size"))
    return int(blocks * bs) if blocks is not None and bs is not None else None


def owner_figures(report: Any) -> dict[str, dict[str, float | None]]:
    """Per-owner driver bytes, estimated and actual, from the plugin's report
    (``SpecgraphCapture.to_dict()``: ``estimate.owners`` and ``actual``)."""
    out: dict[str, dict[str, float | None]] = {}
    if not isinstance(report, dict):
        return out
    sections = (
        ("estimate", (report.get("estimate") or {}).get("owners")),
        ("actual", report.get("actual")),
    )
    for key, owners in sections:
        for owner in owners or ():
            slot = out.setdefault(owner["owner"], {"estimate": None, "actual": None})
            slot[key] = owner["driver_bytes"]
    return out


def pct(err: float | None, base: float | None) -> float | None:
    if err is None or not base:
        return None
    return 100.0 * err / base


def plugin_kept(report: Any) -> tuple[float | None, float | None, float]:
    """(graph bytes, bytes budgeted as kept by the process, of which one-time) from
    the plugin's report."""
    estimate = (report or {}).get("estimate") if isinstance(report, dict) else None
    if not estimate:
        return None, None, 0
    graphs = sum(o["driver_bytes"] for o in estimate["owners"])
    one_time = estimate["one_time_bytes"]
    return graphs, one_time + max(estimate["retained_bytes"], 0), one_time


def rank_view(r: Run | None, index: int) -> Run | None:
    """A tensor-parallel run as seen from one rank: that rank's figures and
    plugin report, with the run's own fields (tokens, KV tokens, start-up)."""
    if r is None:
        return None
    ranks = r.get("ranks") or []
    rank = ranks[index] if index < len(ranks) else {}
    return r | {"mem": rank.get("mem"), "plugin_report": rank.get("plugin_report")}


def rank_worst_first(sub: dict) -> tuple:
    """Sort key: failing ranks first, then the larger estimate error and the
    more memory left taken after the profile."""
    err = sub.get("plugin_error_bytes")
    kept = sub.get("retained_on_bytes")
    return (
        bool(sub["pass"]),
        -(abs(err) if err is not None else float("inf")),
        -(kept if kept is not None else float("inf")),
    )


def build_tp_row(
    size: str,
    case: str,
    off: Run | None,
    on: Run | None,
    off_switch: str,
    tp: int,
    noest: Run | None = None,
) -> dict:
    """One row for a tensor-parallel (size, case): each rank's off/on pair is
    checked like a TP=1 row; the row shows the worst rank and passes only if
    every rank does."""
    n = max(len((off or {}).get("ranks") or []), len((on or {}).get("ranks") or []), tp)
    subs = []
    for i in range(n):
        sub = build_row(
            size, case, rank_view(off, i), rank_view(on, i), off_switch, rank_view(noest, i)
        )
        sub["rank"] = i
        subs.append(sub)
    worst = min(subs, key=rank_worst_first)
    row = dict(worst)
    row["tp"] = tp
    row["worst_rank"] = worst["rank"]
    row.pop("rank")
    row["ranks"] = [
        {k: v for k, v in sub.items() if k not in ("size", "case", "off_switch")} for sub in subs
    ]
    checks: dict[str, bool | None] = {}
    for name in worst["checks"]:
        values = [sub["checks"][name] for sub in subs]
        checks[name] = (
            False if any(v is False for v in values) else None if None in values else True
        )
    row["checks"] = checks
    row["pass"] = all(sub["pass"] for sub in subs)
    failing = [sub for sub in subs if not sub["pass"]]
    row["status"] = (
        "PASS"
        if row["pass"]
        else "FAIL ("
        + "; ".join(f"rank {sub['rank']}: {sub['status'][len('FAIL (') : -1]}" for sub in failing)
        + ")"
    )
    return row


def side_figures(row: dict, side: str, run_: Run | None, budget: float | None) -> None:
    """What the KV-cache budget had to leave, for one switch: the profile is
    followed by KV sizing, so what it left taken counts as much as what the
    production capture then took; and what the started instance held beyond
    vLLM's limit (``memory_budget.over_budget_bytes``)."""
    kept = mem_of(run_, "profile_driver_left_taken")
    actual = mem_of(run_, "capture_actual_bytes")
    taken = kept + actual if kept is not None and actual is not None else None
    row[f"retained_{side}_bytes"] = kept
    row[f"taken_{side}_bytes"] = taken
    row[f"budget_minus_taken_{side}_bytes"] = (
        budget - taken if budget is not None and taken is not None else None
    )
    row[f"over_budget_{side}_bytes"] = memory_budget.over_budget_bytes((run_ or {}).get("mem"))
    row[f"kv_tokens_{side}"] = kv_tokens(run_)
    row[f"startup_{side}_s"] = num((run_ or {}).get("startup_s"))
    row[f"profile_wall_{side}_s"] = mem_of(run_, "profile_wall_s")
    row[f"capture_wall_{side}_s"] = mem_of(run_, "capture_wall_s")


def tokens_of(r: Run | None) -> Any:
    return r.get("tokens") if r and r.get("ok") else None


def build_row(
    size: str,
    case: str,
    off: Run | None,
    on: Run | None,
    off_switch: str,
    noest: Run | None = None,
) -> dict:
    est_off, budget_on = estimate_of(off), estimate_of(on)
    # The plugin returns a budget: graph bytes plus what the profile left with the
    # process (one-time state such as lazily loaded kernels). Its graph estimate is
    # what compares with the production capture.
    graphs_on, kept_on, one_time_on = plugin_kept((on or {}).get("plugin_report"))
    est_on = graphs_on if graphs_on is not None else budget_on
    act_off = mem_of(off, "capture_actual_bytes")
    act_on = mem_of(on, "capture_actual_bytes")
    err_on = est_on - act_on if est_on is not None and act_on is not None else None
    err_off = est_off - act_off if est_off is not None and act_off is not None else None
    prof_wall, cap_wall = mem_of(on, "profile_wall_s"), mem_of(on, "capture_wall_s")
    tok_off, tok_on, tok_noest = tokens_of(off), tokens_of(on), tokens_of(noest)
    some = on or off or noest or {}
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
        # With VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=0 vLLM subtracts nothing.
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
        "owners_on": owner_figures((on or {}).get("plugin_report")),
        "measured_utc": max(
            (r["_measured_utc"] for r in (off, on, noest) if r and r.get("_measured_utc")),
            default=None,
        ),
        "commit": commit_of(off, on, noest),
    }
    noest_budget = 0 if noest is not None else None
    for side, run_, budget in (("off", off, est_off), ("on", on, budget_on)):
        side_figures(row, side, run_, budget)
    side_figures(row, "noest", noest, noest_budget)
    checks: dict[str, bool | None] = {
        "estimate": None,
        "retained": None,
        "tokens": row["tokens_equal_on_off"],
    }
    if err_on is not None and act_on is not None:
        checks["estimate"] = abs(err_on) <= max(EST_TOL_FRACTION * act_on, EST_TOL_BYTES)
    if row["retained_on_bytes"] is not None:
        # One-time process state that a second pass proved it would not take again
        # is budgeted, not retained.
        row["retained_on_beyond_one_time_bytes"] = row["retained_on_bytes"] - one_time_on
        checks["retained"] = row["retained_on_beyond_one_time_bytes"] <= RETAINED_MAX_BYTES
    row["checks"] = checks
    row["pass"] = all(v is True for v in checks.values())
    reasons = []
    if checks["estimate"] is None:
        reasons.append("no estimate/actual (on)")
    elif not checks["estimate"]:
        reasons.append(f"estimate {row['plugin_error_pct']:+.1f} %")
    if checks["retained"] is None:
        reasons.append("no retained figure (on)")
    elif not checks["retained"]:
        reasons.append(f"retained {mib(row['retained_on_bytes'])} MiB")
    if checks["tokens"] is None:
        reasons.append("tokens missing")
    elif not checks["tokens"]:
        reasons.append("tokens differ")
    row["status"] = "PASS" if row["pass"] else "FAIL (" + "; ".join(reasons) + ")"
    return row


def commit_of(*runs: Run | None) -> str | None:
    """The plugin commit the runs measured; several joined, none if any run lacks it."""
    commits = [r.get("commit") for r in runs if r]
    if not commits or not all(commits):
        return None
    return "/".join(dict.fromkeys(commits))


def size_meta(size: str, runs: dict[Key, Run], outdir: str) -> dict:
    mine = [r for (s, _, _), r in sorted(runs.items()) if s == size]
    gpu = next((r["gpu"] for r in mine if isinstance(r.get("gpu"), dict)), {})
    gpu_txt = os.path.join(outdir, "gpu.txt")
    smi = None
    if os.path.exists(gpu_txt):
        with open(gpu_txt) as f:
            smi = "; ".join(line.strip() for line in f if line.strip()) or None
    kw = next((r["llm_kwargs"] for r in mine if isinstance(r.get("llm_kwargs"), dict)), {})
    res = next((r["resolved"] for r in mine if isinstance(r.get("resolved"), dict)), {})
    cc = kw.get("compilation_config") or {}
    # When the last run of this size wrote its result.
    mtimes = [os.path.getmtime(r["_json"]) for r in mine if os.path.exists(r.get("_json", ""))]
    when = datetime.datetime.fromtimestamp(max(mtimes), datetime.UTC) if mtimes else None
    return {
        "measured_utc": when.strftime("%Y-%m-%d %H:%M") if when else None,
        "gpu": gpu.get("name"),
        "nvidia_smi": smi,
        "torch": next((r.get("torch") for r in mine if r.get("torch")), None),
        "vllm": next((r.get("vllm") for r in mine if r.get("vllm")), None),
        "settings": {
            "model": os.path.basename(str(kw.get("model", ""))) or None,
            "dtype": kw.get("dtype"),
            "max_num_seqs": kw.get("max_num_seqs"),
            "max_model_len": kw.get("max_model_len"),
            "max_num_batched_tokens": kw.get("max_num_batched_tokens"),
            "gpu_memory_utilization": kw.get("gpu_memory_utilization"),
            "capture_sizes": cc.get("cudagraph_capture_sizes", "vLLM default"),
            "num_capture_sizes": res.get("num_capture_sizes"),
        }
        | (
            {"allocator": "expandable segments"}
            if any(r.get("allocator") == "expandable" for r in mine)
            else {}
        )
        | (
            {"tensor_parallel_size": kw["tensor_parallel_size"]}
            if kw.get("tensor_parallel_size", 1) > 1
            else {}
        ),
    }


def compact_run(key: Key, r: Run) -> dict:
    keep = (
        "ok",
        "stage",
        "error",
        "startup_s",
        "init_s",
        "generate_s",
        "kv_tokens",
        "mem",
        "spec",
        "plugin",
        "plugin_report",
        "tokens",
        "tp",
        "capture",
        "workload",
        "load",
        "gpu",
        "commit",
    )
    out = {"size": key[0], "case": key[1], "plugin": key[2]} | {k: r.get(k) for k in keep if k in r}
    out["measured_utc"] = r.get("_measured_utc")
    if "ranks" in r:  # tensor parallel: every rank's figures, without its log lines
        out["ranks"] = [
            {k: v for k, v in rank.items() if k != "plugin_log"} for rank in r.get("ranks") or []
        ]
    return out


# ---- printing --------------------------------------------------------------


def print_ranks(r: Run) -> None:
    """Tensor parallel: each rank's figures, plugin state, environment and
    stand-in op counts (each rank is its own process)."""
    for rank in r.get("ranks") or []:
        m = rank.get("mem") or {}
        p = rank.get("plugin") or {}
        print(
            f"    rank {rank.get('rank')} (pid {rank.get('pid')}, {rank.get('start_method')}):"
            f" graph memory MiB: estimate={mib(num(m.get('profile_estimate_bytes')))}"
            f" actual={mib(num(m.get('capture_actual_bytes')))}"
            " | after profiling still taken (driver): "
            f"{mib(num(m.get('profile_driver_left_taken')))}"
            f" | KV cache MiB: {mib(num(m.get('kv_cache_bytes')))}"
            f" | profile={m.get('profile_wall_s')} s capture={m.get('capture_wall_s')} s"
        )
        if p or rank.get("wrappers_intact") is not None:
            print(
                f"      plugin loaded={p.get('loaded')} as expected={p.get('loaded_as_expected')}"
                f" from={p.get('module_file')} wrappers intact={rank.get('wrappers_intact')}"
                f" report={'yes' if rank.get('plugin_report') else 'no'}"
            )
        if rank.get("env") is not None:
            print(f"      env: {rank.get('env')}")
        if rank.get("shim_calls") is not None:
            print(f"      shim ops called: {rank.get('shim_calls')}")
        for line in (rank.get("plugin_log") or [])[:PLUGIN_LOG_SHOWN]:
            print(f"      {PLUGIN_LOG_PREFIX} {line[:200]}")


def print_run(key: tuple[str, ...], r: Run) -> None:
    tag = "/".join(key)
    if not r.get("ok"):
        err = (r.get("error") or "")[:400]
        print(f"[{tag}] FAILED at stage {r.get('stage')}: {err}")
        for line in (r.get("traceback") or "").strip().splitlines()[-6:]:
            print(f"    {line[:200]}")
        m = r.get("mem") or {}
        if m:
            print(
                "    (before failing) graph memory MiB: "
                f"estimate={mib(num(m.get('profile_estimate_bytes')))}"
                f" actual={mib(num(m.get('capture_actual_bytes')))}"
                f" left taken after profiling={mib(num(m.get('profile_driver_left_taken')))}"
            )
    else:
        m = r.get("mem", {})
        res = r.get("resolved", {})
        print(
            f"[{tag}] ok  runner={res.get('runner_class', '?').rsplit('.', 1)[-1]}"
            f" spec={res.get('spec_method')} speculator={res.get('speculator_class')}"
            f" cg={res.get('cudagraph_mode')} sizes={res.get('num_capture_sizes')}"
            f" attn={res.get('attn_backend')}"
        )
        if "ranks" in r:  # tensor parallel: the figures are per rank, below
            print(f"    tensor parallel: {len(r['ranks'])} ranks, KV tokens {kv_tokens(r)}")
        else:
            print(
                f"    graph memory MiB: estimate={mib(num(m.get('profile_estimate_bytes')))}"
                f" actual={mib(num(m.get('capture_actual_bytes')))}"
                " | after profiling still taken (driver): "
                f"{mib(num(m.get('profile_driver_left_taken')))}"
                " (after empty_cache: "
                f"{mib(num(m.get('profile_driver_left_taken_after_empty_cache')))})"
                f" | KV cache MiB: {mib(num(m.get('kv_cache_bytes')))}, tokens {kv_tokens(r)}"
            )
        print(
            f"    timings s: import={r.get('import_s')} startup={r.get('startup_s')}"
            f" profile={m.get('profile_wall_s')} capture={m.get('capture_wall_s')}"
            f" generate={r.get('generate_s')} | shim ops called: {r.get('shim_calls')}"
        )
        sp = r.get("spec") or {}
        if sp.get("drafts"):
            print(
                f"    spec decode: drafts={sp.get('drafts')} draft tokens={sp.get('draft_tokens')}"
                f" accepted={sp.get('accepted_tokens')} acceptance={sp.get('acceptance_rate')}"
                f" mean length={sp.get('mean_acceptance_length')}"
            )
    p = r.get("plugin") if isinstance(r.get("plugin"), dict) else {}
    if p:
        print(
            f"    plugin: switch={p.get('switch')} env={p.get('env')} loaded={p.get('loaded')}"
            f" as expected={p.get('loaded_as_expected')} from={p.get('module_file')}"
            f" wrappers intact={p.get('wrappers_intact')}"
            f" report={'yes' if r.get('plugin_report') else 'no'}"
        )
    for line in (r.get("plugin_log") or [])[:PLUGIN_LOG_SHOWN]:
        print(f"    {PLUGIN_LOG_PREFIX} {line[:200]}")
    if "ranks" in r:
        print_ranks(r)
    logp = r.get("_log")
    if logp and os.path.exists(logp):
        with open(logp, errors="replace") as f:
            text = f.read()
        for pat in LOG_PATTERNS:
            for mm in re.findall(pat, text):
                print(f"    vllm: {mm.strip()[:160]}")


def compare_tokens(runs: dict[Key, Run]) -> bool | None:
    """Greedy speculative outputs against the baseline of the same size group and
    switch; None when there was nothing to compare. The ``-peak`` groups sample
    (seeded), and speculative sampling matches the baseline only in distribution,
    so they are left out."""
    all_eq: bool | None = None
    for size in sorted({k[0] for k in runs}, key=group_order):
        if "peak" in split_group(size)[0].split("-"):
            continue
        for switch in SWITCHES:
            base = runs.get((size, "base", switch))
            if not base or not base.get("ok"):
                continue
            bt = base["tokens"]
            n = sum(len(t) for t in bt)
            print(f"baseline {size}/{switch}: {len(bt)} prompts, {n} tokens; first: {bt[0][:12]}")
            for case in SPEC_CASES:
                r = runs.get((size, case, switch))
                if r and r.get("ok"):
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


# ---- rows and files ----------------------------------------------------------


def memory_rows(runs: dict[Key, Run]) -> list[dict]:
    """One row per (size group, case) of the memory runs."""
    rows = []
    for size in sorted({k[0] for k in runs}, key=group_order):
        tp = split_group(size)[1]
        for case in CASES:
            has_none = (size, case, "none") in runs
            off_switch = "none" if has_none and (size, case, "off") not in runs else "off"
            off, on = runs.get((size, case, off_switch)), runs.get((size, case, "on"))
            noest = runs.get((size, case, "noest"))
            if off is None and on is None and noest is None:
                continue
            if tp > 1:
                rows.append(build_tp_row(size, case, off, on, off_switch, tp, noest))
            else:
                rows.append(build_row(size, case, off, on, off_switch, noest))
    return rows


def load_rows(runs: dict[Key, list[Run]]) -> list[dict]:
    """One row per (size group, case, requests per generate): runs of other
    workloads are never pooled. A speculative row also gets its group's
    no-speculator figures (the ``base`` case, plugin off, same requests), if they ran."""

    def requests_of(r: Run) -> int | None:
        return (r.get("load") or {}).get("num_requests")

    def of(group: str, case: str, switch: str, n: int | None) -> list[Run]:
        return [r for r in runs.get((group, case, switch), []) if requests_of(r) == n]

    measured = {(g, c, requests_of(r)) for (g, c, _), rs in runs.items() for r in rs}
    # A run that stopped before its repeats has no workload of its own: it counts
    # toward its case's rows (as a run that added nothing), or makes a row alone.
    keys = {k for k in measured if k[2] is not None}
    keys |= {k for k in measured if k[2] is None and not any(m[:2] == k[:2] for m in keys)}
    rows = sorted(keys, key=lambda k: (group_order(k[0]), CASES.index(k[1]), k[2] or 0))
    return [
        summarize_load.build_row(
            g,
            c,
            of(g, c, "off", n),
            of(g, c, "on", n),
            None if c == "base" else of(g, "base", "off", n),
        )
        for g, c, n in rows
    ]


def carry_over(doc: dict, prev: dict, source: str) -> None:
    """Add the rows (and group settings) of ``prev`` whose (size group, case)
    this invocation has no row for, of those that name the plugin commit they
    measured: a row without one is from code older than the record and goes."""
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
    groups = {size for size, _ in kept}
    for group, meta in (prev.get("sizes") or {}).items():
        if group in groups:
            doc["sizes"].setdefault(group, meta)


def row_order(r: dict) -> tuple:
    return (group_order(r["size"]), CASES.index(r["case"]) if r["case"] in CASES else 99)


def runs_ok(kinds: Kinds, skipped: list[str]) -> bool:
    """Every run ran."""
    runs = [r for _, _, r in every_run(kinds)]
    return bool(runs) and not skipped and all(r.get("ok") for r in runs)


def print_rows(label: str, rows: list[dict], module: Any, first: int) -> None:
    """Each row's check, then its cells from column ``first`` on."""
    for r in rows:
        cells = dict(zip(module.COLUMNS, module.row_cells(r), strict=True))
        print(f"[{label}{r['size']}/{r['case']}] {cells['check']}")
        for col in module.COLUMNS[first:-1]:
            print(f"    {col}: {cells[col]}")


def graph_memory_doc(kinds: Kinds, outdir: str, skipped: list[str]) -> dict[str, Any]:
    runs = kinds["memory"]
    return {
        "schema": SCHEMA,
        "generated_utc": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M"),
        "targets": {
            "estimate_tolerance_fraction": EST_TOL_FRACTION,
            "estimate_tolerance_bytes": EST_TOL_BYTES,
            "retained_max_bytes": RETAINED_MAX_BYTES,
        },
        "sizes": {s: size_meta(s, runs, outdir) for s in {k[0] for k in runs}},
        "rows": memory_rows(runs),
        "runs": [compact_run(k, r) for k, r in sorted(runs.items())],
        "skipped": skipped,
    }


def write_graph_memory(doc: dict[str, Any], results_dir: str) -> None:
    jpath, mpath = write_json_and_markdown(
        results_dir, RESULTS_NAME, doc, summarize_table.markdown(doc)
    )
    print(f"wrote {jpath} and {mpath} ({len(doc['rows'])} rows)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("outdir")
    ap.add_argument("--results", help="where to write the table (default OUTDIR/bench/results)")
    ap.add_argument(
        "--previous",
        help="an earlier vllm_graph_memory.json to carry rows from (and vllm_load.json next to it)",
    )
    args = ap.parse_args(argv)
    outdir = args.outdir
    results_dir = args.results or os.path.join(outdir, "bench", "results")

    kinds = load_runs(outdir)
    skipped: list[str] = []
    skipped_txt = os.path.join(outdir, "skipped.txt")
    if os.path.exists(skipped_txt):
        with open(skipped_txt) as f:
            skipped = [line.strip() for line in f if line.strip()]
    print("=" * 72)
    print("vLLM 0.33.0 end-to-end on the GPU (MRV2, Triton attention)")
    print("=" * 72)
    if not any(kinds.values()):
        print(f"no run results in {outdir}")
    for kind, key, r in every_run(kinds):
        if kind == "load":
            print_run((*key, kind, f"round {summarize_load.round_of(r)}"), r)
        else:
            print_run(key, r)
    spec_eq = compare_tokens(kinds["memory"])

    doc = graph_memory_doc(kinds, outdir, skipped)
    rows = list(doc["rows"])
    if args.previous and os.path.exists(args.previous):
        with open(args.previous) as f:
            prev = json.load(f)
        if prev.get("schema") in READABLE_SCHEMAS:
            carry_over(doc, prev, args.previous)
    doc["sizes"] = dict(sorted(doc["sizes"].items(), key=lambda kv: group_order(kv[0])))
    doc["rows"].sort(key=row_order)
    print("-" * 72)
    print("plugin off vs on (MiB unless stated)")
    print_rows("", sorted(rows, key=row_order), summarize_table, 3)
    write_graph_memory(doc, results_dir)

    loads = load_rows(kinds["load"])
    if loads:
        prev_load = None
        if args.previous:
            prev_load = os.path.join(
                os.path.dirname(args.previous), f"{summarize_load.RESULTS_NAME}.json"
            )
        print_rows("load ", loads, summarize_load, 2)
        paths = summarize_load.write(loads, results_dir, prev_load)
        print(f"wrote {paths[0]} and {paths[1]} ({len(loads)} rows)")

    if skipped:
        print(f"skipped for lack of time: {' '.join(skipped)}")
    ran = runs_ok(kinds, skipped)
    all_runs = [r for _, _, r in every_run(kinds)]
    mine = rows + loads  # this invocation's rows decide
    passed = sum(r["pass"] for r in mine)
    print(
        f"SUMMARY: all runs ok={ran} ({sum(bool(r.get('ok')) for r in all_runs)}/"
        f"{len(all_runs)}), rows PASS={passed}/{len(mine)}, "
        f"speculative outputs equal baseline={spec_eq}"
    )
    return 0 if ran and mine and passed == len(mine) else 1


if __name__ == "__main__":
    sys.exit(main())
