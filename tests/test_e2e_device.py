"""device.py on a CPU: knobs, plan, lanes, limits and warm-ups, with process launching
and nvidia-smi faked (no GPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from types import SimpleNamespace
from typing import Any

import pytest

from tests.e2e_fakes import SCRIPTS, device, kv, run_llm


@pytest.mark.parametrize(
    ("env", "says"),
    [
        ("MODE=tight", "unknown MODE 'tight' (bench, load, demo, serve)"),
        ("SIZES=tiny 2b", "unknown SIZES '2b' (tiny, 1b, 8b)"),
        ("CASES=medusa", "unknown CASES 'medusa'"),
        ("GRAPHS=eager", "unknown GRAPHS 'eager' (full, compile)"),
        ("PLUGIN=off noest", "unknown PLUGIN 'noest' (off, on, none, once)"),
        ("TP=0", "TP must be a positive integer, got '0'"),
        ("LOAD_REQUESTS=x", "LOAD_REQUESTS must be a positive integer, got 'x'"),
        ("T_1b=-5", "T_1b must be a whole number of seconds, got '-5'"),
        ("MODE=serve; PLUGIN=on", "MODE=serve runs PLUGIN=\"off on\" at TP=1 only, got 'on'"),
        ("MODE=serve; TP=2", 'MODE=serve runs PLUGIN="off on" at TP=1 only'),
    ],
)
def test_knobs_refused_with_the_reason(env, says, capsys):
    with pytest.raises(SystemExit) as stop:
        device.knobs(kv(env))
    assert stop.value.code == 2 and says in capsys.readouterr().out


def plan(knobs: str) -> list[list[Any]]:
    return device.plan(device.knobs(kv(knobs + "; OUT=/o")))


def names(knobs: str) -> str:
    """The runs planned: a job's names joined by spaces, the jobs by " / "."""
    return " / ".join(" ".join(run.name for run in job) for job in plan(knobs))


def test_plan_of_the_knobs():
    assert names("SIZES=tiny 1b; CASES=base; GRAPHS=compile full; PLUGIN=on once") == (
        "tiny-base-on-compile / tiny-base-once-compile / 1b-base-on-compile / "
        "1b-base-once-compile / tiny-base-on / tiny-base-once / 1b-base-on / 1b-base-once"
    )
    ((run,),) = plan("SIZES=8b; CASES=eagle; PLUGIN=on; GRAPHS=full; TP=2; CUSTOM_AR=1")
    assert f"{run.script} {' '.join(run.args)}" == (
        "run_llm.py --size 8b --case eagle --plugin on --workload smoke --graph-mode full "
        "--tp 2 --custom-all-reduce --out /o/8b-eagle-on-tp2.json"
    )
    # Load: each round's switches one job, the order reversed every other round.
    assert names("MODE=load; CASES=draft; GRAPHS=full; LOAD_ROUNDS=3") == (
        "1b-draft-off-load 1b-draft-on-load / 1b-draft-on-load-r2 1b-draft-off-load-r2 / "
        "1b-draft-off-load-r3 1b-draft-on-load-r3"
    )
    assert " ".join(plan("MODE=load; LOAD_REQUESTS=64")[1][0].args[6:]) == (
        "--workload load --graph-mode compile --load-requests 64 --load-repeats 2 --load-round 2 "
        "--out /o/1b-base-on-compile-load-r2.json"
    )
    for knobs in ("", "MODE=load; GRAPHS=full compile; TP=2; CUSTOM_AR=1"):  # run_llm.py's flags
        assert all(run_llm.parse_args(run.args) for job in plan(knobs) for run in job)
    ((_, on),) = plan("MODE=serve")  # one job: one server at a time
    assert f"{on.name} {on.script} {' '.join(on.args)}" == (
        "1b-draft-on-compile-serve serve.py --size 1b --case draft --plugin on --graph-mode "
        "compile --out /o/serve/1b-draft-on-compile-serve.json"
    )


