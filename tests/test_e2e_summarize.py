"""summarize.py on a CPU: rows, checks and tables of results that run_llm.py's own
wrappers made on stand-ins (no GPU)."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from tests.e2e_fakes import EXACT, KV_MAX, UPSTREAM, MiB, fake_run, once_run, pick, summarize


def _report(estimate: int, actual: int, one_time: int = 0) -> dict:
    """The plugin's report of one owner, as its own classes write it (test byte counts)."""
    from vllm_specgraph.meter import OwnerMemory
    from vllm_specgraph.patches._measurements import SpecgraphCapture
    from vllm_specgraph.profile import GraphMemoryReport

    report = GraphMemoryReport((OwnerMemory("target", 1, estimate, 0),), one_time, 0, 0, 0, 1.0)
    actual_owners = (OwnerMemory("target", 1, actual, 0),)
    return SpecgraphCapture(report, capture_wall_seconds=1.0, actual=actual_owners).to_dict()


REPORT = _report(30 * MiB, 30 * MiB, 4 * MiB)  # EXACT's: 4 MiB one-time


def write(out, name: str, run: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(run))


def summary(out, *extra: str) -> tuple[int, dict, str]:
    """summarize.py on ``out``: exit status, the graph-memory JSON and its Markdown."""
    rc = summarize.main([str(out), "--results", str(out / "res"), *extra])
    doc = json.loads((out / "res" / "vllm_graph_memory.json").read_text())
    return rc, doc, (out / "res" / "vllm_graph_memory.md").read_text()


def test_memory_rows_are_checked_tabled_and_printed(tmp_path, capsys):
    misses = EXACT | {"est": 90 * MiB, "retained": MiB, "actual": 100 * MiB}
    for name, run in (
        ("base-off", fake_run("tiny", "base", "off", [[5, 6]], UPSTREAM)),
        ("base-on", fake_run("tiny", "base", "on", [[5, 6]], EXACT, report=REPORT)),
        # eagle: the plugin misses by 10 %, the tokens differ, the off run is "none"
        ("eagle-off", fake_run("tiny", "eagle", "none", [[5, 6]], UPSTREAM)),
        ("eagle-on", fake_run("tiny", "eagle", "on", [[5]], misses)),
        ("draft-on", {"case": "draft", "ok": False, "stage": "init", "plugin": {"switch": "on"}}),
    ):
        write(tmp_path, name, run | {"commit": None if name == "eagle-on" else "c1"})
    (tmp_path / "skipped.txt").write_text("tiny-ngram-off\n")
    rc, doc, md = summary(tmp_path)
    assert rc == 1 and doc["skipped"] == ["tiny-ngram-off"]
    base, draft, eagle = doc["rows"]
    keys = "upstream_error_bytes plugin_error_bytes retained_on_bytes plugin_budget_bytes"
    keys += " plugin_kept_bytes budget_minus_taken_off_bytes over_budget_off_bytes"
    assert pick([base], keys) == " ".join(str(n * MiB) for n in (5, 0, 4, 34, 4, -27, 27))
    assert pick([base], "retained_on_beyond_one_time_bytes tokens_equal_on_off") == "0 True"
    assert base["owners_on"] == {"target": {"estimate": 30 * MiB, "actual": 30 * MiB}}
    assert draft["status"].startswith("FAIL (no estimate/actual (on); no retained figure (on)")
    assert pick([base, eagle], "off_switch commit") == "off c1; none None"
    assert eagle["checks"] == {"estimate": False, "retained": True, "tokens": False}
    assert eagle["status"] == "FAIL (estimate -10.0 %; tokens differ)"
    cells = "41.0 / 30.0 | 34.0 | 36.0 / 30.0 | +13.9 % (+5.0) / +0.0 % (+0.0) | 32.0 / 4.0"
    assert f"| tiny | 6 | base | {cells} | -27.0 / 0.0 | 27.0 / 0.0 | 7,340,032 / 8" in md
    assert "| eagle (off=none) |" in md and "Not run (the script's time budget ran out)" in md
    printed = capsys.readouterr().out
    text = next(line for line in printed.splitlines() if re.match(r"tiny +6 +base ", line))
    markdown = next(line for line in md.splitlines() if line.startswith("| tiny | 6 | base |"))
    assert re.split(r"\s\s+", text) == markdown.strip("| ").split(" | ")  # the same cells
    assert f"FAILED {tmp_path}/draft-on.log at stage init: no error recorded" in printed
    assert "tokens of tiny eagle on differ from its base case's" in printed
    assert "SUMMARY: all runs ok=False (4/5), rows PASS=1/3" in printed


