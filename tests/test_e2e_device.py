"""device.py on a CPU: knobs, plan, limits and warm-ups; launching and nvidia-smi faked."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e_fakes import SCRIPTS, device, kv, run_llm

FAKE_RUN = """import json, os, sys
out = sys.argv[sys.argv.index("--out") + 1] if "--out" in sys.argv else f"{sys.argv[1]}/sum.json"
json.dump({"argv": sys.argv[1:], "cwd": os.getcwd(), "env": dict(os.environ)}, open(out, "w"))
sys.exit(3)
"""


def knobs(tmp_path: Path, text: str = ""):
    where = f"OUT={tmp_path}/out; E2E_WORK={tmp_path}/w; VLLM_CACHE_ROOT={tmp_path}/cache"
    return device.knobs(kv(f"{where}; GPUS=0 1 2 3; {text}"))


def test_knobs_refusals_plan_arguments_gpus_and_core_pin(tmp_path, monkeypatch, capsys):
    for env, says in [  # knobs, and what the refusal says
        ("MODE=tight", "unknown MODE 'tight' (bench, load, demo, serve)"),
        ("PLUGIN=off noest", "unknown PLUGIN 'noest' (off, on, none, once)"),
        ("TP=0", "TP must be a positive integer, got '0'"),
        ("T_1b=-5", "T_1b must be a whole number of seconds, got '-5'"),
        ("MODE=serve; PLUGIN=on", "MODE=serve runs PLUGIN=\"off on\" at TP=1 only, got 'on'"),
        ("TP=2; GPUS=0", "TP=2 needs 2 GPUs, found 1: '0'"),
    ]:
        with pytest.raises(SystemExit, match=r"^2$"):
            device.knobs(kv(env))
        assert says in capsys.readouterr().out
    monkeypatch.setattr(device, "smi", lambda *q: ["0", "1", "2", "3"])
    monkeypatch.setattr(device.os, "sched_getaffinity", lambda pid: set(range(16)))
    monkeypatch.setattr(device.shutil, "which", lambda name: f"/usr/bin/{name}")
    k = knobs(tmp_path, "MODE=load; SIZES=8b; CASES=eagle; GRAPHS=full; TP=2; CUSTOM_AR=1")
    warm, off, *_ = device.plan(k)
    assert f"{k.gpus} {' '.join(k.pin)} | {' '.join(off.args)} {off.out}" == (
        "0,1 taskset -c 0,1,2,3,4,5,6,7 | --size 8b --case eagle --plugin off --graph-mode full "
        "--workload load --load-requests 256 --load-repeats 2 --load-round 1 --tp 2 "
        f"--custom-all-reduce {tmp_path}/out/8b-eagle-off-load-tp2.json"
    )
    assert warm.args[:6] == [*off.args[:4], "--plugin", "none"] and warm.args[-3:] == off.args[-3:]
    assert [device.knobs(kv(t)).gpus for t in ("TP=2", "CUDA_VISIBLE_DEVICES=3,1")] == ["0,1", "3"]
    for text in ("", "MODE=load; GRAPHS=full compile; TP=2; CUSTOM_AR=1"):  # run_llm.py's flags
        for run in device.plan(knobs(tmp_path, text)):
            assert run_llm.parse_args([*run.args, "--out", "x"])
    warm, _, on = device.plan(knobs(tmp_path, "MODE=serve"))  # a warm-up is an offline run
    assert [os.path.basename(run.script) for run in (warm, on)] == ["run_llm.py", "serve.py"]
    assert on.out == f"{tmp_path}/out/serve/1b-draft-on-compile-serve.json"


def test_warm_ups_rounds_limits_and_the_budget(tmp_path, monkeypatch, capsys):
    def execute(text: str, fails: str = "-", took: int = 10) -> str:
        """Each run's name and limit, ``launch`` faked: ``took`` s a run, 1 where ``fails``."""
        ran, clock = [], [1000]

        def launch(k, argv: list[str], limit: int, log: str) -> subprocess.Popen:
            ran.append(f"{os.path.basename(argv[-1]).removesuffix('.json')} {limit}")
            clock[0] += took
            Path(log).write_text("INFO KV cache: 1 GiB\nnoise\n")
            return subprocess.Popen(["false" if fails in argv[-1] else "true"])

        monkeypatch.setattr(device, "launch", launch)
        monkeypatch.setattr(device, "now", lambda: clock[0])
        os.makedirs((k := knobs(tmp_path, text)).out, exist_ok=True)
        device.execute(k, device.plan(k))
        return " ".join(ran)

    killed = []
    monkeypatch.setattr(device.os, "killpg", lambda pid, sig: killed.append(sig))
    monkeypatch.setattr(device, "smi", lambda *q: [])
    os.makedirs(markers := f"{tmp_path}/cache/specgraph-e2e-compiled")
    Path(markers, "1b-base-full-tp2").touch()  # its warm-up ran on this machine before
    # A warm-up first per (size, case, graph mode), T_FIRST_EXTRA; at TP > 1 T_TP_EXTRA, kills.
    knobs_tp = "SIZES=tiny 1b; CASES=base; GRAPHS=compile full; T_tiny=50; TP=2"
    assert execute(knobs_tp, fails="warmup-tiny-base-c").replace("-tp2", "") == (
        "warmup-tiny-base-compile 140 tiny-base-off-compile 80 tiny-base-on-compile 80 "
        "warmup-1b-base-compile 240 1b-base-off-compile 180 1b-base-on-compile 180 "
        "warmup-tiny-base-full 140 tiny-base-off 80 tiny-base-on 80 1b-base-off 180 1b-base-on 180"
    )
    marked = " ".join(sorted(os.listdir(markers))).replace("-tp2", "")
    assert marked == "1b-base-compile 1b-base-full tiny-base-full" and killed == [9] * 11
    printed = capsys.readouterr().out
    assert "rc=0 elapsed=10 s (80 s since start)\nINFO KV" in printed and "noise" not in printed
    # T_LOAD_EXTRA, limits cut to what is left, ABBA rounds; skipped runs listed, warm-ups not.
    knobs_load = "MODE=load; CASES=base draft; GRAPHS=full; BUDGET=230; T_LOAD_EXTRA=7"
    assert execute(knobs_load, took=40) == (
        "warmup-1b-base-full 205 1b-base-off-load 157 1b-base-on-load 125 1b-base-on-load-r2 85 "
        "1b-base-off-load-r2 45"
    )
    assert (tmp_path / "out" / "skipped.txt").read_text().replace("\n", " ") == (
        "1b-draft-off-load 1b-draft-on-load 1b-draft-on-load-r2 1b-draft-off-load-r2 "
    )
    # serve.py keeps its own start-up and shutdown limits, and only it can stop its server.
    assert execute("MODE=serve; T_1b=40") == (
        "warmup-1b-draft-compile 100 1b-draft-off-compile-serve 535 1b-draft-on-compile-serve 525"
    )
    calls = []  # then each (graph mode, size, case)'s pair compared; the first one fails
    monkeypatch.setattr(device.subprocess, "call", lambda cmd: calls.append(cmd) or len(calls) == 1)
    assert device.compare_serve_runs(knobs(tmp_path, "MODE=serve; GRAPHS=compile full")) == 1
    assert [" ".join(os.path.basename(arg) for arg in cmd[3:]) for cmd in calls] == [
        "1b-draft-off-compile-serve.json 1b-draft-on-compile-serve.json --results 1b-draft-compile",
        "1b-draft-off-serve.json 1b-draft-on-serve.json --results 1b-draft-full",
    ]


