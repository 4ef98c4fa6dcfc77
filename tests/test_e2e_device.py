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

from tests.e2e_fakes import (
    SCRIPTS,
    device,
    kv,
)

# ---- device.py -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("env", "says"),
    [
        ("MODE=tight", "unknown MODE 'tight'"),
        ("SIZES=tiny 2b", "unknown SIZES '2b'"),
        ("CASES=medusa", "unknown CASES 'medusa'"),
        ("GRAPHS=eager", "unknown GRAPHS"),
        ("PLUGIN=maybe", "unknown PLUGIN"),
        ("CAPTURE=large", "unknown CAPTURE"),
        ("ALLOCATOR=cumem", "unknown ALLOCATOR 'cumem'"),
        ("ALLOCATOR=default expandable", "unknown ALLOCATOR"),
        ("WORKLOAD=tight", "unknown WORKLOAD 'tight'"),
        ("MEMORY_HISTORY=2", "unknown MEMORY_HISTORY '2'"),
        ("TP=0", "TP must be a positive integer, got '0'"),
        ("LOAD_ROUNDS=x", "LOAD_ROUNDS must be a positive integer"),
        ("LOAD_CORES=0", "LOAD_CORES must be a positive integer"),
        ("MEMORY_HISTORY=1; TP=2", "MEMORY_HISTORY=1 records at TP=1 only"),
        ("UTIL=1.5", "UTIL must be a gpu_memory_utilization in (0, 1], got '1.5'"),
        ("UTIL=0.0", "got '0.0'"),
        ("MODE=serve; PLUGIN=on", 'MODE=serve runs PLUGIN="off on" only'),
        ("MODE=serve; TP=2", "MODE=serve runs TP=1"),
        ("MODE=serve; CAPTURE=small", "CAPTURE=default"),
        ("MODE=serve; UTIL=0.9", "MODE=serve takes neither UTIL nor MEMORY_HISTORY"),
    ],
)
def test_knobs_refused_with_the_reason(env, says, capsys):
    with pytest.raises(SystemExit) as stop:
        device.knobs(kv(env))
    assert stop.value.code == 2 and says in capsys.readouterr().out


def plan(knobs: str) -> str:
    """The names of the runs planned, a job's runs joined by spaces, the jobs by " / "."""
    return " / ".join(
        " ".join(run.name for run in job) for job in device.plan(device.knobs(kv(knobs)))
    )


def test_plan_of_the_knobs():
    assert plan("") == " / ".join(
        f"tiny-{c}-{p}-compile" for c in ("base", "draft", "ngram", "eagle") for p in ("off", "on")
    )  # bench, vLLM's graph mode
    assert plan("SIZES=tiny 1b; CASES=base; GRAPHS=compile full") == (
        "tiny-base-off-compile / tiny-base-on-compile / 1b-base-off-compile / 1b-base-on-compile / "
        "tiny-base-off / tiny-base-on / 1b-base-off / 1b-base-on"
    )
    ((run,),) = device.plan(
        device.knobs(kv("SIZES=1b; CASES=eagle; PLUGIN=on; GRAPHS=full; OUT=/o"))
    )
    assert " ".join(run.args) == (
        "--size 1b --case eagle --plugin on --capture default --workload smoke --graph-mode full "
        "--allocator default --out /o/1b-eagle-on.json"
    )
    knobs = "SIZES=8b; CASES=base; PLUGIN=noest; CAPTURE=small; ALLOCATOR=expandable; UTIL=0.9"
    ((run,),) = device.plan(device.knobs(kv(f"{knobs}; TP=2; CUSTOM_AR=1; WORKLOAD=peak; OUT=/o")))
    assert run.name == "8b-base-noest-small-compile-peak-expandable-util0.9-tp2"
    assert " ".join(run.args[-9:-1]) == (
        "--tp 2 --custom-all-reduce --allocator expandable --gpu-mem-util 0.9 --out"
    )
    knobs = "WORKLOAD=peak; MEMORY_HISTORY=1; CASES=base; PLUGIN=on; GRAPHS=full; OUT=/o"
    ((run,),) = device.plan(device.knobs(kv(knobs)))
    assert run.args[-6:-4] == ["--memory-history", "/o/tiny-base-on-peak.pickle"]
    # Load: each round's switches one job, the order reversed every other round.
    assert plan("MODE=load; CASES=draft; GRAPHS=full; LOAD_ROUNDS=3") == (
        "1b-draft-off-load 1b-draft-on-load / 1b-draft-on-load-r2 1b-draft-off-load-r2 / "
        "1b-draft-off-load-r3 1b-draft-on-load-r3"
    )
    jobs = device.plan(device.knobs(kv("MODE=load; LOAD_REQUESTS=64")))
    assert " ".join(jobs[1][0].args[8:18]) == (
        "--workload load --graph-mode compile --load-requests 64 --load-repeats 2 --load-round 2"
    )
    assert [job[0].case for job in jobs] == ["base", "base", "draft", "draft", "accept", "accept"]
    assert device.knobs({"MODE": "serve"}).cases == ["draft"]
    assert plan("CASES=base; GRAPHS=full; PLUGIN=on once") == "tiny-base-on / tiny-base-once"