def load_run(rates: list[float], round_: int = 1, tokens: list | None = None, **load: Any) -> dict:
    """A load run's result: one timed repeat per rate (``steps``: their step times;
    ``spec``: the drafts, draft tokens and accepted tokens)."""
    pairs = zip(rates, load.pop("steps", [None] * len(rates)), strict=True)
    reps = [{"generated_tokens": 3, "tokens_per_s": r, "step_ms": s} for r, s in pairs]
    counts = ("drafts", "draft_tokens", "accepted_tokens")
    spec = dict(zip(counts, load.pop("spec", (0, 0, 0)), strict=True))
    load = {"num_requests": 2, "repeats": reps, "repeats_equal": True, "spec": spec} | load
    return {"ok": True, "tokens": tokens or [[1]], "load_round": round_, "load": load}


def save_load(out, name: str, run: dict, commit: str | None = None) -> None:
    size, case, switch = name.split("-")[:3]
    run |= {"size": size, "case": case, "workload": "load", "commit": commit}
    write(out, name, run | {"plugin": {"switch": switch}})


def test_rows_that_name_their_commit_carry_over(tmp_path, capsys):
    order = ["tiny", "1b", "1b-tp2", "1b-compile", "1b-compile-tp2", "8b"]
    assert sorted(order[::-1], key=summarize.group_order) == order
    assert summarize.group_of({"size": "1b", "graph_mode": "compile", "tp": 2}) == order[4]
    a, b = tmp_path / "a", tmp_path / "b"
    for p in ("off", "on"):
        for case, commit in (("base", "c1"), ("eagle", None)):  # eagle: older code than the record
            run = fake_run("tiny", case, p, [[1]], EXACT, report=REPORT)
            write(a, f"{case}-{p}", run | {"commit": commit})
        save_load(a, f"8b-draft-{p}", load_run([10.0]), "abc")
        write(b, p, fake_run("1b", "base", p, [[1]], EXACT))
    assert summary(a)[0] == 0
    (a / "skipped.txt").write_text("tiny-ngram-off\n")
    assert summary(a)[0] == 1  # a run that did not run fails the invocation
    rc, doc, md = summary(b, "--previous", str(a / "res" / "vllm_graph_memory.json"))
    assert rc == 1  # only this invocation's rows decide: 1b's has no plugin report
    assert pick(doc["rows"], "size case") == "tiny base; 1b base"
    assert {(r["size"], r["case"]) for r in doc["runs"]} == {("tiny", "base"), ("1b", "base")}
    assert list(doc["sizes"]) == ["tiny", "1b"] and "| tiny | 6 | base |" in md
    assert "dropped from" in capsys.readouterr().out  # eagle, and it says so
    load = json.loads((b / "res" / "vllm_load.json").read_text())  # though b ran no load
    assert load["schema"] == 3 and pick(load["rows"], "size case commit") == "8b draft abc"
    assert "| 8b | draft | 2 | 1 / 1 | 10 (10 - 10) |" in (b / "res" / "vllm_load.md").read_text()


