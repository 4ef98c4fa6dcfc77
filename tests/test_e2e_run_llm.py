"""run_llm.py on a CPU: its switches, wrappers, workloads and worker extension against
stand-ins for vLLM's runner, worker and ``torch.cuda`` (the GPU and vLLM's engine are
what is faked)."""

from __future__ import annotations

import json
import logging
import os
import sys
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from tests.e2e_fakes import (
    ESTIMATE_ENV,
    EXACT,
    HEADROOM,
    KV_MAX,
    ONCE,
    UPSTREAM,
    FakeCuda,
    MiB,
    fake_classes,
    fake_run,
    metrics,
    once_run,
    pick,
    run_llm,
    summarize,
)

# ---- run_llm.py ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("switch", "allocator", "env"),
    [
        ("on", "default", "specgraph None None None None"),
        ("off", "expandable", "specgraph 0 None expandable_segments:True None"),
        ("none", "default", " None None None None"),
        ("noest", "default", "specgraph 0 0 None None"),
        ("once", "default", "specgraph None None None capture-once"),
    ],
)
def test_plugin_and_allocator_switches_set_the_environment(monkeypatch, switch, allocator, env):
    # Inherited values must not turn one switch into another.
    inherited = {"VLLM_SPECGRAPH": "0", "VLLM_PLUGINS": "other", ESTIMATE_ENV: "7"}
    inherited[run_llm.PROFILE_ENV] = "extrapolate"
    inherited |= {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:64", "PYTORCH_ALLOC_CONF": "x"}
    for key, value in inherited.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    got = run_llm.set_env(switch, allocator)
    assert " ".join(map(str, got.values())) == env
    assert got == {k: os.environ.get(k) for k in got}
    assert "PYTORCH_ALLOC_CONF" not in os.environ and os.environ["VLLM_USE_V2_MODEL_RUNNER"] == "1"
    assert run_llm.estimate_applied() is (switch != "noest")
    with pytest.raises(ValueError, match="allocator must be one of"):
        run_llm.set_env("on", "cumem")


def test_wrappers_record_what_vllm_returned_the_budget_and_the_step():
    r = fake_run("tiny", "base", "off", [[1, 2]], UPSTREAM, step=150 * MiB)
    m = {k: v // MiB if isinstance(v, int) and v > 1000 else v for k, v in r["mem"].items()}
    assert pick([m], "profile_estimate_bytes worker_cudagraph_memory_estimate") == "41 41"
    assert pick([m], "profile_driver_left_taken profile_driver_left_taken_after_empty_cache") == (
        "32 32"
    )
    assert pick([m], "capture_actual_bytes capture_driver_delta kv_cache_bytes") == "36 36 7168"
    assert pick([m], "capture_calls profile_only_capture_calls capture_started") == "1 1 True"
    assert pick([m], "requested_bytes activation_headroom_bytes non_kv_bytes") == "7309 100 100"
    assert m["graph_estimate_applied_bytes"] == 41 and r["mem"]["profile_wall_s"] >= 0
    # Held since the snapshot: retained + KV + actual; the limit at rest is requested -
    # headroom = KV + estimate: over by retained + actual - estimate.
    assert summarize.over_budget_bytes(r["mem"]) == (32 + 36 - 41) * MiB
    assert m["free_at_rest_bytes"] - m["free_after_step_bytes"] == 150
    assert m["step_reserved_peak_bytes"] == 150
    assert r["tokens"] == [[1, 2]] and r["spec"]["acceptance_rate"] == 0.4
    assert r["sampled_with"] == [None] and all(r["plugin"]["wrappers_intact"].values())
    assert run_llm.worker_budget(SimpleNamespace(), True) == {}


def test_wrappers_notice_a_replaced_method_and_noest_subtracts_nothing(monkeypatch):
    cuda = FakeCuda()
    runner_cls, worker_cls = fake_classes(cuda, 1, 0, 1, 1)
    installed = run_llm.install_wrappers(runner_cls, worker_cls, cuda, {})
    runner_cls.capture_model = lambda self, **kw: 0
    assert run_llm.wrappers_intact(installed)["capture_model"] is False
    monkeypatch.setenv(ESTIMATE_ENV, "0")
    m = fake_run("tiny", "base", "noest", [[1]], UPSTREAM)["mem"]
    assert (m["graph_estimate_applied_bytes"], m["activation_headroom_bytes"]) == (0, HEADROOM)
    assert summarize.over_budget_bytes(m) == (32 + 36) * MiB


def test_once_over_budget_at_rest_counts_the_pages_backed_not_the_range():
    r = once_run("base", [[1]])
    assert r["capture_once"]["num_blocks"] == ONCE["held"] >> 14
    assert r["capture_once_fallback"] is None and r["kv_tokens"] == ONCE["held"] >> 10
    # vLLM reported the reserved most and subtracted nothing for graphs: its limit at
    # rest (requested - headroom) is the KV budget with nothing taken for graphs.
    keys = "kv_cache_bytes graph_estimate_applied_bytes activation_headroom_bytes"
    assert pick([r["mem"]], keys) == f"{KV_MAX} 0 {HEADROOM}"
    # Held: the pages backed (the budget less what graphs took) and the graphs.
    assert summarize.over_budget_bytes(r["mem"]) == 0
    # Backed to the reserved most: over by what the graphs took.
    assert summarize.over_budget_bytes(once_run("base", [[1]], KV_MAX)["mem"]) == 30 * MiB


@pytest.fixture
def restore_plugin_loggers():
    loggers = [logging.getLogger(name) for name in run_llm.PLUGIN_LOGGERS]
    saved = [(lg, lg.handlers[:], lg.propagate, lg.level) for lg in loggers]
    yield
    for lg, handlers, propagate, level in saved:
        lg.handlers[:], lg.propagate = handlers, propagate
        lg.setLevel(level)


def test_plugin_log_tap_prints_with_its_prefix_and_keeps_the_lines(capsys, restore_plugin_loggers):
    sink: list[str] = []
    run_llm.tap_plugin_logs(sink)
    logging.getLogger("vllm.specgraph.profile").info("estimate %d MiB", 12)
    logging.getLogger("vllm_specgraph").info("loaded")
    assert sink == ["INFO vllm.specgraph.profile: estimate 12 MiB", "INFO vllm_specgraph: loaded"]
    assert capsys.readouterr().out.splitlines() == [f"SPECGRAPH-LOG {line}" for line in sink]


def _kwargs(size: str = "1b", **kw: Any) -> dict:
    args = {"case": "eagle", "model": "m", "draft": "d", "eagle": "e", "num_spec": 3}
    args |= {"dtype": "bfloat16", "gpu_mem_util": 0.5}
    return run_llm.llm_kwargs(SimpleNamespace(**(args | kw)), run_llm.SIZES[size])


def test_sizes_capture_sets_speculators_and_tensor_parallel_engine_arguments():
    for preset in run_llm.SIZES.values():  # the configs exist and the smoke prompts fit them
        for key in ("model", "draft", "eagle"):
            with open(os.path.join(run_llm.CONFIGS, preset[key], "config.json")) as f:
                vocab = json.load(f)["vocab_size"]
            assert all(0 < t < vocab for p in run_llm.prompts_token_ids(6, vocab) for t in p)
    with open(os.path.join(run_llm.CONFIGS, "llama-1b", "config.json")) as f:
        target = json.load(f)
    assert pick([target], "hidden_size num_hidden_layers vocab_size") == "2048 16 128256"
    kw = _kwargs()
    assert pick([kw], "max_num_seqs max_model_len max_num_batched_tokens") == "256 1024 2048"
    assert kw["compilation_config"] == {
        "mode": 3,
        "cudagraph_mode": "FULL_AND_PIECEWISE",
        "custom_ops": ["none"],
    }  # vLLM's default sizes
    assert kw["speculative_config"] == {
        "method": "eagle",
        "model": "e",
        "num_speculative_tokens": 3,
    }
    small = _kwargs(capture="small", graph_mode="full")["compilation_config"]
    assert (small["mode"], small["cudagraph_mode"]) == (0, "FULL")
    assert small["cudagraph_capture_sizes"] == [1, 2, 4, 8, 16, 32]
    assert run_llm.capture_sizes(run_llm.SIZES["tiny"], "default") == [1, 2, 4, 8, 16, 32]
    with pytest.raises(ValueError, match="capture-size set"):
        run_llm.capture_sizes(run_llm.SIZES["1b"], "large")
    specs = {c: run_llm.speculative_config(c, "d", "e", 3, "t") for c in run_llm.CASES}
    assert specs["base"] is None and specs["ngram"]["prompt_lookup_max"] == 4
    assert (specs["draft"]["model"], specs["accept"]["model"]) == ("d", "t")
    one, two = _kwargs("tiny", tp=1), _kwargs("tiny", tp=2)
    tp = {k: two.pop(k) for k in list(two) if k not in one}
    assert two == one and " ".join(map(str, tp.values())) == "2 mp True run_llm.E2EWorkerExtension"
    assert _kwargs(tp=2, custom_all_reduce=True)["disable_custom_all_reduce"] is False


def test_workload_requests_and_spec_counters():
    peak = run_llm.peak_requests(512, 256, 2048)
    assert len(peak) == 256 and sum(len(ids) for ids, _ in peak) == 2048
    assert {n for _, n in peak} == {16}
    assert sum(len(ids) for ids, _ in run_llm.peak_requests(512, 8, 515)) == 515
    with pytest.raises(ValueError, match="at least max_num_seqs"):
        run_llm.peak_requests(512, 8, 4)
    load = run_llm.load_requests(128256, 256, 1024, seed=0)
    assert load == run_llm.load_requests(128256, 256, 1024, seed=0)
    assert load != run_llm.load_requests(128256, 256, 1024, seed=1)
    assert all(16 <= len(ids) <= 512 and 16 <= n <= 256 for ids, n in load)
    assert all(0 < t < 128255 for ids, _ in load for t in ids)
    assert len({len(ids) for ids, _ in load}) > 50 and len({n for _, n in load}) > 50
    with pytest.raises(ValueError, match="max_model_len"):
        run_llm.load_requests(512, 1, 32, seed=0)
    before = run_llm.read_spec_counters(metrics(10, 30, 12, steps=40))
    assert before["vllm:iteration_tokens_total"] == 40 and "vllm:num_requests_running" not in before
    after = run_llm.read_spec_counters(metrics(20, 60, 27))
    after["vllm:spec_decode_num_accepted_tokens_per_pos"] = [9, 8, 7]
    delta = run_llm.counter_delta(before, after)
    assert delta["vllm:spec_decode_num_accepted_tokens_per_pos"] == [4, 4, 7]
    assert " ".join(map(str, run_llm.spec_summary(delta).values())) == "10 30 15 0.5 2.5"
    assert run_llm.spec_summary({})["acceptance_rate"] is None


def test_run_load_times_only_the_repeats_and_counts_only_their_drafts():
    ticks, calls = iter(range(100)), []

    def generate(requests: list) -> list[list[int]]:
        calls.append(len(requests))
        return [[7] * n for _, n in requests]

    def counters() -> dict:
        # Every request drafts 3 times (9 tokens); a timed one has 6 accepted, the
        # warm-up's none (counted in, it would lower the rate); 5 engine steps each.
        n = sum(calls)
        return run_llm.read_spec_counters(metrics(3 * n, 9 * n, 6 * sum(calls[1:]), steps=5 * n))

    requests, clock = [([1, 2], 5), ([3], 7)], lambda: float(next(ticks))
    out = run_llm.run_load(generate, counters, requests, [([1], 2)], repeats=2, clock=clock)
    assert calls == [1, 2, 2]  # the warm-up first, then the timed repeats
    repeats = "wall_s generated_tokens tokens_per_s engine_steps step_ms"
    assert pick(out["repeats"], repeats) == "1.0 12 12.0 10 100.0; 1.0 12 12.0 10 100.0"
    assert pick([out], "step_ms_median tokens_per_s_best tokens_per_s_median") == "100.0 12.0 12.0"
    assert out["repeats_equal"] is True and out["tokens"] == [[7] * 5, [7] * 7]
    assert out["spec"]["drafts"] == 12 and out["spec"]["acceptance_rate"] == round(24 / 36, 4)
    assert pick([out], "num_requests prompt_tokens max_tokens") == "2 3 12"
    flaky = iter([[[1]], [[1]], [[2]]])
    assert not run_llm.run_load(lambda r: next(flaky), dict, [([1], 1)], [], 2)["repeats_equal"]
    with pytest.raises(ValueError, match="repeats"):
        run_llm.run_load(generate, dict, [], [], repeats=0)
    r = fake_run("1b", "draft", "on", [[4]], EXACT, workload="load")
    assert r["tokens"] == [[4]] and "tokens" not in r["load"] and len(r["load"]["repeats"]) == 2
    assert r["generate_s"] == sum(x["wall_s"] for x in r["load"]["repeats"])
    assert "free_at_rest_bytes" in r["mem"] and "free_after_step_bytes" not in r["mem"]
    peak = fake_run("1b", "base", "on", [[1]], EXACT, workload="peak")
    assert peak["sampled_with"] == [run_llm.PEAK_SAMPLING] and run_llm.PEAK_SAMPLING["logprobs"]


def test_plugin_share_counts_the_package_own_time_per_step(tmp_path, monkeypatch):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "hot.py").write_text("def wrapper(fn):\n    return fn()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    from pkg import hot

    steps = [0]

    def generate(requests: list) -> list:
        for _ in requests:
            steps[0] += 1
            hot.wrapper(lambda: sum(i * i for i in range(2000)))
        return [[1]] * len(requests)

    share = run_llm.plugin_share(generate, [([1], 1)] * 50, f"{tmp_path}/pkg/", lambda: steps[0])
    assert share["engine_steps"] == 50 and share["plugin_calls_per_step"] == 1.0
    assert 0 < share["plugin_share"] < 0.5 and share["plugin_s"] < share["profiled_s"]
    assert share["plugin_top"][0].startswith("wrapper ")


# ---- the worker extension (TP > 1) -----------------------------------------------------


@pytest.fixture
def worker_state(monkeypatch, tmp_path):
    """A fresh per-process state of the extension, a rank directory, no CUDA needed."""
    state = {"mem": None, "installed": None, "plugin_log": [], "cuda": None}
    monkeypatch.setattr(run_llm, "STATE", state)
    (rank_dir := tmp_path / "run.json.ranks").mkdir()
    monkeypatch.setenv(run_llm.RANK_DIR_ENV, str(rank_dir))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    return rank_dir


def test_worker_extension_measures_and_reports_a_rank(worker_state, capsys):
    cuda = FakeCuda()
    runner_cls, worker_cls = fake_classes(cuda, 41 * MiB, 2 * MiB, 36 * MiB, 7 << 30)
    mem = run_llm.install_in_worker(1, runner_cls, worker_cls, cuda)
    assert run_llm.install_in_worker(1, runner_cls, worker_cls, cuda) is mem  # once a process
    assert json.loads((worker_state / "rank1.json").read_text())["mem"] == {}
    worker_cls().determine_available_memory()
    runner_cls().capture_model()
    (on_disk,) = run_llm.read_rank_files(str(worker_state))  # for a run that fails later
    assert on_disk["rank"] == 1 and on_disk["mem"]["capture_actual_bytes"] == 36 * MiB
    runner = runner_cls()
    runner.specgraph_profile = SimpleNamespace(to_dict=lambda: {"estimate": None})
    worker = SimpleNamespace(rank=1, local_rank=1, model_runner=runner)
    record = run_llm.E2EWorkerExtension.e2e_rank_record(worker, "on")
    assert (record["rank"], record["local_rank"], record["plugin"]["switch"]) == (1, 1, "on")
    assert record["mem"] == dict(mem) and record["mem"]["profile_driver_left_taken"] == 2 * MiB
    assert record["plugin_report"] == {"estimate": None} and all(record["wrappers_intact"].values())
    assert set(record["env"]) == set(run_llm.WORKER_ENV_KEYS)
    json.dumps(record)  # crosses the process boundary as plain data
    broken = record | {"wrappers_intact": {"capture_model": False}}
    assert run_llm.merge_wrappers_intact([record, broken])["capture_model"] is False
    figures = run_llm.RankFigures(0, str(worker_state / "gone" / "rank0.json"))
    figures["kv_cache_bytes"] = 1  # its directory is gone: said, not raised
    assert figures == {"kv_cache_bytes": 1} and "cannot write" in capsys.readouterr().err


def test_prepare_workers_makes_the_extension_importable(monkeypatch, tmp_path):
    monkeypatch.setenv("PYTHONPATH", "/some/site")
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p != run_llm.HERE])
    out = str(tmp_path / "tiny-base-on-tp2.json")
    os.makedirs(out + ".ranks")
    (tmp_path / "tiny-base-on-tp2.json.ranks" / "rank0.json").write_text('{"rank": 0}')
    env = run_llm.prepare_workers(out)
    assert env["PYTHONPATH"].split(os.pathsep) == [run_llm.HERE, "/some/site"]
    assert os.environ[run_llm.RANK_DIR_ENV] == out + ".ranks" and run_llm.HERE in sys.path
    assert os.listdir(out + ".ranks") == []  # an earlier run's figures are gone
    run_llm.prepare_workers(out)
    assert os.environ["PYTHONPATH"].count(run_llm.HERE) == 1


