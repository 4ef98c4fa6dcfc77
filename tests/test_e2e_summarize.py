"""summarize.py on a CPU, on results that run_llm.py's wrappers made on stand-ins."""

from __future__ import annotations

import json
from typing import Any

from tests.e2e_fakes import EXACT, KV_MAX, UPSTREAM, MiB, fake_run, once_run, pick, summarize
from vllm_specgraph.meter import OwnerMemory
from vllm_specgraph.patches._measurements import SpecgraphCapture
from vllm_specgraph.profile import GraphMemoryReport

OWNERS = (OwnerMemory("target", 1, 30 * MiB, 0),)  # the plugin's, of EXACT: 4 MiB one-time
REPORT = SpecgraphCapture(GraphMemoryReport(OWNERS, 4 * MiB, 0, 0, 0, 1.0), actual=OWNERS).to_dict()


def write(out, name: str, run: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(run))


def summary(out, previous=None) -> tuple[int, dict, str]:
    carry = ["--previous", str(previous / "res/vllm_graph_memory.json")] if previous else []
    rc = summarize.main([str(out), "--results", str(out / "res"), *carry])
    doc = json.loads((out / "res/vllm_graph_memory.json").read_text())
    return rc, doc, (out / "res/vllm_graph_memory.md").read_text()


def test_memory_rows_are_checked_tabled_printed_and_carried_over(tmp_path, capsys):
    order = ["tiny", "1b", "1b-tp2", "1b-compile", "1b-compile-tp2", "8b"]
    assert sorted(order[::-1], key=summarize.group_order) == order
    assert summarize.group_of({"size": "1b", "graph_mode": "compile", "tp": 2}) == order[4]
    misses = EXACT | {"est": 90 * MiB, "retained": 3 * MiB, "actual": 100 * MiB}
    failed = {"size": "tiny", "case": "draft", "ok": False, "stage": "init"}
    for name, run in (
        ("base-off", fake_run("tiny", "base", "off", [[5, 6]], UPSTREAM)),
        ("base-on", fake_run("tiny", "base", "on", [[5, 6]], EXACT, report=REPORT)),
        # eagle: the plugin misses by 10 % and keeps 3 MiB, the tokens differ, off is "none"
        ("eagle-off", fake_run("tiny", "eagle", "none", [[5, 6]], UPSTREAM)),
        ("eagle-on", fake_run("tiny", "eagle", "on", [[5]], misses)),
        ("draft-on", failed | {"plugin": {"switch": "on"}}),
    ):
        write(tmp_path, name, run | {"commit": None if name == "eagle-on" else "c1"})
    # At TP=2 rank 0's estimate is 1 MiB (3 %) short, within 2 MiB; rank 1 keeps 6 MiB more.
    near, kept = EXACT | {"actual": 31 * MiB}, EXACT | {"retained": 10 * MiB}
    for switch, figs in (("off", [UPSTREAM, UPSTREAM]), ("on", [near, kept])):
        runs = [fake_run("tiny", "base", switch, [[5]], fig, report=REPORT) for fig in figs]
        ranks = [{"mem": r["mem"], "plugin_report": r["plugin_report"]} for r in runs]
        write(tmp_path, f"base-{switch}-tp2", runs[0] | {"tp": 2, "ranks": ranks, "commit": "c1"})
    (tmp_path / "skipped.txt").write_text("tiny-ngram-off\n")
    rc, doc, md = summary(tmp_path)
    base, draft, eagle, *ranks = doc["rows"]  # base passes: its 4 MiB retained are one-time
    assert base["owners_on"] == {"target": {"estimate": 30 * MiB, "actual": 30 * MiB}}
    assert draft["status"].startswith("FAIL (no estimate/actual (on); no retained figure (on)")
    assert eagle["status"] == "FAIL (estimate -10.0 %; retained 3.0 MiB; tokens differ)"
    assert pick(ranks, "size rank status") == "tiny-tp2 0 PASS; tiny-tp2 1 FAIL (retained 10.0 MiB)"
    cells = "41.0 / 30.0 | 34.0 | 36.0 / 30.0 | +13.9 / +0.0 | 5.0 / 0.0 | 32.0 / 4.0 | -27.0 / 0.0"
    assert (line := f"| tiny | 6 | base | {cells} | 27.0 / 0.0 | 7,340,032 / 8,388,608 |") in md
    assert "| eagle (off=none) |" in md and "| tiny-tp2 | 6 | base [rank 1] | 41.0 / 30.0 |" in md
    assert "Not run (the script's time budget ran out): tiny-ngram-off." in md
    printed = capsys.readouterr().out
    assert line in printed and rc == 1  # the same table
    assert f"FAILED {tmp_path}/draft-on.log at stage init: no error recorded" in printed
    assert "tokens of tiny eagle on differ from its base case's" in printed
    assert "SUMMARY: all runs ok=False (6/7), rows PASS=2/5" in printed
    # The next invocation carries over the rows that name their commit, not eagle's.
    for switch, fig in (("off", UPSTREAM), ("on", EXACT)):
        write(tmp_path / "b", switch, fake_run("1b", "base", switch, [[1]], fig, report=REPORT))
    rc, doc, md = summary(tmp_path / "b", tmp_path)
    assert rc == 0 and pick(doc["rows"], "case") == "base; draft; base; base; base"
    assert list(doc["sizes"]) == ["tiny", "tiny-tp2", "1b"] and len(doc["runs"]) == 7
    assert "| tiny | 6 | base |" in md and "dropped from" in capsys.readouterr().out
    (tmp_path / "b/skipped.txt").write_text("1b-draft-off\n")
    assert summary(tmp_path / "b")[0] == 1  # a run that did not run fails the invocation


