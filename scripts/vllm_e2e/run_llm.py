# SPDX-License-Identifier: Apache-2.0
"""One offline vLLM 0.33.0 run on a dummy-weight Llama, written to ``--out`` as JSON
(docs/vllm-e2e.md: the knobs, and what a run records). Nothing in vLLM changes:
wrappers call the methods they replace and read the driver's figures and the time
around them, a log handler copies the plugin's lines. ``E2EWorkerExtension`` is the
measuring side: vLLM mixes it into every worker at ``--tp`` > 1; at TP=1 this process
calls its methods on its own worker."""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import gc
import importlib.util
import json
import logging
import multiprocessing
import os
import pstats
import random
import statistics
import sys
import time
import traceback
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
CONFIGS = os.path.join(os.path.dirname(os.path.dirname(HERE)), "configs")
# The tiny model's configs ship with the package, for its demo: found (not
# imported: nothing may load before set_env) where the package is installed.
DEMO_CONFIGS = os.path.join(
    importlib.util.find_spec("vllm_specgraph.demo").submodule_search_locations[0], "configs"
)
CASES = ("base", "draft", "accept", "ngram", "eagle")  # accept: the target drafts for itself
PLUGIN_SWITCHES = ("off", "on", "none", "once")  # none: not loaded; once: on, capture-once
PLUGIN_NAME, PLUGIN_GROUP = "specgraph", "vllm.general_plugins"  # pyproject.toml's entry point
PLUGIN_LOGGERS = ("vllm.specgraph", "vllm_specgraph")
PLUGIN_LOG_PREFIX, PLUGIN_LOG_LIMIT = "SPECGRAPH-LOG", 500
PLUGIN_LOG_ECHO_ENV = "E2E_PLUGIN_LOG_ECHO"  # 0: vLLM's own logging prints the plugin's lines
WORKER_EXTENSION = "run_llm.E2EWorkerExtension"  # vLLM imports it in every worker at TP > 1
RANK_DIR_ENV = "E2E_RANK_DIR"  # where the workers also write their figures as they are taken
COMMIT_ENV = "SPECGRAPH_COMMIT"  # the plugin commit the device script measures
PROFILE_ENV, ALLREDUCE_ENV = "VLLM_SPECGRAPH_PROFILE", "VLLM_SPECGRAPH_ALLREDUCE"
# What a run records of its environment (an allocator setting is inherited, not set).
RECORDED_ENV = ("VLLM_PLUGINS", "VLLM_SPECGRAPH", "PYTORCH_CUDA_ALLOC_CONF", PROFILE_ENV)
BASE_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_USE_V2_MODEL_RUNNER": "1"}
TINY = {"model": "tiny-llama", "draft": "tiny-llama-draft", "eagle": "tiny-llama-draft"}
SIZES: dict[str, dict[str, Any]] = {  # model, draft, eagle: config dirs (CONFIGS/NAME)
    "tiny": {k: os.path.join(DEMO_CONFIGS, v) for k, v in TINY.items()}
    | {"dtype": "float32", "capture_sizes": [1, 2, 4, 8, 16, 32], "max_num_seqs": 8}
    | {"max_model_len": 256, "max_num_batched_tokens": 512, "gpu_memory_utilization": 0.1},
    "1b": {"model": "llama-1b", "draft": "llama-1b-draft", "eagle": "llama-1b-eagle"}
    | {"dtype": "bfloat16", "capture_sizes": None, "max_num_seqs": 256}  # None: vLLM's
    | {"max_model_len": 1024, "max_num_batched_tokens": 2048, "gpu_memory_utilization": 0.5},
}
SIZES["8b"] = SIZES["1b"] | {"model": "llama-8b", "draft": "llama-8b-draft"}
SIZES["8b"]["eagle"] = "llama-8b-eagle"  # the 8B-class model: the 1B model's engine settings
GRAPH_MODES: dict[str, dict[str, Any]] = {
    "full": {"mode": 0, "cudagraph_mode": "FULL"},  # compilation off, FULL graphs
    "compile": {"mode": 3, "cudagraph_mode": "FULL_AND_PIECEWISE"},  # vLLM's default for MRV2
}
NUM_SPEC, REINIT_STD = 3, 0.05  # speculative tokens; the weight refill's N(0, std)
SMOKE_PROMPTS, SMOKE_MAX_TOKENS = 6, 32
LOAD_MIN_LEN, LOAD_WARMUP_REQUESTS, LOAD_WARMUP_MAX_TOKENS, LOAD_SEED = 16, 16, 32, 0
ENGINE_STEPS = "vllm:iteration_tokens_total"  # its count: the engine steps so far
Request = tuple[list[int], int]  # (prompt token ids, max_tokens)
Generate = Callable[[list[Request]], list[list[int]]]  # greedy: the generated token ids


def config_dir(size: str, key: str = "model") -> str:
    """The config directory of the size's ``model``, ``draft`` or ``eagle``."""
    return os.path.join(CONFIGS, SIZES[size][key])


def vocab_size(size: str) -> int:
    with open(os.path.join(config_dir(size), "config.json")) as f:
        return int(json.load(f)["vocab_size"])


