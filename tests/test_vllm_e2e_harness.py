"""The end-to-end harness's CPU-side logic (scripts/vllm_e2e): the plugin switch,
the measurement wrappers, the size presets, and the off/on summary table.

The wrappers run here against stand-in runner and worker classes and a
stand-in ``torch.cuda`` whose driver-level usage the stand-ins move; the
summarizer then reads the JSON those runs produce. The byte counts are test
inputs, not measurements.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import sys
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
import torch

SCRIPTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts")
MiB = 1 << 20


def _load(name: str) -> ModuleType:
    path = os.path.join(SCRIPTS, "vllm_e2e", f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"vllm_e2e_{name}", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


run_llm = _load("run_llm")
summarize = _load("summarize")
memory_budget = workloads = e2e_worker = run_llm


@pytest.fixture(autouse=True)
def _no_garbage_collection_at_rest(monkeypatch):
    """``workloads.free_at_rest`` collects garbage first; with vLLM imported that
    takes a while and the stand-in GPU does not need it."""
    monkeypatch.setattr(workloads, "gc", SimpleNamespace(collect=lambda: 0))


class FakeCuda:
    """Driver-level usage that the stand-in vLLM methods below move by hand."""

    total = 80 << 30

    def __init__(self) -> None:
        self.used = 10 << 30
        self.reserved = 0
        self.allocated = 0
        self.peak_allocated = 0
        self.peak_reserved = 0

    def synchronize(self) -> None:
        pass

    def empty_cache(self) -> None:
        pass

    def mem_get_info(self) -> tuple[int, int]:
        return self.total - self.used, self.total

    def memory_reserved(self) -> int:
        return self.reserved

    def memory_allocated(self) -> int:
        return self.allocated

    def reset_peak_memory_stats(self) -> None:
        self.peak_allocated, self.peak_reserved = self.allocated, self.reserved

    def max_memory_allocated(self) -> int:
        return self.peak_allocated

    def max_memory_reserved(self) -> int:
        return self.peak_reserved

    def take(self, nbytes: int) -> None:
        """A step that keeps ``nbytes`` in the allocator's cache (driver level)."""
        self.used += nbytes
        self.reserved += nbytes
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        self.peak_allocated = max(self.peak_allocated, self.allocated + nbytes)


HEADROOM = 100 * MiB  # the stand-in worker's activation headroom


def fake_classes(cuda: FakeCuda, est: int, retained: int, actual: int, kv: int) -> tuple:
    """A runner and a worker that move ``cuda`` as vLLM would: the profile leaves
    ``retained`` taken, the worker sizes the KV cache at ``kv`` (its limit is
    ``kv + headroom + estimate`` above the snapshot, as vLLM's formula gives
    with nothing else taken) and allocates it, the capture takes ``actual``."""

    class Runner:
        def profile_cudagraph_memory(self) -> int:
            cuda.used += retained  # what the profile leaves taken
            return est

        def capture_model(self, *, profile_only: bool = False) -> int:
            if profile_only:
                return 0
            cuda.used += actual
            return actual

    class Worker:
        cudagraph_memory_estimate = est

        def determine_available_memory(self) -> int:
            applied = est if memory_budget.estimate_applied() else 0
            self.init_snapshot = SimpleNamespace(
                free_memory=cuda.total - cuda.used, total_memory=cuda.total
            )
            self.requested_memory = kv + HEADROOM + applied
            self.peak_activation_memory = HEADROOM + applied
            self.available_kv_cache_memory_bytes = kv
            Runner().profile_cudagraph_memory()
            cuda.used += kv
            return kv

    return Runner, Worker


def fake_metrics(
    drafts: int, draft_tokens: int, accepted: int, steps: int = 0
) -> list[SimpleNamespace]:
    """``llm.get_metrics()`` entries as vLLM's reader makes them."""
    return [
        SimpleNamespace(name="vllm:iteration_tokens_total", count=steps, sum=4.0 * steps),
        SimpleNamespace(name="vllm:spec_decode_num_drafts", value=drafts),
        SimpleNamespace(name="vllm:spec_decode_num_draft_tokens", value=draft_tokens),
        SimpleNamespace(name="vllm:spec_decode_num_accepted_tokens", value=accepted),
        SimpleNamespace(name="vllm:spec_decode_num_accepted_tokens_per_pos", values=[5, 4, 3]),
        SimpleNamespace(name="vllm:num_requests_running", value=0),
    ]


def workload_args(workload: str = "smoke", **kw: Any) -> SimpleNamespace:
    """run_llm.py's arguments that ``run_workload`` reads."""
    defaults = {
        "workload": workload,
        "max_tokens": 3,
        "num_prompts": 2,
        "load_requests": 4,
        "load_repeats": 2,
        "seed": 0,
    }
    return SimpleNamespace(**(defaults | kw))


def fake_run(
    size: str,
    case: str,
    plugin: str,
    *,
    est: int,
    retained: int,
    actual: int,
    kv: int,
    tokens: list[list[int]],
    report: dict | None = None,
    step: int = 0,
    workload: str = "smoke",
    capture: str = "default",
) -> dict[str, Any]:
    """One run_llm.py result built by the harness's own wrappers and helpers: the
    start-up moves the stand-in GPU, then ``run_llm.run_workload`` generates
    ``tokens`` with a step that keeps ``step`` bytes."""
    cuda = FakeCuda()
    runner_cls, worker_cls = fake_classes(cuda, est, retained, actual, kv)
    mem: dict[str, Any] = {}
    installed = run_llm.install_wrappers(runner_cls, worker_cls, cuda, mem)
    worker_cls().determine_available_memory()
    runner_cls().capture_model(profile_only=True)
    runner_cls().capture_model()
    block_size = 16
    runner = SimpleNamespace(specgraph_profile=None)
    if report is not None:
        runner.specgraph_profile = SimpleNamespace(to_dict=lambda: report)
    result: dict[str, Any] = {
        "size": size,
        "case": case,
        "plugin": {"switch": plugin, "wrappers_intact": run_llm.wrappers_intact(installed)},
        "capture": capture,
        "workload": workload,
        "ok": True,
        "stage": "done",
        "mem": mem,
        "startup_s": 12.5,
        "resolved": {"num_gpu_blocks": kv // (block_size * 1024), "block_size": block_size},
        "kv_tokens": kv // 1024,
        "plugin_report": run_llm.plugin_report(runner),
    }

    def generate(requests: list, sampling: dict | None = None) -> list[list[int]]:
        cuda.take(step)
        result.setdefault("sampled_with", []).append(sampling)
        return [list(t) for t in tokens]

    llm = SimpleNamespace(get_metrics=lambda: fake_metrics(10, 30, 12))
    preset = run_llm.SIZES[size]
    run_llm.run_workload(workload_args(workload), preset, 512, generate, llm, cuda, mem, result)
    return result


def test_wrappers_record_estimate_retained_actual_and_kv():
    r = fake_run(
        "tiny",
        "base",
        "off",
        est=41 * MiB,
        retained=32 * MiB,
        actual=36 * MiB,
        kv=7 << 30,
        tokens=[[1]],
    )
    m = r["mem"]
    assert m["profile_estimate_bytes"] == 41 * MiB
    assert m["profile_driver_left_taken"] == 32 * MiB
    assert m["profile_driver_left_taken_after_empty_cache"] == 32 * MiB
    assert m["capture_actual_bytes"] == 36 * MiB
    assert m["capture_driver_delta"] == 36 * MiB
    assert m["capture_calls"] == 1
    assert m["profile_only_capture_calls"] == 1
    assert m["kv_cache_bytes"] == 7 << 30
    assert m["worker_cudagraph_memory_estimate"] == 41 * MiB
    assert m["profile_wall_s"] >= 0 and m["capture_wall_s"] >= 0
    assert r["plugin"]["wrappers_intact"] == {
        "profile_cudagraph_memory": True,
        "capture_model": True,
        "determine_available_memory": True,
    }


def test_wrappers_intact_notices_a_replaced_method():
    cuda = FakeCuda()
    runner_cls, worker_cls = fake_classes(cuda, 1, 0, 1, 1)
    installed = run_llm.install_wrappers(runner_cls, worker_cls, cuda, {})
    runner_cls.capture_model = lambda self, **kw: 0
    assert run_llm.wrappers_intact(installed)["capture_model"] is False


ESTIMATE_ENV = "VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS"


@pytest.mark.parametrize(
    ("switch", "plugins", "specgraph", "estimate"),
    [
        ("on", "specgraph", None, None),
        ("off", "specgraph", "0", None),
        ("none", "", None, None),
        ("noest", "specgraph", "0", "0"),
    ],
)
def test_plugin_switch_sets_the_environment(monkeypatch, switch, plugins, specgraph, estimate):
    for key in ("VLLM_PLUGINS", "VLLM_SPECGRAPH", *run_llm.BASE_ENV):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("VLLM_SPECGRAPH", "0")  # inherited values must not leak through
    monkeypatch.setenv("VLLM_PLUGINS", "other")
    monkeypatch.setenv(ESTIMATE_ENV, "7")
    env = run_llm.set_env(switch)
    assert env == {
        "VLLM_PLUGINS": plugins,
        "VLLM_SPECGRAPH": specgraph,
        ESTIMATE_ENV: estimate,
        "PYTORCH_CUDA_ALLOC_CONF": None,
    }
    assert os.environ["VLLM_USE_V2_MODEL_RUNNER"] == "1"
    assert memory_budget.estimate_applied() is (switch != "noest")


@pytest.mark.parametrize(
    ("allocator", "conf"), [("default", None), ("expandable", "expandable_segments:True")]
)
def test_allocator_switch_sets_the_allocator_environment(monkeypatch, allocator, conf):
    # Inherited settings must not leak into either allocator's runs.
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:64")
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "expandable_segments:True")
    env = run_llm.set_env("on", allocator)
    assert env["PYTORCH_CUDA_ALLOC_CONF"] == os.environ.get("PYTORCH_CUDA_ALLOC_CONF") == conf
    assert "PYTORCH_ALLOC_CONF" not in os.environ
    with pytest.raises(ValueError, match="allocator must be one of"):
        run_llm.set_env("on", "cumem")


