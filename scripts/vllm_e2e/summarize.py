# SPDX-License-Identifier: Apache-2.0
"""Summarise the run_llm.py results: one block per run (with vLLM's own log
lines), greedy-token comparisons, then one table with vllm-specgraph off and on
side by side per (size, case), checked against the targets.

    python3 summarize.py OUTDIR [--results DIR] [--previous FILE]

Reads every OUTDIR/*.json written by run_llm.py (SIZE-CASE-PLUGIN.json, and the
older CASE.json of runs with plugins off) and the .log next to it. Runs named in
OUTDIR/skipped.txt (the device script's runs that did not fit its time budget)
count as not run. Writes DIR/vllm_graph_memory.json and DIR/vllm_graph_memory.md
(DIR defaults to OUTDIR/bench/results). With --previous, the rows of sizes that
this OUTDIR has no run for are carried over from that earlier
vllm_graph_memory.json, with the date and machine they were measured on, so that
two invocations (one per size) end in one table. Exits 0 only if every run ran
and every row passed.

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
from typing import Any

MiB = 1 << 20
SIZES = ("tiny", "1b")
CASES = ("base", "draft", "ngram", "eagle")
SPEC_CASES = ("draft", "ngram", "eagle")
RESULTS_NAME = "vllm_graph_memory"
SCHEMA = 1
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


def mib(x: float | None, digits: int = 1) -> str:
    if x is None:
        return "-"
    return f"{x / MiB:.{digits}f}"


def num(x: Any) -> float | None:
    return x if isinstance(x, int | float) and not isinstance(x, bool) else None


def group_of(size: str, tp: Any) -> str:
    """The table's size label: the size at TP=1, ``SIZE-tpN`` above."""
    return size if not isinstance(tp, int) or tp <= 1 else f"{size}-tp{tp}"


def split_group(group: str) -> tuple[str, int]:
    size, _, tp = group.partition("-tp")
    return size, int(tp) if tp.isdigit() else 1


def group_order(group: str) -> tuple[int, int]:
    size, tp = split_group(group)
    return (SIZES.index(size) if size in SIZES else 99, tp)


def load_runs(outdir: str) -> dict[Key, Run]:
    runs: dict[Key, Run] = {}
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
        runs[(group_of(r.get("size", "tiny"), r.get("tp")), r["case"], switch)] = r
    return runs


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
    size: str, case: str, off: Run | None, on: Run | None, off_switch: str, tp: int
) -> dict:
    """One row for a tensor-parallel (size, case): each rank's off/on pair is
    checked like a TP=1 row; the row shows the worst rank and passes only if
    every rank does."""
    n = max(len((off or {}).get("ranks") or []), len((on or {}).get("ranks") or []), tp)
    subs = []
    for i in range(n):
        sub = build_row(size, case, rank_view(off, i), rank_view(on, i), off_switch)
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


def build_row(size: str, case: str, off: Run | None, on: Run | None, off_switch: str) -> dict:
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
    tok_off = off.get("tokens") if off and off.get("ok") else None
    tok_on = on.get("tokens") if on and on.get("ok") else None
    row: dict[str, Any] = {
        "size": size,
        "case": case,
        "off_switch": off_switch,
        "ran_off": bool(off and off.get("ok")),
        "ran_on": bool(on and on.get("ok")),
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
        "retained_off_bytes": mem_of(off, "profile_driver_left_taken"),
        "retained_on_bytes": mem_of(on, "profile_driver_left_taken"),
        "kv_cache_off_bytes": mem_of(off, "kv_cache_bytes"),
        "kv_cache_on_bytes": mem_of(on, "kv_cache_bytes"),
        "kv_tokens_off": kv_tokens(off),
        "kv_tokens_on": kv_tokens(on),
        "startup_off_s": num((off or {}).get("startup_s")),
        "startup_on_s": num((on or {}).get("startup_s")),
        "profile_wall_on_s": prof_wall,
        "capture_wall_on_s": cap_wall,
        "profile_capture_wall_ratio_on": (
            round(prof_wall / cap_wall, 3) if prof_wall is not None and cap_wall else None
        ),
        "tokens_equal_on_off": (tok_on == tok_off) if tok_on is not None and tok_off else None,
        "acceptance_off": ((off or {}).get("spec") or {}).get("acceptance_rate"),
        "acceptance_on": ((on or {}).get("spec") or {}).get("acceptance_rate"),
        "owners_on": owner_figures((on or {}).get("plugin_report")),
    }
    # What the KV-cache budget had to leave: the profile is followed by KV sizing, so
    # what it left taken counts as much as what production capture then took.
    for side, run_, budget in (("off", off, est_off), ("on", on, budget_on)):
        kept = row[f"retained_{side}_bytes"]
        actual = mem_of(run_, "capture_actual_bytes")
        taken = kept + actual if kept is not None and actual is not None else None
        row[f"taken_{side}_bytes"] = taken
        row[f"budget_minus_taken_{side}_bytes"] = (
            budget - taken if budget is not None and taken is not None else None
        )
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


