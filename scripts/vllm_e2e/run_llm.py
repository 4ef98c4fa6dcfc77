# SPDX-License-Identifier: Apache-2.0
"""One offline vLLM 0.33.0 run on a dummy-weight Llama, written to ``--out`` as JSON
(docs/vllm-e2e.md: the knobs, and what a run records). Nothing in vLLM changes:
wrappers call the methods they replace and read the driver's figures and the time
around them, a log handler copies the plugin's lines. At ``--tp`` > 1 the model runs
in vLLM's workers, where ``E2EWorkerExtension`` measures the same."""

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
MiB = 1 << 20
CASES = ("base", "draft", "accept", "ngram", "eagle")  # accept: the target's own config
PLUGIN_SWITCHES = ("off", "on", "none", "noest", "once")  # once: on, profile capture-once
PLUGIN_NAME, PLUGIN_GROUP = "specgraph", "vllm.general_plugins"  # pyproject.toml's entry point
PLUGIN_LOGGERS = ("vllm.specgraph", "vllm_specgraph")
PLUGIN_LOG_PREFIX, PLUGIN_LOG_LIMIT = "SPECGRAPH-LOG", 500
PLUGIN_LOG_ECHO_ENV = "E2E_PLUGIN_LOG_ECHO"  # 0: vLLM's own logging prints the plugin's lines
WORKER_EXTENSION = "run_llm.E2EWorkerExtension"  # vLLM imports it in every worker at TP > 1
RANK_DIR_ENV = "E2E_RANK_DIR"  # where the workers also write their figures as they are taken
COMMIT_ENV = "SPECGRAPH_COMMIT"  # the plugin commit the device script measures
ESTIMATE_ENV = "VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS"
PROFILE_ENV = "VLLM_SPECGRAPH_PROFILE"
TINY = {"model": "tiny-llama", "draft": "tiny-llama-draft", "eagle": "tiny-llama-draft"}
SIZES: dict[str, dict[str, Any]] = {
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
CAPTURE_SETS = ("default", "small")  # the size's own; the same short list for every size
SMALL_CAPTURE_SIZES = [1, 2, 4, 8, 16, 32]
ALLOCATORS = {"default": None, "expandable": "expandable_segments:True"}
ALLOC_CONF_ENVS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
BASE_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_USE_V2_MODEL_RUNNER": "1"}
BASE_ENV |= {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}
BASE_ENV |= {"DO_NOT_TRACK": "1", "VLLM_LOGGING_LEVEL": "INFO"}
BASE_ENV |= {"VLLM_USE_FLASHINFER_SAMPLER": "0", "TVM_FFI_DISABLE_TORCH_C_DLPACK": "1"}
WORKLOADS = ("smoke", "peak", "load")
LOAD_MIN_LEN, LOAD_WARMUP_REQUESTS, LOAD_WARMUP_MAX_TOKENS = 16, 16, 32
# The full step samples with the features of vLLM's sampler warm-up
# (SamplingParams.for_sampler_warmup), whose fp32 pipeline vLLM's profile budgets
# as activation headroom; greedy sampling would leave most of it unused. Prompt
# logprobs (not budgeted), bad words and watermarking (no peak) are left out.
# Seeded, so both switches sample the same.
PEAK_SAMPLING: dict[str, Any] = {"temperature": 0.9, "top_p": 0.9, "top_k": 50, "min_p": 0.1}
PEAK_SAMPLING |= {"frequency_penalty": 0.5, "presence_penalty": 0.5, "repetition_penalty": 1.2}
PEAK_SAMPLING |= {"logit_bias": {0: -1.0, 1: 0.5}, "logprobs": 5, "seed": 0}
ENGINE_STEPS = "vllm:iteration_tokens_total"  # its count: the engine steps so far
Request = tuple[list[int], int]  # (prompt token ids, max_tokens)
Generate = Callable[..., list[list[int]]]  # generate(requests, sampling=None): token ids


def set_env(plugin: str, allocator: str = "default") -> dict[str, str | None]:
    """The engine's, the plugin switch's and the allocator's environment, before vLLM
    is imported and torch allocates; the switch's variables are forced, so that an
    inherited value cannot turn one switch into another."""
    if allocator not in ALLOCATORS:
        raise ValueError(f"allocator must be one of {tuple(ALLOCATORS)}, got {allocator!r}")
    if plugin not in PLUGIN_SWITCHES:
        raise ValueError(f"plugin switch must be one of {PLUGIN_SWITCHES}, got {plugin!r}")
    for key, value in BASE_ENV.items():
        os.environ.setdefault(key, value)
    for key in (*ALLOC_CONF_ENVS, ESTIMATE_ENV, "VLLM_SPECGRAPH", PROFILE_ENV):
        os.environ.pop(key, None)  # vLLM's default: subtract the estimate; the plugin's: on, exact
    if ALLOCATORS[allocator] is not None:
        os.environ[ALLOC_CONF_ENVS[0]] = ALLOCATORS[allocator]
    os.environ["VLLM_PLUGINS"] = "" if plugin == "none" else PLUGIN_NAME
    if plugin in ("off", "noest"):
        os.environ["VLLM_SPECGRAPH"] = "0"
    if plugin == "noest":
        os.environ[ESTIMATE_ENV] = "0"
    if plugin == "once":
        os.environ[PROFILE_ENV] = "capture-once"
    keys = ("VLLM_PLUGINS", "VLLM_SPECGRAPH", ESTIMATE_ENV, ALLOC_CONF_ENVS[0], PROFILE_ENV)
    return {k: os.environ.get(k) for k in keys}


def estimate_applied(environ: dict[str, str] | None = None) -> bool:
    """Whether vLLM subtracts its graph estimate, read as ``vllm.envs`` reads it."""
    return bool(int((os.environ if environ is None else environ).get(ESTIMATE_ENV, "1")))


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


def tap_plugin_logs(sink: list[str]) -> PluginLogTap:
    """Route the plugin's loggers through one tap, after vLLM configured logging.
    Echoing, ``propagate`` is cleared so that each line is printed once; with
    ``E2E_PLUGIN_LOG_ECHO=0`` (serve.py checks the server's own log) vLLM prints them."""
    echo = os.environ.get(PLUGIN_LOG_ECHO_ENV, "1") != "0"
    tap = PluginLogTap(sink, echo=echo)
    for name in PLUGIN_LOGGERS:
        lg = logging.getLogger(name)
        lg.addHandler(tap)
        lg.propagate = not echo
        if lg.getEffectiveLevel() > logging.INFO:
            lg.setLevel(logging.INFO)
    return tap


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


def plugin_report(runner: Any) -> dict | None:
    """The plugin's own profile report, if it attached one to the runner."""
    prof = getattr(runner, "specgraph_profile", None)
    if prof is None:
        return None
    if getattr(prof, "to_dict", None) is None:
        return {"error": f"{type(prof).__name__} has no to_dict()"}
    return prof.to_dict()


def capture_once_of(runner: Any) -> dict[str, Any]:
    """Capture-once's outcome on the runner (None when absent) and why it fell back
    (None when it did not; then the exact profile ran, reported as for ``on``)."""
    outcome = getattr(runner, "specgraph_capture_once", None)
    return {
        "capture_once": None if outcome is None else dataclasses.asdict(outcome),
        "capture_once_fallback": getattr(runner, "specgraph_capture_once_fallback", None),
    }


# ---- measurement -----------------------------------------------------------------


def install_wrappers(runner_cls: Any, worker_cls: Any, cuda: Any, mem: dict[str, Any]) -> dict:
    """Wrap three vLLM methods to read numbers into ``mem`` (``cuda``: ``torch.cuda``),
    each calling the method it replaces: the profile's estimate, wall time and what it
    left taken; the production capture's own figure and wall time (profiling captures
    counted); the KV-cache bytes and the worker's budget. Returns {name: (class, fn)}."""

    def drv_used() -> int:
        cuda.synchronize()
        free, total = cuda.mem_get_info()
        return total - free

    orig_prof, orig_cap = runner_cls.profile_cudagraph_memory, runner_cls.capture_model
    orig_dam = worker_cls.determine_available_memory

    def prof_wrapper(self: Any) -> int:
        cuda.synchronize()
        cuda.empty_cache()
        b_used, b_res = drv_used(), cuda.memory_reserved()
        t0 = time.perf_counter()
        est = orig_prof(self)
        cuda.synchronize()
        wall = time.perf_counter() - t0
        a_used, a_res = drv_used(), cuda.memory_reserved()
        cuda.empty_cache()
        a2_used = drv_used()
        mem["profile_estimate_bytes"] = int(est) if isinstance(est, int | float) else repr(est)
        mem["profile_wall_s"] = round(wall, 3)
        mem["profile_driver_used_before"] = b_used
        mem["profile_driver_left_taken"] = a_used - b_used
        mem["profile_driver_left_taken_after_empty_cache"] = a2_used - b_used
        mem["profile_allocator_reserved_delta"] = a_res - b_res
        return est

    def cap_wrapper(self: Any, *a: Any, **kw: Any) -> int:
        t0 = time.perf_counter()
        if kw.get("profile_only"):
            r = orig_cap(self, *a, **kw)
            mem["profile_only_capture_calls"] = mem.get("profile_only_capture_calls", 0) + 1
            mem["profile_only_capture_wall_s"] = round(
                mem.get("profile_only_capture_wall_s", 0.0) + time.perf_counter() - t0, 3
            )
            return r
        mem["capture_started"] = True
        b_used, b_res = drv_used(), cuda.memory_reserved()
        t0 = time.perf_counter()
        actual = orig_cap(self, *a, **kw)
        cuda.synchronize()
        wall = time.perf_counter() - t0
        mem["capture_calls"] = mem.get("capture_calls", 0) + 1
        mem["capture_actual_bytes"] = (
            int(actual) if isinstance(actual, int | float) else repr(actual)
        )
        mem["capture_wall_s"] = round(wall, 3)
        mem["capture_driver_delta"] = drv_used() - b_used
        mem["capture_allocator_reserved_delta"] = cuda.memory_reserved() - b_res
        return actual

    def dam_wrapper(self: Any) -> int:
        t0 = time.perf_counter()
        r = orig_dam(self)
        mem["determine_available_memory_wall_s"] = round(time.perf_counter() - t0, 3)
        mem["kv_cache_bytes"] = int(r)  # capture-once: the reserved most, not what it backs
        mem["worker_cudagraph_memory_estimate"] = int(
            getattr(self, "cudagraph_memory_estimate", -1)
        )
        for key, value in worker_budget(self, estimate_applied()).items():
            mem[key] = value
        return r

    runner_cls.profile_cudagraph_memory = prof_wrapper
    runner_cls.capture_model = cap_wrapper
    worker_cls.determine_available_memory = dam_wrapper
    return {
        "profile_cudagraph_memory": (runner_cls, prof_wrapper),
        "capture_model": (runner_cls, cap_wrapper),
        "determine_available_memory": (worker_cls, dam_wrapper),
    }


def wrappers_intact(installed: dict) -> dict[str, bool]:
    return {name: getattr(cls, name) is fn for name, (cls, fn) in installed.items()}


def worker_budget(worker: Any, applied: bool) -> dict[str, int]:
    """vLLM 0.33.0's KV-cache budget as its worker kept it after
    ``determine_available_memory``: ``kv = requested - non_kv - graph estimate applied``,
    ``requested = ceil(total * gpu_memory_utilization)`` from its init snapshot, the
    headroom the profile run's activation peak above what it kept. Empty when the
    worker did not profile (``kv_cache_memory_bytes`` was set).

    Over budget at rest (summarize.py) is what the process holds at driver level at
    rest beyond ``requested - headroom``, and means the same under capture-once: its
    profile returned 0, so nothing was subtracted and the headroom is the activation
    peak alone, as vLLM kept it; the reserved range counts at driver level only for
    the pages backed (``capture_once.mapped_bytes``), beside what graphs and warm-up
    took. No KV figure enters it: ``kv_cache_bytes`` is there the reserved most, and
    a limit built from it would hide what the graphs took."""
    snapshot = getattr(worker, "init_snapshot", None)
    needed = ("requested_memory", "peak_activation_memory", "available_kv_cache_memory_bytes")
    if snapshot is None or not all(hasattr(worker, name) for name in needed):
        return {}
    subtracted = int(getattr(worker, "cudagraph_memory_estimate", 0)) if applied else 0
    requested = int(worker.requested_memory)
    return {
        "init_free_bytes": int(snapshot.free_memory),
        "init_total_bytes": int(snapshot.total_memory),
        "requested_bytes": requested,
        "activation_headroom_bytes": int(worker.peak_activation_memory) - subtracted,
        "graph_estimate_applied_bytes": subtracted,
        "non_kv_bytes": requested - int(worker.available_kv_cache_memory_bytes) - subtracted,
    }


def free_at_rest(cuda: Any) -> int:
    """Driver-level free bytes with nothing cached by the allocator (not in a capture)."""
    gc.collect()
    cuda.synchronize()
    cuda.empty_cache()
    return int(cuda.mem_get_info()[0])


@contextmanager
def measure_step(cuda: Any, mem: dict[str, Any]) -> Iterator[None]:
    """Around one generate from rest: driver-level free bytes after it (the allocator
    keeps its segments) and the allocator's peaks above its start."""
    cuda.synchronize()
    cuda.reset_peak_memory_stats()
    allocated, reserved = cuda.memory_allocated(), cuda.memory_reserved()
    yield
    cuda.synchronize()
    mem["free_after_step_bytes"] = int(cuda.mem_get_info()[0])
    mem["step_allocated_peak_bytes"] = int(cuda.max_memory_allocated() - allocated)
    mem["step_reserved_peak_bytes"] = int(cuda.max_memory_reserved() - reserved)


# ---- workloads -------------------------------------------------------------------


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


def peak_requests(vocab: int, max_num_seqs: int, max_num_batched_tokens: int) -> list[Request]:
    """``peak``: ``max_num_seqs`` prompts of (nearly) equal length adding up to
    ``max_num_batched_tokens``, the shape of vLLM's profile run."""
    if max_num_batched_tokens < max_num_seqs:
        raise ValueError(
            f"max_num_batched_tokens ({max_num_batched_tokens}) must be at least "
            f"max_num_seqs ({max_num_seqs})"
        )
    base, extra = divmod(max_num_batched_tokens, max_num_seqs)
    out = []
    for i in range(max_num_seqs):
        length = base + (i >= max_num_seqs - extra)
        out.append(([(3 + 17 * i + 29 * j) % (vocab - 2) + 1 for j in range(length)], 16))
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
    before = read_counters()
    timings, tokens, same = [], None, True
    for _ in range(repeats):
        steps_before = read_counters().get(ENGINE_STEPS)
        start = clock()
        out = generate(requests)
        wall = clock() - start
        steps_after = read_counters().get(ENGINE_STEPS)
        generated = sum(len(t) for t in out)
        steps = None if None in (steps_before, steps_after) else steps_after - steps_before
        timings.append({"wall_s": round(wall, 4), "generated_tokens": generated})
        timings[-1]["tokens_per_s"] = round(generated / wall, 1) if wall > 0 else None
        timings[-1]["engine_steps"] = steps
        timings[-1]["step_ms"] = round(1000 * wall / steps, 3) if steps else None
        tokens = out if tokens is None else tokens
        same = same and out == tokens
    delta = counter_delta(before, read_counters())
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
        "repeats_equal": same,
        "spec_counters": delta,
        "spec": spec_summary(delta),
        "tokens": tokens,
    }