def test_tensor_parallel_rows_check_every_rank_and_show_the_worst(tmp_path):
    def tp_run(case: str, plugin: str, ranks: list[dict], report: dict | None = None) -> dict:
        """A --tp result: the run's own fields, and one record per rank by the wrappers."""
        runs = [fake_run("tiny", case, plugin, [[5]], fig, report=report) for fig in ranks]
        records = [{"mem": r["mem"], "plugin_report": r["plugin_report"]} for r in runs]
        return runs[0] | {"tp": len(ranks), "ranks": records}

    exact, report = EXACT | {"est": 30 * MiB, "retained": 0}, _report(30 * MiB, 30 * MiB)
    kept = exact | {"retained": 6 * MiB}  # rank 1 leaves 6 MiB after its profile
    for case, on_ranks in (("base", [exact, kept]), ("eagle", [exact, exact])):
        write(tmp_path, f"{case}-off-tp2", tp_run(case, "off", [UPSTREAM, UPSTREAM]))
        write(tmp_path, f"{case}-on-tp2", tp_run(case, "on", on_ranks, report))
    rc, doc, md = summary(tmp_path)
    base, eagle = doc["rows"]
    assert rc == 1 and pick([base], "size tp worst_rank") == "tiny-tp2 2 1"
    assert pick(base["ranks"], "rank retained_on_bytes pass") == f"0 0 True; 1 {6 * MiB} False"
    assert base["retained_on_bytes"] == 6 * MiB  # the worst rank's figures
    assert base["checks"] == {"estimate": True, "retained": False, "tokens": True}
    assert base["status"] == "FAIL (rank 1: retained 6.0 MiB)" and eagle["status"] == "PASS"
    assert "| tiny-tp2 | 6 | base [rank 1 of 2] | 41.0 / 30.0 |" in md


def share(x: float) -> dict:
    return {"plugin_share": {"plugin_share": x, "plugin_us_per_step": 12.0}}


@pytest.mark.parametrize(
    ("offs", "ons", "status"),
    [
        ([load_run([1000.0])], [load_run([970.0])], "FAIL (on/off 0.970)"),
        ([load_run([1000.0])], [load_run([1100.0])], "PASS"),  # faster on: the spread, no cost
        ([load_run([1000.0])], [load_run([900.0], **share(0.0004))], "PASS"),  # the share decides
        ([load_run([9.0])], [load_run([9.0], **share(0.03))], "FAIL (plugin share 3.00%)"),
        ([], [load_run([1.0], tokens=[[2]])], "FAIL (tokens missing; no tokens/s)"),
        (
            [load_run([1.0]), load_run([1.0], 2), {"ok": False, "load_round": 3}],
            [load_run([1.0]), load_run([1.0], 2, [[9]])],
            "FAIL (tokens differ: on r2 from off r1)",
        ),
    ],
)
def test_load_row_checks(offs, ons, status):
    assert summarize.build_load_row("1b", "draft", offs, ons)["status"] == status


def test_load_rows_pool_the_rounds_of_one_request_count(tmp_path):
    # Round 1's off run had one fast repeat: of the medians over both rounds 98 / 97.
    for name, run in (
        ("1b-accept-off", load_run([110.0, 96.0], steps=[2.0, 3.1], spec=(10, 30, 12))),
        ("1b-accept-off-r2", load_run([98.0, 95.0], 2, steps=[3.0, 3.2], spec=(10, 30, 18))),
        ("1b-accept-on", load_run([97.0, 99.0], steps=[3.0, 2.9], **share(4e-4))),
        ("1b-accept-on-r2", load_run([96.0, 99.0], 2, steps=[3.1, 2.9], spec=(10, 30, 15))),
        ("1b-accept-on-96", load_run([50.0], num_requests=96)),  # another count: never pooled
        ("1b-base-off", load_run([50.0])),
        ("1b-base-off-r2", load_run([40.0], 2)),
    ):
        save_load(tmp_path, name, run, "r2" if name.endswith("r2") else "r1")
    summary(tmp_path)
    rows = json.loads((tmp_path / "res" / "vllm_load.json").read_text())["rows"]
    assert pick(rows, "case num_requests runs_off") == "base 2 2; accept 2 2; accept 96 0"
    row = rows[1]
    assert row["tokens_per_s_off"] == {"median": 97.0, "best": 110.0, "lowest": 95.0}
    assert pick(row["rounds"], "round ratio_on_off") == f"1 {98 / 103:.4f}; 2 {97.5 / 96.5:.4f}"
    keys = "step_ms_off step_ms_on acceptance_off mean_acceptance_length_off commit status"
    assert pick([row], keys) == "3.05 2.95 0.5 2.5 r1 r2 PASS"
    assert [r["round"] for r in row["repeats_off"]] == [1, 1, 2, 2]
    assert " | ".join(cell(row) for _, cell in summarize.LOAD[3:13]) == (
        "2 / 2 | 97 (95 - 110) | 98 (96 - 99) | 1.010 | r1 0.952, r2 1.010 | 3.05 / 2.95 | 0.967 | "
        "0.500 / 0.500 | 2.178 | 0.040% (12)"  # on / no speculator: over base's 45
    )
    # A run that compiled its graphs beside one that loaded them from vLLM's cache is named.
    for switch, log in (("off", "Compiling a graph for compile range"), ("on", "Directly load")):
        (tmp_path / f"{switch}.log").write_text(log + " the compiled graph(s)")
    offs = [load_run([1.0]) | {"_log": str(tmp_path / "off.log")}]
    ons = [load_run([1.0], tokens=[[9]]) | {"_log": str(tmp_path / "on.log")}]
    assert summarize.build_load_row("8b-compile", "accept", offs, ons)["status"] == (
        "FAIL (tokens differ: on r1 from off r1 (torch.compile: off r1 compiled, on r1 cache))"
    )