def set_env(plugin: str, *, plugin_allreduce: bool = False) -> dict[str, str | None]:
    """The engine's and the plugin switch's environment, before vLLM is imported: the
    switch's variables are forced, so that an inherited value cannot turn one switch
    into another, and vLLM subtracts its graph estimate (its default; ``Meter.budget``
    counts on it). ``plugin_allreduce``: at TP > 1 with vLLM's custom all-reduce off
    (only because its compiled library is not carried) the plugin would keep vLLM's
    NCCL choice unless asked for its own by name. Returns what a run records."""
    if plugin not in PLUGIN_SWITCHES:
        raise ValueError(f"plugin switch must be one of {PLUGIN_SWITCHES}, got {plugin!r}")
    for key, value in BASE_ENV.items():
        os.environ.setdefault(key, value)
    for key in ("VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS", "VLLM_SPECGRAPH", PROFILE_ENV):
        os.environ.pop(key, None)
    os.environ["VLLM_PLUGINS"] = "" if plugin == "none" else PLUGIN_NAME
    if plugin == "off":
        os.environ["VLLM_SPECGRAPH"] = "0"
    if plugin == "once":
        os.environ[PROFILE_ENV] = "capture-once"
    if plugin_allreduce:
        os.environ.setdefault(ALLREDUCE_ENV, "1")
    recorded = RECORDED_ENV + (ALLREDUCE_ENV,) * plugin_allreduce
    return {key: os.environ.get(key) for key in recorded}


# ---- what a run reads of the plugin ------------------------------------------------


class PluginLogTap(logging.Handler):
    """Keeps the plugin's first ``limit`` log lines for the result and, with ``echo``,
    prints them with a fixed prefix (vLLM's format names the file, not the logger)."""

    def __init__(self, sink: list[str], limit: int = PLUGIN_LOG_LIMIT, echo: bool = True) -> None:
        super().__init__(logging.DEBUG)
        self.sink, self.limit, self.echo = sink, limit, echo

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = f"{record.levelname} {record.name}: {record.getMessage()}"
        except Exception:  # a bad format string must not stop the engine
            line = f"{record.levelname} {record.name}: {record.msg!r}"
        if len(self.sink) < self.limit:
            self.sink.append(line)
        if self.echo:
            print(f"{PLUGIN_LOG_PREFIX} {line}", flush=True)


def tap_plugin_logs(sink: list[str]) -> None:
    """Route the plugin's loggers through one tap, after vLLM configured logging. Each
    line is printed once: a tap a forked worker inherited (another class, from the
    launcher's ``__main__``) is replaced and, echoing, ``propagate`` cleared. With
    ``E2E_PLUGIN_LOG_ECHO=0`` (serve.py checks the server's own log) vLLM prints them."""
    echo = os.environ.get(PLUGIN_LOG_ECHO_ENV, "1") != "0"
    tap = PluginLogTap(sink, echo=echo)
    for name in PLUGIN_LOGGERS:
        lg = logging.getLogger(name)
        for inherited in [h for h in lg.handlers if type(h).__name__ == "PluginLogTap"]:
            lg.removeHandler(inherited)
        lg.addHandler(tap)
        lg.propagate = not echo
        if lg.getEffectiveLevel() > logging.INFO:
            lg.setLevel(logging.INFO)


def plugin_info(switch: str, env: dict[str, str | None]) -> dict[str, Any]:
    """Where the plugin's entry point comes from and whether the package was imported,
    read after vLLM loaded its general plugins."""
    from importlib.metadata import entry_points

    eps = [ep for ep in entry_points(group=PLUGIN_GROUP) if ep.name == PLUGIN_NAME]
    dist = getattr(eps[0], "dist", None) if eps else None
    mod = sys.modules.get("vllm_specgraph")
    return {
        "switch": switch,
        "env": env,
        "entry_point": eps[0].value if eps else None,
        "entry_points_found": len(eps),
        "dist": f"{dist.name} {dist.version}" if dist is not None else None,
        "dist_location": str(dist.locate_file("")) if dist is not None else None,
        "loaded": mod is not None,
        "module_file": getattr(mod, "__file__", None),
        "loaded_as_expected": (mod is not None) == (switch != "none"),
    }


RUNNER_KEYS = ("capture_once", "capture_once_fallback", "plugin_report")


def runner_record(runner: Any) -> dict[str, Any]:
    """What a model runner resolved (its and its speculator's classes, the attention
    backends) and what the plugin left on it: its profile report (null when it attached
    none), capture-once's outcome (null when absent) and why capture-once fell back
    (null when it did not; then the exact profile ran, reported as for ``on``)."""
    record: dict[str, Any] = {}
    try:  # informational only
        groups = getattr(runner, "attn_groups", None)
        backends = None if groups is None else [g.backend.get_name() for gs in groups for g in gs]
        record["resolved"] = {
            "runner_class": f"{type(runner).__module__}.{type(runner).__name__}",
            "speculator_class": type(getattr(runner, "speculator", None)).__name__,
            "attn_backend": backends,
        }
    except Exception as e:
        record["resolved"] = {"introspect_error": repr(e)}
    try:
        report = getattr(runner, "specgraph_profile", None)
        if report is not None:
            to_dict = getattr(report, "to_dict", None)
            missing = {"error": f"{type(report).__name__} has no to_dict()"}
            report = to_dict() if to_dict else missing
        outcome = getattr(runner, "specgraph_capture_once", None)
        record["capture_once"] = None if outcome is None else dataclasses.asdict(outcome)
        record["capture_once_fallback"] = getattr(runner, "specgraph_capture_once_fallback", None)
        record["plugin_report"] = report
    except Exception as e:
        record["plugin_report"] = {"error": repr(e)}
    return record


def shim_record() -> dict[str, Any]:
    """How often this process called each compiled op that _C_stable_libtorch.py stands in for."""
    shim = sys.modules.get("vllm._C_stable_libtorch")
    return {
        "shim_calls": dict(getattr(shim, "CALLS", {}) or {}),
        "shim_active": bool(getattr(shim, "IS_SHIM", False)),
    }


# ---- measurement -------------------------------------------------------------------


def as_bytes(value: Any) -> int | str:
    return int(value) if isinstance(value, int | float) else repr(value)


