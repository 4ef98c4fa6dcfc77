"""The end-to-end harness on a CPU (scripts/vllm_e2e): run_llm.py's switches, wrappers,
workloads and worker extension against stand-ins for vLLM's runner, worker and
``torch.cuda``; summarize.py's rows, checks and tables on synthetic results; and
device.py's knobs, plan, lanes, limits and warm-ups with process launching faked.
The byte counts are test inputs, not measurements."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging
import os
import subprocess
import sys
import time
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
import torch

SCRIPTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts")
MiB = 1 << 20


def _load(name: str) -> ModuleType:
    path = os.path.join(SCRIPTS, "vllm_e2e", f"{name}.py")
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


run_llm, summarize, device = _load("run_llm"), _load("summarize"), _load("device")
ESTIMATE_ENV = run_llm.ESTIMATE_ENV
HEADROOM = 100 * MiB  # the stand-in worker's activation headroom
UPSTREAM = {"est": 41 * MiB, "retained": 32 * MiB, "actual": 36 * MiB, "kv": 7 << 30}
EXACT = {"est": 34 * MiB, "retained": 4 * MiB, "actual": 30 * MiB, "kv": 8 << 30}
# Capture-once: nothing estimated, the KV cache sized (and reserved) for EXACT's KV plus
# its estimate, the pages held those less what the capture took.
KV_MAX = EXACT["kv"] + EXACT["est"]
ONCE = EXACT | {"est": 0, "retained": 0, "kv": KV_MAX, "held": KV_MAX - EXACT["actual"]}


def kv(text: str) -> dict[str, str]:
    """``"A=x y; B=z"`` as {"A": "x y", "B": "z"}."""
    return dict(item.strip().split("=", 1) for item in text.split(";") if item.strip())


def pick(rows: list[dict], keys: str) -> str:
    """The ``keys`` of each row: a row's values joined by spaces, the rows by "; "."""
    return "; ".join(" ".join(str(row[k]) for k in keys.split()) for row in rows)


class FakeCuda:
    """``torch.cuda`` whose driver-level usage the stand-ins below move."""

    total = 80 << 30

    def __init__(self) -> None:
        self.used, self.reserved, self.allocated = 10 << 30, 0, 0
        self.peak_allocated = self.peak_reserved = 0

    def synchronize(self) -> None:
        pass

    empty_cache = reset_peak_memory_stats = synchronize

    def mem_get_info(self) -> tuple[int, int]:
        return self.total - self.used, self.total

    def memory_reserved(self) -> int:
        return self.reserved

    def memory_allocated(self) -> int:
        return self.allocated

    def max_memory_allocated(self) -> int:
        return self.peak_allocated

    def max_memory_reserved(self) -> int:
        return self.peak_reserved


def fake_classes(
    cuda: FakeCuda, est: int, retained: int, actual: int, kv: int, held: int | None = None
) -> tuple:
    """A runner and a worker that move ``cuda`` as vLLM would: the profile leaves
    ``retained`` taken, the worker sizes the KV cache at ``kv`` (its limit ``kv +
    headroom + estimate``, as vLLM's formula gives) and takes it (capture-once: ``held``
    of it), the capture ``actual``."""

    class Runner:
        def profile_cudagraph_memory(self) -> int:
            cuda.used += retained
            return est

        def capture_model(self, *, profile_only: bool = False) -> int:
            cuda.used += 0 if profile_only else actual
            return 0 if profile_only else actual

    class Worker:
        cudagraph_memory_estimate = est

        def determine_available_memory(self) -> int:
            applied = est if run_llm.estimate_applied() else 0
            free = cuda.total - cuda.used
            self.init_snapshot = SimpleNamespace(free_memory=free, total_memory=cuda.total)
            self.requested_memory = kv + HEADROOM + applied
            self.peak_activation_memory = HEADROOM + applied
            self.available_kv_cache_memory_bytes = kv
            Runner().profile_cudagraph_memory()
            cuda.used += kv if held is None else held
            return kv

    return Runner, Worker