@pytest.fixture
def restore_plugin_loggers():
    saved = {
        n: (lg.handlers[:], lg.propagate, lg.level)
        for n in run_llm.PLUGIN_LOGGERS
        for lg in [logging.getLogger(n)]
    }
    yield
    for n, (handlers, propagate, level) in saved.items():
        lg = logging.getLogger(n)
        lg.handlers[:] = handlers
        lg.propagate = propagate
        lg.setLevel(level)


def test_plugin_log_tap_prints_with_prefix_and_keeps_lines(capsys, restore_plugin_loggers):
    sink: list[str] = []
    run_llm.tap_plugin_logs(sink)
    logging.getLogger("vllm.specgraph.profile").info("estimate %d MiB", 12)
    logging.getLogger("vllm_specgraph").info("loaded")
    assert sink == ["INFO vllm.specgraph.profile: estimate 12 MiB", "INFO vllm_specgraph: loaded"]
    out = capsys.readouterr().out.splitlines()
    assert out == [f"{run_llm.PLUGIN_LOG_PREFIX} {line}" for line in sink]


def test_size_presets_and_engine_kwargs():
    for size, preset in run_llm.SIZES.items():
        for key in ("model", "draft", "eagle"):
            cfg = os.path.join(run_llm.CONFIGS, preset[key], "config.json")
            with open(cfg) as f:
                vocab = json.load(f)["vocab_size"]
            ids = run_llm.prompts_token_ids(6, vocab)
            assert all(0 < t < vocab for p in ids for t in p), size
    args = SimpleNamespace(
        case="eagle",
        model="m",
        draft="d",
        eagle="e",
        num_spec=3,
        dtype="bfloat16",
        gpu_mem_util=0.5,
    )
    kw = run_llm.llm_kwargs(args, run_llm.SIZES["1b"])
    assert "cudagraph_capture_sizes" not in kw["compilation_config"]  # vLLM's defaults
    assert (kw["max_num_seqs"], kw["max_model_len"], kw["max_num_batched_tokens"]) == (
        256,
        1024,
        2048,
    )
    assert kw["speculative_config"] == {
        "method": "eagle",
        "model": "e",
        "num_speculative_tokens": 3,
    }
    kw = run_llm.llm_kwargs(args, run_llm.SIZES["tiny"])
    assert kw["compilation_config"]["cudagraph_capture_sizes"] == [1, 2, 4, 8, 16, 32]
    assert run_llm.speculative_config("base", "d", "e", 3) is None
    assert run_llm.speculative_config("draft", "d", "e", 3)["method"] == "draft_model"


def test_llama_1b_configs_are_1b_shaped():
    def cfg(name: str) -> dict:
        with open(os.path.join(run_llm.CONFIGS, name, "config.json")) as f:
            return json.load(f)

    target = cfg("llama-1b")
    assert (target["hidden_size"], target["num_hidden_layers"], target["vocab_size"]) == (
        2048,
        16,
        128256,
    )
    assert cfg("llama-1b-draft") == target | {"num_hidden_layers": 2}
    assert cfg("llama-1b-eagle") == target | {"num_hidden_layers": 1}


def test_spec_summary_and_missing_plugin_report():
    s = run_llm.spec_summary({"vllm:spec_decode_num_drafts": 4})
    assert s["drafts"] == 4 and s["acceptance_rate"] is None
    assert run_llm.plugin_report(SimpleNamespace()) is None
    assert run_llm.plugin_report(None) is None


def _plugin_report(
    estimate: dict[str, int], actual: dict[str, int] | None, one_time: int = 0
) -> dict:
    """The report as the plugin writes it (its own classes, test byte counts)."""
    from vllm_specgraph.patches._capture_meter import SpecgraphCapture
    from vllm_specgraph.profile import GraphMemoryReport, OwnerMemory

    def owners(figures):
        return tuple(OwnerMemory(name, 1, nbytes, 0) for name, nbytes in figures.items())

    report = GraphMemoryReport(owners(estimate), one_time, 0, 0, 0, 1.0)
    return SpecgraphCapture(
        report, capture_wall_seconds=1.0, actual=None if actual is None else owners(actual)
    ).to_dict()


def test_owner_figures_reads_the_plugin_report():
    report = _plugin_report({"target": 4 * MiB, "draft": 2 * MiB}, {"target": 5 * MiB})
    assert summarize.owner_figures(report) == {
        "target": {"estimate": 4 * MiB, "actual": 5 * MiB},
        "draft": {"estimate": 2 * MiB, "actual": None},
    }
    assert summarize.owner_figures(_plugin_report({"target": 1}, None)) == {
        "target": {"estimate": 1, "actual": None}
    }
    assert summarize.owner_figures(None) == {}


def _write(outdir, run: dict) -> None:
    name = f"{run['size']}-{run['case']}-{run['plugin']['switch']}.json"
    with open(os.path.join(outdir, name), "w") as f:
        json.dump(run, f)


