"""run_llm.py on a CPU, against stand-ins for vLLM's runner, worker, engine and GPU."""

import json
import logging
import os
from types import SimpleNamespace

import pytest
import torch

from tests import e2e_fakes as fakes

run_llm, pick, MiB = fakes.run_llm, fakes.pick, fakes.MiB
over_budget = fakes.summarize.over_budget_bytes


def test_plugin_switches_force_their_environment_and_the_plugin_is_found(monkeypatch):
    estimate = "VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS"  # vLLM's; run_llm.py resets it
    for switch, env in {"on": "specgraph None", "off": "specgraph 0", "none": " None"}.items():
        # Inherited values must not turn one switch into another; the allocator's is kept.
        inherited = {"VLLM_SPECGRAPH": "0", "VLLM_PLUGINS": "x", estimate: "0"}
        monkeypatch.setattr(os, "environ", inherited | {"PYTORCH_CUDA_ALLOC_CONF": "e:1"})
        got = run_llm.set_env(switch)
        assert " ".join(map(str, got.values())) == f"{env} e:1 None" and estimate not in os.environ
        assert got == {k: os.environ.get(k) for k in got} and os.environ["VLLM_USE_V2_MODEL_RUNNER"]
    once = run_llm.set_env("once", plugin_allreduce=True)
    assert pick([once], f"{run_llm.PROFILE_ENV} {run_llm.ALLREDUCE_ENV}") == "capture-once 1"
    os.environ[run_llm.ALLREDUCE_ENV] = "0"  # asked for by name: the caller's stands
    assert run_llm.set_env("on", plugin_allreduce=True)[run_llm.ALLREDUCE_ENV] == "0"
    info = run_llm.plugin_info("on", got)  # the tests have imported vllm_specgraph
    assert pick([info], "entry_point loaded_as_expected") == "vllm_specgraph:register True"
    assert info["dist"].startswith("vllm-specgraph ") and info["env"] == got
    assert not run_llm.plugin_info("none", got)["loaded_as_expected"]