def metrics(drafts: int, draft_tokens: int, accepted: int, steps: int = 0) -> list:
    """``llm.get_metrics()`` entries as vLLM's reader makes them."""
    out = [SimpleNamespace(name="vllm:iteration_tokens_total", count=steps)]
    for name, value in (("drafts", drafts), ("draft_tokens", draft_tokens)):
        out.append(SimpleNamespace(name=f"vllm:spec_decode_num_{name}", value=value))
    out.append(SimpleNamespace(name="vllm:spec_decode_num_accepted_tokens", value=accepted))
    out.append(SimpleNamespace(name="vllm:spec_decode_num_accepted_tokens_per_pos", values=[5, 4]))
    return [*out, SimpleNamespace(name="vllm:num_requests_running", value=0)]


def fake_run(size: str, case: str, plugin: str, tokens: list, fig: dict, **kw: Any) -> dict:
    """A run_llm.py result made by its own wrappers and ``run_workload``: start-up moves
    the stand-in GPU by ``fig`` (est, retained, actual, kv), then the workload
    (``workload``) generates ``tokens`` with a step that keeps ``step`` bytes; ``once``
    and ``fallback``: what capture-once left on the runner."""
    cuda, report, step = FakeCuda(), kw.get("report"), kw.get("step", 0)
    held = fig.get("held", fig["kv"])
    runner_cls, worker_cls = fake_classes(
        cuda, fig["est"], fig["retained"], fig["actual"], fig["kv"], held
    )
    mem: dict[str, Any] = {}
    installed = run_llm.install_wrappers(runner_cls, worker_cls, cuda, mem)
    worker_cls().determine_available_memory()
    runner_cls().capture_model(profile_only=True)
    runner_cls().capture_model()
    runner = SimpleNamespace(specgraph_profile=report and SimpleNamespace(to_dict=lambda: report))
    runner.specgraph_capture_once = kw.get("once")
    runner.specgraph_capture_once_fallback = kw.get("fallback")
    result = {"size": size, "case": case, "capture": kw.get("capture", "default"), "ok": True}
    result |= {"workload": kw.get("workload", "smoke"), "mem": mem, "startup_s": 12.5}
    result["plugin"] = {"switch": plugin, "wrappers_intact": run_llm.wrappers_intact(installed)}
    result["resolved"] = {
        "num_gpu_blocks": held >> 14,
        "block_size": 16,
        "num_capture_sizes": 6,
    }
    result |= {"kv_tokens": held >> 10, "plugin_report": run_llm.plugin_report(runner)}
    result |= run_llm.capture_once_of(runner)

    def generate(requests: list, sampling: dict | None = None) -> list[list[int]]:
        cuda.used += step
        cuda.reserved += step
        cuda.peak_allocated, cuda.peak_reserved = cuda.allocated + step, cuda.reserved
        result.setdefault("sampled_with", []).append(sampling)
        return [list(t) for t in tokens]

    args = SimpleNamespace(workload=result["workload"], max_tokens=3, num_prompts=2, seed=0)
    args.load_requests, args.load_repeats = 4, 2
    llm = SimpleNamespace(get_metrics=lambda: metrics(10, 30, 12))
    run_llm.run_workload(args, run_llm.SIZES[size], 512, generate, llm, cuda, mem, result)
    return result


@pytest.fixture(autouse=True)
def _no_garbage_collection_at_rest(monkeypatch):
    """``free_at_rest`` collects garbage; with vLLM imported that is slow, and needless here."""
    monkeypatch.setattr(run_llm, "gc", SimpleNamespace(collect=lambda: 0))


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


@dataclasses.dataclass(frozen=True)
class Outcome:
    """The plugin's ``CaptureOnceOutcome``, the fields run_llm.py reads."""

    max_blocks: int
    num_blocks: int
    reserved_bytes: int
    mapped_bytes: int
    taken_bytes: int
    budget_bytes: int
    seconds: float


def once_run(case: str, tokens: list, held: int = ONCE["held"]) -> dict:
    """A ``once`` run whose capture-once backed ``held`` bytes of KV pages."""
    budget = KV_MAX - ONCE["actual"]
    outcome = Outcome(KV_MAX >> 14, held >> 14, KV_MAX, held, ONCE["actual"], budget, 0.5)
    return fake_run("tiny", case, "once", tokens, ONCE | {"held": held}, once=outcome)


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


