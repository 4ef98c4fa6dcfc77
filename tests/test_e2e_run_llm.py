"""run_llm.py on a CPU: its switches, meter, workloads, engine arguments and worker
extension against stand-ins for vLLM's runner, worker, engine and ``torch.cuda``."""

from __future__ import annotations

import json
import logging
import os
import sys
from types import SimpleNamespace

import pytest
import torch

from tests import e2e_fakes as fakes

run_llm, pick, MiB = fakes.run_llm, fakes.pick, fakes.MiB
over_budget = fakes.summarize.over_budget_bytes


@pytest.fixture
def environ():
    saved = dict(os.environ)
    yield os.environ
    os.environ.clear()
    os.environ.update(saved)


@pytest.mark.parametrize(
    ("switch", "env"),
    [
        ("on", "specgraph None expandable_segments:True None"),
        ("off", "specgraph 0 expandable_segments:True None"),
        ("none", " None expandable_segments:True None"),
        ("once", "specgraph None expandable_segments:True capture-once"),
    ],
)
def test_plugin_switches_force_their_environment(environ, switch, env):
    # Inherited values must not turn one switch into another; the allocator's is kept.
    environ |= {"VLLM_SPECGRAPH": "0", "VLLM_PLUGINS": "x", fakes.ESTIMATE_ENV: "0"}
    environ |= {run_llm.PROFILE_ENV: "x", "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    environ.pop("VLLM_USE_V2_MODEL_RUNNER", None)
    got = run_llm.set_env(switch)
    assert " ".join(map(str, got.values())) == env and got == {k: environ.get(k) for k in got}
    assert fakes.ESTIMATE_ENV not in environ and environ["VLLM_USE_V2_MODEL_RUNNER"] == "1"
    assert run_llm.set_env(switch, plugin_allreduce=True)[run_llm.ALLREDUCE_ENV] == "1"
    environ[run_llm.ALLREDUCE_ENV] = "0"  # asked for by name: the caller's stands
    assert run_llm.set_env(switch, plugin_allreduce=True)[run_llm.ALLREDUCE_ENV] == "0"


def test_a_run_records_what_vllm_returned_its_budget_and_what_it_held():
    r = fakes.fake_run("tiny", "base", "off", [[1, 2]], fakes.UPSTREAM, step=150 * MiB)
    m = {k: v // MiB if isinstance(v, int) and v > 1000 else v for k, v in r["mem"].items()}
    keys = "profile_estimate_bytes worker_cudagraph_memory_estimate graph_estimate_applied_bytes"
    assert pick([m], keys) == "41 41 41"
    keys = "profile_driver_left_taken profile_driver_left_taken_after_empty_cache"
    assert pick([m], keys) == "32 32"
    assert pick([m], "capture_actual_bytes capture_driver_delta kv_cache_bytes") == "36 36 7168"
    assert pick([m], "capture_calls profile_only_capture_calls capture_started") == "1 1 True"
    assert pick([m], "requested_bytes activation_headroom_bytes non_kv_bytes") == "7309 100 100"
    # Held since the snapshot: retained + KV + actual; the limit at rest is requested -
    # headroom = KV + estimate: over by retained + actual - estimate.
    assert over_budget(r["mem"]) == (32 + 36 - 41) * MiB
    assert m["free_at_rest_bytes"] - m["free_after_step_bytes"] == 150
    assert m["step_reserved_peak_bytes"] == m["step_allocated_peak_bytes"] == 150
    assert r["tokens"] == [[1, 2]] and r["spec"]["acceptance_rate"] == 0.4
    assert r["spec_metrics"]["vllm:spec_decode_num_accepted_tokens_per_pos"] == [5, 4]
    assert "vllm:num_requests_running" not in r["spec_metrics"] and r["plugin_report"] is None
    assert all(r["plugin"]["wrappers_intact"].values())
    cuda = fakes.fake_cuda()
    runner_cls, worker_cls = fakes.fake_classes(cuda, 1, 0, 1, 1)
    meter = run_llm.Meter(cuda, {}).install(runner_cls, worker_cls)
    runner_cls.capture_model = lambda self, **kw: 0  # patched over the wrapper: said
    assert list(meter.intact().values()) == [True, False, True]
    meter.budget(lambda worker: 5, SimpleNamespace())  # a worker that did not profile
    assert pick([meter.mem], "kv_cache_bytes worker_cudagraph_memory_estimate") == "5 -1"
    assert "requested_bytes" not in meter.mem
    # Capture-once: vLLM reported the reserved most and subtracted nothing for graphs, so
    # its limit at rest is the KV budget; held are the pages backed (the budget less what
    # graphs took) and the graphs. Backed to the reserved most: over by the graphs.
    once = fakes.once_run("base", [[1]])
    assert once["capture_once"]["num_blocks"] == fakes.ONCE["held"] >> 14
    assert once["capture_once_fallback"] is None and once["kv_tokens"] == fakes.ONCE["held"] >> 10
    keys = "kv_cache_bytes graph_estimate_applied_bytes activation_headroom_bytes"
    assert pick([once["mem"]], keys) == f"{fakes.KV_MAX} 0 {fakes.HEADROOM}"
    assert over_budget(once["mem"]) == 0
    assert over_budget(fakes.once_run("base", [[1]], fakes.KV_MAX)["mem"]) == 30 * MiB
    fell_back = fakes.fake_run("tiny", "eagle", "once", [[1]], fakes.EXACT, fallback="no bindings")
    assert (fell_back["capture_once"], fell_back["capture_once_fallback"]) == (None, "no bindings")


@pytest.fixture
def restore_plugin_loggers():
    loggers = [logging.getLogger(name) for name in run_llm.PLUGIN_LOGGERS]
    saved = [(lg, lg.handlers[:], lg.propagate, lg.level) for lg in loggers]
    yield
    for lg, handlers, propagate, level in saved:
        lg.handlers[:], lg.propagate = handlers, propagate
        lg.setLevel(level)


def test_plugin_log_tap_prints_each_line_once_with_its_prefix(capsys, restore_plugin_loggers):
    # What a forked worker inherits: the launcher's tap, another class of the same name.
    inherited = type("PluginLogTap", (logging.Handler,), {"emit": lambda self, r: print("again")})
    logging.getLogger("vllm.specgraph").addHandler(inherited())
    sink: list[str] = []
    run_llm.tap_plugin_logs(sink)
    logging.getLogger("vllm.specgraph.profile").info("estimate %d MiB", 12)
    logging.getLogger("vllm_specgraph").info("loaded")
    assert sink == ["INFO vllm.specgraph.profile: estimate 12 MiB", "INFO vllm_specgraph: loaded"]
    assert capsys.readouterr().out.splitlines() == [f"SPECGRAPH-LOG {line}" for line in sink]
    assert not any(logging.getLogger(name).propagate for name in run_llm.PLUGIN_LOGGERS)


def test_engine_arguments_of_every_size_case_graph_mode_and_tp():
    for size in run_llm.SIZES:  # the configs exist and the smoke prompts fit them
        for key in ("model", "draft", "eagle"):
            with open(os.path.join(run_llm.config_dir(size, key), "config.json")) as f:
                vocab = json.load(f)["vocab_size"]
            assert all(0 < t < vocab for p in run_llm.prompts_token_ids(6, vocab) for t in p)
    kw = run_llm.llm_kwargs("1b", "base")
    keys = "max_num_seqs max_model_len max_num_batched_tokens dtype gpu_memory_utilization"
    assert pick([kw], keys) == "256 1024 2048 bfloat16 0.5" and run_llm.vocab_size("1b") == 128256
    compiled = {"mode": 3, "cudagraph_mode": "FULL_AND_PIECEWISE", "custom_ops": ["none"]}
    assert kw["compilation_config"] == compiled  # vLLM's default capture sizes
    full = run_llm.llm_kwargs("tiny", "base", "full")["compilation_config"]
    assert (full["mode"], full["cudagraph_mode"]) == (0, "FULL")
    assert full["cudagraph_capture_sizes"] == [1, 2, 4, 8, 16, 32]
    specs = {case: run_llm.llm_kwargs("8b", case)["speculative_config"] for case in run_llm.CASES}
    assert specs["base"] is None and specs["ngram"]["prompt_lookup_max"] == 4
    models = [os.path.basename(specs[case]["model"]) for case in ("draft", "accept", "eagle")]
    assert models == ["llama-8b-draft", "llama-8b", "llama-8b-eagle"]
    assert {spec["num_speculative_tokens"] for spec in specs.values() if spec} == {3}
    one, two = run_llm.llm_kwargs("tiny", "draft"), run_llm.llm_kwargs("tiny", "draft", tp=2)
    tp = {k: two.pop(k) for k in list(two) if k not in one}
    assert two == one and " ".join(map(str, tp.values())) == "2 mp True run_llm.E2EWorkerExtension"
    custom = run_llm.llm_kwargs("1b", "base", tp=2, custom_all_reduce=True)
    assert custom["disable_custom_all_reduce"] is False


def test_load_times_only_the_repeats_and_counts_only_their_drafts():
    load = run_llm.load_requests(128256, 256, 1024, seed=0)
    assert load == run_llm.load_requests(128256, 256, 1024, seed=0)
    assert load != run_llm.load_requests(128256, 256, 1024, seed=1)
    assert all(16 <= len(ids) <= 512 and 16 <= n <= 256 for ids, n in load)
    assert all(0 < t < 128255 for ids, _ in load for t in ids)
    assert len({len(ids) for ids, _ in load}) > 50 and len({n for _, n in load}) > 50
    ticks, calls = iter(range(100)), []

    def generate(requests: list) -> list[list[int]]:
        calls.append(len(requests))
        return [[7] * n for _, n in requests]

    def counters() -> dict:
        # Every request drafts 3 times (9 tokens); a timed one has 6 accepted, the
        # warm-up's none (counted in, it would lower the rate); 5 engine steps each.
        n = sum(calls)
        drafted = fakes.metrics(3 * n, 9 * n, 6 * sum(calls[1:]), steps=5 * n)
        return run_llm.read_spec_counters(drafted)

    requests, clock = [([1, 2], 5), ([3], 7)], lambda: float(next(ticks))
    out = run_llm.run_load(generate, counters, requests, [([1], 2)], repeats=2, clock=clock)
    assert calls == [1, 2, 2]  # the warm-up first, then the timed repeats
    repeats = "wall_s generated_tokens tokens_per_s engine_steps step_ms"
    assert pick(out["repeats"], repeats) == "1.0 12 12.0 10 100.0; 1.0 12 12.0 10 100.0"
    assert pick([out], "step_ms_median tokens_per_s_best tokens_per_s_median") == "100.0 12.0 12.0"
    assert out["repeats_equal"] is True and out["tokens"] == [[7] * 5, [7] * 7]
    assert out["spec"]["drafts"] == 12 and out["spec"]["acceptance_rate"] == round(24 / 36, 4)
    assert pick([out], "num_requests prompt_tokens max_tokens") == "2 3 12"
    delta = run_llm.counter_delta({"v": [5, 4], "n": 1}, {"v": [9, 8, 7], "n": 3, "x": None})
    assert delta == {"v": [4, 4, 7], "n": 2}
    flaky = iter([[[1]], [[1]], [[2]]])
    assert not run_llm.run_load(lambda r: next(flaky), dict, [([1], 1)], [], 2)["repeats_equal"]
    r = fakes.fake_run("1b", "draft", "on", [[4]], fakes.EXACT, workload="load")
    assert r["tokens"] == [[4]] and "tokens" not in r["load"] and len(r["load"]["repeats"]) == 2
    assert r["load"]["num_requests"] == 4 and r["load"]["warmup_requests"] == 16
    assert r["generate_s"] == sum(x["wall_s"] for x in r["load"]["repeats"])
    assert "free_at_rest_bytes" in r["mem"] and "free_after_step_bytes" not in r["mem"]


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


# ---- the measuring side (the worker extension) ---------------------------------------


@pytest.fixture
def worker_state(monkeypatch, tmp_path):
    """A fresh per-process state of the extension and a rank directory."""
    monkeypatch.setattr(run_llm, "STATE", {"meter": None, "plugin_log": []})
    (rank_dir := tmp_path / "run.json.ranks").mkdir()
    monkeypatch.setenv(run_llm.RANK_DIR_ENV, str(rank_dir))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    return rank_dir


def test_a_rank_writes_its_figures_as_taken_and_reports_them(worker_state, capsys):
    cuda = fakes.fake_cuda()
    runner_cls, worker_cls = fakes.fake_classes(cuda, 41 * MiB, 2 * MiB, 36 * MiB, 7 << 30)
    mem = run_llm.RankFigures(1, str(worker_state / "rank1.json"))
    run_llm.STATE["meter"] = run_llm.Meter(cuda, mem).install(runner_cls, worker_cls)
    worker_cls().determine_available_memory()
    runner_cls().capture_model()
    (on_disk,) = run_llm.read_rank_files(str(worker_state))  # for a run that fails later
    assert on_disk["rank"] == 1 and on_disk["mem"]["capture_actual_bytes"] == 36 * MiB
    runner = SimpleNamespace(specgraph_profile=SimpleNamespace(to_dict=lambda: {"estimate": 1}))
    worker = SimpleNamespace(rank=1, local_rank=1, model_runner=runner)
    # At TP=1 the run calls the extension on its own worker, the engine's only one.
    executor = SimpleNamespace(driver_worker=SimpleNamespace(worker=worker))
    core = SimpleNamespace(engine_core=SimpleNamespace(model_executor=executor))
    llm = SimpleNamespace(llm_engine=SimpleNamespace(engine_core=core))
    (record,) = run_llm.on_workers(llm, 1, "e2e_rank_record", "on")
    assert pick([record], "rank local_rank tp_rank") == "1 1 1"
    assert record["mem"] == mem and record["mem"]["profile_driver_left_taken"] == 2 * MiB
    assert record["plugin_report"] == {"estimate": 1} and all(record["wrappers_intact"].values())
    assert record["plugin"]["switch"] == "on" and set(record["env"]) == set(run_llm.WORKER_ENV_KEYS)
    assert record["resolved"]["runner_class"] == "types.SimpleNamespace"
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


class _Layer(torch.nn.Linear):  # a layer of vLLM's, split over ``tp_size`` ranks
    def __init__(self, cols: int, rows: int, tp_size: int, bias: bool = True) -> None:
        super().__init__(cols, rows, bias=bias)
        self.tp_size = tp_size


_Column, _Row, _Vocab = (type(n, (_Layer,), {}) for n in ("Column", "Row", "Vocab"))
SPLIT = ((_Column, _Vocab), (_Row,))


def _model(tp_size: int, embed: torch.nn.Module | None = None) -> torch.nn.Module:
    model = torch.nn.Module()
    model.embed_tokens = embed if embed is not None else _Vocab(4, 8, tp_size, bias=False)
    model.qkv, model.o_proj = _Column(4, 6, tp_size), _Row(3, 4, tp_size)
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
        assert done["spec_model"]
        # The draft's parameters all but the shared embedding.
        assert pick([done], "rank tp_rank params spec_params") == f"{rank} {rank} 8 7"
        models.append((dict(target.named_parameters()), draft))
    (p0, d0), (p1, _) = models
    assert all(not torch.equal(p0[n], p1[n]) for n in shards)  # shards of one tensor differ
    assert all(torch.equal(p0[n], p1[n]) for n in ("o_proj.bias", "fc.weight", "fc.bias"))
    assert (p0["norm.weight"] == 1).all() and torch.equal(d0.qkv.weight, p0["qkv.weight"])
    ref = _model(1)  # rank 0 keeps the name's seed, as at TP=1
    done = run_llm.refill_weights(SimpleNamespace(model=ref), 0.05)
    assert torch.equal(ref.qkv.weight, p0["qkv.weight"]) and not done["spec_model"]


@pytest.mark.vllm
def test_worker_extension_fits_vllms_worker_class_and_hook(
    worker_state, monkeypatch, restore_plugin_loggers
):
    """vLLM's check before it adds the extension to the worker's bases, the base change,
    and the hook: the wrappers on MRV2's runner and the GPU worker, the rank's file, one
    log tap in place of one inherited through fork."""
    from vllm.v1.worker import gpu_worker
    from vllm.v1.worker.gpu import model_runner as mr2

    ext = run_llm.E2EWorkerExtension
    own = [a for a in dir(ext) if not a.startswith("__")]
    assert own == ["e2e_rank_record", "e2e_reinit_weights", "init_worker_extension"]
    assert not [a for a in own if hasattr(gpu_worker.Worker, a)]
    probe = type("Probe", (gpu_worker.Worker,), {})
    probe.__bases__ = (*probe.__bases__, ext)
    assert probe.e2e_rank_record is ext.e2e_rank_record
    wrapped = {"profile_cudagraph_memory": mr2.GPUModelRunner, "capture_model": mr2.GPUModelRunner}
    wrapped["determine_available_memory"] = gpu_worker.Worker
    for name, cls in wrapped.items():
        monkeypatch.setattr(cls, name, getattr(cls, name))  # put back after the test
    inherited = type("PluginLogTap", (logging.Handler,), {})()
    logging.getLogger(run_llm.PLUGIN_LOGGERS[0]).addHandler(inherited)
    ext.init_worker_extension(SimpleNamespace(rank=1))
    meter = run_llm.STATE["meter"]
    assert {name: cls for name, (cls, _) in meter.installed.items()} == wrapped
    assert all(meter.intact().values()) and meter.cuda is torch.cuda
    assert json.loads((worker_state / "rank1.json").read_text())["mem"] == {}
    for name in run_llm.PLUGIN_LOGGERS:
        taps = [h for h in logging.getLogger(name).handlers if type(h).__name__ == "PluginLogTap"]
        assert len(taps) == 1 and taps[0].sink is run_llm.STATE["plugin_log"], name