def test_summarize_table_checks_and_carry_over(tmp_path, capsys):
    toks = [[5, 6, 7], [8, 9]]
    # The plugin's first pass kept 4 MiB of one-time process state: budgeted, and
    # not counted as retained; its graph estimate equals the actual.
    report = _plugin_report({"target": 30 * MiB}, {"target": 30 * MiB}, one_time=4 * MiB)
    runs = [
        # base: upstream over-estimates and leaves 32 MiB; the plugin is exact.
        fake_run(
            "tiny",
            "base",
            "off",
            est=41 * MiB,
            retained=32 * MiB,
            actual=36 * MiB,
            kv=7 << 30,
            tokens=toks,
        ),
        fake_run(
            "tiny",
            "base",
            "on",
            est=34 * MiB,
            retained=4 * MiB,
            actual=30 * MiB,
            kv=8 << 30,
            tokens=toks,
            report=report,
        ),
        # eagle: the plugin misses by 10 % and the tokens differ.
        fake_run(
            "tiny",
            "eagle",
            "off",
            est=113 * MiB,
            retained=100 * MiB,
            actual=104 * MiB,
            kv=7 << 30,
            tokens=toks,
        ),
        fake_run(
            "tiny",
            "eagle",
            "on",
            est=90 * MiB,
            retained=MiB,
            actual=100 * MiB,
            kv=8 << 30,
            tokens=[[5, 6, 0], [8, 9]],
        ),
    ]
    for r in runs[:2]:
        r["commit"] = "abc1234"  # the eagle runs name no commit: code older than the record
    out = tmp_path / "out"
    out.mkdir()
    for r in runs:
        _write(out, r)
    res = tmp_path / "res"
    rc = summarize.main([str(out), "--results", str(res)])
    assert rc == 1  # the eagle row fails
    doc = json.loads((res / "vllm_graph_memory.json").read_text())
    rows = {r["case"]: r for r in doc["rows"]}
    base, eagle = rows["base"], rows["eagle"]
    assert base["pass"] and base["status"] == "PASS"
    assert base["upstream_error_bytes"] == 5 * MiB
    assert base["upstream_error_pct"] == pytest.approx(100 * 5 / 36)
    assert base["plugin_error_bytes"] == 0
    assert (base["retained_off_bytes"], base["retained_on_bytes"]) == (32 * MiB, 4 * MiB)
    assert base["retained_on_beyond_one_time_bytes"] == 0
    assert base["budget_minus_taken_off_bytes"] == (41 - 32 - 36) * MiB
    assert base["budget_minus_taken_on_bytes"] == 0
    assert (base["plugin_estimate_bytes"], base["plugin_budget_bytes"]) == (30 * MiB, 34 * MiB)
    assert (base["kv_tokens_off"], base["kv_tokens_on"]) == ((7 << 30) // 1024, (8 << 30) // 1024)
    assert base["tokens_equal_on_off"] is True
    assert base["owners_on"] == {"target": {"estimate": 30 * MiB, "actual": 30 * MiB}}
    assert not eagle["pass"]
    assert eagle["checks"] == {"estimate": False, "retained": True, "tokens": False}
    assert eagle["status"] == "FAIL (estimate -10.0 %; tokens differ)"
    md = (res / "vllm_graph_memory.md").read_text()
    assert (
        "| tiny | default | base | 41.0 / 30.0 | 34.0 | 36.0 / 30.0 "
        "| +13.9 % (+5.0) / +0.0 % (+0.0) | 32.0 / 4.0 | -27.0 / 0.0 |" in md
    )
    assert "target 30.0 / 30.0" in md and "| PASS |" in md
    assert base["commit"] == "abc1234" and eagle["commit"] is None
    assert ", abc1234 | PASS |" in md
    printed = capsys.readouterr().out
    assert "SUMMARY: all runs ok=True (4/4), rows PASS=1/2" in printed

    # A second invocation for another size carries over the tiny row that names
    # its commit, and drops the one that does not.
    out2 = tmp_path / "out2"
    out2.mkdir()
    for plugin in ("off", "on"):
        _write(
            out2,
            fake_run(
                "1b",
                "base",
                plugin,
                est=200 * MiB,
                retained=0,
                actual=200 * MiB,
                kv=60 << 30,
                tokens=toks,
            ),
        )
    res2 = tmp_path / "res2"
    rc = summarize.main(
        [str(out2), "--results", str(res2), "--previous", str(res / "vllm_graph_memory.json")]
    )
    assert rc == 0  # only this invocation's rows decide
    doc2 = json.loads((res2 / "vllm_graph_memory.json").read_text())
    assert [(r["size"], r["case"]) for r in doc2["rows"]] == [("tiny", "base"), ("1b", "base")]
    assert {(r["size"], r["case"]) for r in doc2["runs"]} == {("tiny", "base"), ("1b", "base")}
    assert list(doc2["sizes"]) == ["tiny", "1b"]
    assert "| 1b | default | base |" in (res2 / "vllm_graph_memory.md").read_text()


def test_summarize_counts_skipped_runs_as_not_run(tmp_path, capsys):
    for plugin in ("off", "on"):
        _write(
            tmp_path,
            fake_run(
                "tiny", "base", plugin, est=MiB, retained=0, actual=MiB, kv=1 << 30, tokens=[[1]]
            ),
        )
    (tmp_path / "skipped.txt").write_text("tiny-ngram-off\ntiny-ngram-on\n")
    assert summarize.main([str(tmp_path)]) == 1
    doc = json.loads((tmp_path / "bench" / "results" / "vllm_graph_memory.json").read_text())
    assert doc["skipped"] == ["tiny-ngram-off", "tiny-ngram-on"]
    assert [r["status"] for r in doc["rows"]] == ["PASS"]
    assert "skipped for lack of time: tiny-ngram-off tiny-ngram-on" in capsys.readouterr().out


# ---- budget figures, workloads ---------------------------------------------------


def test_wrappers_record_the_workers_budget_and_the_step():
    r = fake_run(
        "tiny",
        "base",
        "off",
        est=41 * MiB,
        retained=32 * MiB,
        actual=36 * MiB,
        kv=7 << 30,
        tokens=[[1, 2]],
        step=150 * MiB,
    )
    m = r["mem"]
    assert m["requested_bytes"] == (7 << 30) + HEADROOM + 41 * MiB
    assert m["activation_headroom_bytes"] == HEADROOM
    assert m["graph_estimate_applied_bytes"] == 41 * MiB
    assert m["non_kv_bytes"] == HEADROOM
    assert m["capture_started"] is True
    # Held since the snapshot: retained + KV + actual; the limit at rest is
    # requested - headroom = KV + estimate: over by retained + actual - estimate.
    assert summarize.over_budget_bytes(m) == (32 + 36 - 41) * MiB
    assert m["free_at_rest_bytes"] - m["free_after_step_bytes"] == 150 * MiB
    assert m["step_reserved_peak_bytes"] == 150 * MiB
    assert r["tokens"] == [[1, 2]] and r["spec"]["acceptance_rate"] == 0.4
    assert r["sampled_with"] == [None]  # greedy
    peak = fake_run(
        "1b", "base", "on", est=1, retained=0, actual=1, kv=1 << 30, tokens=[[1]], workload="peak"
    )
    assert peak["sampled_with"] == [workloads.PEAK_SAMPLING]
    assert peak["sampled_with"][0]["logprobs"] and "prompt_logprobs" not in peak["sampled_with"][0]


def test_no_estimate_switch_leaves_the_graphs_out_of_the_budget(monkeypatch):
    monkeypatch.setenv(ESTIMATE_ENV, "0")
    r = fake_run(
        "tiny",
        "base",
        "noest",
        est=41 * MiB,
        retained=32 * MiB,
        actual=36 * MiB,
        kv=7 << 30,
        tokens=[[1]],
    )
    m = r["mem"]
    assert m["graph_estimate_applied_bytes"] == 0
    assert m["activation_headroom_bytes"] == HEADROOM
    assert summarize.over_budget_bytes(m) == (32 + 36) * MiB


def test_worker_budget_is_empty_without_a_profile():
    assert memory_budget.worker_budget(SimpleNamespace(), True) == {}
    assert summarize.over_budget_bytes({"init_free_bytes": 1}) is None


def test_peak_and_load_requests():
    peak = workloads.peak_requests(512, 256, 2048)
    assert len(peak) == 256 and sum(len(ids) for ids, _ in peak) == 2048
    assert {n for _, n in peak} == {workloads.PEAK_MAX_TOKENS}
    assert sum(len(ids) for ids, _ in workloads.peak_requests(512, 8, 515)) == 515
    with pytest.raises(ValueError, match="at least max_num_seqs"):
        workloads.peak_requests(512, 8, 4)
    load = workloads.load_requests(128256, 256, 1024, seed=0)
    assert load == workloads.load_requests(128256, 256, 1024, seed=0)
    assert load != workloads.load_requests(128256, 256, 1024, seed=1)
    assert all(16 <= len(ids) <= 512 and 16 <= n <= 256 for ids, n in load)
    assert all(0 < t < 128255 for ids, _ in load for t in ids)
    assert len({len(ids) for ids, _ in load}) > 50 and len({n for _, n in load}) > 50
    with pytest.raises(ValueError, match="max_model_len"):
        workloads.load_requests(512, 1, 32, seed=0)


def test_counter_delta_and_spec_counters():
    before = workloads.read_spec_counters(fake_metrics(10, 30, 12, steps=40))
    assert before == {
        "vllm:iteration_tokens_total": 40,
        "vllm:spec_decode_num_drafts": 10,
        "vllm:spec_decode_num_draft_tokens": 30,
        "vllm:spec_decode_num_accepted_tokens": 12,
        "vllm:spec_decode_num_accepted_tokens_per_pos": [5, 4, 3],
    }
    after = workloads.read_spec_counters(fake_metrics(20, 60, 27)) | {
        "vllm:spec_decode_num_accepted_tokens_per_pos": [9, 8, 7, 1]
    }
    delta = workloads.counter_delta(before, after)
    assert delta["vllm:spec_decode_num_drafts"] == 10
    assert delta["vllm:spec_decode_num_accepted_tokens_per_pos"] == [4, 4, 4, 1]
    assert workloads.spec_summary(delta)["acceptance_rate"] == 0.5


def test_run_load_times_only_the_repeats():
    ticks = iter(range(100))
    calls: list[int] = []

    def generate(requests):
        calls.append(len(requests))
        return [[7] * n for _, n in requests]

    def counters() -> dict:
        # Every request drafts 3 times (9 draft tokens); a timed one has 6 of them
        # accepted, the warm-up's none (counted in, it would lower the rate).
        # Every request takes 5 engine steps.
        n = sum(calls)
        return workloads.read_spec_counters(
            fake_metrics(3 * n, 9 * n, 6 * sum(calls[1:]), steps=5 * n)
        )

    requests = [([1, 2], 5), ([3], 7)]
    warmup = [([1], 2)]
    out = workloads.run_load(
        generate,
        counters,
        requests,
        warmup,
        repeats=2,
        clock=lambda: float(next(ticks)),
    )
    assert calls == [1, 2, 2]  # the warm-up first, then the timed repeats
    repeat = {"wall_s": 1.0, "generated_tokens": 12, "tokens_per_s": 12.0}
    assert out["repeats"] == [repeat | {"engine_steps": 10, "step_ms": 100.0}] * 2
    assert out["step_ms_median"] == 100.0
    assert out["tokens_per_s_best"] == out["tokens_per_s_median"] == 12.0
    assert out["repeats_equal"] is True and out["tokens"] == [[7] * 5, [7] * 7]
    assert out["spec"]["drafts"] == 12 and out["spec"]["acceptance_rate"] == round(24 / 36, 4)
    assert (out["num_requests"], out["prompt_tokens"], out["max_tokens"]) == (2, 3, 12)
    flaky = iter([[[1]], [[1]], [[2]]])
    again = workloads.run_load(lambda r: next(flaky), dict, [([1], 1)], [], repeats=2)
    assert again["repeats_equal"] is False
    with pytest.raises(ValueError, match="repeats"):
        workloads.run_load(generate, dict, requests, warmup, repeats=0)


def test_run_workload_load_records_throughput_and_the_first_tokens():
    r = fake_run(
        "1b",
        "draft",
        "on",
        est=1,
        retained=0,
        actual=1,
        kv=1 << 30,
        tokens=[[4, 5]],
        workload="load",
    )
    load = r["load"]
    assert load["num_requests"] == 4 and len(load["repeats"]) == 2
    assert r["tokens"] == [[4, 5]] and "tokens" not in load
    assert load["spec"] == r["spec"] and r["spec"]["drafts"] == 0  # counters did not move
    assert "free_at_rest_bytes" in r["mem"] and "free_after_step_bytes" not in r["mem"]
    assert r["generate_s"] == sum(x["wall_s"] for x in load["repeats"])


def test_capture_size_sets():
    args = SimpleNamespace(
        case="base",
        model="m",
        draft="d",
        eagle="e",
        num_spec=3,
        dtype="bfloat16",
        gpu_mem_util=0.5,
        capture="small",
    )
    kw = run_llm.llm_kwargs(args, run_llm.SIZES["1b"])
    assert kw["compilation_config"]["cudagraph_capture_sizes"] == [1, 2, 4, 8, 16, 32]
    assert run_llm.capture_sizes(run_llm.SIZES["1b"], "default") is None
    assert run_llm.capture_sizes(run_llm.SIZES["tiny"], "default") == [1, 2, 4, 8, 16, 32]
    with pytest.raises(ValueError, match="capture-size set"):
        run_llm.capture_sizes(run_llm.SIZES["1b"], "large")


def test_summarize_noest_capture_sets_peak_and_load(tmp_path, capsys):
    toks = [[5, 6, 7]]
    exact = _plugin_report({"target": 30 * MiB}, {"target": 30 * MiB}, one_time=4 * MiB)
    off_fig = {"est": 41 * MiB, "retained": 32 * MiB, "actual": 36 * MiB, "kv": 7 << 30}
    on_fig = {"est": 34 * MiB, "retained": 4 * MiB, "actual": 30 * MiB, "kv": 7 << 30}
    out = tmp_path / "out"
    out.mkdir()

    def write(run: dict, name: str, where=out) -> None:
        (where / f"{name}.json").write_text(json.dumps(run | {"commit": "abc1234"}))

    for capture, suffix in (("default", ""), ("small", "-small")):
        write(
            fake_run("1b", "base", "off", tokens=toks, capture=capture, **off_fig), f"off{suffix}"
        )
        on = fake_run("1b", "base", "on", tokens=toks, report=exact, capture=capture, **on_fig)
        write(on, f"on{suffix}")
    os.environ[ESTIMATE_ENV] = "0"
    try:
        write(fake_run("1b", "base", "noest", tokens=toks, **off_fig), "noest")
    finally:
        del os.environ[ESTIMATE_ENV]
    for switch, fig, report in (("off", off_fig, None), ("on", on_fig, exact)):
        peak = fake_run(
            "1b", "base", switch, tokens=toks, workload="peak", step=150 * MiB, report=report, **fig
        )
        write(peak, f"{switch}-peak")
        write(peak | {"utilization": 0.9}, f"{switch}-peak-util0.9")  # a limit of its own

    for switch, rate in (("off", 1000.0), ("on", 1010.0)):
        load = fake_run("1b", "draft", switch, tokens=toks, workload="load", **on_fig)
        for repeat in load["load"]["repeats"]:
            repeat["tokens_per_s"] = rate
        load["gpu"] = {"visible_devices": "1"}
        write(load, f"load-{switch}")

    (out / "gpu.txt").write_text("0, NVIDIA H200, 143771 MiB\n1, NVIDIA H200, 143771 MiB\n")
    res = tmp_path / "res"
    assert summarize.main([str(out), "--results", str(res)]) == 0
    doc = json.loads((res / "vllm_graph_memory.json").read_text())
    rows = {(r["size"], r["case"]): r for r in doc["rows"]}
    assert list(rows) == [
        ("1b", "base"),
        ("1b-small", "base"),
        ("1b-peak", "base"),
        ("1b-peak-util0.9", "base"),
    ]
    base = rows[("1b", "base")]
    assert base["noest_estimate_applied_bytes"] == 0
    assert base["budget_minus_taken_noest_bytes"] == -(32 + 36) * MiB
    assert base["over_budget_noest_bytes"] == (32 + 36) * MiB
    assert (base["over_budget_off_bytes"], base["over_budget_on_bytes"]) == (27 * MiB, 0)
    assert base["tokens_equal_noest_off"] is True and base["capture"] == "default"
    assert rows[("1b-small", "base")]["capture"] == "small"
    md = (res / "vllm_graph_memory.md").read_text()
    assert "| 1b | default | base | 41.0 / 30.0 / 0.0 | 34.0 |" in md
    assert "| -27.0 / 0.0 / -68.0 | 27.0 / 0.0 / 68.0 |" in md
    assert "| 1b-small | small | base |" in md
    assert "on 0, NVIDIA H200, 143771 MiB; 1, NVIDIA H200, 143771 MiB, torch" in md

    loads = json.loads((res / "vllm_load.json").read_text())["rows"]
    assert [(r["size"], r["case"], r["ratio_on_off_median"], r["pass"]) for r in loads] == [
        ("1b", "draft", 1.01, True)
    ]
    load_md = (res / "vllm_load.md").read_text()
    assert "| 1b | draft | 4 |" in load_md and "| 1.010 |" in load_md
    printed = capsys.readouterr().out
    assert "[load 1b/draft] PASS" in printed
    assert "baseline 1b/off:" in printed and "baseline 1b-peak" not in printed

    # A later invocation of another case of the same size keeps the other rows,
    # each with its date and commit.
    out2 = tmp_path / "out2"
    out2.mkdir()
    for switch, fig in (("off", off_fig), ("on", on_fig)):
        write(fake_run("1b", "draft", switch, tokens=toks, report=exact, **fig), switch, out2)
    res2 = tmp_path / "res2"
    assert (
        summarize.main(
            [str(out2), "--results", str(res2), "--previous", str(res / "vllm_graph_memory.json")]
        )
        == 0
    )
    doc2 = json.loads((res2 / "vllm_graph_memory.json").read_text())
    assert [(r["size"], r["case"]) for r in doc2["rows"]] == [
        ("1b", "base"),
        ("1b", "draft"),
        ("1b-small", "base"),
        ("1b-peak", "base"),
        ("1b-peak-util0.9", "base"),
    ]
    assert all(r["measured_utc"] and r["commit"] == "abc1234" for r in doc2["rows"])
    assert not (res2 / "vllm_load.json").exists()


def load_run(
    rates: list[float],
    round_: int = 1,
    tokens: list | None = None,
    steps: list[float] | None = None,
    spec: tuple[int, int, int] = (0, 0, 0),
) -> dict:
    """A load run's result: one timed repeat per rate (and step time)."""
    repeats = [
        {"generated_tokens": 3, "tokens_per_s": rate, "step_ms": step}
        for rate, step in zip(rates, steps or [None] * len(rates), strict=True)
    ]
    drafts, draft_tokens, accepted = spec
    load = {
        "num_requests": 2,
        "repeats": repeats,
        "repeats_equal": True,
        "spec": {"drafts": drafts, "draft_tokens": draft_tokens, "accepted_tokens": accepted},
    }
    return {"ok": True, "tokens": tokens or [[1]], "load_round": round_, "load": load}


def _load_cells(row: dict) -> dict[str, str]:
    return dict(zip(summarize.LOAD_COLUMNS, summarize.load_cells(row), strict=True))


def test_load_row_fails_when_on_is_slower_than_the_target_or_tokens_differ():
    row = summarize.build_load_row("1b", "draft", [load_run([1000.0])], [load_run([970.0])])
    assert row["status"] == "FAIL (on/off 0.970)"
    row = summarize.build_load_row("1b", "draft", [load_run([1000.0])], [load_run([980.0])])
    assert row["status"] == "PASS"
    # Faster with the plugin on is the runs' spread, not a cost: shown, not failed.
    row = summarize.build_load_row("1b", "draft", [load_run([1000.0])], [load_run([1100.0])])
    assert (row["ratio_on_off_median"], row["status"]) == (1.1, "PASS")
    row = summarize.build_load_row(
        "1b", "draft", [load_run([1000.0])], [load_run([1000.0], tokens=[[2]])]
    )
    assert row["status"] == "FAIL (tokens differ: on r1 from off r1)"
    row = summarize.build_load_row("1b", "draft", [], [load_run([1000.0], tokens=[[2]])])
    assert row["status"] == "FAIL (tokens missing; no tokens/s)"


def test_load_row_pools_the_rounds_and_checks_the_ratio_of_the_medians():
    # Round 1's off run had one fast repeat: on/off of the best repeats is 0.9,
    # of the medians over both rounds 98 / 97.
    offs = [
        load_run([98.0, 95.0], 2, steps=[3.0, 3.2], spec=(10, 30, 18)),
        load_run([110.0, 96.0], 1, steps=[2.0, 3.1], spec=(10, 30, 12)),
    ]
    ons = [
        load_run([97.0, 99.0], 1, steps=[3.0, 2.9], spec=(10, 30, 15)),
        load_run([96.0, 99.0], 2, steps=[3.1, 2.9], spec=(10, 30, 15)),
    ]
    row = summarize.build_load_row("1b", "draft", offs, ons)
    assert row["tokens_per_s_off"] == {"median": 97.0, "best": 110.0, "lowest": 95.0}
    assert row["tokens_per_s_on"] == {"median": 98.0, "best": 99.0, "lowest": 96.0}
    assert row["ratio_on_off_median"] == round(98 / 97, 4)
    assert row["checks"] == {"tokens": True, "ratio": True} and row["status"] == "PASS"
    assert [(r["round"], r["ratio_on_off"]) for r in row["rounds"]] == [
        (1, round(98 / 103, 4)),
        (2, round(97.5 / 96.5, 4)),
    ]
    assert (row["runs_off"], row["runs_on"]) == (2, 2)
    assert (row["step_ms_off"], row["step_ms_on"]) == (3.05, 2.95)
    assert row["step_ratio_on_off"] == round(2.95 / 3.05, 4)
    assert (row["acceptance_off"], row["mean_acceptance_length_off"]) == (0.5, 2.5)
    assert [r["round"] for r in row["repeats_off"]] == [1, 1, 2, 2]
    cells = _load_cells(row)
    assert cells["runs off / on"] == "2 / 2"
    assert cells["tokens/s off: median (lowest - best)"] == "97 (95 - 110)"
    assert cells["on / off (medians)"] == "1.010"
    assert cells["on / off per round"] == "r1 0.952, r2 1.010"
    assert cells["engine step ms off / on (median)"] == "3.05 / 2.95"
    assert cells["step on / off"] == "0.967"
    # Drift that favours the run that comes later cancels over an ABBA pair.
    drift = summarize.build_load_row(
        "1b",
        "draft",
        [load_run([100.0], 1), load_run([103.0], 2)],
        [load_run([101.0], 1), load_run([102.0], 2)],
    )
    assert drift["ratio_on_off_median"] == 1.0
    assert [r["ratio_on_off"] for r in drift["rounds"]] == [1.01, round(102 / 103, 4)]


def test_load_row_fails_when_any_round_differs_in_its_tokens():
    offs = [load_run([100.0], 1), load_run([100.0], 2)]
    ons = [load_run([100.0], 1), load_run([100.0], 2, tokens=[[1, 9]])]
    row = summarize.build_load_row("1b", "draft", offs, ons)
    assert row["tokens_equal_on_off"] is False and row["tokens_differing"] == ["on r2"]
    assert row["status"] == "FAIL (tokens differ: on r2 from off r1)"
    offs[1]["tokens"] = [[1, 9]]  # off and on of round 2 agree, round 1 does not
    row = summarize.build_load_row("1b", "draft", offs, ons)
    assert row["tokens_differing"] == ["off r2", "on r2"] and not row["pass"]
    assert _load_cells(row)["tokens equal (all runs)"] == "False"


def test_load_row_names_where_each_run_got_its_compiled_graphs(tmp_path):
    """A run that compiled torch.compile's graphs itself, beside runs that loaded
    them from vLLM's cache, is named in the reason its tokens differ."""

    def with_log(run: dict, name: str, text: str) -> dict:
        (tmp_path / name).write_text(text)
        return run | {"_log": str(tmp_path / name)}

    compiled = "[backbone] Compiling a graph for compile range (1, 2048) takes 9.81 s\n"
    cached = "[backbone] Directly load the compiled graph(s) for compile range (1, 2048)\n"
    offs = [with_log(load_run([100.0]), "off.log", compiled)]
    ons = [with_log(load_run([100.0], tokens=[[1, 9]]), "on.log", cached)]
    row = summarize.build_load_row("8b-compile", "accept", offs, ons)
    assert row["compile_sources"] == {"off r1": "compiled", "on r1": "cache"}
    assert row["status"] == (
        "FAIL (tokens differ: on r1 from off r1 (torch.compile: off r1 compiled, on r1 cache))"
    )
    ons = [with_log(load_run([100.0], tokens=[[1, 9]]), "on2.log", compiled)]
    row = summarize.build_load_row("8b-compile", "accept", offs, ons)
    assert row["status"] == "FAIL (tokens differ: on r1 from off r1)"
    full = summarize.build_load_row("1b", "accept", [load_run([1.0])], [load_run([1.0])])
    assert full["compile_sources"] is None


def test_load_rows_from_the_rounds_that_ran(tmp_path, capsys):
    """Round 2 ran on, then its off run was skipped: the row pools what ran and
    says so; the invocation fails, as for any run that did not run."""
    out = tmp_path / "out"
    out.mkdir()
    for name, run in (
        ("1b-draft-off-load", load_run([100.0, 98.0], 1)),
        ("1b-draft-on-load", load_run([99.0, 99.0], 1)),
        ("1b-draft-on-load-r2", load_run([97.0, 101.0], 2)),
    ):
        run |= {"size": "1b", "case": "draft", "workload": "load"}
        run["plugin"] = {"switch": name.split("-")[2]}
        (out / f"{name}.json").write_text(json.dumps(run))
    (out / "skipped.txt").write_text("1b-draft-off-load-r2\n")
    res = tmp_path / "res"
    assert summarize.main([str(out), "--results", str(res)]) == 1
    (row,) = json.loads((res / "vllm_load.json").read_text())["rows"]
    assert (row["runs_off"], row["runs_on"], row["ratio_on_off_median"]) == (1, 2, 1.0)
    assert row["status"] == "PASS"
    cells = _load_cells(row)
    assert (cells["runs off / on"], cells["on / off per round"]) == ("1 / 2", "r1 1.000, r2 -")
    assert "| 1b | draft | 2 | 1 / 2 | 99 (98 - 100) |" in (res / "vllm_load.md").read_text()
    printed = capsys.readouterr().out
    assert "[1b/draft/on/load/round 2] ok" in printed
    assert "SUMMARY: all runs ok=False (3/3), rows PASS=1/1" in printed
    # A run that stopped before its repeats adds nothing either.
    failed = {"ok": False, "stage": "init", "load_round": 2}
    row = summarize.build_load_row("1b", "draft", [load_run([100.0]), failed], [load_run([100.0])])
    assert (row["runs_off"], row["status"]) == (1, "PASS")


def test_load_row_compares_with_no_speculator_and_names_its_commit():
    offs = [load_run([100.0]) | {"commit": "abc"}]
    ons = [load_run([99.0]) | {"commit": "abc"}, load_run([101.0], 2) | {"commit": "abd"}]
    base = [load_run([50.0]), load_run([40.0], 2), {"ok": False}]
    row = summarize.build_load_row("1b", "accept", offs, ons, base)
    assert row["tokens_per_s_no_speculator"] == 45.0
    assert row["ratio_on_no_speculator"] == round(100 / 45, 4)
    assert row["commit"] == "abc abd"
    cells = _load_cells(row)
    assert (cells["on / no speculator"], cells["commit"]) == ("2.222", "abc abd")
    alone = summarize.build_load_row("1b", "base", base, base)
    assert alone["ratio_on_no_speculator"] is None and alone["commit"] is None


def test_load_rows_carried_over_only_if_they_name_their_commit(tmp_path):
    def write(out, name: str, rate: float, commit: str | None) -> None:
        size, case, switch = name.split("-")[:3]
        run = load_run([rate]) | {"size": size, "case": case, "workload": "load"}
        run |= {"plugin": {"switch": switch}, "commit": commit}
        out.mkdir(exist_ok=True)
        (out / f"{name}.json").write_text(json.dumps(run))

    for name in ("tiny-draft-off", "tiny-draft-on", "8b-draft-off", "8b-draft-on"):
        write(tmp_path / "a", name, 10.0, "abc" if name == "tiny-draft-off" else None)
    summarize.main([str(tmp_path / "a"), "--results", str(tmp_path / "ra")])
    for switch in ("off", "on"):
        write(tmp_path / "b", f"1b-draft-{switch}", 100.0, None)
    previous = str(tmp_path / "ra" / "vllm_graph_memory.json")
    summarize.main([str(tmp_path / "b"), "--results", str(tmp_path / "rb"), "--previous", previous])
    doc = json.loads((tmp_path / "rb" / "vllm_load.json").read_text())
    assert doc["schema"] == 3
    assert [(r["size"], r["commit"]) for r in doc["rows"]] == [("1b", None), ("tiny", "abc")]
    markdown = (tmp_path / "rb" / "vllm_load.md").read_text()
    assert "| tiny | draft | 2 | 1 / 1 | 10 (10 - 10) |" in markdown


# ---- the device script's scheduling, with stand-ins for nvidia-smi and python3 ----

FAKE_NVIDIA_SMI = """#!/usr/bin/env bash
for i in $(seq 0 $(( ${FAKE_GPUS:-2} - 1 ))); do
  case "$1" in
    --query-gpu=index) echo "$i" ;;
    --query-gpu=index,uuid) echo "$i, GPU-fake-$i" ;;
    --query-gpu=*) echo "$i, Fake GPU, 1000 MiB, 0 MiB, 0.0" ;;
  esac
done
"""

# Setup steps succeed without doing anything; run_llm.py is FAKE_RUN; the rest
# (memory_budget.py, summarize.py) is the real thing.
FAKE_PYTHON = """#!/usr/bin/env bash
case "$*" in
  *run_llm.py*) exec "$REAL_PYTHON" "$FAKE_RUN" "$@" ;;
  "-m pip "*|*apply_shims.py*|*install_plugin.py*) exit 0 ;;
esac
exec "$REAL_PYTHON" "$@"
"""

FAKE_RUN = """
import argparse, json, os, sys, time
ap = argparse.ArgumentParser()
names = ("size", "case", "plugin", "capture", "allocator", "workload", "gpu-mem-util", "out", "tp")
for name in names:
    ap.add_argument("--" + name)
ap.add_argument("--load-round", type=int)
args, _ = ap.parse_known_args()
start = time.time()
time.sleep(float(os.environ.get("FAKE_RUN_S", "0.5")))
MiB = 1 << 20
total, headroom = 80 << 30, 100 * MiB
init_free = total - (1 << 30)
util = float(args.gpu_mem_util or 0.5)
requested = int(total * util)
over = {"off": 27 * MiB, "noest": 68 * MiB}.get(args.plugin, 0)
rest = init_free - (requested - headroom + over)
mem = {
    "init_free_bytes": init_free, "init_total_bytes": total, "requested_bytes": requested,
    "activation_headroom_bytes": headroom, "free_at_rest_bytes": rest,
    "free_after_step_bytes": rest - 150 * MiB,
}
result = {
    "size": args.size, "case": args.case, "plugin": {"switch": args.plugin},
    "capture": args.capture, "allocator": args.allocator, "workload": args.workload,
    "ok": True, "stage": "done",
    "mem": mem, "tokens": [[1, 2]], "argv": sys.argv[1:], "start": start, "end": time.time(),
    "lane": os.environ.get("CUDA_VISIBLE_DEVICES"), "gpu_memory_utilization": util,
}
if args.workload == "load":
    result["load_round"] = args.load_round
    result["load"] = {"repeats": [{"generated_tokens": 2, "tokens_per_s": 100.0}]}
json.dump(result, open(args.out, "w"))
"""


@pytest.fixture
def device_script(tmp_path):
    """Runs a copy of scripts/device-vllm-e2e.sh in a stand-in repository, with
    nvidia-smi and python3 stand-ins on PATH; returns (run, out dir)."""
    import shutil
    import subprocess
    import tarfile

    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    shutil.copy(os.path.join(SCRIPTS, "device-vllm-e2e.sh"), repo / "scripts")
    os.symlink(os.path.join(SCRIPTS, "vllm_e2e"), repo / "scripts" / "vllm_e2e")
    (repo / ".e2e" / "wheels").mkdir(parents=True)
    (repo / ".e2e" / "wheels" / "x-1-py3-none-any.whl").write_text("")
    with tarfile.open(repo / ".e2e" / "vllm-py.tar.gz", "w:gz"):
        pass
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("nvidia-smi", FAKE_NVIDIA_SMI), ("python3", FAKE_PYTHON)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    (tmp_path / "fake_run.py").write_text(FAKE_RUN)
    out = tmp_path / "out"

    def run(**env: str) -> subprocess.CompletedProcess:
        full = {
            "PATH": f"{bin_dir}:{os.environ['PATH']}",
            "REAL_PYTHON": sys.executable,
            "FAKE_RUN": str(tmp_path / "fake_run.py"),
            "OUT": str(out),
            "E2E_WORK": str(tmp_path / "work"),
            "TRITON_CACHE_DIR": str(tmp_path / "triton"),
            "HOME": str(tmp_path),
            "GRAPHS": "full",  # most tests here: the script's second graph mode
        } | env
        return subprocess.run(
            ["bash", str(repo / "scripts" / "device-vllm-e2e.sh")],
            env=full,
            capture_output=True,
            text=True,
            timeout=120,
        )

    return run, out


def _runs(out) -> dict[str, dict]:
    return {
        p.name[: -len(".json")]: json.loads(p.read_text())
        for p in out.glob("*.json")
        if not p.name.startswith("plan-")
    }


def _overlap(a: dict, b: dict) -> bool:
    return a["start"] < b["end"] and b["start"] < a["end"]


def test_device_script_default_graph_mode_is_vllms_with_one_compile_warm_up_per_case(
    device_script, tmp_path
):
    """Without GRAPHS, vLLM's default (torch.compile): before the first measured run
    of a (size, case), one unmeasured run without the plugin fills the compile
    cache; it is not among the results, and the next invocation needs none."""
    run, out = device_script
    done = run(SIZES="tiny", CASES="base draft", PLUGIN="off on", GRAPHS="", GPUS="0")
    runs = _runs(out)
    assert sorted(runs) == sorted(
        f"tiny-{c}-{p}-compile" for c in ("base", "draft") for p in ("off", "on")
    )
    work = tmp_path / "work"
    for case in ("base", "draft"):
        warm = json.loads((work / f"compile-warmup-tiny-{case}-default.json").read_text())
        assert warm["plugin"] == {"switch": "none"} and "compile" in warm["argv"]
        measured = [runs[f"tiny-{case}-{p}-compile"] for p in ("off", "on")]
        assert all(warm["end"] <= r["start"] for r in measured)
        assert (out / f"compile-warmup-tiny-{case}-default.txt").exists()
    assert done.stdout.count("compile cache warm-up") == 2
    again = run(SIZES="tiny", CASES="base", PLUGIN="on", GRAPHS="", GPUS="0")
    assert "run tiny-base-on-compile rc=0" in again.stdout
    assert "compile cache warm-up" not in again.stdout
    # vLLM's compile cache is keyed by the capture sizes too: another set, another warm-up.
    small = run(SIZES="tiny", CASES="base", PLUGIN="on", GRAPHS="", GPUS="0", CAPTURE="small")
    assert "compile cache warm-up tiny-base-small rc=0" in small.stdout


def test_device_script_serve_mode_refuses_what_it_does_not_run(device_script):
    run, _ = device_script
    for env, says in (
        ({"PLUGIN": "on"}, 'MODE=serve runs PLUGIN="off on" only'),
        ({"TP": "2"}, "MODE=serve runs TP=1"),
        ({"CAPTURE": "small"}, "MODE=serve runs TP=1, CAPTURE=default"),
    ):
        done = run(MODE="serve", **env)
        assert done.returncode == 2 and says in done.stdout, done.stdout


def test_device_script_runs_one_run_per_gpu_at_a_time(device_script):
    run, out = device_script
    done = run(SIZES="tiny", CASES="base draft ngram", PLUGIN="off on")
    assert "lanes (CUDA_VISIBLE_DEVICES): 0 1" in done.stdout, done.stdout + done.stderr
    runs = _runs(out)
    assert sorted(runs) == sorted(
        f"tiny-{c}-{p}" for c in ("base", "draft", "ngram") for p in ("off", "on")
    )
    lanes = {r["lane"] for r in runs.values()}
    assert lanes == {"0", "1"}
    pairs = [(a, b) for a in runs.values() for b in runs.values() if a is not b]
    assert not [(a, b) for a, b in pairs if a["lane"] == b["lane"] and _overlap(a, b)]
    assert [(a, b) for a, b in pairs if a["lane"] != b["lane"] and _overlap(a, b)]
    assert (out / "bench" / "results" / "vllm_graph_memory.md").exists()
    assert "SUMMARY: all runs ok=True (6/6)" in done.stdout


def _arg(run: dict, name: str) -> str:
    return run["argv"][run["argv"].index(name) + 1]


def test_device_script_runs_each_load_round_on_one_gpu_and_rounds_at_once(device_script):
    run, out = device_script
    out.mkdir()
    # A third round of an earlier invocation, and a round of one at TP=2.
    stale = out / "tiny-draft-on-load-r3.json"
    stale.write_text(json.dumps({"size": "tiny", "case": "draft", "workload": "load"}))
    (out / "tiny-draft-on-load-r3.log").write_text("")
    (out / "tiny-draft-on-load-r2-tp2.log").write_text("")
    done = run(MODE="load", SIZES="tiny", CASES="base draft", LOAD_REQUESTS="8")
    assert not (out / "tiny-draft-on-load-r3.log").exists()
    assert (out / "tiny-draft-on-load-r2-tp2.log").exists()
    runs = _runs(out)
    assert sorted(runs) == sorted(
        f"tiny-{c}-{p}-load{r}"
        for c in ("base", "draft")
        for p in ("off", "on")
        for r in ("", "-r2")
    ), done.stdout + done.stderr
    for case in ("base", "draft"):
        # ABBA: off, on in round 1, on, off in round 2; a round's runs one after the
        # other on one lane.
        rounds = [
            [runs[f"tiny-{case}-{n}"] for n in ("off-load", "on-load")],
            [runs[f"tiny-{case}-{n}"] for n in ("on-load-r2", "off-load-r2")],
        ]
        for number, order in enumerate(rounds, 1):
            assert len({r["lane"] for r in order}) == 1
            assert order[0]["end"] <= order[1]["start"]
            assert [_arg(r, "--load-round") for r in order] == [str(number)] * 2
            assert [r["load_round"] for r in order] == [number] * 2
        assert _arg(rounds[0][0], "--load-requests") == "8"
    # Two lanes: the rounds of a case run at once, one per lane.
    first, second = runs["tiny-base-off-load"], runs["tiny-base-on-load-r2"]
    assert first["lane"] != second["lane"]
    assert second["start"] < first["end"] and first["start"] < second["end"]
    loads = json.loads((out / "bench" / "results" / "vllm_load.json").read_text())["rows"]
    assert [(r["case"], r["runs_off"], r["runs_on"]) for r in loads] == [
        ("base", 2, 2),
        ("draft", 2, 2),
    ]
    three = run(MODE="load", SIZES="tiny", CASES="draft", GPUS="0", LOAD_ROUNDS="3")
    runs = _runs(out)
    order = sorted(
        (r for n, r in runs.items() if n.startswith("tiny-draft-")), key=lambda r: r["start"]
    )
    assert [(r["plugin"]["switch"], r["load_round"]) for r in order] == [
        ("off", 1),
        ("on", 1),
        ("on", 2),
        ("off", 2),
        ("off", 3),
        ("on", 3),
    ], three.stdout + three.stderr
    refused = run(MODE="load", LOAD_ROUNDS="0")
    assert refused.returncode == 2 and "LOAD_ROUNDS must be a positive integer" in refused.stdout


def test_device_script_skips_runs_past_the_budget(device_script):
    run, out = device_script
    done = run(SIZES="tiny", CASES="base", BUDGET="40")
    assert sorted((out / "skipped.txt").read_text().split()) == ["tiny-base-off", "tiny-base-on"]
    assert not _runs(out)
    assert (out / "bench" / "results" / "vllm_graph_memory.json").exists(), done.stdout
    run(MODE="load", SIZES="tiny", CASES="base", BUDGET="40")  # each round's runs, one by one
    assert sorted((out / "skipped.txt").read_text().split()) == [
        "tiny-base-off-load",
        "tiny-base-off-load-r2",
        "tiny-base-on-load",
        "tiny-base-on-load-r2",
    ]


def test_device_script_packs_tensor_parallel_gpu_groups(device_script):
    run, out = device_script
    done = run(SIZES="tiny", CASES="base", TP="2", FAKE_GPUS="4")
    assert "lanes (CUDA_VISIBLE_DEVICES): 0,1 2,3" in done.stdout, done.stdout + done.stderr
    runs = _runs(out)
    assert {r["lane"] for r in runs.values()} == {"0,1", "2,3"}
    assert set(runs) == {"tiny-base-off-tp2", "tiny-base-on-tp2"}
    assert all("--tp" in r["argv"] for r in runs.values())
    limited = run(SIZES="tiny", CASES="base", PLUGIN="on", CUDA_VISIBLE_DEVICES="3,1")
    assert "lanes (CUDA_VISIBLE_DEVICES): 3 1" in limited.stdout, limited.stdout
    refused = run(TP="2", FAKE_GPUS="1")
    assert refused.returncode == 2 and "TP=2 needs 2 GPUs" in refused.stdout


def test_device_script_puts_both_allocators_into_one_table(device_script):
    run, out = device_script
    run(SIZES="tiny", CASES="base", GPUS="0")
    done = run(SIZES="tiny", CASES="base", GPUS="0", ALLOCATOR="expandable")
    runs = _runs(out)
    assert set(runs) == {f"tiny-base-{p}{a}" for p in ("off", "on") for a in ("", "-expandable")}, (
        done.stdout + done.stderr
    )
    assert {_arg(r, "--allocator") for n, r in runs.items() if "expandable" in n} == {"expandable"}
    assert {_arg(r, "--allocator") for n, r in runs.items() if "expandable" not in n} == {"default"}
    table = (out / "bench" / "results" / "vllm_graph_memory.md").read_text()
    assert "| tiny | default | base |" in table and "| tiny-expandable | default | base |" in table
    assert "allocator: expandable segments" in table
    refused = run(ALLOCATOR="cumem")
    assert refused.returncode == 2 and "unknown ALLOCATOR 'cumem'" in refused.stdout


def test_device_script_flags_for_a_full_step_at_a_chosen_limit_and_memory_history(device_script):
    run, out = device_script
    done = run(
        SIZES="tiny", CASES="base", PLUGIN="on", WORKLOAD="peak", UTIL="0.9", MEMORY_HISTORY="1"
    )
    runs = _runs(out)
    assert set(runs) == {"tiny-base-on-peak-util0.9"}, done.stdout + done.stderr
    assert "no plugin commit known (no git here): set COMMIT" in done.stdout
    r = runs["tiny-base-on-peak-util0.9"]
    assert (_arg(r, "--workload"), _arg(r, "--gpu-mem-util")) == ("peak", "0.9")
    assert _arg(r, "--memory-history") == str(out / "tiny-base-on-peak-util0.9.pickle")
    for bad, message in (
        ({"WORKLOAD": "tight"}, "unknown WORKLOAD 'tight'"),
        ({"UTIL": "1.5"}, "UTIL must be a gpu_memory_utilization in (0, 1], got '1.5'"),
        ({"UTIL": "0"}, "got '0'"),
        ({"MEMORY_HISTORY": "1", "TP": "2"}, "MEMORY_HISTORY=1 records at TP=1 only"),
        ({"MODE": "serve", "UTIL": "0.9"}, "MODE=serve takes neither UTIL nor MEMORY_HISTORY"),
        ({"MODE": "tight"}, "unknown MODE 'tight'"),
    ):
        refused = run(**bad)
        assert refused.returncode == 2 and message in refused.stdout


# ---- tensor parallelism (--tp > 1) ----------------------------------------------


def _tp_args(tp: int, custom_all_reduce: bool = False) -> SimpleNamespace:
    return SimpleNamespace(
        case="draft",
        model="m",
        draft="d",
        eagle="e",
        num_spec=3,
        dtype="float32",
        gpu_mem_util=0.1,
        tp=tp,
        custom_all_reduce=custom_all_reduce,
    )


def test_engine_kwargs_for_tensor_parallelism():
    preset = run_llm.SIZES["tiny"]
    tp_keys = {
        "tensor_parallel_size",
        "distributed_executor_backend",
        "disable_custom_all_reduce",
        "worker_extension_cls",
    }
    one = run_llm.llm_kwargs(_tp_args(1), preset)
    legacy = _tp_args(1)
    del legacy.tp, legacy.custom_all_reduce
    assert one == run_llm.llm_kwargs(legacy, preset)  # TP=1: the arguments of earlier runs
    assert not tp_keys & set(one)
    two = run_llm.llm_kwargs(_tp_args(2), preset)
    assert {k: two[k] for k in tp_keys} == {
        "tensor_parallel_size": 2,
        "distributed_executor_backend": "mp",
        "disable_custom_all_reduce": True,
        "worker_extension_cls": "run_llm.E2EWorkerExtension",
    }
    assert {k: v for k, v in two.items() if k not in tp_keys} == one
    assert run_llm.llm_kwargs(_tp_args(2, True), preset)["disable_custom_all_reduce"] is False
    module, cls = run_llm.WORKER_EXTENSION.rsplit(".", 1)
    assert module == "run_llm" and hasattr(run_llm, cls)


@pytest.fixture
def worker_state(monkeypatch, tmp_path):
    """A fresh per-process state of the worker extension, a rank directory, and
    no CUDA needed for the weight refill."""
    monkeypatch.setattr(
        e2e_worker, "STATE", {"mem": None, "installed": None, "plugin_log": [], "cuda": None}
    )
    rank_dir = tmp_path / "run.json.ranks"
    rank_dir.mkdir()
    monkeypatch.setenv(run_llm.RANK_DIR_ENV, str(rank_dir))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    return rank_dir


def test_worker_extension_measures_and_reports_a_rank(worker_state):
    cuda = FakeCuda()
    runner_cls, worker_cls = fake_classes(cuda, 41 * MiB, 2 * MiB, 36 * MiB, 7 << 30)
    report = _plugin_report({"target": 36 * MiB}, {"target": 36 * MiB})
    mem = e2e_worker.install_in_worker(1, runner_cls, worker_cls, cuda)
    assert e2e_worker.install_in_worker(1, runner_cls, worker_cls, cuda) is mem  # once per process
    assert json.loads((worker_state / "rank1.json").read_text())["mem"] == {}
    worker_cls().determine_available_memory()
    runner_cls().capture_model()

    # What the rank left on disk as it measured, for a run that fails later on.
    on_disk = run_llm.read_rank_files(str(worker_state))
    assert [r["rank"] for r in on_disk] == [1]
    assert on_disk[0]["mem"]["profile_estimate_bytes"] == 41 * MiB
    assert on_disk[0]["mem"]["capture_actual_bytes"] == 36 * MiB

    runner = runner_cls()
    runner.specgraph_profile = SimpleNamespace(to_dict=lambda: report)
    worker = SimpleNamespace(rank=1, local_rank=1, model_runner=runner)
    record = e2e_worker.E2EWorkerExtension.e2e_rank_record(worker, "on")
    assert record["rank"] == 1 and record["local_rank"] == 1
    assert record["mem"]["profile_estimate_bytes"] == 41 * MiB
    assert record["mem"]["profile_driver_left_taken"] == 2 * MiB
    assert record["mem"]["capture_actual_bytes"] == 36 * MiB
    assert record["mem"]["kv_cache_bytes"] == 7 << 30
    assert record["plugin_report"] == report
    assert record["wrappers_intact"] == {
        "profile_cudagraph_memory": True,
        "capture_model": True,
        "determine_available_memory": True,
    }
    assert set(e2e_worker.WORKER_ENV_KEYS) == set(record["env"])
    assert record["plugin"]["switch"] == "on"
    json.dumps(record)  # crosses the process boundary as plain data
    assert run_llm.merge_wrappers_intact(
        [record, record | {"wrappers_intact": {"capture_model": False}}]
    ) == {
        "profile_cudagraph_memory": True,
        "capture_model": False,
        "determine_available_memory": True,
    }


def test_prepare_workers_makes_the_extension_importable(monkeypatch, tmp_path):
    monkeypatch.setenv("PYTHONPATH", "/some/site")
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p != run_llm.HERE])
    out = str(tmp_path / "tiny-base-on-tp2.json")
    os.makedirs(out + ".ranks")
    (tmp_path / "tiny-base-on-tp2.json.ranks" / "rank0.json").write_text('{"rank": 0}')
    env = run_llm.prepare_workers(out)
    assert env["PYTHONPATH"].split(os.pathsep) == [run_llm.HERE, "/some/site"]
    assert os.environ[run_llm.RANK_DIR_ENV] == out + ".ranks"
    assert os.listdir(out + ".ranks") == []  # a previous run's figures are gone
    assert run_llm.HERE in sys.path
    run_llm.prepare_workers(out)
    assert os.environ["PYTHONPATH"].count(run_llm.HERE) == 1