def test_lanes_and_core_pins(monkeypatch, capsys):
    monkeypatch.setattr(device, "smi", lambda *q: ["0", "1", "2", "3"])
    monkeypatch.setattr(device.os, "sched_getaffinity", lambda pid: set(range(16)))
    monkeypatch.setattr(device, "call", lambda cmd, **kw: 0)

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
    seconds, exits with ``rc(argv)`` and writes a log."""

    def __init__(self, monkeypatch, rc: Any = lambda argv: 0, took: int = 10) -> None:
        self.calls: list[tuple[int, list[str], int]] = []
        self.clock, self.rc, self.took = [1000], rc, took
        monkeypatch.setattr(device, "now", lambda: self.clock[0])
        monkeypatch.setattr(device.Device, "launch", lambda dev, *a: self.launch(*a))

    def launch(self, lane: int, argv: list[str], limit: int, log: str | None) -> Any:
        self.calls.append((lane, argv, limit))
        self.clock[0] += self.took
        with open(log or os.devnull, "w") as f:
            f.write("INFO Graph capturing finished in 3 secs\nvllm-specgraph armed\n")
        rc = self.rc(argv)
        return SimpleNamespace(
            wait=lambda: rc, pid=0, returncode=rc, communicate=lambda: ("ok", "")
        )

    def runs(self) -> str:
        """What ran (a run's name, or warm-up:KEY) and its limit, one after the other."""
        out = []
        for _, argv, limit in self.calls:
            name = os.path.basename(argv[argv.index("--out") + 1]).removesuffix(".json")
            out.append(f"{name.replace('compile-warmup-', 'warm-up:')} {limit}")
        return ", ".join(out)


def _device(tmp_path, knobs: str) -> Any:
    k = device.knobs(kv(f"OUT={tmp_path}/out; E2E_WORK={tmp_path}/w; {knobs}"))
    os.makedirs(k.out, exist_ok=True)
    return device.Device(k, ["0"], [[]], device.now())


def test_limits_budget_and_compile_warm_ups(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "cache"))
    fake = Launches(monkeypatch, rc=lambda argv: 1 if "tiny-base-off" in argv[-1] else 0)
    dev = _device(tmp_path, "SIZES=tiny 1b; CASES=base; CAPTURE=default small; T_tiny=50")
    dev.execute(device.plan(dev.k))
    # A run of a size no run of which has ended well yet gets T_FIRST_EXTRA; one unmeasured
    # warm-up without the plugin before the first compile run of each (size, case, capture
    # set) on the machine, with the run's limit.
    assert fake.runs() == (
        "warm-up:tiny-base-default 110, tiny-base-off-compile 110, tiny-base-on-compile 110, "
        "warm-up:tiny-base-small 50, tiny-base-off-small-compile 50, "
        "tiny-base-on-small-compile 50, "
        "warm-up:1b-base-default 210, 1b-base-off-compile 210, 1b-base-on-compile 150, "
        "warm-up:1b-base-small 150, 1b-base-off-small-compile 150, 1b-base-on-small-compile 150"
    )
    warm = fake.calls[0][1]
    assert warm[warm.index("--plugin") + 1] == "none" and "--workload" not in warm
    markers = sorted(os.listdir(tmp_path / "cache" / "specgraph-e2e-compiled"))
    assert markers == [
        ".lock",
        "1b-base-default",
        "1b-base-small",
        "tiny-base-default",
        "tiny-base-small",
    ]
    assert "run tiny-base-on-compile rc=0 elapsed=10 s" in capsys.readouterr().out
    fake.calls.clear()
    dev.execute(device.plan(dev.k)[:1])  # the markers stay: no warm-up
    assert fake.runs() == "tiny-base-off-compile 50"
    # The budget: a limit cut to what is left (25 s kept), a run under 30 s skipped;
    # a failed warm-up is not tried again.
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "cache2"))
    fake = Launches(monkeypatch, rc=lambda argv: 1 if "warmup" in argv[-1] else 0, took=40)
    dev = _device(tmp_path, "MODE=load; CASES=base draft; BUDGET=150; LOAD_ROUNDS=1")
    dev.execute(device.plan(dev.k))
    assert fake.runs() == (
        "warm-up:1b-base-default 125, 1b-base-off-compile-load 85, 1b-base-on-compile-load 45"
    )
    skipped = (tmp_path / "out" / "skipped.txt").read_text().split()
    assert skipped == ["1b-draft-off-compile-load", "1b-draft-on-compile-load"]
    fake = Launches(monkeypatch)
    monkeypatch.setattr(device.os, "killpg", lambda pid, sig: None)
    monkeypatch.setattr(device, "smi", lambda *q: [])
    knobs = "MODE=load; GRAPHS=full; TP=2; CASES=base; T_1b=100; T_LOAD_EXTRA=7; T_TP_EXTRA=11"
    dev = _device(tmp_path, knobs + "; T_FIRST_EXTRA=0; LOAD_ROUNDS=1")
    dev.execute(device.plan(dev.k))
    assert fake.runs() == "1b-base-off-load-tp2 118, 1b-base-on-load-tp2 118"