def wrap(method: Callable, measure: Callable) -> Callable:
    """``method`` as ``measure(method, self, *args, **kwargs)``."""

    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        return measure(method, self, *args, **kwargs)

    return wrapper


class Meter:
    """Reads figures into ``mem`` (``cuda``: ``torch.cuda``) around three vLLM methods,
    each wrapper calling the method it replaces: the graph profile's estimate, wall
    time and what it left taken; the production capture's own figure and wall time
    (profiling captures counted apart); the KV-cache bytes and the worker's budget.
    Then the free memory at rest and what one generate took."""

    def __init__(self, cuda: Any, mem: dict[str, Any]) -> None:
        self.cuda, self.mem = cuda, mem
        self.installed: dict[str, tuple[type, Callable]] = {}

    def install(self, runner_cls: type, worker_cls: type) -> Meter:
        for cls, name, measure in (
            (runner_cls, "profile_cudagraph_memory", self.profile),
            (runner_cls, "capture_model", self.capture),
            (worker_cls, "determine_available_memory", self.budget),
        ):
            wrapper = wrap(getattr(cls, name), measure)
            setattr(cls, name, wrapper)
            self.installed[name] = (cls, wrapper)
        return self

    def intact(self) -> dict[str, bool]:
        """Per wrapper: still in place (a later patch would have bypassed it)."""
        return {name: getattr(cls, name) is fn for name, (cls, fn) in self.installed.items()}

    def used(self) -> int:
        self.cuda.synchronize()
        free, total = self.cuda.mem_get_info()
        return total - free

    @contextmanager
    def around(self, prefix: str, driver_key: str) -> Iterator[None]:
        """``prefix``'s wall time, and the driver-level and allocator-reserved bytes it added."""
        used, reserved, t0 = self.used(), self.cuda.memory_reserved(), time.perf_counter()
        yield
        self.cuda.synchronize()
        self.mem[f"{prefix}_wall_s"] = round(time.perf_counter() - t0, 3)
        self.mem[driver_key] = self.used() - used
        self.mem[f"{prefix}_allocator_reserved_delta"] = self.cuda.memory_reserved() - reserved

    def profile(self, method: Callable, runner: Any) -> Any:
        self.cuda.synchronize()
        self.cuda.empty_cache()
        self.mem["profile_driver_used_before"] = used = self.used()
        with self.around("profile", "profile_driver_left_taken"):
            estimate = method(runner)
        self.mem["profile_estimate_bytes"] = as_bytes(estimate)
        self.cuda.empty_cache()
        self.mem["profile_driver_left_taken_after_empty_cache"] = self.used() - used
        return estimate

    def capture(self, method: Callable, runner: Any, *args: Any, **kwargs: Any) -> Any:
        mem = self.mem
        if kwargs.get("profile_only"):
            t0 = time.perf_counter()
            out = method(runner, *args, **kwargs)
            mem["profile_only_capture_calls"] = mem.get("profile_only_capture_calls", 0) + 1
            wall = mem.get("profile_only_capture_wall_s", 0.0) + time.perf_counter() - t0
            mem["profile_only_capture_wall_s"] = round(wall, 3)
            return out
        mem["capture_started"] = True  # a run that dies in the capture says so
        with self.around("capture", "capture_driver_delta"):
            actual = method(runner, *args, **kwargs)
        mem["capture_calls"] = mem.get("capture_calls", 0) + 1
        mem["capture_actual_bytes"] = as_bytes(actual)
        return actual

    def budget(self, method: Callable, worker: Any) -> Any:
        """vLLM 0.33.0's KV-cache budget as its worker kept it: ``kv = requested - non_kv -
        graph estimate``, ``requested = ceil(total * gpu_memory_utilization)`` from its init
        snapshot, the headroom the profile run's activation peak above what it kept
        (capture-once: its profile returned 0, so the peak alone). summarize.py's over
        budget at rest builds on ``requested - headroom``, never on ``kv_cache_bytes``
        (capture-once: the reserved most, which would hide what the graphs took)."""
        mem, t0 = self.mem, time.perf_counter()
        kv = method(worker)
        mem["determine_available_memory_wall_s"] = round(time.perf_counter() - t0, 3)
        mem["kv_cache_bytes"] = int(kv)
        estimate = getattr(worker, "cudagraph_memory_estimate", None)  # None: it kept none
        mem["worker_cudagraph_memory_estimate"] = -1 if estimate is None else int(estimate)
        snapshot = getattr(worker, "init_snapshot", None)
        needed = ("requested_memory", "peak_activation_memory", "available_kv_cache_memory_bytes")
        if snapshot is None or not all(hasattr(worker, name) for name in needed):
            return kv  # it did not profile: kv_cache_memory_bytes was set
        requested = int(worker.requested_memory)
        subtracted = 0 if estimate is None else int(estimate)
        mem["init_free_bytes"] = int(snapshot.free_memory)
        mem["init_total_bytes"] = int(snapshot.total_memory)
        mem["requested_bytes"] = requested
        mem["activation_headroom_bytes"] = int(worker.peak_activation_memory) - subtracted
        mem["graph_estimate_applied_bytes"] = subtracted
        non_kv = requested - int(worker.available_kv_cache_memory_bytes) - subtracted
        mem["non_kv_bytes"] = non_kv
        return kv

    def at_rest(self) -> None:
        """Driver-level free bytes with nothing cached by the allocator."""
        gc.collect()
        self.cuda.synchronize()
        self.cuda.empty_cache()
        self.mem["free_at_rest_bytes"] = int(self.cuda.mem_get_info()[0])

    @contextmanager
    def step(self) -> Iterator[None]:
        """Around one generate from rest: driver-level free bytes after it (the
        allocator keeps its segments) and the allocator's peaks above its start."""
        cuda = self.cuda
        cuda.synchronize()
        cuda.reset_peak_memory_stats()
        allocated, reserved = cuda.memory_allocated(), cuda.memory_reserved()
        yield
        cuda.synchronize()
        self.mem["free_after_step_bytes"] = int(cuda.mem_get_info()[0])
        self.mem["step_allocated_peak_bytes"] = int(cuda.max_memory_allocated() - allocated)
        self.mem["step_reserved_peak_bytes"] = int(cuda.max_memory_reserved() - reserved)