class _Split(torch.nn.Module):
    """A layer with a weight and a bias and vLLM's ``tp_size`` attribute."""

    def __init__(self, rows: int, cols: int, tp_size: int, bias: bool = True) -> None:
        super().__init__()
        self.tp_size = tp_size
        self.weight = torch.nn.Parameter(torch.zeros(rows, cols))
        self.bias = torch.nn.Parameter(torch.zeros(rows)) if bias else None


class _Column(_Split):
    pass


class _Row(_Split):
    pass


class _Vocab(_Split):
    pass


class _Replicated(_Split):
    pass


class _TinyModel(torch.nn.Module):
    def __init__(self, tp_size: int, embed: _Vocab | None = None) -> None:
        super().__init__()
        self.embed_tokens = embed if embed is not None else _Vocab(8, 4, tp_size, bias=False)
        self.qkv = _Column(6, 4, tp_size)
        self.o_proj = _Row(4, 3, tp_size)
        self.fc = _Replicated(4, 4, tp_size)
        self.norm = torch.nn.Module()
        self.norm.weight = torch.nn.Parameter(torch.zeros(4))


SPLIT = ((_Column, _Vocab), (_Row,))


def test_sharded_parameter_names():
    names = e2e_worker.sharded_parameter_names(_TinyModel(2), *SPLIT)
    assert names == {"embed_tokens.weight", "qkv.weight", "qkv.bias", "o_proj.weight"}
    assert e2e_worker.sharded_parameter_names(_TinyModel(1), *SPLIT) == set()