def test_lanes_and_core_pins(monkeypatch, capsys):
    monkeypatch.setattr(device, "smi", lambda *q: ["0", "1", "2", "3"])
    monkeypatch.setattr(device.os, "sched_getaffinity", lambda pid: set(range(16)))

    def lanes(knobs: str, env: dict) -> str:
        found = device.lanes_and_pins(device.knobs(kv(knobs)), env)
        return " ".join(
            f"{lane}@{pin[-1] if pin else '-'}" for lane, pin in zip(*found, strict=True)
        )

    assert lanes("TP=2", {}) == "0,1@0,1,2,3,4,5,6,7 2,3@8,9,10,11,12,13,14,15"
    assert lanes("MODE=load", {"GPUS": "2"}) == "2@0,1,2,3,4,5,6,7"  # LOAD_CORES on one lane
    assert lanes("", {"CUDA_VISIBLE_DEVICES": "3,1"}) == "3@0,1,2,3,4,5,6,7 1@8,9,10,11,12,13,14,15"
    assert lanes("", {"GPUS": "5"}) == "5@-"  # one lane, not load: not pinned
    with pytest.raises(SystemExit):
        device.lanes_and_pins(device.knobs({"TP": "2"}), {"GPUS": "0"})
    assert "TP=2 needs 2 GPUs, GPUS lists '0'" in capsys.readouterr().out


class Launches:
    """Device.launch faked: records (lane, argv, limit), moves the clock by ``took``
    seconds and exits with 1 where ``fails`` is in the argv's --out."""

    def __init__(self, monkeypatch, fails: str = "no run", took: int = 10) -> None:
        self.calls: list[tuple[int, list[str], int]] = []
        self.clock, self.fails, self.took = [1000], fails, took
        monkeypatch.setattr(device, "now", lambda: self.clock[0])
        monkeypatch.setattr(device.Device, "launch", lambda dev, *a: self.launch(*a))

    def launch(self, lane: int, argv: list[str], limit: int, log: str) -> Any:
        self.calls.append((lane, argv, limit))
        self.clock[0] += self.took
        open(log, "w").close()
        return SimpleNamespace(wait=lambda: int(self.fails in argv[-1]), pid=0)

    def runs(self) -> str:
        """What ran (a run's name, or warm-up:KEY) and its limit, one after the other."""
        out = [(os.path.basename(argv[-1])[:-5], limit) for _, argv, limit in self.calls]
        return ", ".join(f"{name.replace('compile-warmup-', 'warm-up:')} {s}" for name, s in out)


def _device(tmp_path, knobs: str, lanes: int = 1) -> Any:
    k = device.knobs(kv(f"OUT={tmp_path}/out; E2E_WORK={tmp_path}/w; {knobs}"))
    os.makedirs(k.out, exist_ok=True)
    return device.Device(k, [str(i) for i in range(lanes)], [[]] * lanes, device.now())


def test_limits_budget_and_compile_warm_ups(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "cache"))
    fake = Launches(monkeypatch, fails="tiny-base-off")
    dev = _device(tmp_path, "SIZES=tiny 1b; CASES=base; T_tiny=50")
    dev.execute(device.plan(dev.k))
    # T_FIRST_EXTRA until a run of the (size, graph mode) ends well; one unmeasured warm-up
    # without the plugin before the first compile run of each (size, case), at its limit.
    assert fake.runs() == (
        "warm-up:tiny-base 110, tiny-base-off-compile 110, tiny-base-on-compile 110, "
        "warm-up:1b-base 210, 1b-base-off-compile 210, 1b-base-on-compile 150"
    )
    warm_up = run_llm.parse_args(fake.calls[0][1][1:])
    assert (warm_up.plugin, warm_up.graph_mode, warm_up.workload) == ("none", "compile", "smoke")
    assert "run tiny-base-on-compile rc=0 elapsed=10 s" in capsys.readouterr().out
    fake.calls.clear()
    dev = _device(tmp_path, "CASES=base; PLUGIN=off")
    dev.execute(device.plan(dev.k))  # the markers stay for the next invocation: no warm-up
    assert fake.runs() == "tiny-base-off-compile 150"
    # The budget: a limit cut to what is left (25 s kept), a run under 30 s skipped and
    # listed; a failed warm-up is not tried again.
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "cache2"))
    fake = Launches(monkeypatch, fails="warmup", took=40)
    dev = _device(tmp_path, "MODE=load; CASES=base draft; BUDGET=190; LOAD_ROUNDS=1")
    dev.execute(device.plan(dev.k))
    assert fake.runs() == (
        "warm-up:1b-base 165, 1b-base-off-compile-load 125, 1b-base-on-compile-load 85, "
        "warm-up:1b-draft 45"
    )
    skipped = (tmp_path / "out" / "skipped.txt").read_text().split()
    assert skipped == ["1b-draft-off-compile-load", "1b-draft-on-compile-load"]
    knobs = "MODE=load; TP=2; T_1b=100; T_LOAD_EXTRA=7; T_TP_EXTRA=11; T_FIRST_EXTRA=5"
    dev = _device(tmp_path, knobs)
    assert dev.limit(device.plan(dev.k)[0][0]) == 100 + 7 + 11 + 5
    # serve.py keeps its own start-up and shutdown limits, and only it can stop its server.
    dev = _device(tmp_path, "MODE=serve; T_1b=40")
    assert dev.limit(device.plan(dev.k)[0][0]) == dev.left() > 40