# ---- summarize.py ----------------------------------------------------------------------


def _report(estimate: dict[str, int], actual: dict[str, int] | None, one_time: int = 0) -> dict:
    """The plugin's report, as its own classes write it (test byte counts)."""
    from vllm_specgraph.meter import OwnerMemory
    from vllm_specgraph.patches._measurements import SpecgraphCapture
    from vllm_specgraph.profile import GraphMemoryReport

    def owners(figures: dict[str, int] | None) -> tuple | None:
        return figures and tuple(OwnerMemory(name, 1, n, 0) for name, n in figures.items())

    report = GraphMemoryReport(owners(estimate), one_time, 0, 0, 0, 1.0)
    return SpecgraphCapture(report, capture_wall_seconds=1.0, actual=owners(actual)).to_dict()


def write(out, name: str, run: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(run))


def summary(out, *extra: str) -> tuple[int, dict, str]:
    """summarize.py on ``out``: exit status, the graph-memory JSON and its Markdown."""
    rc = summarize.main([str(out), "--results", str(out / "res"), *extra])
    doc = json.loads((out / "res" / "vllm_graph_memory.json").read_text())
    return rc, doc, (out / "res" / "vllm_graph_memory.md").read_text()


MISSES = {"est": 90 * MiB, "retained": MiB, "actual": 100 * MiB}