def test_reinit_weights_seeds_shards_per_rank(worker_state, monkeypatch):
    real = e2e_worker.sharded_parameter_names
    monkeypatch.setattr(e2e_worker, "sharded_parameter_names", lambda m: real(m, *SPLIT))
    models = {}
    for rank in (0, 1):
        target = _TinyModel(2)
        draft = _TinyModel(2, embed=target.embed_tokens)  # an EAGLE head shares the embedding
        runner = SimpleNamespace(model=target, speculator=SimpleNamespace(model=draft))
        worker = SimpleNamespace(rank=rank, local_rank=rank, model_runner=runner)
        done = e2e_worker.E2EWorkerExtension.e2e_reinit_weights(worker, 0.05)
        assert done == {
            "rank": rank,
            "tp_rank": rank,
            "params": 8,
            "spec_params": 7,  # all but the shared embedding
            "spec_model": True,
        }
        models[rank] = (target, draft)
    (t0, d0), (t1, _) = models[0], models[1]
    p0, p1 = dict(t0.named_parameters()), dict(t1.named_parameters())
    for name in ("embed_tokens.weight", "qkv.weight", "qkv.bias", "o_proj.weight"):
        assert not torch.equal(p0[name], p1[name]), name  # shards of one tensor differ
    for name in ("o_proj.bias", "fc.weight", "fc.bias"):
        assert torch.equal(p0[name], p1[name]), name  # replicated: the same on every rank
    assert (p0["norm.weight"] == 1).all() and (p1["norm.weight"] == 1).all()
    assert torch.equal(d0.qkv.weight, t0.qkv.weight)  # same name, same seed as the target
    # Rank 0 keeps the name's seed, as at TP=1.
    ref = _TinyModel(1)
    run_llm.reinit_weights(ref, 0.05)
    assert torch.equal(dict(ref.named_parameters())["qkv.weight"], p0["qkv.weight"])


