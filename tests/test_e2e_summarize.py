"""summarize.py on a CPU: rows, checks and tables of results that run_llm.py's own
wrappers made on stand-ins (no GPU)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.e2e_fakes import (
    ESTIMATE_ENV,
    EXACT,
    KV_MAX,
    UPSTREAM,
    MiB,
    fake_run,
    once_run,
    pick,
    summarize,
)

# ---- summarize.py ----------------------------------------------------------------------


def _report(estimate: dict[str, int], actual: dict[str, int] | None, one_time: int = 0) -> dict:
    """The plugin's report, as its own classes write it (test byte counts)."""
    from vllm_specgraph.meter import OwnerMemory
    from vllm_specgraph.patches._measurements import SpecgraphCapture
    from vllm_specgraph.profile import GraphMemoryReport

    def owners(figures: dict[str, int] | None) -> tuple | None:
        return figures and tuple(OwnerMemory(name, 1, n, 0) for name, n in figures.items())

    report = GraphMemoryReport(owners(estimate), one_time, 0, 0, 0, 1.0)
    return SpecgraphCapture(report, capture_wall_seconds=1.0, actual=owners(actual)).to_dict()


def write(out, name: str, run: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(run))


def summary(out, *extra: str) -> tuple[int, dict, str]:
    """summarize.py on ``out``: exit status, the graph-memory JSON and its Markdown."""
    rc = summarize.main([str(out), "--results", str(out / "res"), *extra])
    doc = json.loads((out / "res" / "vllm_graph_memory.json").read_text())
    return rc, doc, (out / "res" / "vllm_graph_memory.md").read_text()


MISSES = {"est": 90 * MiB, "retained": MiB, "actual": 100 * MiB}