def test_main_in_load_mode_then_the_summary(tmp_path, monkeypatch, capfd):
    """main and the wrapper, in an interpreter without the package; setup, GPU, scripts faked."""
    for script in ("run_llm.py", "summarize.py"):
        (tmp_path / script).write_text(FAKE_RUN)
    (tmp_path / "python3").write_text(f'#!/bin/sh\nexec {sys.executable} -I -S "$@"\n')
    (tmp_path / "python3").chmod(0o755)
    ((work := tmp_path / "work") / "cwd").mkdir(parents=True)
    (out := tmp_path / "out").mkdir()
    stale = ["1b-base-on-load-r3.log", "1b-base-on-load-r3-tp2.json", "x-load-r3.json"]
    for name in stale:  # an earlier invocation's rounds: this one's removed, others' kept
        (out / name).touch()
    env = kv(f"OUT={out}; E2E_WORK={work}; VLLM_CACHE_ROOT={tmp_path}; GPUS=3 1; MODE=load")
    env |= kv(f"CASES=base; GRAPHS=full; COMMIT=abc; PATH={tmp_path}:{os.environ['PATH']}")
    monkeypatch.setattr(os, "environ", os.environ | env)  # what main sets goes with it
    monkeypatch.setattr(device, "HERE", str(tmp_path))
    monkeypatch.setattr(device, "setup", lambda k: None)
    monkeypatch.setattr(device, "smi", lambda *q: [])
    assert device.main() == 3  # summarize.py's exit status
    assert [(out / name).exists() for name in stale] == [False, True, True]
    on = json.loads((out / "1b-base-on-load-r2.json").read_text())
    env = {"CUDA_VISIBLE_DEVICES": "3", "PYTHONPATH": f"{work}/tree:{work}/site"}
    assert on["env"].items() >= (env | device.ENV | {"SPECGRAPH_COMMIT": "abc"}).items()
    assert on["cwd"] == str(work / "cwd") and (work / "warmup-1b-base-full.json").exists()
    summary = " ".join(json.loads((out / "sum.json").read_text())["argv"])
    previous = f"{device.REPO}/bench/results/vllm_graph_memory.json"
    assert summary == f"{out} --results {out}/bench/results --previous {previous}"
    assert "mode load; CUDA_VISIBLE_DEVICES=3; pinned to: " in capfd.readouterr().out
    wrapper = ["bash", os.path.join(SCRIPTS, "device-vllm-e2e.sh")]
    done = subprocess.run(wrapper, env=os.environ | {"MODE": "x"}, capture_output=True)
    assert done.returncode == 2 and b"unknown MODE 'x'" in done.stdout


def test_apply_shims_lists_the_ops_to_stand_in_and_edits_the_guard_once(tmp_path, capsys):
    (guard := tmp_path / "vllm" / "vllm_flash_attn" / "__init__.py").parent.mkdir(parents=True)
    (tmp_path / "vllm" / "layer.py").write_text(
        "self.op = torch.ops._C.silu_and_mul\nx = torch.ops._C_cache_ops.reshape\n"
        "if hasattr(torch.ops._C, 'probed'):\n    torch.ops._C.probed(1)\n"
    )
    guard.write_text(device.FA_GUARD + "    raise ImportError(\n        'no FA'\n    )\n")
    device.apply_shims(str(tmp_path))
    placeholders = (tmp_path / "vllm" / "_C_stable_libtorch_placeholders.txt").read_text()
    assert placeholders.split() == ["_C::silu_and_mul", "_C_cache_ops::reshape"]  # not the probed
    assert "_w.warn(" in guard.read_text() and "raise ImportError" not in guard.read_text()
    with pytest.raises(SystemExit):  # another vLLM fails loudly
        device.apply_shims(str(tmp_path))
    assert "expected 1 match, found 0" in capsys.readouterr().out