@pytest.mark.vllm
def test_worker_extension_fits_vllms_worker_class():
    """The check vLLM makes before it adds the extension to the worker's bases,
    and the base change itself, on a throwaway subclass."""
    try:
        from vllm.v1.worker.gpu_worker import Worker
    except Exception as e:  # pragma: no cover - environment-dependent
        pytest.skip(f"vllm.v1.worker.gpu_worker not importable here: {e!r}")
    ext = e2e_worker.E2EWorkerExtension
    own = [a for a in dir(ext) if not a.startswith("__")]
    assert own == ["e2e_rank_record", "e2e_reinit_weights", "init_worker_extension"]
    assert not [a for a in own if hasattr(Worker, a)]

    class Probe(Worker):
        pass

    Probe.__bases__ = (*Probe.__bases__, ext)
    assert Probe.e2e_rank_record is ext.e2e_rank_record


@pytest.mark.vllm
def test_worker_extension_hook_installs_on_vllms_classes(
    worker_state, monkeypatch, restore_plugin_loggers
):
    """vLLM calls ``init_worker_extension`` with the worker once its device is
    set: the wrappers go onto MRV2's runner and the GPU worker class (as at
    TP=1), and a tap inherited through fork is replaced, not doubled."""
    try:
        from vllm.v1.worker import gpu_worker
        from vllm.v1.worker.gpu import model_runner as mr2
    except Exception as e:  # pragma: no cover - environment-dependent
        pytest.skip(f"vLLM's worker modules not importable here: {e!r}")
    calls = []
    monkeypatch.setattr(e2e_worker, "install_in_worker", lambda *a: calls.append(a))

    class PluginLogTap(logging.Handler):  # what a forked worker inherits
        def emit(self, record: logging.LogRecord) -> None:
            pass

    inherited = logging.getLogger(run_llm.PLUGIN_LOGGERS[0])
    inherited.addHandler(PluginLogTap())
    e2e_worker.E2EWorkerExtension.init_worker_extension(SimpleNamespace(rank=1))
    assert calls == [(1, mr2.GPUModelRunner, gpu_worker.Worker, torch.cuda)]
    for name in run_llm.PLUGIN_LOGGERS:
        taps = [h for h in logging.getLogger(name).handlers if type(h).__name__ == "PluginLogTap"]
        assert len(taps) == 1 and taps[0].sink is e2e_worker.STATE["plugin_log"], name