class _Layer(torch.nn.Module):
    def __init__(self, rows: int, cols: int, tp_size: int, bias: bool = True) -> None:
        super().__init__()
        self.tp_size = tp_size
        self.weight = torch.nn.Parameter(torch.zeros(rows, cols))
        self.bias = torch.nn.Parameter(torch.zeros(rows)) if bias else None


_Column, _Row, _Vocab = (type(n, (_Layer,), {}) for n in ("Column", "Row", "Vocab"))
SPLIT = ((_Column, _Vocab), (_Row,))


def _model(tp_size: int, embed: torch.nn.Module | None = None) -> torch.nn.Module:
    model = torch.nn.Module()
    model.embed_tokens = embed if embed is not None else _Vocab(8, 4, tp_size, bias=False)
    model.qkv, model.o_proj = _Column(6, 4, tp_size), _Row(4, 3, tp_size)
    model.fc, model.norm = _Layer(4, 4, tp_size), torch.nn.Module()
    model.norm.weight = torch.nn.Parameter(torch.zeros(4))
    return model


def test_weights_are_refilled_by_name_and_shards_seeded_per_rank(worker_state, monkeypatch):
    shards = {"embed_tokens.weight", "qkv.weight", "qkv.bias", "o_proj.weight"}
    assert run_llm.sharded_parameter_names(_model(2), *SPLIT) == shards
    assert run_llm.sharded_parameter_names(_model(1), *SPLIT) == set()
    real = run_llm.sharded_parameter_names
    monkeypatch.setattr(run_llm, "sharded_parameter_names", lambda m: real(m, *SPLIT))
    models = []
    for rank in (0, 1):
        target = _model(2)
        draft = _model(2, embed=target.embed_tokens)  # an EAGLE head shares the embedding
        runner = SimpleNamespace(model=target, speculator=SimpleNamespace(model=draft))
        worker = SimpleNamespace(rank=rank, local_rank=rank, model_runner=runner)
        done = run_llm.E2EWorkerExtension.e2e_reinit_weights(worker, "0.05")
        # The draft's parameters all but the shared embedding.
        assert (
            pick([done], "rank tp_rank params spec_params spec_model") == f"{rank} {rank} 8 7 True"
        )
        models.append((dict(target.named_parameters()), draft))
    (p0, d0), (p1, _) = models
    assert all(not torch.equal(p0[n], p1[n]) for n in shards)  # shards of one tensor differ
    assert all(torch.equal(p0[n], p1[n]) for n in ("o_proj.bias", "fc.weight", "fc.bias"))
    assert (p0["norm.weight"] == 1).all() and torch.equal(d0.qkv.weight, p0["qkv.weight"])
    ref = _model(1)  # rank 0 keeps the name's seed, as at TP=1
    run_llm.reinit_weights(ref, 0.05)
    assert torch.equal(ref.qkv.weight, p0["qkv.weight"])