def test_once_rows_show_off_on_and_once_side_by_side(tmp_path):
    for case in ("base", "draft", "accept", "eagle"):
        write(tmp_path, f"{case}-off", fake_run("tiny", case, "off", [[5]], UPSTREAM))
        write(tmp_path, f"{case}-on", fake_run("tiny", case, "on", [[5]], EXACT, report=REPORT))
    write(tmp_path, "base-once", once_run("base", [[5]]))
    write(tmp_path, "draft-once", once_run("draft", [[5]], KV_MAX))  # backed past its budget
    write(tmp_path, "accept-once", once_run("accept", [[5]], 4 << 30))  # half the KV cache
    fell_back = {"report": REPORT, "fallback": "no cuda-bindings"}  # the exact profile ran
    write(tmp_path, "eagle-once", fake_run("tiny", "eagle", "once", [[5]], EXACT, **fell_back))
    rc, doc, md = summary(tmp_path)
    assert rc == 1 and pick(doc["rows"], "pass once_status") == (
        "True PASS; False FAIL (over budget 30.0 MiB); False FAIL (KV tokens -50.0 % against "
        "on); True FALLBACK (no cuda-bindings)"
    )
    assert md[md.index("| size | case | KV tokens off / on / once |") :].splitlines()[2] == (
        "| tiny | base | 7,340,032 / 8,388,608 / 8,392,704 | 12.5 / 12.5 / 12.5 | 0.0 / 0.0 "
        "| 524,544 / 526,464 | True | PASS |"
    )


def load_run(rates: list[float], round_: int = 1, tokens=None, share=None, **load: Any) -> dict:
    """A load run: a timed repeat per rate; ``steps`` (ms), ``spec`` (drafted, accepted)."""
    steps = load.pop("steps", [None] * len(rates))
    reps = [{"tokens_per_s": r, "step_ms": s} for r, s in zip(rates, steps, strict=True)]
    spec = dict(zip(("draft_tokens", "accepted_tokens"), load.pop("spec", (0, 0)), strict=True))
    load = {"num_requests": 2, "repeats": reps, "spec": spec} | load
    if share is not None:
        load["plugin_share"] = {"plugin_share": share, "plugin_us_per_step": 12.0}
    return {"ok": True, "tokens": tokens or [[1]], "load_round": round_, "load": load}