def test_serve_runs_each_switch_after_one_warm_up_then_compares_them(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "cache"))
    fake = Launches(monkeypatch, rc=lambda argv: 0)
    compared = []
    monkeypatch.setattr(
        device, "call", lambda cmd, **kw: compared.append(cmd[2:]) or len(compared) - 1
    )
    dev = _device(tmp_path, "MODE=serve; GRAPHS=compile full; BUDGET=600")
    assert dev.serve() == 1  # the second comparison failed
    assert fake.runs() == (
        "warm-up:1b-draft-default 575, 1b-draft-off-compile-serve 565, "
        "1b-draft-on-compile-serve 555, 1b-draft-off-serve 545, 1b-draft-on-serve 535"
    )
    assert fake.calls[1][1][1:9] == [
        "--size",
        "1b",
        "--case",
        "draft",
        "--plugin",
        "off",
        "--graph-mode",
        "compile",
    ]
    off, on = (f"{tmp_path}/out/serve/1b-draft-{p}-compile-serve.json" for p in ("off", "on"))
    assert compared[0] == [
        "--serve",
        off,
        on,
        "--results",
        f"{tmp_path}/out/serve/1b-draft-compile",
    ]


def test_jobs_run_one_at_a_time_per_lane_and_side_by_side_across_lanes(tmp_path, monkeypatch):
    spans: list[tuple[int, float, float]] = []

    def launch(dev: Any, lane: int, argv: list[str], limit: int, log: str | None) -> Any:
        open(log, "w").close()
        start = time.monotonic()

        def wait() -> int:
            time.sleep(0.3)
            spans.append((lane, start, time.monotonic()))
            return 0

        return SimpleNamespace(wait=wait)

    monkeypatch.setattr(device.Device, "launch", launch)
    dev = _device(tmp_path, "MODE=load; GRAPHS=full; CASES=base draft; LOAD_ROUNDS=2")
    dev.lanes, dev.pins = ["0", "1"], [[], []]
    dev.execute(device.plan(dev.k))
    assert len(spans) == 8 and {lane for lane, _, _ in spans} == {0, 1}
    pairs = [(a, b) for a in spans for b in spans if a is not b and a[1] < b[2] and b[1] < a[2]]
    assert pairs and all(a[0] != b[0] for a, b in pairs)  # overlaps only across lanes


def test_main_runs_the_plan_with_the_run_environment_then_summarizes(tmp_path, monkeypatch, capfd):
    """The device script end to end, with setup and the GPU left out: every run's process
    gets its lane, the site dir's tree, the commit and an empty working directory."""
    fake_run_llm = """import json, os, sys
out = sys.argv[sys.argv.index("--out") + 1]
keys = ("CUDA_VISIBLE_DEVICES", "PYTHONPATH", "SPECGRAPH_COMMIT", "VLLM_USE_V2_MODEL_RUNNER")
run = {"size": "tiny", "case": "base", "ok": True, "tokens": [[1]], "cwd": os.getcwd()}
run["plugin"] = {"switch": sys.argv[sys.argv.index("--plugin") + 1]}
json.dump(run | {"env": {k: os.environ.get(k) for k in keys}}, open(out, "w"))
"""
    (tmp_path / "fake_run_llm.py").write_text(fake_run_llm)
    (bin_dir := tmp_path / "bin").mkdir()
    (bin_dir / "python3").write_text(
        f'#!/bin/sh\ncase "$*" in *run_llm.py*) exec {sys.executable} {tmp_path}/fake_run_llm.py '
        f'"$@" ;; esac\nexec {sys.executable} "$@"\n'
    )
    (bin_dir / "python3").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    out, work = tmp_path / "out", tmp_path / "work"
    knobs = f"OUT={out}; E2E_WORK={work}; GPUS=3; CASES=base; GRAPHS=full; COMMIT=abc"
    for key, value in kv(knobs + "; VLLM_PLUGINS=inherited").items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(device, "setup", lambda k: os.makedirs(f"{k.work}/cwd"))
    monkeypatch.setattr(device, "smi", lambda *q: [])
    assert device.main() == 1  # no measured figures: the rows fail their checks
    runs = {p.stem: json.loads(p.read_text()) for p in out.glob("tiny-*.json")}
    assert sorted(runs) == ["tiny-base-off", "tiny-base-on"]
    on = runs["tiny-base-on"]["env"]
    assert on == {
        "CUDA_VISIBLE_DEVICES": "3",
        "PYTHONPATH": f"{work}/tree:{work}/site",
        "SPECGRAPH_COMMIT": "abc",
        "VLLM_USE_V2_MODEL_RUNNER": "1",
    }
    assert runs["tiny-base-on"]["cwd"] == str(work / "cwd") and "VLLM_PLUGINS" not in os.environ
    assert (out / "bench" / "results" / "vllm_graph_memory.md").exists()
    printed = capfd.readouterr().out
    assert "mode bench; lanes (CUDA_VISIBLE_DEVICES): 3; pinned to: (not pinned)" in printed
    assert "SUMMARY: all runs ok=True (2/2)" in printed
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