@pytest.mark.vllm
def test_worker_extension_fits_vllms_worker_class_and_hook(
    worker_state, monkeypatch, restore_plugin_loggers
):
    """vLLM's check before it adds the extension to the worker's bases, the base change,
    and the hook: the wrappers go onto MRV2's runner and the GPU worker, and a log tap
    inherited through fork is replaced, not doubled."""
    from vllm.v1.worker import gpu_worker
    from vllm.v1.worker.gpu import model_runner as mr2

    ext = run_llm.E2EWorkerExtension
    own = [a for a in dir(ext) if not a.startswith("__")]
    assert own == ["e2e_rank_record", "e2e_reinit_weights", "init_worker_extension"]
    assert not [a for a in own if hasattr(gpu_worker.Worker, a)]
    probe = type("Probe", (gpu_worker.Worker,), {})
    probe.__bases__ = (*probe.__bases__, ext)
    assert probe.e2e_rank_record is ext.e2e_rank_record
    calls = []
    monkeypatch.setattr(run_llm, "install_in_worker", lambda *a: calls.append(a))
    inherited = type("PluginLogTap", (logging.Handler,), {})()  # what a forked worker has
    logging.getLogger(run_llm.PLUGIN_LOGGERS[0]).addHandler(inherited)
    ext.init_worker_extension(SimpleNamespace(rank=1))
    assert calls == [(1, mr2.GPUModelRunner, gpu_worker.Worker, torch.cuda)]
    for name in run_llm.PLUGIN_LOGGERS:
        taps = [h for h in logging.getLogger(name).handlers if type(h).__name__ == "PluginLogTap"]
        assert len(taps) == 1 and taps[0].sink is run_llm.STATE["plugin_log"], name