def size_meta(size: str, runs: dict[Key, Run], outdir: str) -> dict:
    mine = [r for (s, _, _), r in sorted(runs.items()) if s == size]
    gpu = next((r["gpu"] for r in mine if isinstance(r.get("gpu"), dict)), {})
    gpu_txt = os.path.join(outdir, "gpu.txt")
    smi = None
    if os.path.exists(gpu_txt):
        with open(gpu_txt) as f:
            smi = f.read().strip() or None
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
    )
    out = {"size": key[0], "case": key[1], "plugin": key[2]} | {k: r.get(k) for k in keep if k in r}
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


def print_run(key: Key, r: Run) -> None:
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
    """Speculative outputs against the baseline of the same size and switch; None
    when there was nothing to compare."""
    all_eq: bool | None = None
    for size in sorted({k[0] for k in runs}, key=group_order):
        for switch in ("off", "on", "none"):
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


# ---- table -----------------------------------------------------------------


def fmt_err(err: float | None, p: float | None) -> str:
    if err is None:
        return "-"
    return f"{p:+.1f} % ({err / MiB:+.1f})" if p is not None else f"({err / MiB:+.1f})"


def fmt_pair(a: Any, b: Any, f: Any = str) -> str:
    return f"{'-' if a is None else f(a)} / {'-' if b is None else f(b)}"


def fmt_owners(owners: dict[str, dict[str, float | None]]) -> str:
    if not owners:
        return "-"
    return "; ".join(
        f"{name} {mib(v.get('estimate'))} / {mib(v.get('actual'))}" for name, v in owners.items()
    )


COLUMNS = (
    "size",
    "case",
    "upstream est. (off) MiB",
    "plugin est. (on) MiB",
    "plugin budget (on) MiB",
    "actual (on) MiB",
    "actual (off) MiB",
    "plugin error % (MiB)",
    "upstream error % (MiB)",
    "retained after profile off / on MiB",
    "budget - (retained + actual) off / on MiB",
    "KV tokens off / on",
    "start-up s off / on",
    "profile / capture wall (on)",
    "tokens on = off",
    "per owner est. / actual (on) MiB",
    "check",
)


def row_cells(row: dict) -> list[str]:
    ratio = row["profile_capture_wall_ratio_on"]
    return [
        row["size"],
        row["case"]
        + ("" if row.get("off_switch", "off") == "off" else f" (off={row['off_switch']})")
        + (f" [rank {row['worst_rank']} of {row['tp']}]" if "worst_rank" in row else ""),
        mib(row["upstream_estimate_bytes"]),
        mib(row["plugin_estimate_bytes"]),
        mib(row["plugin_budget_bytes"]),
        mib(row["actual_on_bytes"]),
        mib(row["actual_off_bytes"]),
        fmt_err(row["plugin_error_bytes"], row["plugin_error_pct"]),
        fmt_err(row["upstream_error_bytes"], row["upstream_error_pct"]),
        fmt_pair(row["retained_off_bytes"], row["retained_on_bytes"], mib),
        fmt_pair(row["budget_minus_taken_off_bytes"], row["budget_minus_taken_on_bytes"], mib),
        fmt_pair(row["kv_tokens_off"], row["kv_tokens_on"], lambda x: f"{x:,}"),
        fmt_pair(row["startup_off_s"], row["startup_on_s"], lambda x: f"{x:.1f}"),
        "-" if ratio is None else f"{ratio:.2f}",
        str(row["tokens_equal_on_off"]) if row["tokens_equal_on_off"] is not None else "-",
        fmt_owners(row["owners_on"]),
        row["status"],
    ]