def test_serve_rows_pass_only_with_equal_tokens_plugin_lines_and_clean_exits(tmp_path):
    def run(tokens: list | None, **extra: Any) -> dict:
        base = {"size": "1b", "case": "draft", "graph_mode": "compile", "ok": True, "requests": 1}
        base |= {"startup_s": 40.0, "seconds": 3.0, "shutdown_s": 4.0, "gpu_left_mib": 0}
        return base | {"log_ok": True, "clean_shutdown": True, "tokens": tokens} | extra

    ok, unclean = run([[1]]), run([[1]], clean_shutdown=False, log_ok=False)
    assert summarize.serve_row(ok, ok)["check"] == "PASS"
    assert summarize.serve_row(ok, run([[2]]))["check"] == "FAIL (tokens equal)"
    for off, on in ((ok, unclean), (unclean, ok)):  # off's count too
        check = summarize.serve_row(off, on)["check"]
        assert check == "FAIL (plugin lines in the server log, clean shutdown)"
    (tmp_path / "on.json").write_text(json.dumps(run([[1]], commit="abc", measured_utc="U")))
    pair = [str(tmp_path / "off.json"), str(tmp_path / "on.json")]
    assert summarize.main(["--serve", *pair, "--results", str(tmp_path)]) == 1  # off: no result
    row = json.loads((tmp_path / "vllm_serve.json").read_text())["rows"][0]
    assert row["check"].startswith("FAIL (both ran, tokens equal, plugin lines in the server log")
    md = (tmp_path / "vllm_serve.md").read_text()
    assert "| 1b | compile | draft | 1 | - / 40.0 | - / 3.0 | - / 4.0 | - / 0 | FAIL (" in md
    assert md.endswith("| U, abc |\n")


def test_once_rows_show_off_on_and_once_side_by_side(tmp_path):
    for case in ("base", "draft", "eagle"):
        write(tmp_path, f"{case}-off", fake_run("tiny", case, "off", [[5]], UPSTREAM))
        write(tmp_path, f"{case}-on", fake_run("tiny", case, "on", [[5]], EXACT, report=REPORT))
    write(tmp_path, "base-once", once_run("base", [[5]]))
    write(tmp_path, "draft-once", once_run("draft", [[5]], KV_MAX))  # backed past its budget
    fell_back = {"report": REPORT, "fallback": "no cuda-bindings"}  # the exact profile ran
    write(tmp_path, "eagle-once", fake_run("tiny", "eagle", "once", [[5]], EXACT, **fell_back))
    rc, doc, md = summary(tmp_path)
    assert rc == 1 and pick(doc["rows"], "status pass") == "PASS True; PASS False; PASS True"
    once = md[md.index("| size | case | KV tokens off / on / once |") :].splitlines()[2:5]
    checks = "PASS |; FAIL (over budget 30.0 MiB) |; FALLBACK (no cuda-bindings) |"
    assert [line.split(" | ")[-1] for line in once] == checks.split("; ")
    assert once[0] == (
        "| tiny | base | 7,340,032 / 8,388,608 / 8,392,704 | 12.5 / 12.5 / 12.5 | 0.0 / 0.0 "
        "| 524,544 / 526,464 | True | PASS |"
    )