def fake_tp_run(
    size: str, case: str, plugin: str, ranks: list[dict], tokens: list[list[int]]
) -> dict:
    """A run_llm.py --tp result: run-level fields from the driver, one record per
    rank built by the harness's own wrappers."""
    records = []
    for i, fig in enumerate(ranks):
        one = fake_run(size, case, plugin, tokens=tokens, **fig)
        records.append(
            {
                "rank": i,
                "mem": one["mem"],
                "plugin_report": one["plugin_report"],
                "wrappers_intact": one["plugin"]["wrappers_intact"],
            }
        )
    run = fake_run(size, case, plugin, tokens=tokens, **ranks[0])
    del run["mem"], run["plugin_report"]
    return run | {"tp": len(ranks), "ranks": records}


def _write_tp(outdir, run: dict) -> None:
    name = f"{run['size']}-{run['case']}-{run['plugin']['switch']}-tp{run['tp']}.json"
    with open(os.path.join(outdir, name), "w") as f:
        json.dump(run, f)


def test_summarize_tensor_parallel_rows_check_every_rank(tmp_path, capsys):
    toks = [[5, 6, 7]]
    exact = _plugin_report({"target": 30 * MiB}, {"target": 30 * MiB})
    off_rank = {"est": 41 * MiB, "retained": 32 * MiB, "actual": 36 * MiB, "kv": 7 << 30}
    on_ok = {"est": 30 * MiB, "retained": 0, "actual": 30 * MiB, "kv": 8 << 30, "report": exact}
    on_kept = on_ok | {"retained": 6 * MiB}  # rank 1 leaves 6 MiB after its profile
    out = tmp_path / "out"
    out.mkdir()
    _write(out, fake_run("tiny", "base", "off", tokens=toks, **off_rank))
    _write(out, fake_run("tiny", "base", "on", tokens=toks, **on_ok))
    _write_tp(out, fake_tp_run("tiny", "base", "off", [off_rank, off_rank], toks))
    _write_tp(out, fake_tp_run("tiny", "base", "on", [on_ok, on_kept], toks))
    _write_tp(out, fake_tp_run("tiny", "eagle", "off", [off_rank, off_rank], toks))
    _write_tp(out, fake_tp_run("tiny", "eagle", "on", [on_ok, on_ok], toks))
    res = tmp_path / "res"
    assert summarize.main([str(out), "--results", str(res)]) == 1
    doc = json.loads((res / "vllm_graph_memory.json").read_text())
    rows = {(r["size"], r["case"]): r for r in doc["rows"]}
    assert list(rows) == [("tiny", "base"), ("tiny-tp2", "base"), ("tiny-tp2", "eagle")]
    assert list(doc["sizes"]) == ["tiny", "tiny-tp2"]
    assert rows[("tiny", "base")]["pass"] and "ranks" not in rows[("tiny", "base")]

    base = rows[("tiny-tp2", "base")]
    assert (base["tp"], base["worst_rank"]) == (2, 1)
    assert base["retained_on_bytes"] == 6 * MiB  # the worst rank's figures
    assert [r["retained_on_bytes"] for r in base["ranks"]] == [0, 6 * MiB]
    assert [r["pass"] for r in base["ranks"]] == [True, False]
    assert base["checks"] == {"estimate": True, "retained": False, "tokens": True}
    assert not base["pass"] and base["status"] == "FAIL (rank 1: retained 6.0 MiB)"
    eagle = rows[("tiny-tp2", "eagle")]
    assert eagle["pass"] and eagle["status"] == "PASS"
    assert eagle["plugin_error_bytes"] == 0 and eagle["upstream_error_bytes"] == 5 * MiB

    md = (res / "vllm_graph_memory.md").read_text()
    assert "| tiny-tp2 | default | base [rank 1 of 2] | 41.0 / 30.0 |" in md
    assert "| tiny | default | base | 41.0 / 30.0 |" in md
    runs = {(r["size"], r["case"], r["plugin"]["switch"]): r for r in doc["runs"]}
    assert len(runs[("tiny-tp2", "base", "on")]["ranks"]) == 2
    assert "ranks" not in runs[("tiny", "base", "on")]
    printed = capsys.readouterr().out
    assert "rank 1 (pid None, None): graph memory MiB: estimate=30.0 actual=30.0" in printed
    assert "SUMMARY: all runs ok=True (6/6), rows PASS=2/3" in printed