def test_memory_rows_are_checked_and_tabled(tmp_path, capsys, monkeypatch):
    toks = [[5, 6, 7], [8, 9]]
    exact = _report({"target": 30 * MiB}, {"target": 30 * MiB}, 4 * MiB)  # 4 MiB one-time
    for name, run in (
        ("base-off", fake_run("tiny", "base", "off", toks, UPSTREAM)),
        ("base-on", fake_run("tiny", "base", "on", toks, EXACT, report=exact)),
        # eagle: the plugin misses by 10 %, the tokens differ, the off run is "none"
        ("eagle-off", fake_run("tiny", "eagle", "none", toks, UPSTREAM)),
        ("eagle-on", fake_run("tiny", "eagle", "on", [[5]], EXACT | MISSES)),
    ):
        write(tmp_path, name, run | {"commit": None if name == "eagle-on" else "c1"})
    monkeypatch.setenv(ESTIMATE_ENV, "0")
    write(tmp_path, "noest", fake_run("tiny", "base", "noest", toks, UPSTREAM) | {"commit": "c1"})
    (tmp_path / "skipped.txt").write_text("tiny-ngram-off\n")
    rc, doc, md = summary(tmp_path)
    assert rc == 1 and doc["skipped"] == ["tiny-ngram-off"]
    base, eagle = (
        {k: v // MiB if isinstance(v, int) and abs(v) > 1000 else v for k, v in row.items()}
        for row in doc["rows"]
    )
    assert pick([base], "status upstream_error_bytes plugin_error_bytes commit") == "PASS 5 0 c1"
    assert base["upstream_error_pct"] == pytest.approx(100 * 5 / 36)
    assert pick([base], "retained_on_bytes retained_on_beyond_one_time_bytes") == "4 0"
    assert pick([base], "plugin_estimate_bytes plugin_budget_bytes plugin_kept_bytes") == "30 34 4"
    keys = "budget_minus_taken_off_bytes budget_minus_taken_on_bytes budget_minus_taken_noest_bytes"
    assert pick([base], keys) == "-27 0 -68"
    assert pick([base], "over_budget_off_bytes over_budget_on_bytes over_budget_noest_bytes") == (
        "27 0 68"
    )
    assert pick(doc["rows"][:1], "kv_tokens_off kv_tokens_on") == f"{7 << 20} {8 << 20}"
    assert base["owners_on"] == {"target": {"estimate": 30 * MiB, "actual": 30 * MiB}}
    assert pick([base], "tokens_equal_on_off tokens_equal_noest_off") == "True True"
    assert (eagle["off_switch"], eagle["commit"]) == ("none", None)
    assert eagle["checks"] == {"estimate": False, "retained": True, "tokens": False}
    assert eagle["status"] == "FAIL (estimate -10.0 %; tokens differ)"
    row = next(line for line in md.splitlines() if line.startswith("| tiny | default (6) | base |"))
    cells = row.strip("|").split(" | ")
    assert len(cells) == len(summarize.MEMORY_COLUMNS) and cells[-1].strip() == "PASS"
    assert " | ".join(cells[3:10]) == (
        "41.0 / 30.0 / 0.0 | 34.0 | 36.0 / 30.0 | +13.9 % (+5.0) / +0.0 % (+0.0) | 32.0 / 4.0 | "
        "-27.0 / 0.0 / -68.0 | 27.0 / 0.0 / 68.0"
    )
    assert "| eagle (off=none) |" in md and "Not run (the script's time budget ran out)" in md
    printed = capsys.readouterr().out
    assert "TOKENS tiny on eagle == base: False" in printed
    assert "SUMMARY: all runs ok=False (5/5), rows PASS=1/2" in printed


def test_group_names_order_and_carry_over(tmp_path):
    groups = [
        ({"size": "1b", "graph_mode": "compile", "tp": 2}, "1b-compile-tp2"),
        (
            {"size": "8b", "capture": "small", "workload": "peak", "utilization": 0.9},
            "8b-small-peak-util0.9",
        ),
        ({"size": "1b", "allocator": "expandable", "graph_mode": "full"}, "1b-expandable"),
    ]
    assert [summarize.group_of(r, "memory") for r, _ in groups] == [g for _, g in groups]
    assert summarize.group_of({"size": "1b", "workload": "peak"}, "load") == "1b"
    order = ["tiny", "1b", "1b-tp2", "1b-small", "1b-peak", "1b-compile", "8b"]
    assert sorted(order[::-1], key=summarize.group_order) == order
    exact = _report({"target": 30 * MiB}, {"target": 30 * MiB}, 4 * MiB)
    for case, commit in (("base", "c1"), ("eagle", None)):  # eagle: code older than the record
        for p in ("off", "on"):
            run = fake_run("tiny", case, p, [[1]], EXACT, report=exact)
            write(tmp_path / "a", f"{case}-{p}", run | {"commit": commit})
    for p in ("off", "on"):
        write(tmp_path / "b", p, fake_run("1b", "base", p, [[1]], EXACT))
    assert summary(tmp_path / "a")[0] == 0
    previous = str(tmp_path / "a" / "res" / "vllm_graph_memory.json")
    rc, doc, md = summary(tmp_path / "b", "--previous", previous)
    assert pick(doc["rows"], "size case") == "tiny base; 1b base"
    assert {(r["size"], r["case"]) for r in doc["runs"]} == {("tiny", "base"), ("1b", "base")}
    assert list(doc["sizes"]) == ["tiny", "1b"] and "| tiny | default (6) | base |" in md
    assert rc == 1  # only this invocation's rows decide: 1b's has no plugin report


def fake_tp_run(case: str, plugin: str, ranks: list[dict], report: dict | None = None) -> dict:
    """A --tp result: the run's own fields, and one record per rank made by the wrappers."""
    runs = [fake_run("tiny", case, plugin, [[5]], fig, report=report) for fig in ranks]
    records = [
        {"rank": i, "mem": r["mem"], "plugin_report": r["plugin_report"]}
        for i, r in enumerate(runs)
    ]
    top = {k: v for k, v in runs[0].items() if k not in ("mem", "plugin_report")}
    return top | {"tp": len(ranks), "ranks": records}


def test_tensor_parallel_rows_check_every_rank_and_show_the_worst(tmp_path, capsys):
    exact, report = (
        EXACT | {"est": 30 * MiB, "retained": 0},
        _report({"t": 30 * MiB}, {"t": 30 * MiB}),
    )
    kept = exact | {"retained": 6 * MiB}  # rank 1 leaves 6 MiB after its profile
    for case, on_ranks in (("base", [exact, kept]), ("eagle", [exact, exact])):
        write(tmp_path, f"{case}-off-tp2", fake_tp_run(case, "off", [UPSTREAM, UPSTREAM]))
        write(tmp_path, f"{case}-on-tp2", fake_tp_run(case, "on", on_ranks, report))
    rc, doc, md = summary(tmp_path)
    base, eagle = doc["rows"]
    assert rc == 1 and pick([base], "size tp worst_rank") == "tiny-tp2 2 1"
    assert pick(base["ranks"], "rank retained_on_bytes pass") == f"0 0 True; 1 {6 * MiB} False"
    assert base["retained_on_bytes"] == 6 * MiB  # the worst rank's figures
    assert base["checks"] == {"estimate": True, "retained": False, "tokens": True}
    assert base["status"] == "FAIL (rank 1: retained 6.0 MiB)" and eagle["status"] == "PASS"
    assert "| tiny-tp2 | default (6) | base [rank 1 of 2] | 41.0 / 30.0 |" in md
    assert len(doc["runs"][0]["ranks"]) == 2
    assert "rank 1 (pid None, None): graph memory MiB: estimate=30.0" in capsys.readouterr().out


def load_run(rates: list[float], round_: int = 1, tokens: list | None = None, **load: Any) -> dict:
    """A load run's result: one timed repeat per rate (``steps``: their step times;
    ``spec``: the drafts, draft tokens and accepted tokens)."""
    steps = load.pop("steps", [None] * len(rates))
    repeats = [
        {"generated_tokens": 3, "tokens_per_s": r, "step_ms": s}
        for r, s in zip(rates, steps, strict=True)
    ]
    counts = ("drafts", "draft_tokens", "accepted_tokens")
    spec = dict(zip(counts, load.pop("spec", (0, 0, 0)), strict=True))
    load = {"num_requests": 2, "repeats": repeats, "repeats_equal": True, "spec": spec} | load
    return {"ok": True, "tokens": tokens or [[1]], "load_round": round_, "load": load}


def cells(row: dict) -> dict[str, str]:
    return dict(zip(summarize.LOAD_COLUMNS, summarize.load_cells(row), strict=True))


SHARE = {"plugin_share": 0.0004, "plugin_us_per_step": 12.0}


@pytest.mark.parametrize(
    ("offs", "ons", "status"),
    [
        ([load_run([1000.0])], [load_run([970.0])], "FAIL (on/off 0.970)"),
        ([load_run([1000.0])], [load_run([980.0])], "PASS"),
        ([load_run([1000.0])], [load_run([1100.0])], "PASS"),  # faster on: the spread, no cost
        (
            [load_run([1000.0])],
            [load_run([900.0], plugin_share=SHARE)],
            "PASS",
        ),  # the share decides
        (
            [load_run([9.0])],
            [load_run([9.0], plugin_share={"plugin_share": 0.03})],
            "FAIL (plugin share 3.00%)",
        ),
        (
            [load_run([1.0])],
            [load_run([1.0], tokens=[[2]])],
            "FAIL (tokens differ: on r1 from off r1)",
        ),
        ([], [load_run([1.0], tokens=[[2]])], "FAIL (tokens missing; no tokens/s)"),
        (
            [load_run([1.0]), load_run([1.0], 2)],
            [load_run([1.0]), load_run([1.0], 2, [[9]])],
            "FAIL (tokens differ: on r2 from off r1)",
        ),
        ([load_run([1.0]), {"ok": False, "load_round": 2}], [load_run([1.0])], "PASS"),
    ],
)
def test_load_row_checks(offs, ons, status):
    assert summarize.build_load_row("1b", "draft", offs, ons)["status"] == status


def test_load_row_pools_the_rounds(tmp_path):
    # Round 1's off run had one fast repeat: of the medians over both rounds 98 / 97.
    offs = [
        load_run([98.0, 95.0], 2, steps=[3.0, 3.2], spec=(10, 30, 18)) | {"commit": "b"},
        load_run([110.0, 96.0], 1, steps=[2.0, 3.1], spec=(10, 30, 12)) | {"commit": "a"},
    ]
    ons = [
        load_run([97.0, 99.0], 1, steps=[3.0, 2.9], spec=(10, 30, 15)),
        load_run([96.0, 99.0], 2, steps=[3.1, 2.9], spec=(10, 30, 15)),
    ]
    ons[1]["gpu"] = {"visible_devices": 1}
    base = [load_run([50.0]), load_run([40.0], 2), {"ok": False}]
    row = summarize.build_load_row("1b", "accept", offs, ons, base)
    assert row["tokens_per_s_off"] == {"median": 97.0, "best": 110.0, "lowest": 95.0}
    assert row["ratio_on_off_median"] == round(98 / 97, 4) and row["status"] == "PASS"
    assert pick(row["rounds"], "round ratio_on_off") == f"1 {98 / 103:.4f}; 2 {97.5 / 96.5:.4f}"
    keys = "step_ms_off step_ms_on runs_off acceptance_off mean_acceptance_length_off gpu_on"
    assert pick([row], keys) == "3.05 2.95 2 0.5 2.5 1"
    assert [r["round"] for r in row["repeats_off"]] == [1, 1, 2, 2]
    assert pick([row], "tokens_per_s_no_speculator commit") == "45.0 a b"
    assert row["ratio_on_no_speculator"] == round(98 / 45, 4)
    got = list(cells(row).values())
    assert " | ".join(got[3:13]) == (
        "2 / 2 | 97 (95 - 110) | 98 (96 - 99) | 1.010 | r1 0.952, r2 1.010 | 3.05 / 2.95 | 0.967 | "
        "0.500 / 0.500 | 2.178 | -"
    )
    assert cells(row | SHARE)["plugin share of a step (us)"] == "0.040% (12)"
    # A run that compiled its graphs beside one that loaded them from vLLM's cache is named.
    (tmp_path / "off.log").write_text("Compiling a graph for compile range (1, 2048)")
    (tmp_path / "on.log").write_text("Directly load the compiled graph(s)")
    offs = [load_run([1.0]) | {"_log": str(tmp_path / "off.log")}]
    ons = [load_run([1.0], tokens=[[9]]) | {"_log": str(tmp_path / "on.log")}]
    assert summarize.build_load_row("8b-compile", "accept", offs, ons)["status"] == (
        "FAIL (tokens differ: on r1 from off r1 (torch.compile: off r1 compiled, on r1 cache))"
    )


def test_load_rows_by_request_count_the_runs_that_ran_and_carry_over(tmp_path, capsys):
    def save(out, name: str, run: dict, commit: str | None = None) -> None:
        size, case, switch = name.split("-")[:3]
        run |= {"size": size, "case": case, "workload": "load", "commit": commit}
        write(out, name, run | {"plugin": {"switch": switch}})

    for name, run in (
        ("1b-accept-off", load_run([100.0])),
        ("1b-accept-on", load_run([99.0])),
        ("1b-accept-on-r2", load_run([50.0], 2, num_requests=96)),
        ("1b-base-off", load_run([40.0])),
        ("8b-draft-off", load_run([10.0])),
        ("8b-draft-on", load_run([10.0])),
    ):
        save(tmp_path / "a", name, run, "abc" if name.startswith("8b") else None)
    (tmp_path / "a" / "skipped.txt").write_text("1b-base-on\n")
    assert summary(tmp_path / "a")[0] == 1  # a run that did not run fails the invocation
    rows = json.loads((tmp_path / "a" / "res" / "vllm_load.json").read_text())["rows"]
    # Runs of another request count are never pooled; the base case's off run speaks
    # for "no speculator".
    assert pick(rows, "size case num_requests runs_off runs_on") == (
        "1b base 2 1 0; 1b accept 2 1 1; 1b accept 96 0 1; 8b draft 2 1 1"
    )
    assert pick(rows[1:2], "tokens_per_s_no_speculator ratio_on_off_median") == "40.0 0.99"
    assert "[load 1b/accept] PASS" in capsys.readouterr().out
    for switch in ("off", "on"):
        save(tmp_path / "b", f"1b-draft-{switch}", load_run([100.0]))
    summary(tmp_path / "b", "--previous", str(tmp_path / "a" / "res" / "vllm_graph_memory.json"))
    doc = json.loads((tmp_path / "b" / "res" / "vllm_load.json").read_text())
    assert doc["schema"] == 3 and pick(doc["rows"], "size commit") == "1b None; 8b abc"
    md = (tmp_path / "b" / "res" / "vllm_load.md").read_text()
    assert "| 8b | draft | 2 | 1 / 1 | 10 (10 - 10) |" in md  # carried over: it names its commit


def test_serve_rows_pass_only_with_equal_tokens_plugin_lines_and_clean_exits(tmp_path):
    def run(tokens: list | None, **extra: Any) -> dict:
        base = {"size": "1b", "case": "draft", "graph_mode": "compile", "ok": True, "requests": 1}
        base |= {"startup_s": 40.0, "seconds": 3.0, "shutdown_s": 4.0, "gpu_left_mib": 0}
        return base | {"log_ok": True, "clean_shutdown": True, "tokens": tokens} | extra

    assert summarize.serve_row(run([[1]]), run([[1]]))["check"] == "PASS"
    assert summarize.serve_row(run([[1]]), run([[2]]))["check"] == "FAIL (tokens equal)"
    row = summarize.serve_row(run([[1]]), run([[1]], clean_shutdown=False, log_ok=False))
    assert row["check"] == "FAIL (plugin lines in the server log, clean shutdown)"
    row = summarize.serve_row(run([[1]], clean_shutdown=False, log_ok=False), run([[1]]))
    assert row["check"] == "FAIL (plugin lines in the server log, clean shutdown)"  # off's too
    (tmp_path / "on.json").write_text(json.dumps(run([[1]], commit="abc", measured_utc="U")))
    pair = [str(tmp_path / "off.json"), str(tmp_path / "on.json")]
    assert summarize.main(["--serve", *pair, "--results", str(tmp_path)]) == 1  # off: no result
    row = json.loads((tmp_path / "vllm_serve.json").read_text())["rows"][0]
    assert row["check"].startswith("FAIL (both ran, tokens equal, plugin lines in the server log")
    md = (tmp_path / "vllm_serve.md").read_text()
    assert "| 1b | compile | draft | 1 | - / 40.0 | - / 3.0 | - / 4.0 | - / 0 |" in md
    assert md.endswith("| U, abc |\n")


def test_once_rows_show_off_on_and_once_side_by_side(tmp_path):
    toks, exact = [[5, 6]], _report({"target": 30 * MiB}, {"target": 30 * MiB}, 4 * MiB)
    for case in ("base", "draft", "eagle"):
        write(tmp_path, f"{case}-off", fake_run("tiny", case, "off", toks, UPSTREAM))
        write(tmp_path, f"{case}-on", fake_run("tiny", case, "on", toks, EXACT, report=exact))
    write(tmp_path, "base-once", once_run("base", toks))
    write(tmp_path, "draft-once", once_run("draft", toks, KV_MAX))  # backed past its budget
    fell_back = {"report": exact, "fallback": "no cuda-bindings"}  # the exact profile ran
    write(tmp_path, "eagle-once", fake_run("tiny", "eagle", "once", toks, EXACT, **fell_back))
    rc, doc, md = summary(tmp_path)
    assert rc == 1 and pick(doc["rows"], "status pass") == "PASS True; PASS False; PASS True"
    once = md[md.index("| size | case | KV tokens off / on / once |") :].splitlines()[2:5]
    kv_tokens, startup = "| 7,340,032 / 8,388,608 / ", "| 12.5 / 12.5 / 12.5 | 0.0 / "
    assert once == [
        f"| tiny | base {kv_tokens}8,392,704 {startup}0.0 | 524,544 / 526,464 | True | PASS |",
        f"| tiny | draft {kv_tokens}8,423,424 {startup}30.0 | 526,464 / 526,464 | True "
        "| FAIL (over budget 30.0 MiB) |",
        f"| tiny | eagle {kv_tokens}8,388,608 {startup}0.0 | - / - | True "
        "| FALLBACK (no cuda-bindings) |",
    ]