def test_a_run_records_what_vllm_returned_its_budget_and_what_it_held():
    r = fakes.fake_run("tiny", "base", "off", [[1, 2]], fakes.UPSTREAM)
    m = {k: v // MiB if isinstance(v, int) and v > 1000 else v for k, v in r["mem"].items()}
    keys = "profile_estimate_bytes worker_cudagraph_memory_estimate profile_driver_left_taken"
    assert pick([m], f"{keys} capture_actual_bytes kv_cache_bytes") == "41 41 32 36 7168"
    assert pick([m], "requested_bytes activation_headroom_bytes capture_started") == "7309 100 True"
    # Held since the snapshot: retained + KV + actual; the limit at rest is requested -
    # headroom = KV + estimate: over by retained + actual - estimate.
    assert over_budget(r["mem"]) == (32 + 36 - 41) * MiB
    assert r["plugin_report"] is None and all(r["plugin"]["wrappers_intact"].values())
    assert r["gpu"]["name"] == "Stand-in" and json.loads(json.dumps(r)) == r  # plain data
    assert r["tokens"] == [[1, 2]] and r["spec"]["drafts"] is None and "load" not in r
    names = ("profile_cudagraph_memory", "capture_model", "determine_available_memory")
    stand = type("Stand", (), {name: lambda self, **kw: 5 for name in names})
    meter = run_llm.Meter(None, {}).install(stand, stand)
    stand().capture_model(profile_only=True)  # the profile's own: not the production one
    stand.capture_model = lambda self, **kw: 0  # patched over the wrapper: said
    assert list(meter.intact().values()) == [True, False, True]
    stand().determine_available_memory()  # a worker that did not profile
    assert meter.mem == {"kv_cache_bytes": 5, "worker_cudagraph_memory_estimate": -1}
    # Capture-once: no graph estimate; the KV pages backed and the graphs, within its limit.
    once = fakes.once_run("base", [[1]])
    assert once["capture_once"]["num_blocks"] == fakes.ONCE["held"] >> 14
    assert once["capture_once_fallback"] is None and over_budget(once["mem"]) == 0
    fell_back = fakes.fake_run("tiny", "eagle", "once", [[1]], fakes.EXACT, fallback="no bindings")
    assert (fell_back["capture_once"], fell_back["capture_once_fallback"]) == (None, "no bindings")


def test_engine_arguments_of_every_size_case_graph_mode_and_tp():
    for size, key in [(s, k) for s in run_llm.SIZES for k in ("model", "draft", "eagle")]:
        with open(os.path.join(run_llm.CONFIGS, run_llm.SIZES[size][key], "config.json")) as f:
            vocab = json.load(f)["vocab_size"]  # the configs exist and the smoke prompts fit
        assert all(0 < t < vocab for p in run_llm.prompts_token_ids(6, vocab) for t in p)
    kw, full = run_llm.llm_kwargs("1b", "base"), run_llm.llm_kwargs("tiny", "base", "full")
    keys = "max_num_seqs max_model_len max_num_batched_tokens dtype gpu_memory_utilization"
    assert pick([kw], keys) == "256 1024 2048 bfloat16 0.5" and run_llm.vocab_size("1b") == 128256
    compiled = [kw["compilation_config"], full["compilation_config"]]
    assert pick(compiled, "mode cudagraph_mode") == "3 FULL_AND_PIECEWISE; 0 FULL"
    assert [c.get("cudagraph_capture_sizes") for c in compiled] == [None, [1, 2, 4, 8, 16, 32]]
    specs = [run_llm.llm_kwargs("8b", case)["speculative_config"] for case in run_llm.CASES]
    models = " ".join(f"{s['method']}:{os.path.basename(s.get('model', '-'))}" for s in specs[1:])
    assert models == "draft_model:llama-8b-draft draft_model:llama-8b ngram:- eagle:llama-8b-eagle"
    assert specs[0] is None and {s["num_speculative_tokens"] for s in specs[1:]} == {3}
    one, two = run_llm.llm_kwargs("tiny", "draft"), run_llm.llm_kwargs("tiny", "draft", tp=2)
    tp = {k: two.pop(k) for k in list(two) if k not in one}
    assert two == one and " ".join(map(str, tp.values())) == "2 mp True run_llm.E2EWorkerExtension"
    custom = run_llm.llm_kwargs("1b", "base", tp=2, custom_all_reduce=True)
    assert custom["disable_custom_all_reduce"] is False


def test_load_times_only_the_repeats_and_counts_only_their_drafts(tmp_path, monkeypatch):
    load = run_llm.load_requests(128256, 256, 1024, seed=0)
    assert load == run_llm.load_requests(128256, 256, 1024, 0) and len({n for _, n in load}) > 50
    assert all(16 <= len(ids) <= 512 and 16 <= n <= 256 and min(ids) > 0 for ids, n in load)
    (tmp_path / "hot.py").write_text("def wrapper(fn):\n    return fn()\n")  # the package
    monkeypatch.syspath_prepend(str(tmp_path))
    import hot

    calls = []

    def generate(requests: list) -> list[list[int]]:
        calls.append(len(requests))
        for _ in requests:
            hot.wrapper(lambda: sum(i * i for i in range(2000)))
        return [[7] * n for _, n in requests]

    def counters() -> dict:  # a request: 3 drafts, 9 tokens, 6 accepted (warm-up: none), 5 steps
        n, spec = sum(calls), {"drafts": 3, "draft_tokens": 9, "accepted_tokens_per_pos": None}
        spec = {k: v and v * n for k, v in spec.items()} | {"accepted_tokens": 6 * sum(calls[1:3])}
        metrics = [SimpleNamespace(name=run_llm.ENGINE_STEPS, count=5 * n)]
        for k, v in spec.items():
            metrics.append(SimpleNamespace(name=f"vllm:spec_decode_num_{k}", value=v))
        return run_llm.read_spec_counters(metrics)

    args, r = SimpleNamespace(workload="load", size="tiny", load_requests=2, load_repeats=2), {}
    clock = map(float, range(9)).__next__  # each repeat: 1 s
    run_llm.run_workload(args, generate, counters, r, str(tmp_path / "hot.py"), clock)
    assert calls == [16, 2, 2, 1]  # the warm-up, the timed repeats, the profiled half
    n = sum(len(t) for t in r["tokens"])
    repeats = "wall_s generated_tokens tokens_per_s engine_steps step_ms"
    assert pick(r["load"]["repeats"], repeats) == "; ".join([f"1.0 {n} {n}.0 10 100.0"] * 2)
    assert r["load"]["repeats_equal"] and r["spec"] == r["load"]["spec"] and r["generate_s"] == 2.0
    assert pick([r["spec"]], "drafts draft_tokens acceptance_rate") == f"12 36 {round(24 / 36, 4)}"
    share = r["load"]["plugin_share"]  # the package's own time, and per step of the half's 5
    assert 0 < share["plugin_share"] < 0.5 and share["plugin_us_per_step"] > 0
    flaky = iter([[[1]], [[1]], [[2]]])
    run_llm.run_workload(args, lambda requests: next(flaky), dict, r)
    assert not r["load"]["repeats_equal"] and "plugin_share" not in r["load"]


def test_every_rank_is_recorded_in_order_and_a_failed_run_keeps_its_stage(tmp_path, monkeypatch):
    intact = {1: {"profile": True, "capture": False}, 0: {"profile": False, "capture": True}}
    ranks = [{"rank": i, "gpu": {"name": "G"}, "wrappers_intact": w} for i, w in intact.items()]
    rpc, run = [], {"plugin": {}}
    llm = SimpleNamespace(collective_rpc=lambda method, args: rpc.append(method) or ranks)
    run_llm.record_ranks(llm, 2, run)
    assert rpc == ["e2e_rank_record"] and [r["rank"] for r in run["ranks"]] == [0, 1]
    assert run["plugin"]["wrappers_intact"] == {"profile": False, "capture": False}  # all ranks'
    assert "mem" not in run and "plugin_report" not in run  # TP > 1: per rank only
    monkeypatch.setattr(os, "environ", {"PYTHONPATH": "/site", run_llm.COMMIT_ENV: "c1"})
    monkeypatch.setattr(run_llm, "run_engine", lambda args, run: 1 / 0)
    out = tmp_path / "tiny-draft-on-tp2.json"
    assert run_llm.main(f"--case draft --plugin on --tp 2 --workload load --out {out}".split()) == 1
    r = json.loads(out.read_text())
    assert pick([r], "ok stage commit tp load_round") == "False import c1 2 1"
    assert r["error"] == "ZeroDivisionError('division by zero')" and "1 / 0" in r["traceback"]
    assert os.environ["PYTHONPATH"].split(os.pathsep) == [run_llm.HERE, "/site"]  # for workers


# vLLM's layers split over ``tp_size`` ranks: column-, row- and vocabulary-parallel.
_Column, _Row, _Vocab = (type(n, (torch.nn.Linear,), {}) for n in ("Column", "Row", "Vocab"))


def _model(embed: torch.nn.Module | None = None, tp_size: int = 2) -> torch.nn.Module:
    model = torch.nn.Module()
    model.embed_tokens = embed if embed is not None else _Vocab(4, 8, bias=False)
    model.qkv, model.o_proj, model.fc = _Column(4, 6), _Row(3, 4), torch.nn.Linear(4, 4)
    model.norm = torch.nn.Module()
    model.norm.weight = torch.nn.Parameter(torch.zeros(4))
    return model.apply(lambda module: setattr(module, "tp_size", tp_size))


def test_weights_are_refilled_by_name_and_shards_seeded_per_rank(monkeypatch):
    split, shards = ((_Column, _Vocab), (_Row,)), {"embed_tokens.weight", "o_proj.weight"}
    shards |= {"qkv.weight", "qkv.bias"}  # a row-parallel bias is whole on every rank
    assert run_llm.sharded_parameter_names(_model(), *split) == shards
    assert run_llm.sharded_parameter_names(_model(tp_size=1), *split) == set()
    real = run_llm.sharded_parameter_names
    monkeypatch.setattr(run_llm, "sharded_parameter_names", lambda m: real(m, *split))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    models = []
    for rank in (0, 1):
        target = _model()
        draft = _model(embed=target.embed_tokens)  # an EAGLE head's embedding: the target's
        runner = SimpleNamespace(model=target, speculator=SimpleNamespace(model=draft))
        worker = SimpleNamespace(rank=rank, model_runner=runner)
        done = run_llm.E2EWorkerExtension.e2e_reinit_weights(worker, "0.05")
        assert pick([done], "rank params spec_params spec_model") == f"{rank} 8 7 True"
        models.append((dict(target.named_parameters()), draft))
    (p0, d0), (p1, _) = models
    assert all(not torch.equal(p0[n], p1[n]) for n in shards)  # the shards of one tensor differ
    assert all(torch.equal(p0[n], p1[n]) for n in ("o_proj.bias", "fc.weight", "fc.bias"))
    assert (p0["norm.weight"] == 1).all() and torch.equal(d0.qkv.weight, p0["qkv.weight"])
    ref = _model(tp_size=1)  # rank 0 keeps the name's seed, as at TP=1
    assert not run_llm.refill_weights(SimpleNamespace(model=ref), 0.05)["spec_model"]
    assert torch.equal(ref.qkv.weight, p0["qkv.weight"])


@pytest.mark.vllm
def test_worker_extension_fits_vllms_worker_and_its_hook_taps_the_plugin_log(monkeypatch, capsys):
    """vLLM's name check before it mixes the extension in, and its hook: the wrappers on
    MRV2's runner and the GPU worker, one log tap per plugin logger, each line printed once."""
    from vllm.v1.worker import gpu_worker
    from vllm.v1.worker.gpu import model_runner as mr2

    ext = run_llm.E2EWorkerExtension
    own = [a for a in dir(ext) if not a.startswith("__")]
    assert own == ["e2e_rank_record", "e2e_reinit_weights", "init_worker_extension"]
    assert not [a for a in own if hasattr(gpu_worker.Worker, a)]
    wrapped = {"profile_cudagraph_memory": mr2.GPUModelRunner, "capture_model": mr2.GPUModelRunner}
    wrapped["determine_available_memory"] = gpu_worker.Worker
    loggers = [logging.getLogger(name) for name in run_llm.PLUGIN_LOGGERS]
    for name, cls in wrapped.items():
        monkeypatch.setattr(cls, name, getattr(cls, name))  # put back after the test
    for lg in loggers:  # the tap a forked worker inherits: another class of that name
        monkeypatch.setattr(lg, "propagate", lg.propagate)
        monkeypatch.setattr(lg, "handlers", [type("PluginLogTap", (logging.Handler,), {})()])
    monkeypatch.setattr(run_llm, "STATE", {"meter": None, "plugin_log": []})
    ext.init_worker_extension(None)
    meter, sink = run_llm.STATE["meter"], run_llm.STATE["plugin_log"]
    assert {name: cls for name, (cls, _) in meter.installed.items()} == wrapped
    assert all(meter.intact().values()) and meter.cuda is torch.cuda
    assert [[h.sink for h in lg.handlers] for lg in loggers] == [[sink], [sink]]
    logging.getLogger("vllm.specgraph.profile").info("estimate %d MiB", 12)
    loggers[1].info("loaded %d", "x")  # a bad format string: the raw message
    assert sink[1:] == ["INFO vllm_specgraph: 'loaded %d'"]
    assert capsys.readouterr().out.splitlines() == [f"SPECGRAPH-LOG {line}" for line in sink]
    assert not any(lg.propagate for lg in loggers)