def test_rank_figures_never_stop_the_engine(tmp_path, capsys):
    figures = e2e_worker.RankFigures(0, str(tmp_path / "missing-dir" / "rank0.json"))
    figures["kv_cache_bytes"] = 1  # the directory is gone: reported, not raised
    assert figures == {"kv_cache_bytes": 1}
    assert "cannot write" in capsys.readouterr().err


def test_plugin_share_counts_the_package_own_time_per_step(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "hot.py").write_text("def wrapper(fn):\n    return fn()\n")
    sys.path.insert(0, str(tmp_path))
    try:
        from pkg import hot
    finally:
        sys.path.remove(str(tmp_path))
    steps = [0]

    def work():
        return sum(i * i for i in range(2000))

    def generate(requests):
        for _ in requests:
            steps[0] += 1
            hot.wrapper(work)
        return [[1]] * len(requests)

    share = workloads.plugin_share(
        generate, [([1], 1)] * 50, str(package) + os.sep, lambda: steps[0]
    )
    assert share["engine_steps"] == 50 and share["plugin_calls_per_step"] == 1.0
    assert 0 < share["plugin_share"] < 0.5 and share["plugin_s"] < share["profiled_s"]
    assert share["plugin_top"][0].startswith("wrapper ")


def test_load_row_checks_the_plugin_share_where_it_was_measured():
    def on_run(rate: float, share: float) -> dict:
        run = load_run([rate])
        run["load"]["plugin_share"] = {"plugin_share": share, "plugin_us_per_step": 12.0}
        return run

    # Wall-clock spread of a host-bound step is shown, the measured share decides.
    row = summarize.build_load_row("1b", "accept", [load_run([1000.0])], [on_run(900.0, 0.0004)])
    assert (row["status"], row["ratio_on_off_median"]) == ("PASS", 0.9)
    assert _load_cells(row)["plugin share of a step (us)"] == "0.040% (12)"
    row = summarize.build_load_row(
        "1b", "accept", [load_run([1000.0])], [on_run(1000.0, 0.001), on_run(1000.0, 0.03)]
    )
    assert row["status"] == "FAIL (plugin share 3.00%)"


def test_load_rows_never_pool_runs_of_another_workload():
    def run(rate: float, requests: int, tokens: list) -> dict:
        r = load_run([rate], tokens=tokens)
        r["load"]["num_requests"] = requests
        return r

    runs = {
        ("1b", "accept", "off"): [run(100.0, 128, [[1]])],
        ("1b", "accept", "on"): [run(99.0, 128, [[1]]), run(50.0, 96, [[2]])],
        ("1b", "base", "off"): [run(40.0, 128, [[3]]), {"ok": False, "stage": "init"}],
    }
    rows = summarize.load_rows(runs)
    assert [(r["case"], r["num_requests"], r["runs_off"], r["runs_on"]) for r in rows] == [
        ("base", 128, 1, 0),
        ("accept", 96, 0, 1),
        ("accept", 128, 1, 1),
    ]
    assert rows[2]["tokens_equal_on_off"] is True and rows[2]["ratio_on_off_median"] == 0.99
    assert rows[2]["tokens_per_s_no_speculator"] == 40.0