def test_memory_rows_are_checked_and_tabled(tmp_path, capsys, monkeypatch):
    toks = [[5, 6, 7], [8, 9]]
    exact = _report({"target": 30 * MiB}, {"target": 30 * MiB}, 4 * MiB)  # 4 MiB one-time
    for name, run in (
        ("base-off", fake_run("tiny", "base", "off", toks, UPSTREAM)),
        ("base-on", fake_run("tiny", "base", "on", toks, EXACT, report=exact)),
        # eagle: the plugin misses by 10 %, the tokens differ, the off run is "none"
        ("eagle-off", fake_run("tiny", "eagle", "none", toks, UPSTREAM)),
        ("eagle-on", fake_run("tiny", "eagle", "on", [[5]], EXACT | MISSES)),
    ):
        write(tmp_path, name, run | {"commit": None if name == "eagle-on" else "c1"})
    monkeypatch.setenv(ESTIMATE_ENV, "0")
    write(tmp_path, "noest", fake_run("tiny", "base", "noest", toks, UPSTREAM) | {"commit": "c1"})
    (tmp_path / "skipped.txt").write_text("tiny-ngram-off\n")
    rc, doc, md = summary(tmp_path)
    assert rc == 1 and doc["skipped"] == ["tiny-ngram-off"]
    base, eagle = (
        {k: v // MiB if isinstance(v, int) and abs(v) > 1000 else v for k, v in row.items()}
        for row in doc["rows"]
    )
    assert pick([base], "status upstream_error_bytes plugin_error_bytes commit") == "PASS 5 0 c1"
    assert base["upstream_error_pct"] == pytest.approx(100 * 5 / 36)
    assert pick([base], "retained_on_bytes retained_on_beyond_one_time_bytes") == "4 0"
    assert pick([base], "plugin_estimate_bytes plugin_budget_bytes plugin_kept_bytes") == "30 34 4"
    keys = "budget_minus_taken_off_bytes budget_minus_taken_on_bytes budget_minus_taken_noest_bytes"
    assert pick([base], keys) == "-27 0 -68"
    assert pick([base], "over_budget_off_bytes over_budget_on_bytes over_budget_noest_bytes") == (
        "27 0 68"
    )
    assert pick(doc["rows"][:1], "kv_tokens_off kv_tokens_on") == f"{7 << 20} {8 << 20}"
    assert base["owners_on"] == {"target": {"estimate": 30 * MiB, "actual": 30 * MiB}}
    assert pick([base], "tokens_equal_on_off tokens_equal_noest_off") == "True True"
    assert (eagle["off_switch"], eagle["commit"]) == ("none", None)
    assert eagle["checks"] == {"estimate": False, "retained": True, "tokens": False}
    assert eagle["status"] == "FAIL (estimate -10.0 %; tokens differ)"
    row = next(line for line in md.splitlines() if line.startswith("| tiny | default (6) | base |"))
    cells = row.strip("|").split(" | ")
    assert len(cells) == len(summarize.MEMORY_COLUMNS) and cells[-1].strip() == "PASS"
    assert " | ".join(cells[3:10]) == (
        "41.0 / 30.0 / 0.0 | 34.0 | 36.0 / 30.0 | +13.9 % (+5.0) / +0.0 % (+0.0) | 32.0 / 4.0 | "
        "-27.0 / 0.0 / -68.0 | 27.0 / 0.0 / 68.0"
    )
    assert "| eagle (off=none) |" in md and "Not run (the script's time budget ran out)" in md
    printed = capsys.readouterr().out
    assert "TOKENS tiny on eagle == base: False" in printed
    assert "SUMMARY: all runs ok=False (5/5), rows PASS=1/2" in printed


def test_group_names_order_and_carry_over(tmp_path):
    groups = [
        ({"size": "1b", "graph_mode": "compile", "tp": 2}, "1b-compile-tp2"),
        (
            {"size": "8b", "capture": "small", "workload": "peak", "utilization": 0.9},
            "8b-small-peak-util0.9",
        ),
        ({"size": "1b", "allocator": "expandable", "graph_mode": "full"}, "1b-expandable"),
    ]
    assert [summarize.group_of(r, "memory") for r, _ in groups] == [g for _, g in groups]
    assert summarize.group_of({"size": "1b", "workload": "peak"}, "load") == "1b"
    order = ["tiny", "1b", "1b-tp2", "1b-small", "1b-peak", "1b-compile", "8b"]
    assert sorted(order[::-1], key=summarize.group_order) == order
    exact = _report({"target": 30 * MiB}, {"target": 30 * MiB}, 4 * MiB)
    for case, commit in (("base", "c1"), ("eagle", None)):  # eagle: code older than the record
        for p in ("off", "on"):
            run = fake_run("tiny", case, p, [[1]], EXACT, report=exact)
            write(tmp_path / "a", f"{case}-{p}", run | {"commit": commit})
    for p in ("off", "on"):
        write(tmp_path / "b", p, fake_run("1b", "base", p, [[1]], EXACT))
    assert summary(tmp_path / "a")[0] == 0
    previous = str(tmp_path / "a" / "res" / "vllm_graph_memory.json")
    rc, doc, md = summary(tmp_path / "b", "--previous", previous)
    assert pick(doc["rows"], "size case") == "tiny base; 1b base"
    assert {(r["size"], r["case"]) for r in doc["runs"]} == {("tiny", "base"), ("1b", "base")}
    assert list(doc["sizes"]) == ["tiny", "1b"] and "| tiny | default (6) | base |" in md
    assert rc == 1  # only this invocation's rows decide: 1b's has no plugin report


def fake_tp_run(case: str, plugin: str, ranks: list[dict], report: dict | None = None) -> dict:
    """A --tp result: the run's own fields, and one record per rank made by the wrappers."""
    runs = [fake_run("tiny", case, plugin, [[5]], fig, report=report) for fig in ranks]
    records = [
        {"rank": i, "mem": r["mem"], "plugin_report": r["plugin_report"]}
        for i, r in enumerate(runs)
    ]
    top = {k: v for k, v in runs[0].items() if k not in ("mem", "plugin_report")}
    return top | {"tp": len(ranks), "ranks": records}


def test_tensor_parallel_rows_check_every_rank_and_show_the_worst(tmp_path, capsys):
    exact, report = (
        EXACT | {"est": 30 * MiB, "retained": 0},
        _report({"t": 30 * MiB}, {"t": 30 * MiB}),
    )
    kept = exact | {"retained": 6 * MiB}  # rank 1 leaves 6 MiB after its profile
    for case, on_ranks in (("base", [exact, kept]), ("eagle", [exact, exact])):
        write(tmp_path, f"{case}-off-tp2", fake_tp_run(case, "off", [UPSTREAM, UPSTREAM]))
        write(tmp_path, f"{case}-on-tp2", fake_tp_run(case, "on", on_ranks, report))
    rc, doc, md = summary(tmp_path)
    base, eagle = doc["rows"]
    assert rc == 1 and pick([base], "size tp worst_rank") == "tiny-tp2 2 1"
    assert pick(base["ranks"], "rank retained_on_bytes pass") == f"0 0 True; 1 {6 * MiB} False"
    assert base["retained_on_bytes"] == 6 * MiB  # the worst rank's figures
    assert base["checks"] == {"estimate": True, "retained": False, "tokens": True}
    assert base["status"] == "FAIL (rank 1: retained 6.0 MiB)" and eagle["status"] == "PASS"
    assert "| tiny-tp2 | default (6) | base [rank 1 of 2] | 41.0 / 30.0 |" in md
    assert len(doc["runs"][0]["ranks"]) == 2
    assert "rank 1 (pid None, None): graph memory MiB: estimate=30.0" in capsys.readouterr().out


def load_run(rates: list[float], round_: int = 1, tokens: list | None = None, **load: Any) -> dict:
    """A load run's result: one timed repeat per rate (``steps``: their step times;
    ``spec``: the drafts, draft tokens and accepted tokens)."""
    steps = load.pop("steps", [None] * len(rates))
    repeats = [
        {"generated_tokens": 3, "tokens_per_s": r, "step_ms": s}
        for r, s in zip(rates, steps, strict=True)
    ]
    counts = ("drafts", "draft_tokens", "accepted_tokens")
    spec = dict(zip(counts, load.pop("spec", (0, 0, 0)), strict=True))
    load = {"num_requests": 2, "repeats": repeats, "repeats_equal": True, "spec": spec} | load
    return {"ok": True, "tokens": tokens or [[1]], "load_round": round_, "load": load}


def cells(row: dict) -> dict[str, str]:
    return dict(zip(summarize.LOAD_COLUMNS, summarize.load_cells(row), strict=True))


SHARE = {"plugin_share": 0.0004, "plugin_us_per_step": 12.0}


@pytest.mark.parametrize(
    ("offs", "ons", "status"),
    [
        ([load_run([1000.0])], [load_run([970.0])], "FAIL (on/off 0.970)"),
        ([load_run([1000.0])], [load_run([980.0])], "PASS"),
        ([load_run([1000.0])], [load_run([1100.0])], "PASS"),  # faster on: the spread, no cost
        (
            [load_run([1000.0])],
            [load_run([900.0], plugin_share=SHARE)],
            "PASS",
        ),  # the share decides
        (
            [load_run([9.0])],
            [load_run([9.0], plugin_share={"plugin_share": 0.03})],
            "FAIL (plugin share 3.00%)",
        ),
        (
            [load_run([1.0])],
            [load_run([1.0], tokens=[[2]])],
            "FAIL (tokens differ: on r1 from off r1)",
        ),
        ([], [load_run([1.0], tokens=[[2]])], "FAIL (tokens missing; no tokens/s)"),
        (
            [load_run([1.0]), load_run([1.0], 2)],
            [load_run([1.0]), load_run([1.0], 2, [[9]])],
            "FAIL (tokens differ: on r2 from off r1)",
        ),
        ([load_run([1.0]), {"ok": False, "load_round": 2}], [load_run([1.0])], "PASS"),
    ],
)
def test_load_row_checks(offs, ons, status):
    assert summarize.build_load_row("1b", "draft", offs, ons)["status"] == status


def test_load_row_pools_the_rounds(tmp_path):
    # Round 1's off run had one fast repeat: of the medians over both rounds 98 / 97.
    offs = [
        load_run([98.0, 95.0], 2, steps=[3.0, 3.2], spec=(10, 30, 18)) | {"commit": "b"},
        load_run([110.0, 96.0], 1, steps=[2.0, 3.1], spec=(10, 30, 12)) | {"commit": "a"},
    ]
    ons = [
        load_run([97.0, 99.0], 1, steps=[3.0, 2.9], spec=(10, 30, 15)),
        load_run([96.0, 99.0], 2, steps=[3.1, 2.9], spec=(10, 30, 15)),
    ]
    ons[1]["gpu"] = {"visible_devices": 1}
    base = [load_run([50.0]), load_run([40.0], 2), {"ok": False}]
    row = summarize.build_load_row("1b", "accept", offs, ons, base)
    assert row["tokens_per_s_off"] == {"median": 97.0, "best": 110.0, "lowest": 95.0}
    assert row["ratio_on_off_median"] == round(98 / 97, 4) and row["status"] == "PASS"
    assert pick(row["rounds"], "round ratio_on_off") == f"1 {98 / 103:.4f}; 2 {97.5 / 96.5:.4f}"
    keys = "step_ms_off step_ms_on runs_off acceptance_off mean_acceptance_length_off gpu_on"
    assert pick([row], keys) == "3.05 2.95 2 0.5 2.5 1"
    assert [r["round"] for r in row["repeats_off"]] == [1, 1, 2, 2]
    assert pick([row], "tokens_per_s_no_speculator commit") == "45.0 a b"
    assert row["ratio_on_no_speculator"] == round(98 / 45, 4)
    got = list(cells(row).values())
    assert " | ".join(got[3:13]) == (
        "2 / 2 | 97 (95 - 110) | 98 (96 - 99) | 1.010 | r1 0.952, r2 1.010 | 3.05 / 2.95 | 0.967 | "
        "0.500 / 0.500 | 2.178 | -"
    )
    assert cells(row | SHARE)["plugin share of a step (us)"] == "0.040% (12)"
    # A run that compiled its graphs beside one that loaded them from vLLM's cache is named.
    (tmp_path / "off.log").write_text("Compiling a graph for compile range (1, 2048)")
    (tmp_path / "on.log").write_text("Directly load the compiled graph(s)")
    offs = [load_run([1.0]) | {"_log": str(tmp_path / "off.log")}]
    ons = [load_run([1.0], tokens=[[9]]) | {"_log": str(tmp_path / "on.log")}]
    assert summarize.build_load_row("8b-compile", "accept", offs, ons)["status"] == (
        "FAIL (tokens differ: on r1 from off r1 (torch.compile: off r1 compiled, on r1 cache))"
    )


def test_load_rows_by_request_count_the_runs_that_ran_and_carry_over(tmp_path, capsys):
    def save(out, name: str, run: dict, commit: str | None = None) -> None:
        size, case, switch = name.split("-")[:3]
        run |= {"size": size, "case": case, "workload": "load", "commit": commit}
        write(out, name, run | {"plugin": {"switch": switch}})

    for name, run in (
        ("1b-accept-off", load_run([100.0])),
        ("1b-accept-on", load_run([99.0])),
        ("1b-accept-on-r2", load_run([50.0], 2, num_requests=96)),
        ("1b-base-off", load_run([40.0])),
        ("8b-draft-off", load_run([10.0])),
        ("8b-draft-on", load_run([10.0])),
    ):
        save(tmp_path / "a", name, run, "abc" if name.startswith("8b") else None)
    (tmp_path / "a" / "skipped.txt").write_text("1b-base-on\n")
    assert summary(tmp_path / "a")[0] == 1  # a run that did not run fails the invocation
    rows = json.loads((tmp_path / "a" / "res" / "vllm_load.json").read_text())["rows"]
    # Runs of another request count are never pooled; the base case's off run speaks
    # for "no speculator".
    assert pick(rows, "size case num_requests runs_off runs_on") == (
        "1b base 2 1 0; 1b accept 2 1 1; 1b accept 96 0 1; 8b draft 2 1 1"
    )
    assert pick(rows[1:2], "tokens_per_s_no_speculator ratio_on_off_median") == "40.0 0.99"
    assert "[load 1b/accept] PASS" in capsys.readouterr().out
    for switch in ("off", "on"):
        save(tmp_path / "b", f"1b-draft-{switch}", load_run([100.0]))
    summary(tmp_path / "b", "--previous", str(tmp_path / "a" / "res" / "vllm_graph_memory.json"))
    doc = json.loads((tmp_path / "b" / "res" / "vllm_load.json").read_text())
    assert doc["schema"] == 3 and pick(doc["rows"], "size commit") == "1b None; 8b abc"
    md = (tmp_path / "b" / "res" / "vllm_load.md").read_text()
    assert "| 8b | draft | 2 | 1 / 1 | 10 (10 - 10) |" in md  # carried over: it names its commit


def test_serve_rows_pass_only_with_equal_tokens_plugin_lines_and_clean_exits(tmp_path):
    def run(tokens: list | None, **extra: Any) -> dict:
        base = {"size": "1b", "case": "draft", "graph_mode": "compile", "ok": True, "requests": 1}
        base |= {"startup_s": 40.0, "seconds": 3.0, "shutdown_s": 4.0, "gpu_left_mib": 0}
        return base | {"log_ok": True, "clean_shutdown": True, "tokens": tokens} | extra

    assert summarize.serve_row(run([[1]]), run([[1]]))["check"] == "PASS"
    assert summarize.serve_row(run([[1]]), run([[2]]))["check"] == "FAIL (tokens equal)"
    row = summarize.serve_row(run([[1]]), run([[1]], clean_shutdown=False, log_ok=False))
    assert row["check"] == "FAIL (plugin lines in the server log, clean shutdown)"
    row = summarize.serve_row(run([[1]], clean_shutdown=False, log_ok=False), run([[1]]))
    assert row["check"] == "FAIL (plugin lines in the server log, clean shutdown)"  # off's too
    (tmp_path / "on.json").write_text(json.dumps(run([[1]], commit="abc", measured_utc="U")))
    pair = [str(tmp_path / "off.json"), str(tmp_path / "on.json")]
    assert summarize.main(["--serve", *pair, "--results", str(tmp_path)]) == 1  # off: no result
    row = json.loads((tmp_path / "vllm_serve.json").read_text())["rows"][0]
    assert row["check"].startswith("FAIL (both ran, tokens equal, plugin lines in the server log")
    md = (tmp_path / "vllm_serve.md").read_text()
    assert "| 1b | compile | draft | 1 | - / 40.0 | - / 3.0 | - / 4.0 | - / 0 |" in md
    assert md.endswith("| U, abc |\n")


def test_once_rows_show_off_on_and_once_side_by_side(tmp_path):
    toks, exact = [[5, 6]], _report({"target": 30 * MiB}, {"target": 30 * MiB}, 4 * MiB)
    for case in ("base", "draft", "eagle"):
        write(tmp_path, f"{case}-off", fake_run("tiny", case, "off", toks, UPSTREAM))
        write(tmp_path, f"{case}-on", fake_run("tiny", case, "on", toks, EXACT, report=exact))
    write(tmp_path, "base-once", once_run("base", toks))
    write(tmp_path, "draft-once", once_run("draft", toks, KV_MAX))  # backed past its budget
    fell_back = {"report": exact, "fallback": "no cuda-bindings"}  # the exact profile ran
    write(tmp_path, "eagle-once", fake_run("tiny", "eagle", "once", toks, EXACT, **fell_back))
    rc, doc, md = summary(tmp_path)
    assert rc == 1 and pick(doc["rows"], "status pass") == "PASS True; PASS False; PASS True"
    once = md[md.index("| size | case | KV tokens off / on / once |") :].splitlines()[2:5]
    kv_tokens, startup = "| 7,340,032 / 8,388,608 / ", "| 12.5 / 12.5 / 12.5 | 0.0 / "
    assert once == [
        f"| tiny | base {kv_tokens}8,392,704 {startup}0.0 | 524,544 / 526,464 | True | PASS |",
        f"| tiny | draft {kv_tokens}8,423,424 {startup}30.0 | 526,464 / 526,464 | True "
        "| FAIL (over budget 30.0 MiB) |",
        f"| tiny | eagle {kv_tokens}8,388,608 {startup}0.0 | - / - | True "
        "| FALLBACK (no cuda-bindings) |",
    ]


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