def run_workload(
    args: argparse.Namespace,
    preset: dict[str, Any],
    vocab: int,
    generate: Generate,
    llm: Any,
    cuda: Any,
    mem: dict[str, Any] | None,
    result: dict[str, Any],
) -> None:
    """Run ``args.workload`` and record its tokens, timings and spec-decode figures;
    ``mem`` (TP=1: this process's GPU) also gets the free memory at rest and,
    around a smoke or peak generate, what that step took."""
    if mem is not None:
        mem["free_at_rest_bytes"] = free_at_rest(cuda)

    def counters() -> dict[str, Any]:
        return read_spec_counters(llm.get_metrics())

    if args.workload == "load":
        requests = load_requests(vocab, args.load_requests, preset["max_model_len"], args.seed)
        warmup = load_requests(vocab, LOAD_WARMUP_REQUESTS, preset["max_model_len"], args.seed + 1)
        warmup = [(ids, min(n, LOAD_WARMUP_MAX_TOKENS)) for ids, n in warmup]
        load = run_load(generate, counters, requests, warmup, args.load_repeats)
        # At TP > 1 the plugin's hot path runs in the workers, out of this profiler's sight.
        if getattr(args, "plugin", None) == "on" and getattr(args, "tp", 1) == 1:
            import vllm_specgraph

            package = os.path.dirname(vllm_specgraph.__file__) + os.sep
            load["plugin_share"] = plugin_share(
                generate,
                requests[: max(1, len(requests) // 2)],
                package,
                lambda: counters().get(ENGINE_STEPS),
            )
        result["tokens"] = load.pop("tokens")
        result["load"] = load
        result["spec"] = load["spec"]
        result["generate_s"] = sum(r["wall_s"] for r in load["repeats"])
        return
    if args.workload == "peak":
        requests = peak_requests(vocab, preset["max_num_seqs"], preset["max_num_batched_tokens"])
    else:
        requests = [(ids, args.max_tokens) for ids in prompts_token_ids(args.num_prompts, vocab)]
    t0 = time.time()
    with measure_step(cuda, mem) if mem is not None else nullcontext():
        result["tokens"] = generate(requests, PEAK_SAMPLING if args.workload == "peak" else None)
    result["generate_s"] = round(time.time() - t0, 2)
    try:
        result["spec_metrics"] = counters()
        result["spec"] = spec_summary(result["spec_metrics"])
    except Exception as e:
        result["spec_metrics"] = {"error": repr(e)}


# ---- the model --------------------------------------------------------------------


def reinit_weights(
    model: Any,
    std: float,
    skip: set[int] | None = None,
    *,
    tp_rank: int = 0,
    sharded: set[str] | None = None,
) -> tuple[int, set[int]]:
    """Refill every floating parameter in place with N(0, std) seeded by its name (norm
    weights: 1): vLLM's dummy weights make greedy output one repeated token. Storage in
    ``skip`` (what a speculator shares with the target) is left alone; on ``tp_rank``
    > 0 a parameter in ``sharded`` is seeded by name and rank. Returns (parameters
    refilled, data pointers seen)."""
    import torch

    n, seen = 0, set()
    with torch.inference_mode():
        for name, p in model.named_parameters():
            ptr = p.data_ptr()
            seen.add(ptr)
            if not p.is_floating_point() or (skip is not None and ptr in skip):
                continue
            if name.endswith("norm.weight"):
                p.data.fill_(1.0)
            else:
                key = f"{name}@tp{tp_rank}" if tp_rank > 0 and name in (sharded or ()) else name
                g = torch.Generator(device=p.device)
                g.manual_seed(zlib.crc32(key.encode()))
                p.data.normal_(0.0, std, generator=g)
            n += 1
    torch.cuda.synchronize()
    return n, seen


def speculative_config(case: str, draft: str, eagle: str, num_spec: int, target: str = "") -> Any:
    if case in ("draft", "accept"):
        model = target if case == "accept" else draft
        return {"method": "draft_model", "model": model, "num_speculative_tokens": num_spec}
    if case == "eagle":
        return {"method": "eagle", "model": eagle, "num_speculative_tokens": num_spec}
    if case == "ngram":
        lookup = {"prompt_lookup_min": 2, "prompt_lookup_max": 4}
        return {"method": "ngram", "num_speculative_tokens": num_spec} | lookup
    return None


def capture_sizes(preset: dict[str, Any], capture: str) -> list[int] | None:
    """The explicit capture sizes of a capture-size set; None: vLLM's default."""
    if capture not in CAPTURE_SETS:
        raise ValueError(f"capture-size set must be one of {CAPTURE_SETS}, got {capture!r}")
    sizes = SMALL_CAPTURE_SIZES if capture == "small" else preset["capture_sizes"]
    return None if sizes is None else list(sizes)


def llm_kwargs(args: argparse.Namespace, preset: dict[str, Any]) -> dict[str, Any]:
    """``LLM(...)``'s arguments; at ``args.tp`` > 1 also the multiprocess executor,
    custom all-reduce off unless asked for, and the worker extension."""
    compilation = {**GRAPH_MODES[getattr(args, "graph_mode", "compile")], "custom_ops": ["none"]}
    if (sizes := capture_sizes(preset, getattr(args, "capture", "default"))) is not None:
        compilation["cudagraph_capture_sizes"] = sizes
    kw = {
        "model": args.model,
        "skip_tokenizer_init": True,
        "load_format": "dummy",
        "dtype": args.dtype,
        "seed": 0,
        "max_model_len": preset["max_model_len"],
        "max_num_seqs": preset["max_num_seqs"],
        "max_num_batched_tokens": preset["max_num_batched_tokens"],
        "gpu_memory_utilization": args.gpu_mem_util,
        "enforce_eager": False,
        "enable_prefix_caching": False,
        "attention_config": {"backend": "TRITON_ATTN"},
        "compilation_config": compilation,
        "kernel_config": {
            "ir_op_priority": {"rms_norm": ["native"], "fused_add_rms_norm": ["native"]}
        },
        "speculative_config": speculative_config(
            args.case, args.draft, args.eagle, args.num_spec, args.model
        ),
        "disable_log_stats": False,  # keep spec-decode counters for get_metrics()
    }
    if (tp := getattr(args, "tp", 1)) > 1:
        kw["tensor_parallel_size"] = tp
        kw["distributed_executor_backend"] = "mp"
        kw["disable_custom_all_reduce"] = not getattr(args, "custom_all_reduce", False)
        kw["worker_extension_cls"] = WORKER_EXTENSION
    return kw


# ---- tensor parallelism: vLLM's worker processes -------------------------------------


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


def collect_ranks(llm: Any, switch: str) -> list[dict]:
    ranks = llm.collective_rpc("e2e_rank_record", args=(switch,))
    return sorted(ranks, key=lambda r: r.get("rank", 0))


def merge_wrappers_intact(ranks: list[dict]) -> dict[str, bool]:
    """Per wrapper: still in place on every rank."""
    out: dict[str, bool] = {}
    for r in ranks:
        for name, ok in (r.get("wrappers_intact") or {}).items():
            out[name] = out.get(name, True) and bool(ok)
    return out


def shutdown_engine(llm: Any) -> float:
    """Stop the engine and its workers, so that their GPU memory is free for the next run."""
    t0 = time.perf_counter()
    llm.llm_engine.engine_core.shutdown()
    return round(time.perf_counter() - t0, 2)


WORKER_ENV_KEYS = (  # what a worker inherited and how it was started
    "NCCL_NVLS_ENABLE",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST",
    "NVSHMEM_DISABLE_NVLS",
    "VLLM_PLUGINS",
    "VLLM_SPECGRAPH",
    "VLLM_USE_V2_MODEL_RUNNER",
    "VLLM_WORKER_MULTIPROC_METHOD",
    "CUDA_VISIBLE_DEVICES",
    "PYTHONPATH",
)
# The worker's state in its process (one worker per process).
STATE: dict[str, Any] = {"mem": None, "installed": None, "plugin_log": [], "cuda": None}


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
            with open(self.path + ".tmp", "w") as f:
                json.dump(
                    {"rank": self.rank, "pid": os.getpid(), "mem": dict(self)}, f, default=str
                )
            os.replace(self.path + ".tmp", self.path)
        except OSError as e:
            print(f"run_llm.py: cannot write {self.path}: {e!r}", file=sys.stderr, flush=True)


def install_in_worker(rank: int, runner_cls: Any, worker_cls: Any, cuda: Any) -> RankFigures:
    """The wrappers, once per process; the rank's figures."""
    if STATE["installed"] is not None:
        return STATE["mem"]
    rank_dir = os.environ.get(RANK_DIR_ENV)
    mem = RankFigures(rank, os.path.join(rank_dir, f"rank{rank}.json") if rank_dir else None)
    mem.persist()  # the file says the worker got this far even before any figure
    STATE.update(mem=mem, cuda=cuda, installed=install_wrappers(runner_cls, worker_cls, cuda, mem))
    return mem


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

        split, split_weight_only = (
            (ColumnParallelLinear, VocabParallelEmbedding),
            (RowParallelLinear,),
        )
    ids: set[int] = set()
    for _, module in model.named_modules():
        if getattr(module, "tp_size", 1) <= 1:
            continue
        if isinstance(module, split):
            ids.update(id(p) for p in module.parameters(recurse=False))
        elif isinstance(module, split_weight_only) and getattr(module, "weight", None) is not None:
            ids.add(id(module.weight))
    return {name for name, p in model.named_parameters() if id(p) in ids}


def tp_rank_of(worker: Any) -> int:
    try:
        from vllm.distributed import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())
    except Exception:
        return int(getattr(worker, "rank", 0))


def resolved_of(runner: Any) -> dict[str, Any]:
    """The runner's and speculator's classes and the attention backends."""
    try:
        return {
            "runner_class": f"{type(runner).__module__}.{type(runner).__name__}",
            "speculator_class": type(getattr(runner, "speculator", None)).__name__,
            "attn_backend": [g.backend.get_name() for gs in runner.attn_groups for g in gs]
            if hasattr(runner, "attn_groups")
            else None,
        }
    except Exception as e:  # informational only
        return {"introspect_error": repr(e)}


class E2EWorkerExtension:
    """Mixed into vLLM's worker class by ``worker_extension_cls`` (every name unlike a
    worker's, as vLLM checks): the measurement side of this script in each worker."""

    def init_worker_extension(self) -> None:
        """vLLM calls it once the worker's device is set, before the model loads."""
        import torch
        from vllm.v1.worker import gpu_worker
        from vllm.v1.worker.gpu import model_runner as mr2

        # A forked worker inherits the launching process's tap (another class, from
        # its __main__): one tap per process prints each line once.
        for name in PLUGIN_LOGGERS:
            lg = logging.getLogger(name)
            for h in [h for h in lg.handlers if type(h).__name__ == "PluginLogTap"]:
                lg.removeHandler(h)
        tap_plugin_logs(STATE["plugin_log"])
        rank = int(getattr(self, "rank", 0))
        install_in_worker(rank, mr2.GPUModelRunner, gpu_worker.Worker, torch.cuda)

    def e2e_rank_record(self, switch: str) -> dict[str, Any]:
        mem, cuda = STATE["mem"], STATE["cuda"]
        runner = getattr(self, "model_runner", None)
        shim = sys.modules.get("vllm._C_stable_libtorch")
        gpu: dict[str, Any] | None = None
        if cuda is not None:
            try:
                index = cuda.current_device()
                gpu = {
                    "index": index,
                    "name": cuda.get_device_name(index),
                    "total_bytes": cuda.mem_get_info()[1],
                }
            except Exception as e:
                gpu = {"error": repr(e)}
        record: dict[str, Any] = {
            "rank": int(getattr(self, "rank", 0)),
            "tp_rank": tp_rank_of(self),
            "local_rank": int(getattr(self, "local_rank", 0)),
            "pid": os.getpid(),
            "start_method": multiprocessing.get_start_method(allow_none=True),
            "env": {k: os.environ.get(k) for k in WORKER_ENV_KEYS},
            "gpu": gpu,
            "mem": dict(mem) if mem is not None else None,
            "wrappers_intact": wrappers_intact(STATE["installed"]) if STATE["installed"] else None,
            "plugin": plugin_info(
                switch, {k: os.environ.get(k) for k in ("VLLM_PLUGINS", "VLLM_SPECGRAPH")}
            ),
            "plugin_log": list(STATE["plugin_log"]),
            "resolved": resolved_of(runner),
            "shim_calls": dict(getattr(shim, "CALLS", {}) or {}),
            "shim_active": bool(getattr(shim, "IS_SHIM", False)),
        }
        try:
            record |= capture_once_of(runner)
            record["plugin_report"] = plugin_report(runner)
        except Exception as e:
            record["plugin_report"] = {"error": repr(e)}
        return record

    def e2e_reinit_weights(self, std: float | str) -> dict[str, Any]:
        """The weight refill of TP=1, with shard-aware seeds (serve.py sends ``std`` as
        a string through /collective_rpc)."""
        runner, tp_rank = self.model_runner, tp_rank_of(self)
        out = {"rank": int(getattr(self, "rank", 0)), "tp_rank": tp_rank}
        sharded = sharded_parameter_names(runner.model)
        n, target_ptrs = reinit_weights(runner.model, float(std), tp_rank=tp_rank, sharded=sharded)
        out |= {"params": n, "spec_params": 0, "spec_model": False}
        if (spec_model := getattr(getattr(runner, "speculator", None), "model", None)) is not None:
            sharded = sharded_parameter_names(spec_model)
            out["spec_params"], _ = reinit_weights(
                spec_model, float(std), skip=target_ptrs, tp_rank=tp_rank, sharded=sharded
            )
            out["spec_model"] = True
        return out


# ---- the run ---------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--case", choices=CASES, required=True)
    ap.add_argument("--size", choices=sorted(SIZES), default="tiny")
    ap.add_argument("--plugin", choices=PLUGIN_SWITCHES, default="off")
    ap.add_argument("--out", required=True)
    for key in ("model", "draft", "eagle"):
        ap.add_argument(f"--{key}", help=f"{key} config dir (default: the size's)")
    ap.add_argument("--num-spec", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--num-prompts", type=int, default=6)
    ap.add_argument("--dtype", help="default: the size's")
    ap.add_argument("--gpu-mem-util", type=float, help="default: the size's")
    ap.add_argument("--graph-mode", choices=tuple(GRAPH_MODES), default="compile")
    ap.add_argument("--capture", choices=CAPTURE_SETS, default="default")
    ap.add_argument("--allocator", choices=tuple(ALLOCATORS), default="default")
    ap.add_argument("--memory-history", metavar="FILE", help="the allocator's history (TP=1)")
    ap.add_argument("--workload", choices=WORKLOADS, default="smoke")
    ap.add_argument("--load-requests", type=int, default=256)
    ap.add_argument("--load-repeats", type=int, default=2)
    ap.add_argument("--load-round", type=int, default=1, help="the load case's round")
    ap.add_argument("--seed", type=int, default=0, help="seed of the load requests")
    ap.add_argument("--tp", type=int, default=1, help="tensor_parallel_size")
    ap.add_argument("--custom-all-reduce", action="store_true", help="at --tp > 1: keep it on")
    ap.add_argument("--reinit-std", type=float, default=0.05, help="0: vLLM's dummy weights")
    args = ap.parse_args(argv)
    if args.tp < 1:
        ap.error("--tp must be at least 1")
    if args.memory_history and args.tp > 1:
        ap.error("--memory-history records in this process: use it at --tp 1")
    preset = SIZES[args.size]
    for key in ("model", "draft", "eagle"):
        if getattr(args, key) is None:
            setattr(args, key, os.path.join(CONFIGS, preset[key]))
    args.dtype = args.dtype or preset["dtype"]
    args.utilization_given = args.gpu_mem_util is not None
    if not args.utilization_given:
        args.gpu_mem_util = preset["gpu_memory_utilization"]
    return args


def main() -> int:
    args = parse_args()
    preset = SIZES[args.size]
    env = set_env(args.plugin, args.allocator)
    if args.tp > 1 and not args.custom_all_reduce:
        # Custom all-reduce is off only because its compiled library is not carried;
        # the plugin then keeps vLLM's choice unless asked for its own by name.
        os.environ.setdefault("VLLM_SPECGRAPH_ALLREDUCE", "1")
        env["VLLM_SPECGRAPH_ALLREDUCE"] = os.environ["VLLM_SPECGRAPH_ALLREDUCE"]
    plugin_log: list[str] = []
    result: dict[str, Any] = {
        "size": args.size,
        "case": args.case,
        "plugin": {"switch": args.plugin, "env": env},
        "capture": args.capture,
        "graph_mode": args.graph_mode,
        "commit": os.environ.get(COMMIT_ENV),
        "allocator": args.allocator,
        "workload": args.workload,
        "ok": False,
        "stage": "import",
    }
    if args.utilization_given:  # a run at a limit of its own: a table group of its own
        result["utilization"] = args.gpu_mem_util
    if args.workload == "load":  # in the result: a run that fails early still says it
        result["load_round"] = args.load_round
    if args.tp > 1:
        result["tp"] = args.tp
        result["workers_env"] = prepare_workers(args.out)
    llm = None

    def dump() -> None:
        result["measured_utc"] = time.strftime("%Y-%m-%d %H:%M", time.gmtime())
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1, default=str)

    try:
        import torch

        result["torch"] = torch.__version__
        t0 = time.time()
        import vllm
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.plugins import load_general_plugins

        result["vllm"] = vllm.__version__
        result["import_s"] = round(time.time() - t0, 1)
        # The plugin loads now (vLLM's later calls are no-ops), so that the wrappers
        # below wrap whatever it patched.
        tap_plugin_logs(plugin_log)
        result["plugin_log"] = plugin_log
        load_general_plugins()
        result["plugin"] = plugin_info(args.plugin, env)

        from vllm.v1.worker import gpu_worker
        from vllm.v1.worker.gpu import model_runner as mr2

        installed: dict = {}
        if args.tp == 1:  # at TP > 1 the workers' extension installs them
            mem: dict[str, Any] = {}
            result["mem"] = mem
            installed = install_wrappers(mr2.GPUModelRunner, gpu_worker.Worker, torch.cuda, mem)
            if args.memory_history:
                # Python stacks only: C++ unwinding would slow the timed phases.
                torch.cuda.memory._record_memory_history(stacks="python", max_entries=4_000_000)
                result["memory_history"] = args.memory_history

        with open(os.path.join(args.model, "config.json")) as f:
            vocab = json.load(f)["vocab_size"]
        kw = llm_kwargs(args, preset)
        result["llm_kwargs"] = kw
        result["stage"] = "init"
        dump()
        t0 = time.time()
        t0p = time.perf_counter()
        llm = LLM(**kw)
        result["startup_s"] = round(time.perf_counter() - t0p, 2)
        result["init_s"] = round(time.time() - t0, 1)
        if args.tp == 1:
            result["plugin"]["wrappers_intact"] = wrappers_intact(installed)
            result["gpu"] = {
                "name": torch.cuda.get_device_name(0),
                "total_bytes": torch.cuda.mem_get_info()[1],
                "cuda": torch.version.cuda,
                "visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
            }
        else:  # from the workers: no CUDA context is made in this process
            result["ranks"] = ranks = collect_ranks(llm, args.plugin)
            result["plugin"]["wrappers_intact"] = merge_wrappers_intact(ranks)
            gpu0 = (ranks[0].get("gpu") or {}) if ranks else {}
            result["gpu"] = {
                "name": gpu0.get("name"),
                "total_bytes": gpu0.get("total_bytes"),
                "cuda": torch.version.cuda,
                "ranks": len(ranks),
            }

        vc = llm.llm_engine.vllm_config
        cc = vc.cache_config
        result["resolved"] = {
            "use_v2_model_runner": vc.use_v2_model_runner,
            "cudagraph_mode": str(vc.compilation_config.cudagraph_mode),
            "compilation_mode": str(vc.compilation_config.mode),
            "capture_sizes": vc.compilation_config.cudagraph_capture_sizes,
            "num_capture_sizes": len(vc.compilation_config.cudagraph_capture_sizes or []),
            "max_num_batched_tokens": vc.scheduler_config.max_num_batched_tokens,
            "num_gpu_blocks": cc.num_gpu_blocks,
            "block_size": cc.block_size,
            "spec_method": vc.speculative_config.method if vc.speculative_config else None,
        }
        if cc.num_gpu_blocks is not None and cc.block_size is not None:
            result["kv_tokens"] = int(cc.num_gpu_blocks) * int(cc.block_size)
        runner = None
        if args.tp > 1:  # the runners live in the workers: rank 0's, as its worker read it
            if result["ranks"]:
                result["resolved"].update(result["ranks"][0].get("resolved") or {})
        else:
            try:
                executor = llm.llm_engine.engine_core.engine_core.model_executor
                runner = executor.driver_worker.worker.model_runner
                result["resolved"].update(resolved_of(runner))
            except Exception as e:  # informational only
                result["resolved"]["introspect_error"] = repr(e)
            try:
                result |= capture_once_of(runner)
                result["plugin_report"] = plugin_report(runner)
            except Exception as e:
                result["plugin_report"] = {"error": repr(e)}

        if args.reinit_std > 0 and args.tp > 1:
            done = llm.collective_rpc("e2e_reinit_weights", args=(args.reinit_std,))
            done = sorted(done, key=lambda r: r.get("rank", 0))
            result["reinit_ranks"] = done
            result["reinit_params"] = done[0]["params"] + done[0]["spec_params"]
            if any(d.get("spec_model") for d in done):
                result["reinit_spec_params"] = done[0]["spec_params"]
        elif args.reinit_std > 0:
            n, target_ptrs = reinit_weights(runner.model, args.reinit_std)
            spec_model = getattr(getattr(runner, "speculator", None), "model", None)
            if spec_model is not None:
                n_spec, _ = reinit_weights(spec_model, args.reinit_std, skip=target_ptrs)
                result["reinit_spec_params"] = n_spec
                n += n_spec
            result["reinit_params"] = n

        result["stage"] = "generate"
        dump()  # keep the start-up figures even if generation is cut off

        def generate(requests: list[Request], sampling: dict | None = None) -> list[list[int]]:
            prompts = [TokensPrompt(prompt_token_ids=ids) for ids, _ in requests]
            how = sampling if sampling is not None else {"temperature": 0.0}
            params = [
                SamplingParams(max_tokens=n, ignore_eos=True, detokenize=False, **how)
                for _, n in requests
            ]
            outs = llm.generate(prompts, params, use_tqdm=False)
            return [list(o.outputs[0].token_ids) for o in outs]

        mem_here = result.get("mem") if args.tp == 1 else None
        run_workload(args, preset, vocab, generate, llm, torch.cuda, mem_here, result)
        shim = sys.modules.get("vllm._C_stable_libtorch")
        result["shim_calls"] = dict(getattr(shim, "CALLS", {}) or {})
        result["shim_active"] = bool(getattr(shim, "IS_SHIM", False))
        if args.tp > 1:
            result["ranks"] = collect_ranks(llm, args.plugin)  # shim calls include generation
        result["ok"] = True
        result["stage"] = "done"
        dump()
        if args.tp > 1:
            result["shutdown_s"] = shutdown_engine(llm)
            dump()
        return 0
    except BaseException as e:
        result["error"] = repr(e)
        result["traceback"] = traceback.format_exc()
        traceback.print_exc()
        if args.tp > 1:
            if not result.get("ranks"):
                result["ranks"] = read_rank_files(result["workers_env"][RANK_DIR_ENV])
            dump()
            if llm is not None:
                try:
                    shutdown_engine(llm)
                except Exception:
                    traceback.print_exc()
        dump()
        return 1
    finally:  # also for a run that stopped: often the one worth reading
        if result.get("memory_history"):
            try:
                torch.cuda.memory._dump_snapshot(args.memory_history)
            except Exception:
                traceback.print_exc()


if __name__ == "__main__":
    rc = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)  # skip slow/fragile interpreter teardown of engine threads