def test_load_rows_pool_the_rounds_of_one_request_count_and_check_the_plugin_share(tmp_path):
    for offs, ons, status in (
        ([load_run([1000])], [load_run([970])], "FAIL (on/off 0.970)"),  # without a share
        ([load_run([1000])], [load_run([900], share=0.0004)], "PASS"),  # the share decides
        ([load_run([9])], [load_run([9], share=0.03)], "FAIL (plugin share 3.00%)"),
        ([load_run([1]), load_run([1], 2)], [load_run([1], 2, [[9]])], "FAIL (tokens differ)"),
        ([{"ok": False, "load_round": 1}], [load_run([1])], "FAIL (tokens missing; no tokens/s)"),
    ):
        assert summarize.build_load_row("1b", "draft", offs, ons)["status"] == status
    # Round 1's off run had one fast repeat: medians over both rounds 98 on, 97 off, 45 base.
    for name, run in (
        ("1b-accept-off", load_run([110.0, 96.0], steps=[2.0, 3.1], spec=(30, 12))),
        ("1b-accept-off-r2", load_run([98.0, 95.0], 2, steps=[3.0, 3.2], spec=(30, 18))),
        ("1b-accept-on", load_run([97.0, 99.0], steps=[3.0, 2.9], share=4e-4)),
        ("1b-accept-on-r2", load_run([96.0, 99.0], 2, steps=[3.1, 2.9], spec=(30, 15))),
        ("1b-accept-on-96", load_run([50.0], num_requests=96)),  # another count: never pooled
        ("1b-base-off", load_run([50.0])),
        ("1b-base-off-r2", load_run([40.0], 2)),
        ("1b-accept-on-r3", {"ok": False, "load_round": 3}),  # beside its case's other runs
        ("1b-draft-off", {"ok": False, "load_round": 1}),  # all its case's runs: a row alone
    ):
        size, case, switch = name.split("-")[:3]
        run |= {"size": size, "case": case, "workload": "load", "plugin": {"switch": switch}}
        write(tmp_path, name, run | {"commit": "r2" if name.endswith("r2") else "r1"})
    assert summary(tmp_path)[0] == 1  # draft's run failed, base has no on run, accept-96 no off
    rows = json.loads((tmp_path / "res/vllm_load.json").read_text())["rows"]
    counts = "base 2 0; draft None 0; accept 2 2; accept 96 1"  # the on runs of each count
    assert pick(rows, "case num_requests runs_on") == counts
    assert " | ".join(cell(rows[2]) for _, cell in summarize.LOAD[3:]) == (
        "2 / 2 | 97 (95 - 110) | 98 (96 - 99) | 1.010 | 3.05 / 2.95 | 0.967 | "
        "0.500 / 0.500 | 2.178 | 0.040% | 12 | True | PASS | -, r1 r2"
    )
    summary(tmp_path / "b", tmp_path)  # carried over into an invocation without load runs
    carried = json.loads((tmp_path / "b/res/vllm_load.json").read_text())["rows"]
    assert pick(carried, "case commit") == "base r1 r2; accept r1 r2; accept r1"  # not draft's


def test_serve_rows_pass_only_with_equal_tokens_plugin_lines_and_clean_exits(tmp_path):
    ok = {"size": "1b", "case": "draft", "graph_mode": "compile", "ok": True, "requests": 1}
    ok |= {"startup_s": 40.0, "seconds": 3.0, "shutdown_s": 4.0, "gpu_left_mib": 0}
    ok |= {"log_ok": True, "clean_shutdown": True, "tokens": [[1]]}
    unclean = ok | {"clean_shutdown": False, "log_ok": False}
    checks = {summarize.serve_row(*pair)["check"] for pair in ((ok, unclean), (unclean, ok))}
    assert checks == {"FAIL (plugin lines in the server log, clean shutdown)"}  # off's count too
    assert summarize.serve_row(ok, ok)["check"] == "PASS"
    (tmp_path / "on.json").write_text(json.dumps(ok | {"commit": "abc", "measured_utc": "U"}))
    pair = [str(tmp_path / "off.json"), str(tmp_path / "on.json")]
    assert summarize.main(["--serve", *pair, "--results", str(tmp_path)]) == 1  # off: no result
    md = (tmp_path / "vllm_serve.md").read_text()
    assert md.endswith(
        "| 1b | compile | draft | 1 | - / 40.0 | - / 3.0 | - / 4.0 | - / 0 | FAIL (both ran, "
        "tokens equal, plugin lines in the server log, clean shutdown) | U, abc |\n"
    )