def markdown(doc: dict) -> str:
    out = ["# vLLM 0.33.0 CUDA-graph memory: vllm-specgraph off and on", ""]
    out.append(
        "Real vLLM 0.33.0 (Model Runner V2, FULL CUDA graphs, Triton attention, dummy "
        "weights) through `scripts/device-vllm-e2e.sh`; every run in its own process. "
        "Off: the plugin is loaded with `VLLM_SPECGRAPH=0` (patches nothing), so the "
        "estimate is upstream's. On: `VLLM_PLUGINS=specgraph`."
    )
    out.append("")
    for size, meta in doc["sizes"].items():
        st = meta.get("settings") or {}
        parts = [
            f"{label}{st[key]}"
            for key, label in (
                ("model", ""),
                ("dtype", ""),
                ("max_num_seqs", "max_num_seqs "),
                ("max_model_len", "max_model_len "),
                ("max_num_batched_tokens", "max_num_batched_tokens "),
                ("gpu_memory_utilization", "gpu_memory_utilization "),
                ("num_capture_sizes", "capture sizes: "),
                ("tensor_parallel_size", "tensor_parallel_size "),
            )
            if st.get(key) is not None
        ]
        where = meta.get("nvidia_smi") or meta.get("gpu") or "an unrecorded GPU"
        out.append(
            f"* `{size}` ({', '.join(parts)}): measured {meta.get('measured_utc')} UTC on "
            f"{where}, torch {meta.get('torch')}, vLLM {meta.get('vllm')}."
        )
    out.append("")
    out.append("| " + " | ".join(COLUMNS) + " |")
    out.append("|" + "|".join("---" if i < 2 else "---:" for i in range(len(COLUMNS))) + "|")
    for row in doc["rows"]:
        out.append("| " + " | ".join(row_cells(row)) + " |")
    out.append("")
    if doc.get("skipped"):
        out.append(f"Not run (the script's time budget ran out): {', '.join(doc['skipped'])}.")
        out.append("")
    t = doc["targets"]
    out.append(
        f"Check (plugin on): |estimate - actual| <= max({t['estimate_tolerance_fraction']:.0%}"
        f" of actual, {t['estimate_tolerance_bytes'] / MiB:.0f} MiB); driver-level memory "
        f"still taken after the profile returned <= {t['retained_max_bytes'] / MiB:.0f} MiB; "
        "greedy tokens equal to the plugin-off run."
    )
    out.append("")
    out.append(
        "Upstream estimate: the return of `GPUModelRunner.profile_cudagraph_memory`. "
        "Plugin estimate: the graph bytes of the plugin's report; plugin budget: what "
        "the plugin returns to vLLM, the graphs plus what the profile left with the "
        "process (one-time state, such as kernels loaded by the first capture, that a "
        "second pass showed is not taken again). Actual: the return of `capture_model` "
        "for the production capture (driver-level free memory before minus after). "
        "Errors are estimate minus actual, in % of actual (MiB). Retained: driver-level "
        "bytes still taken when the profile returned; the check allows the plugin's "
        "one-time bytes, which its budget holds. Budget - (retained + actual): what "
        "vLLM subtracted for graphs from the KV-cache budget, minus what the profile "
        "left taken and the production capture then took; negative means the KV cache "
        "was sized too large by that much. KV tokens: "
        "`num_gpu_blocks * block_size`. Start-up: the `LLM(...)` constructor. Wall ratio: "
        "the profile call over the production `capture_model` call. Per owner: the "
        "plugin's own report (`runner.specgraph_profile`)."
    )
    out.append("")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("outdir")
    ap.add_argument("--results", help="where to write the table (default OUTDIR/bench/results)")
    ap.add_argument("--previous", help="an earlier vllm_graph_memory.json to carry rows from")
    args = ap.parse_args(argv)
    outdir = args.outdir
    results_dir = args.results or os.path.join(outdir, "bench", "results")

    runs = load_runs(outdir)
    skipped: list[str] = []
    skipped_txt = os.path.join(outdir, "skipped.txt")
    if os.path.exists(skipped_txt):
        with open(skipped_txt) as f:
            skipped = [line.strip() for line in f if line.strip()]
    print("=" * 72)
    print("vLLM 0.33.0 end-to-end on the GPU (MRV2, FULL CUDA graphs, Triton attention)")
    print("=" * 72)
    if not runs:
        print(f"no run results in {outdir}")
    for key in sorted(runs, key=lambda k: (group_order(k[0]), CASES.index(k[1]), k[2])):
        print_run(key, runs[key])
    spec_eq = compare_tokens(runs)

    sizes_here = sorted({k[0] for k in runs}, key=group_order)
    rows = []
    for size in sizes_here:
        tp = split_group(size)[1]
        for case in CASES:
            has_none = (size, case, "none") in runs
            off_switch = "none" if has_none and (size, case, "off") not in runs else "off"
            off, on = runs.get((size, case, off_switch)), runs.get((size, case, "on"))
            if off is None and on is None:
                continue
            if tp > 1:
                rows.append(build_tp_row(size, case, off, on, off_switch, tp))
            else:
                rows.append(build_row(size, case, off, on, off_switch))

    doc: dict[str, Any] = {
        "schema": SCHEMA,
        "generated_utc": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M"),
        "targets": {
            "estimate_tolerance_fraction": EST_TOL_FRACTION,
            "estimate_tolerance_bytes": EST_TOL_BYTES,
            "retained_max_bytes": RETAINED_MAX_BYTES,
        },
        "sizes": {s: size_meta(s, runs, outdir) for s in sizes_here},
        "rows": rows,
        "runs": [compact_run(k, r) for k, r in sorted(runs.items())],
        "skipped": skipped,
    }
    if args.previous and os.path.exists(args.previous):
        with open(args.previous) as f:
            prev = json.load(f)
        if prev.get("schema") == SCHEMA:
            for s, meta in prev.get("sizes", {}).items():
                if s not in doc["sizes"]:
                    doc["sizes"][s] = meta
                    doc["rows"] += [r for r in prev.get("rows", []) if r.get("size") == s]
                    doc["runs"] += [r for r in prev.get("runs", []) if r.get("size") == s]
                    print(
                        f"carried over from {args.previous}: size {s} ({meta.get('measured_utc')})"
                    )
    doc["sizes"] = dict(sorted(doc["sizes"].items(), key=lambda kv: group_order(kv[0])))
    doc["rows"].sort(key=lambda r: (group_order(r["size"]), CASES.index(r["case"])))

    print("-" * 72)
    print("plugin off vs on (MiB unless stated)")
    for r in doc["rows"]:
        if r["size"] not in sizes_here:
            continue
        c = dict(zip(COLUMNS, row_cells(r), strict=True))
        print(f"[{r['size']}/{r['case']}] {c['check']}")
        for col in COLUMNS[2:-1]:
            print(f"    {col}: {c[col]}")
    os.makedirs(results_dir, exist_ok=True)
    jpath = os.path.join(results_dir, f"{RESULTS_NAME}.json")
    mpath = os.path.join(results_dir, f"{RESULTS_NAME}.md")
    with open(jpath, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    with open(mpath, "w") as f:
        f.write(markdown(doc))
    print(f"wrote {jpath} and {mpath} ({len(doc['rows'])} rows)")

    if skipped:
        print(f"skipped for lack of time: {' '.join(skipped)}")
    ran = bool(runs) and not skipped and all(r.get("ok") for r in runs.values())
    mine = [r for r in doc["rows"] if r["size"] in sizes_here]
    passed = sum(r["pass"] for r in mine)
    print(
        f"SUMMARY: all runs ok={ran} ({sum(bool(r.get('ok')) for r in runs.values())}/"
        f"{len(runs)}), rows PASS={passed}/{len(mine)}, "
        f"speculative outputs equal baseline={spec_eq}"
    )
    return 0 if ran and mine and passed == len(mine) else 1


if __name__ == "__main__":
    sys.exit(main())