def test_device_imports_on_a_machine_without_the_package(tmp_path):
    # The GPU machine runs device.py with its own python3 before setup installs the plugin.
    code = f"import sys; sys.path.insert(0, {os.path.join(SCRIPTS, 'vllm_e2e')!r}); import device"
    done = subprocess.run(
        [sys.executable, "-I", "-S", "-c", code], cwd=tmp_path, capture_output=True
    )
    assert done.returncode == 0, done.stderr.decode()


def test_serve_compares_each_pair(tmp_path, monkeypatch):
    compared = []  # a serve plan is one job (test_plan_of_the_knobs): one server at a time

    def summarize(cmd: list[str]) -> int:
        compared.append(cmd[3:])
        return int(cmd[-1].endswith("-full"))

    monkeypatch.setattr(device, "call", summarize)
    k = device.knobs(kv(f"MODE=serve; GRAPHS=compile full; OUT={tmp_path}"))
    assert device.compare_serve_runs(k) == 1  # the second comparison failed
    serve = f"{tmp_path}/serve/1b-draft"
    pair = [f"{serve}-off-compile-serve.json", f"{serve}-on-compile-serve.json"]
    full = [f"{serve}-off-serve.json", f"{serve}-on-serve.json", "--results", f"{serve}-full"]
    assert compared == [[*pair, "--results", f"{serve}-compile"], full]


def test_a_lane_takes_the_next_job_when_free_and_runs_it_in_turn(tmp_path, monkeypatch):
    spans: list[tuple[int, str, float, float]] = []

    def run(dev: Any, lane: int, run: Any) -> None:
        start = time.monotonic()
        time.sleep(0.05)
        spans.append((lane, run.name, start, time.monotonic()))

    monkeypatch.setattr(device.Device, "run", run)
    dev = _device(tmp_path, "MODE=load; GRAPHS=full; CASES=base draft accept", lanes=2)
    dev.execute(jobs := device.plan(dev.k))
    lane_of = {name: lane for lane, name, _, _ in spans}
    assert len(spans) == 12 and set(lane_of.values()) == {0, 1}
    assert all(len({lane_of[run.name] for run in job}) == 1 for job in jobs)  # a job on one lane
    for a in spans:  # overlaps only across lanes
        assert all(a[0] != b[0] for b in spans if a is not b and a[2] < b[3] and b[2] < a[3])


def test_load_mode_removes_the_stale_rounds_of_its_runs(tmp_path):
    names = [
        "1b-base-on-compile-load-r3.log",
        "1b-base-on-compile-load-r3-tp2.json",
        "x-load-r2.json",
    ]
    for name in names:
        (tmp_path / name).touch()
    device.remove_stale_rounds(device.knobs(kv(f"MODE=load; OUT={tmp_path}")))
    assert sorted(os.listdir(tmp_path)) == names[1:]  # round 1's files go as its run starts