# ---- workloads ---------------------------------------------------------------------


def prompts_token_ids(n: int, vocab: int) -> list[list[int]]:
    """``smoke``: deterministic prompts, ids in [1, vocab - 2]; the odd ones repeat a
    pattern, so that the n-gram speculator finds matches."""
    out = []
    for i in range(n):
        if i % 2 == 0:
            out.append([(7 + 31 * i + 13 * j) % (vocab - 2) + 1 for j in range(12 + 3 * i)])
        else:
            out.append([(11 * i + 5 * j) % (vocab - 2) + 1 for j in range(6)] * 4)
    return out


def load_requests(vocab: int, n: int, max_model_len: int, seed: int) -> list[Request]:
    """``load``: ``n`` seeded requests, prompts of 16 to ``max_model_len // 2`` tokens,
    outputs of 16 to ``max_model_len // 4``, ids in [1, vocab - 2]."""
    if max_model_len < 4 * LOAD_MIN_LEN:
        raise ValueError(f"max_model_len must be at least {4 * LOAD_MIN_LEN}, got {max_model_len}")
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        prompt_len = rng.randint(LOAD_MIN_LEN, max_model_len // 2)
        max_tokens = rng.randint(LOAD_MIN_LEN, max_model_len // 4)
        out.append(([rng.randint(1, vocab - 2) for _ in range(prompt_len)], max_tokens))
    return out


def read_spec_counters(metrics: list[Any]) -> dict[str, Any]:
    """``llm.get_metrics()``'s spec-decode counters (a value, or the per-position
    values) and, under ``ENGINE_STEPS``, the engine steps so far."""
    out: dict[str, Any] = {}
    for m in metrics:
        if "spec_decode" in m.name:
            value = getattr(m, "value", None)
            out[m.name] = value if value is not None else getattr(m, "values", None)
        elif m.name == ENGINE_STEPS:
            out[m.name] = out.get(m.name, 0) + int(m.count)
    return out


def counter_delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """``after - before`` per counter (element-wise for vectors)."""
    out: dict[str, Any] = {}
    for name, value in after.items():
        old = before.get(name)
        if isinstance(value, list):
            old = old if isinstance(old, list) else []
            out[name] = [v - (old[i] if i < len(old) else 0) for i, v in enumerate(value)]
        elif isinstance(value, int | float):
            out[name] = value - (old if isinstance(old, int | float) else 0)
    return out


def spec_summary(metrics: dict[str, Any]) -> dict[str, Any]:
    """Acceptance figures from vLLM's spec-decode counters."""

    def count(name: str) -> int | None:
        v = metrics.get(f"vllm:spec_decode_{name}")
        return int(v) if isinstance(v, int | float) else None

    drafts, draft_tokens = count("num_drafts"), count("num_draft_tokens")
    accepted = count("num_accepted_tokens")
    ok = accepted is not None
    return {
        "drafts": drafts,
        "draft_tokens": draft_tokens,
        "accepted_tokens": accepted,
        "acceptance_rate": round(accepted / draft_tokens, 4) if ok and draft_tokens else None,
        "mean_acceptance_length": round(1 + accepted / drafts, 3) if ok and drafts else None,
    }


def plugin_share(
    generate: Generate, requests: list[Request], package_dir: str, read_steps: Callable
) -> dict[str, Any]:
    """What the code under ``package_dir`` costs a step: one generate under cProfile,
    the time in that package's own functions (their ``tottime``, with the
    profiler's charge per call) over the whole generate's; ``read_steps``: the
    engine steps so far."""
    profiler = cProfile.Profile()
    steps_before = read_steps()
    profiler.enable()
    generate(requests)
    profiler.disable()
    steps = (read_steps() or 0) - (steps_before or 0)
    stats = pstats.Stats(profiler).stats  # (file, line, name) -> (cc, calls, tottime, cum, _)
    total = sum(tottime for _, _, tottime, _, _ in stats.values())
    ours = {key: value for key, value in stats.items() if key[0].startswith(package_dir)}
    seconds = sum(tottime for _, _, tottime, _, _ in ours.values())
    calls = sum(calls for _, calls, _, _, _ in ours.values())
    top = sorted(ours.items(), key=lambda kv: -kv[1][2])[:5]
    return {
        "profiled_s": round(total, 4),
        "plugin_s": round(seconds, 6),
        "plugin_share": round(seconds / total, 6) if total else None,
        "engine_steps": steps,
        "plugin_calls_per_step": round(calls / steps, 2) if steps else None,
        "plugin_us_per_step": round(1e6 * seconds / steps, 2) if steps else None,
        "plugin_top": [f"{name} {1e6 * v[2]:.0f} us / {v[1]} calls" for (_, _, name), v in top],
    }


def run_load(
    generate: Generate,
    read_counters: Callable[[], dict[str, Any]],
    requests: list[Request],
    warmup: list[Request],
    repeats: int,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, Any]:
    """Warm up, then time ``repeats`` generates of ``requests``: tokens/s and the mean
    engine-step time per repeat, the best and median tokens/s, the median step
    time, the first repeat's tokens, whether every repeat gave the same, and the
    spec-decode counters over the timed repeats only."""
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    generate(warmup)
    first = last = read_counters()
    timings, outputs = [], []
    for _ in range(repeats):
        start = clock()
        outputs.append(generate(requests))
        wall, now = clock() - start, read_counters()
        steps = counter_delta(last, now).get(ENGINE_STEPS) if ENGINE_STEPS in last else None
        generated, last = sum(len(t) for t in outputs[-1]), now
        timings.append({"wall_s": round(wall, 4), "generated_tokens": generated})
        timings[-1]["tokens_per_s"] = round(generated / wall, 1) if wall > 0 else None
        timings[-1]["engine_steps"] = steps
        timings[-1]["step_ms"] = round(1000 * wall / steps, 3) if steps else None
    delta = counter_delta(first, last)
    rates = [t["tokens_per_s"] for t in timings if t["tokens_per_s"] is not None]
    step_times = [t["step_ms"] for t in timings if t["step_ms"] is not None]
    return {
        "num_requests": len(requests),
        "prompt_tokens": sum(len(ids) for ids, _ in requests),
        "max_tokens": sum(n for _, n in requests),
        "warmup_requests": len(warmup),
        "repeats": timings,
        "tokens_per_s_best": max(rates) if rates else None,
        "tokens_per_s_median": statistics.median(rates) if rates else None,
        "step_ms_median": statistics.median(step_times) if step_times else None,
        "repeats_equal": all(out == outputs[0] for out in outputs),
        "spec_counters": delta,
        "spec": spec_summary(delta),
        "tokens": outputs[0],
    }


def run_workload(
    args: argparse.Namespace,
    vocab: int,
    generate: Generate,
    read_counters: Callable[[], dict[str, Any]],
    meter: Meter | None,
    result: dict[str, Any],
    share_of: str | None = None,
) -> None:
    """Run ``args.workload`` (token ids below ``vocab``) and record its tokens, timings
    and spec-decode figures; ``meter`` (TP=1: this process's GPU) takes the free memory
    at rest and what the smoke generate took; ``share_of``: the package whose share of
    a load step ``plugin_share`` measures."""
    if meter is not None:
        meter.at_rest()
    if args.workload == "load":
        most = SIZES[args.size]["max_model_len"]
        requests = load_requests(vocab, args.load_requests, most, LOAD_SEED)
        warmup = load_requests(vocab, LOAD_WARMUP_REQUESTS, most, LOAD_SEED + 1)
        warmup = [(ids, min(n, LOAD_WARMUP_MAX_TOKENS)) for ids, n in warmup]
        load = run_load(generate, read_counters, requests, warmup, args.load_repeats)
        if share_of is not None:
            half = requests[: max(1, len(requests) // 2)]
            steps = lambda: read_counters().get(ENGINE_STEPS)  # noqa: E731
            load["plugin_share"] = plugin_share(generate, half, share_of, steps)
        result |= {"tokens": load.pop("tokens"), "load": load, "spec": load["spec"]}
        result["generate_s"] = sum(r["wall_s"] for r in load["repeats"])
        return
    prompts = prompts_token_ids(SMOKE_PROMPTS, vocab)
    t0 = time.time()
    with meter.step() if meter is not None else nullcontext():
        result["tokens"] = generate([(ids, SMOKE_MAX_TOKENS) for ids in prompts])
    result["generate_s"] = round(time.time() - t0, 2)
    try:
        result["spec_metrics"] = read_counters()
        result["spec"] = spec_summary(result["spec_metrics"])
    except Exception as e:
        result["spec_metrics"] = {"error": repr(e)}


# ---- the engine and the model ------------------------------------------------------


def speculative_config(case: str, size: str) -> dict[str, Any] | None:
    if case in ("draft", "accept"):  # accept: the target itself, so every draft is accepted
        model = config_dir(size, "model" if case == "accept" else "draft")
        return {"method": "draft_model", "model": model, "num_speculative_tokens": NUM_SPEC}
    if case == "eagle":
        model = config_dir(size, "eagle")
        return {"method": "eagle", "model": model, "num_speculative_tokens": NUM_SPEC}
    if case == "ngram":
        lookup = {"prompt_lookup_min": 2, "prompt_lookup_max": 4}
        return {"method": "ngram", "num_speculative_tokens": NUM_SPEC} | lookup
    return None


def llm_kwargs(
    size: str, case: str, graph_mode: str = "compile", tp: int = 1, custom_all_reduce: bool = False
) -> dict[str, Any]:
    """``LLM(...)``'s arguments; at ``tp`` > 1 also the multiprocess executor, custom
    all-reduce off unless asked for, and the worker extension."""
    preset = SIZES[size]
    compilation = {**GRAPH_MODES[graph_mode], "custom_ops": ["none"]}
    if preset["capture_sizes"] is not None:
        compilation["cudagraph_capture_sizes"] = list(preset["capture_sizes"])
    kw = {
        "model": config_dir(size),
        "skip_tokenizer_init": True,
        "load_format": "dummy",
        "dtype": preset["dtype"],
        "seed": 0,
        "max_model_len": preset["max_model_len"],
        "max_num_seqs": preset["max_num_seqs"],
        "max_num_batched_tokens": preset["max_num_batched_tokens"],
        "gpu_memory_utilization": preset["gpu_memory_utilization"],
        "enforce_eager": False,
        "enable_prefix_caching": False,
        "attention_config": {"backend": "TRITON_ATTN"},
        "compilation_config": compilation,
        "kernel_config": {
            "ir_op_priority": {"rms_norm": ["native"], "fused_add_rms_norm": ["native"]}
        },
        "speculative_config": speculative_config(case, size),
        "disable_log_stats": False,  # keep spec-decode counters for get_metrics()
    }
    if tp > 1:
        kw["tensor_parallel_size"] = tp
        kw["distributed_executor_backend"] = "mp"
        kw["disable_custom_all_reduce"] = not custom_all_reduce
        kw["worker_extension_cls"] = WORKER_EXTENSION
    return kw


def refill_weights(runner: Any, std: float, tp_rank: int = 0) -> dict[str, Any]:
    """Refill the target's and the speculator's floating parameters in place with
    N(0, std) seeded by name (norm weights: 1): vLLM's dummy weights make greedy output
    one repeated token. Storage a speculator shares with the target (an EAGLE head's
    embedding and head) stays the target's; on ``tp_rank`` > 0 a shard's seed also
    names the rank, a replicated parameter's does not. The graphs keep their addresses."""
    import torch

    speculator = getattr(getattr(runner, "speculator", None), "model", None)
    counts = {"params": 0, "spec_params": 0, "spec_model": speculator is not None}
    targets = {p.data_ptr() for p in runner.model.parameters()}
    models = [("params", runner.model, set())]
    if speculator is not None:
        models.append(("spec_params", speculator, targets))
    with torch.inference_mode():
        for key, model, skip in models:
            sharded = sharded_parameter_names(model) if tp_rank > 0 else set()
            for name, p in model.named_parameters():
                if not p.is_floating_point() or p.data_ptr() in skip:
                    continue
                if name.endswith("norm.weight"):
                    p.data.fill_(1.0)
                else:
                    seed = f"{name}@tp{tp_rank}" if name in sharded else name
                    g = torch.Generator(device=p.device)
                    g.manual_seed(zlib.crc32(seed.encode()))
                    p.data.normal_(0.0, std, generator=g)
                counts[key] += 1
    torch.cuda.synchronize()
    return counts


def sharded_parameter_names(
    model: Any, split: tuple | None = None, split_weight_only: tuple | None = None
) -> set[str]:
    """The parameters that hold one rank's shard, in layers of more than one rank:
    every parameter of a ``split`` layer (vLLM's column-parallel linears and
    vocabulary-parallel embeddings and heads), the weight of a ``split_weight_only``
    one (row-parallel linears, whose bias is whole on every rank)."""
    if split is None or split_weight_only is None:
        from vllm.model_executor.layers.linear import ColumnParallelLinear, RowParallelLinear
        from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

        split = (ColumnParallelLinear, VocabParallelEmbedding)
        split_weight_only = (RowParallelLinear,)
    ids: set[int] = set()
    for _, module in model.named_modules():
        if getattr(module, "tp_size", 1) <= 1:
            continue
        if isinstance(module, split):
            ids.update(id(p) for p in module.parameters(recurse=False))
        elif isinstance(module, split_weight_only) and getattr(module, "weight", None) is not None:
            ids.add(id(module.weight))
    return {name for name, p in model.named_parameters() if id(p) in ids}


# ---- the measuring side: a worker's process ----------------------------------------

WORKER_ENV_KEYS = (  # what a worker inherited and how it was started
    *("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"),
    *("VLLM_PLUGINS", "VLLM_SPECGRAPH", "VLLM_USE_V2_MODEL_RUNNER"),
    *("VLLM_WORKER_MULTIPROC_METHOD", "CUDA_VISIBLE_DEVICES", "PYTHONPATH"),
)
# The measuring side's state in its process (one worker per process).
STATE: dict[str, Any] = {"meter": None, "plugin_log": []}


class RankFigures(dict):
    """A rank's figures; each one set is also written to ``path`` (best effort: a
    figure that cannot be written must not stop the engine)."""

    def __init__(self, rank: int, path: str | None) -> None:
        super().__init__()
        self.rank, self.path = rank, path

    def __setitem__(self, key: str, value: Any) -> None:
        super().__setitem__(key, value)
        self.persist()

    def persist(self) -> None:
        if not self.path:
            return
        try:
            figures = {"rank": self.rank, "pid": os.getpid(), "mem": dict(self)}
            with open(self.path + ".tmp", "w") as f:
                json.dump(figures, f, default=str)
            os.replace(self.path + ".tmp", self.path)
        except OSError as e:
            print(f"run_llm.py: cannot write {self.path}: {e!r}", file=sys.stderr, flush=True)


def install_meter(mem: dict[str, Any]) -> Meter:
    """The wrappers on MRV2's runner and the GPU worker, once per process, after the
    plugin patched them."""
    if STATE["meter"] is None:
        import torch
        from vllm.v1.worker import gpu_worker
        from vllm.v1.worker.gpu import model_runner as mr2

        STATE["meter"] = Meter(torch.cuda, mem).install(mr2.GPUModelRunner, gpu_worker.Worker)
    return STATE["meter"]


def tp_rank_of(worker: Any) -> int:
    try:
        from vllm.distributed import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())
    except Exception:
        return int(getattr(worker, "rank", 0))


def gpu_of(cuda: Any) -> dict[str, Any]:
    try:
        index = cuda.current_device()
        name, total = cuda.get_device_name(index), cuda.mem_get_info()[1]
        return {"index": index, "name": name, "total_bytes": total}
    except Exception as e:
        return {"error": repr(e)}


class E2EWorkerExtension:
    """Mixed into vLLM's worker class by ``worker_extension_cls`` (every name unlike a
    worker's, as vLLM checks): the measuring side of this script in each worker."""

    def init_worker_extension(self) -> None:
        """vLLM calls it once the worker's device is set, before the model loads."""
        tap_plugin_logs(STATE["plugin_log"])
        rank, rank_dir = int(getattr(self, "rank", 0)), os.environ.get(RANK_DIR_ENV)
        mem = RankFigures(rank, os.path.join(rank_dir, f"rank{rank}.json") if rank_dir else None)
        mem.persist()  # the file says the worker got this far even before any figure
        install_meter(mem)

    def e2e_rank_record(self, switch: str) -> dict[str, Any]:
        """This rank's figures and state, as plain data (it crosses process boundaries)."""
        meter: Meter | None = STATE["meter"]
        env = {k: os.environ.get(k) for k in ("VLLM_PLUGINS", "VLLM_SPECGRAPH")}
        return {
            "rank": int(getattr(self, "rank", 0)),
            "tp_rank": tp_rank_of(self),
            "local_rank": int(getattr(self, "local_rank", 0)),
            "pid": os.getpid(),
            "start_method": multiprocessing.get_start_method(allow_none=True),
            "env": {k: os.environ.get(k) for k in WORKER_ENV_KEYS},
            "gpu": gpu_of(meter.cuda) if meter is not None else None,
            "mem": dict(meter.mem) if meter is not None else None,
            "wrappers_intact": meter.intact() if meter is not None else None,
            "plugin": plugin_info(switch, env),
            "plugin_log": list(STATE["plugin_log"]),
            **shim_record(),
            **runner_record(getattr(self, "model_runner", None)),
        }

    def e2e_reinit_weights(self, std: float | str) -> dict[str, Any]:
        """``refill_weights`` on this rank (serve.py sends ``std`` as a string through
        /collective_rpc)."""
        rank, tp_rank = int(getattr(self, "rank", 0)), tp_rank_of(self)
        counts = refill_weights(self.model_runner, float(std), tp_rank)
        return {"rank": rank, "tp_rank": tp_rank} | counts


def on_workers(llm: Any, tp: int, method: str, *args: Any) -> list[dict]:
    """An ``E2EWorkerExtension`` method's answer from every rank, in rank order: at TP=1
    called on this process's worker (instrumented by the run itself), at TP > 1
    through ``collective_rpc``."""
    if tp == 1:
        worker = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker
        return [getattr(E2EWorkerExtension, method)(worker, *args)]
    return sorted(llm.collective_rpc(method, args=args), key=lambda r: r.get("rank", 0))


def merge_wrappers_intact(ranks: list[dict]) -> dict[str, bool]:
    """Per wrapper: still in place on every rank."""
    out: dict[str, bool] = {}
    for r in ranks:
        for name, ok in (r.get("wrappers_intact") or {}).items():
            out[name] = out.get(name, True) and bool(ok)
    return out


def prepare_workers(out: str) -> dict[str, str]:
    """Let the workers import the extension (spawned ones get ``sys.path``,
    ``PYTHONPATH`` covers any other start) and give them an empty rank directory."""
    if HERE not in sys.path:
        sys.path.insert(0, HERE)
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if HERE not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([HERE, *paths])
    rank_dir = out + ".ranks"
    os.makedirs(rank_dir, exist_ok=True)
    for name in os.listdir(rank_dir):
        if name.startswith("rank") and name.endswith(".json"):
            os.remove(os.path.join(rank_dir, name))
    os.environ[RANK_DIR_ENV] = rank_dir
    return {"PYTHONPATH": os.environ["PYTHONPATH"], RANK_DIR_ENV: rank_dir}


def read_rank_files(rank_dir: str) -> list[dict]:
    """What the workers wrote as they measured, for a run that failed before reading
    them back through ``collective_rpc``."""
    ranks = []
    for name in sorted(os.listdir(rank_dir)) if os.path.isdir(rank_dir) else ():
        if name.startswith("rank") and name.endswith(".json"):
            try:
                with open(os.path.join(rank_dir, name)) as f:
                    ranks.append(json.load(f))
            except (OSError, ValueError):
                continue
    return sorted(ranks, key=lambda r: r.get("rank", 0))


# ---- the run -----------------------------------------------------------------------


class RunRecord(dict):
    """The run's JSON, written to ``path`` at every stage, so that a run cut off keeps
    what it measured."""

    def __init__(self, path: str, **fields: Any) -> None:
        super().__init__(fields, ok=False, stage="import")
        self.path = path

    def save(self, stage: str | None = None) -> None:
        self["stage"] = stage or self["stage"]
        self["measured_utc"] = time.strftime("%Y-%m-%d %H:%M", time.gmtime())
        with open(self.path, "w") as f:
            json.dump(self, f, indent=1, default=str)


def start_engine(args: argparse.Namespace, run: RunRecord) -> Any:
    """Import vLLM, load the plugin (vLLM's later calls are then no-ops, and the
    wrappers wrap whatever it patched), instrument this process at TP=1 (the extension
    does each worker at TP > 1) and start the engine."""
    import torch

    run["torch"], t0 = torch.__version__, time.perf_counter()
    import vllm
    from vllm.plugins import load_general_plugins

    run["vllm"], run["import_s"] = vllm.__version__, round(time.perf_counter() - t0, 1)
    run["plugin_log"] = STATE["plugin_log"]
    tap_plugin_logs(STATE["plugin_log"])
    load_general_plugins()
    run["plugin"] = plugin_info(args.plugin, run["plugin"]["env"])
    if args.tp == 1:
        run["mem"] = install_meter({}).mem
    kw = llm_kwargs(args.size, args.case, args.graph_mode, args.tp, args.custom_all_reduce)
    run["llm_kwargs"] = kw
    run.save("init")
    t0 = time.perf_counter()
    llm = vllm.LLM(**kw)
    seconds = time.perf_counter() - t0
    run["startup_s"], run["init_s"] = round(seconds, 2), round(seconds, 1)
    return llm


def read_start_up(llm: Any, args: argparse.Namespace, run: RunRecord) -> None:
    """What start-up resolved and every rank measured, then the weight refill."""
    import torch

    vc = llm.llm_engine.vllm_config
    cc, compilation = vc.cache_config, vc.compilation_config
    ranks = on_workers(llm, args.tp, "e2e_rank_record", args.plugin)
    run["resolved"] = {
        "use_v2_model_runner": vc.use_v2_model_runner,
        "cudagraph_mode": str(compilation.cudagraph_mode),
        "compilation_mode": str(compilation.mode),
        "capture_sizes": compilation.cudagraph_capture_sizes,
        "num_capture_sizes": len(compilation.cudagraph_capture_sizes or []),
        "max_num_batched_tokens": vc.scheduler_config.max_num_batched_tokens,
        "num_gpu_blocks": cc.num_gpu_blocks,
        "block_size": cc.block_size,
        "spec_method": vc.speculative_config.method if vc.speculative_config else None,
        **ranks[0]["resolved"],  # rank 0's runner, as its worker read it
    }
    if cc.num_gpu_blocks is not None and cc.block_size is not None:
        run["kv_tokens"] = int(cc.num_gpu_blocks) * int(cc.block_size)
    run["plugin"]["wrappers_intact"] = merge_wrappers_intact(ranks)
    gpu = ranks[0]["gpu"] or {}
    run["gpu"] = {"name": gpu.get("name"), "total_bytes": gpu.get("total_bytes")}
    run["gpu"]["cuda"] = torch.version.cuda
    if args.tp == 1:  # this process's runner: what the plugin left on it, in the run's own
        run["gpu"]["visible_devices"] = os.environ.get("CUDA_VISIBLE_DEVICES")
        run |= {k: ranks[0][k] for k in RUNNER_KEYS if k in ranks[0]}
    else:
        run["gpu"]["ranks"], run["ranks"] = len(ranks), ranks
    done = on_workers(llm, args.tp, "e2e_reinit_weights", REINIT_STD)
    run["reinit_params"] = done[0]["params"] + done[0]["spec_params"]
    if done[0]["spec_model"]:
        run["reinit_spec_params"] = done[0]["spec_params"]
    if args.tp > 1:
        run["reinit_ranks"] = done


def measure(llm: Any, args: argparse.Namespace, run: RunRecord) -> None:
    """The workload, greedy with ``ignore_eos``; at TP > 1 every rank's record again
    (the stand-ins' calls then include generation)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    def generate(requests: list[Request]) -> list[list[int]]:
        prompts = [TokensPrompt(prompt_token_ids=ids) for ids, _ in requests]
        how = {"ignore_eos": True, "detokenize": False, "temperature": 0.0}
        params = [SamplingParams(max_tokens=n, **how) for _, n in requests]
        return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]

    def counters() -> dict[str, Any]:
        return read_spec_counters(llm.get_metrics())

    share_of = None  # at TP > 1 the plugin's hot path runs out of this profiler's sight
    if args.plugin == "on" and args.tp == 1:
        import vllm_specgraph

        share_of = os.path.dirname(vllm_specgraph.__file__) + os.sep
    run_workload(args, vocab_size(args.size), generate, counters, STATE["meter"], run, share_of)
    run |= shim_record()
    if args.tp > 1:
        run["ranks"] = on_workers(llm, args.tp, "e2e_rank_record", args.plugin)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--case", choices=CASES, required=True)
    ap.add_argument("--size", choices=sorted(SIZES), default="tiny")
    ap.add_argument("--plugin", choices=PLUGIN_SWITCHES, default="off")
    ap.add_argument("--graph-mode", choices=tuple(GRAPH_MODES), default="compile")
    ap.add_argument("--workload", choices=("smoke", "load"), default="smoke")
    ap.add_argument("--load-requests", type=int, default=256)
    ap.add_argument("--load-repeats", type=int, default=2)
    ap.add_argument("--load-round", type=int, default=1, help="the load case's round")
    ap.add_argument("--tp", type=int, default=1, help="tensor_parallel_size")
    ap.add_argument("--custom-all-reduce", action="store_true", help="at --tp > 1: keep it on")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    if args.tp < 1:
        ap.error("--tp must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    env = set_env(args.plugin, plugin_allreduce=args.tp > 1 and not args.custom_all_reduce)
    run = RunRecord(args.out, size=args.size, case=args.case)
    run |= {"plugin": {"switch": args.plugin, "env": env}, "graph_mode": args.graph_mode}
    run |= {"commit": os.environ.get(COMMIT_ENV), "workload": args.workload}
    if args.workload == "load":  # in the result: a run that fails early still says it
        run["load_round"] = args.load_round
    if args.tp > 1:
        run["tp"], run["workers_env"] = args.tp, prepare_workers(args.out)
    llm = None
    try:
        llm = start_engine(args, run)
        read_start_up(llm, args, run)
        run.save("generate")  # keep the start-up figures even if generation is cut off
        measure(llm, args, run)
        run["ok"] = True
        run.save("done")
        return 0
    except BaseException as e:
        run["error"], run["traceback"] = repr(e), traceback.format_exc()
        traceback.print_exc()
        if args.tp > 1 and not run.get("ranks"):
            run["ranks"] = read_rank_files(run["workers_env"][RANK_DIR_ENV])
        run.save()
        return 1
    finally:
        if llm is not None and args.tp > 1:  # the workers' GPU memory, free for the next run
            try:
                t0 = time.perf_counter()
                llm.llm_engine.engine_core.shutdown()
                run["shutdown_s"] = round(time.perf_counter() - t0, 2)
            except Exception:
                traceback.print_exc()
            run.save()


if __name__ == "__main__":
    rc = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)  # skip slow/fragile interpreter teardown of engine threads
