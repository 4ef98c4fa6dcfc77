"""The vLLM demo's CPU-side parts (vllm_specgraph/demo/vllm_demo.py): the engine
settings, the weight refill and the worker record against stand-ins, the
report, and the parent's flow with stand-in child processes. The byte counts
are test inputs, not measurements."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from vllm_specgraph.demo import vllm_demo

MiB = 1 << 20
CONFIGS = os.path.join(os.path.dirname(vllm_demo.__file__), "configs")


def test_child_env_turns_the_plugin_on_and_off():
    assert vllm_demo.child_env("on")["VLLM_SPECGRAPH"] == "1"
    off = vllm_demo.child_env("off")
    assert off["VLLM_SPECGRAPH"] == "0" and off["VLLM_PLUGINS"] == "specgraph"
    assert off["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert off["VLLM_USE_V2_MODEL_RUNNER"] == "1"
    with pytest.raises(ValueError, match="'on' or 'off'"):
        vllm_demo.child_env("none")


def test_engine_kwargs_use_the_repository_configs():
    kw = vllm_demo.engine_kwargs(CONFIGS, 0.1)
    for path in (kw["model"], kw["speculative_config"]["model"]):
        assert os.path.exists(os.path.join(path, "config.json")), path
    assert kw["speculative_config"]["method"] == "draft_model"
    assert kw["compilation_config"]["cudagraph_capture_sizes"] == vllm_demo.CAPTURE_SIZES
    assert kw["compilation_config"]["mode"] == 0 and kw["disable_log_stats"] is False
    with open(os.path.join(kw["model"], "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    assert all(0 < t < vocab - 1 for p in vllm_demo.prompts(vocab) for t in p)


class _Tiny(torch.nn.Module):
    def __init__(self, embed: torch.nn.Embedding | None = None) -> None:
        super().__init__()
        self.embed = embed if embed is not None else torch.nn.Embedding(8, 4)
        self.proj = torch.nn.Linear(4, 4)
        self.norm = torch.nn.LayerNorm(4)


def _worker() -> tuple[Any, _Tiny, _Tiny]:
    target = _Tiny()
    draft = _Tiny(embed=target.embed)  # shared storage is refilled once
    runner = SimpleNamespace(model=target, speculator=SimpleNamespace(model=draft))
    return SimpleNamespace(model_runner=runner), target, draft


def test_refill_weights_seeds_by_name_and_skips_shared_storage():
    worker, target, draft = _worker()
    assert vllm_demo.refill_weights(worker) == 5 + 4  # the draft's embedding is the target's
    assert torch.equal(target.norm.weight, torch.ones(4))
    assert torch.equal(target.proj.weight, draft.proj.weight)  # same name, same seed
    again, other, _ = _worker()
    vllm_demo.refill_weights(again)
    assert torch.equal(other.embed.weight, target.embed.weight)
    assert not torch.equal(target.proj.weight, target.proj.bias.expand(4, 4))


def _record(free_at_rest: int, report: dict | None = None, **kw: Any) -> dict[str, Any]:
    return {
        "graph_estimate_bytes": 41 * MiB,
        "init_free_bytes": 1000 * MiB,
        "requested_bytes": 500 * MiB,
        "activation_headroom_bytes": 100 * MiB,
        "free_at_rest_bytes": free_at_rest,
        "plugin_report": report,
        "kv_tokens": 4_842_384,
        "startup_s": 38.4,
        "acceptance_rate": 0.04,
        "tokens": [[1, 2, 3]] * 6,
        "vllm": "0.33.0",
    } | kw


def test_worker_record_reads_the_budget_at_rest(monkeypatch):
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (573 * MiB, 2000 * MiB))
    monkeypatch.delenv("VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS", raising=False)
    report = {"estimate": {"owners": []}}
    worker = SimpleNamespace(
        cudagraph_memory_estimate=41 * MiB,
        init_snapshot=SimpleNamespace(free_memory=1000 * MiB),
        requested_memory=500 * MiB,
        peak_activation_memory=141 * MiB,
        model_runner=SimpleNamespace(specgraph_profile=SimpleNamespace(to_dict=lambda: report)),
    )
    record = vllm_demo.worker_record(worker)
    assert record == {
        "graph_estimate_bytes": 41 * MiB,
        "init_free_bytes": 1000 * MiB,
        "requested_bytes": 500 * MiB,
        "activation_headroom_bytes": 100 * MiB,
        "free_at_rest_bytes": 573 * MiB,
        "plugin_report": report,
    }
    # Held 427 MiB since the snapshot against a limit at rest of 400 MiB.
    assert vllm_demo.over_budget_bytes(record) == 27 * MiB


def _plugin_report() -> dict[str, Any]:
    owners = [
        {"owner": "target", "num_graphs": 6, "driver_bytes": 36 * MiB, "allocator_bytes": 0},
        {"owner": "draft", "num_graphs": 6, "driver_bytes": 0, "allocator_bytes": 0},
    ]
    return {
        "estimate": {
            "owners": owners,
            "one_time_bytes": 4 * MiB,
            "retained_bytes": 0,
            "wall_seconds": 3.1,
        },
        "actual": owners,
        "capture_wall_seconds": 1.1,
    }


def test_format_report_sets_the_plugin_next_to_vllm_alone():
    on = _record(600 * MiB, _plugin_report(), graph_estimate_bytes=36 * MiB, startup_s=12.2)
    off = _record(573 * MiB)
    text = vllm_demo.format_report(on, off)
    lines = text.splitlines()
    assert lines[1].split() == ["vLLM", "alone", "with", "vllm-specgraph"]
    assert "41.0 MiB   36.0 MiB" in text
    assert "36.0 MiB: target 36.0, draft 0.0" in text
    assert "one-time; retained" in text and "4.0 MiB; 0.0 MiB" in text
    assert "+27.0 MiB   +0.0 MiB" in text
    assert "4,842,384   4,842,384" in text and "38.4 s   12.2 s" in text
    assert "3.10 s / 1.10 s" in text
    assert "greedy tokens equal, plugin off and on: True" in text
    assert lines[-5] == "  [1, 2, 3]"
    assert lines[-3:] == [
        "* Graph memory: vLLM budgeted 41.0 MiB, the plugin 36.0 MiB, for 36.0 MiB the graphs "
        "took; at rest the engine held +27.0 MiB beyond its memory budget without the plugin, "
        "+0.0 MiB with it.",
        "* Start-up, both engines after a warm-up engine compiled the kernels: 38.4 s without "
        "the plugin, 12.2 s with it (its exact profile captures every graph once more).",
        "* Outputs: greedy tokens equal with the plugin off and on.",
    ]
    alone = vllm_demo.format_report(on)
    assert "vLLM alone" not in alone and "greedy tokens equal" not in alone


def test_main_without_cuda_says_what_it_needs(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert vllm_demo.main([]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_main_runs_both_engines_and_compares_tokens(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(vllm_demo, "_missing_requirements", lambda configs: None)
    tokens = {"on": [[1, 2]], "off": [[1, 2]]}
    commands: list[list[str]] = []

    def fake_child(command: list[str], check: bool) -> SimpleNamespace:
        commands.append(command)
        switch = command[command.index("--child") + 1]
        out = command[command.index("--out") + 1]
        report = _plugin_report() if switch == "on" else None
        with open(out, "w") as f:
            json.dump(_record(600 * MiB, report, tokens=tokens[switch]), f)
        return SimpleNamespace(returncode=0)

    monkeypatch.setattr(subprocess, "run", fake_child)
    assert vllm_demo.main(["--out-dir", str(tmp_path)]) == 0
    # A warm-up engine compiles the kernels first, so the two compared start alike.
    assert [c[c.index("--child") + 1] for c in commands] == ["off", "on", "off"]
    assert [Path(c[c.index("--out") + 1]).name for c in commands] == [
        "warm-up.json",
        "on.json",
        "off.json",
    ]
    assert "greedy tokens equal, plugin off and on: True" in capsys.readouterr().out
    tokens["off"] = [[9]]
    assert vllm_demo.main(["--out-dir", str(tmp_path)]) == 1
    commands.clear()
    assert vllm_demo.main(["--out-dir", str(tmp_path), "--no-compare"]) == 0
    assert len(commands) == 1
    monkeypatch.setattr(subprocess, "run", lambda command, check: SimpleNamespace(returncode=3))
    assert vllm_demo.main(["--out-dir", str(tmp_path / "new")]) == 1
    assert "failed (exit 3)" in capsys.readouterr().err