FAKE_RUN = """import json, os, sys
keys = ("CUDA_VISIBLE_DEVICES", "PYTHONPATH", "SPECGRAPH_COMMIT", "VLLM_PLUGINS")
env = {k: os.environ.get(k) for k in keys}
out = sys.argv[sys.argv.index("--out") + 1] if "--out" in sys.argv else f"{sys.argv[1]}/sum.json"
json.dump({"argv": sys.argv[1:], "cwd": os.getcwd(), "env": env}, open(out, "w"))
sys.exit(3)
"""


def test_main_runs_the_plan_with_the_run_environment_then_summarizes(tmp_path, monkeypatch, capfd):
    """The device script end to end, setup and the GPU left out, run_llm.py and
    summarize.py faked: every run gets its lane, the site dir's tree, the commit and an
    empty working directory; the summary reads OUT."""
    for script in ("run_llm.py", "summarize.py"):
        (tmp_path / script).write_text(FAKE_RUN)
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "python3").write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
    (tmp_path / "bin" / "python3").chmod(0o755)
    out, work = tmp_path / "out", tmp_path / "work"
    knobs = f"OUT={out}; E2E_WORK={work}; GPUS=3; CASES=base; GRAPHS=full; COMMIT=abc"
    for key, value in kv(f"{knobs}; VLLM_PLUGINS=inherited").items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("PATH", f"{tmp_path}/bin:{os.environ['PATH']}")
    monkeypatch.setattr(device, "HERE", str(tmp_path))
    monkeypatch.setattr(device, "setup", lambda k: os.makedirs(f"{k.work}/cwd"))
    monkeypatch.setattr(device, "smi", lambda *q: [])
    assert device.main() == 3  # summarize.py's exit status
    on = json.loads((out / "tiny-base-on.json").read_text())
    assert on["argv"][:6] == ["--size", "tiny", "--case", "base", "--plugin", "on"]
    env = {"CUDA_VISIBLE_DEVICES": "3", "PYTHONPATH": f"{work}/tree:{work}/site"}
    assert on["env"] == env | {"SPECGRAPH_COMMIT": "abc", "VLLM_PLUGINS": None}
    assert on["cwd"] == str(work / "cwd") and (out / "tiny-base-off.json").exists()
    summary = json.loads((out / "sum.json").read_text())["argv"]
    assert summary[:3] == [str(out), "--results", f"{out}/bench/results"]
    printed = capfd.readouterr().out
    assert "mode bench; lanes (CUDA_VISIBLE_DEVICES): 3; pinned to: (not pinned)" in printed
    assert "run tiny-base-on rc=3" in printed
    wrapper = [os.path.join(SCRIPTS, "device-vllm-e2e.sh")]
    done = subprocess.run(["bash", *wrapper], env=os.environ | {"MODE": "x"}, capture_output=True)
    assert done.returncode == 2 and b"unknown MODE 'x'" in done.stdout


def test_apply_shims_lists_the_ops_to_stand_in_and_edits_the_guard_once(tmp_path, capsys):
    (tmp_path / "vllm" / "vllm_flash_attn").mkdir(parents=True)
    (tmp_path / "vllm" / "layer.py").write_text(
        "self.op = torch.ops._C.silu_and_mul\nx = torch.ops._C_cache_ops.reshape\n"
        "if hasattr(torch.ops._C, 'probed'):\n    torch.ops._C.probed(1)\n"
    )
    guard = tmp_path / "vllm" / "vllm_flash_attn" / "__init__.py"
    guard.write_text(device.FA_GUARD + "    raise ImportError(\n        'no FA'\n    )\n")
    device.apply_shims(str(tmp_path))
    placeholders = (tmp_path / "vllm" / "_C_stable_libtorch_placeholders.txt").read_text()
    assert placeholders.split() == ["_C::silu_and_mul", "_C_cache_ops::reshape"]  # not the probed
    assert (tmp_path / "vllm" / "_C_stable_libtorch.py").exists()
    assert "_w.warn(" in guard.read_text() and "raise ImportError" not in guard.read_text()
    with pytest.raises(SystemExit):  # another vLLM fails loudly
        device.apply_shims(str(tmp_path))
    assert "expected 1 match, found 0" in capsys.readouterr().out
