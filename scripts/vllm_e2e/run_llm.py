# SPDX-License-Identifier: Apache-2.0
"""One offline vLLM 0.33.0 run on a dummy-weight Llama, written to ``--out`` as JSON
(docs/vllm-e2e.md: what a run records). Nothing in vLLM changes: wrappers call the
methods they replace and read figures around them; a log handler copies the plugin's
lines. ``E2EWorkerExtension`` measures in every worker at ``--tp`` > 1, at TP=1 here."""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import gc
import importlib.util
import json
import logging
import os
import pstats
import random
import sys
import time
import traceback
import zlib
from collections.abc import Callable
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
CONFIGS = os.path.join(os.path.dirname(os.path.dirname(HERE)), "configs")
# The tiny model's configs ship with the package (found, not imported, before set_env).
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
COMMIT_ENV = "SPECGRAPH_COMMIT"  # the plugin commit the device script measures
PROFILE_ENV, ALLREDUCE_ENV = "VLLM_SPECGRAPH_PROFILE", "VLLM_SPECGRAPH_ALLREDUCE"
# What a run records of its environment (an allocator setting is inherited, not set).
RECORDED_ENV = ("VLLM_PLUGINS", "VLLM_SPECGRAPH", "PYTORCH_CUDA_ALLOC_CONF", PROFILE_ENV)
SWITCH_ENV = {"off": {"VLLM_SPECGRAPH": "0"}, "once": {PROFILE_ENV: "capture-once"}}
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
SPEC_METHODS = {"draft": "draft_model", "accept": "draft_model", "eagle": "eagle", "ngram": "ngram"}
SPEC_MODELS = {"draft": "draft", "accept": "model", "eagle": "eagle"}  # accept: the target's own
NUM_SPEC, REINIT_STD = 3, 0.05  # speculative tokens; the weight refill's N(0, std)
SMOKE_PROMPTS, SMOKE_MAX_TOKENS = 6, 32
LOAD_MIN_LEN, LOAD_WARMUP_REQUESTS, LOAD_WARMUP_MAX_TOKENS, LOAD_SEED = 16, 16, 32, 0
ENGINE_STEPS = "vllm:iteration_tokens_total"  # its count: the engine steps so far
Request = tuple[list[int], int]  # (prompt token ids, max_tokens)
Generate = Callable[[list[Request]], list[list[int]]]  # greedy: the generated token ids
Counters = Callable[[], dict[str, Any]]  # read_spec_counters of the engine's metrics now
ENGINE_SETTINGS = "dtype max_model_len max_num_seqs max_num_batched_tokens gpu_memory_utilization"
# The measuring side's state in its process (one worker each; TP=1: this process).
STATE: dict[str, Any] = {"meter": None, "plugin_log": [], "llm": None}


def vocab_size(size: str) -> int:
    with open(os.path.join(CONFIGS, SIZES[size]["model"], "config.json")) as f:
        return int(json.load(f)["vocab_size"])


def set_env(plugin: str, *, plugin_allreduce: bool = False) -> dict[str, str | None]:
    """The environment, before vLLM is imported: the switch's forced, vLLM's graph estimate
    subtracted (``Meter.budget`` counts on it), ``plugin_allreduce``: the plugin's
    all-reduce asked for by name (TP > 1, vLLM's custom one off). Returns what a run records."""
    if plugin not in PLUGIN_SWITCHES:
        raise ValueError(f"plugin switch must be one of {PLUGIN_SWITCHES}, got {plugin!r}")
    for key, value in BASE_ENV.items():
        os.environ.setdefault(key, value)
    for key in ("VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS", "VLLM_SPECGRAPH", PROFILE_ENV):
        os.environ.pop(key, None)
    os.environ["VLLM_PLUGINS"] = "" if plugin == "none" else PLUGIN_NAME
    os.environ.update(SWITCH_ENV.get(plugin, {}))
    if plugin_allreduce:
        os.environ.setdefault(ALLREDUCE_ENV, "1")
    recorded = RECORDED_ENV + (ALLREDUCE_ENV,) * plugin_allreduce
    return {key: os.environ.get(key) for key in recorded}


class PluginLogTap(logging.Handler):
    """Keeps the plugin's first ``limit`` log lines; ``echo``: prints them, prefixed."""

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
    """Route the plugin's loggers through one tap, after vLLM configured logging: a tap
    inherited through fork is replaced; echoing, ``propagate`` is cleared (printed once)."""
    echo = os.environ.get(PLUGIN_LOG_ECHO_ENV, "1") != "0"
    tap = PluginLogTap(sink, echo=echo)
    for name in PLUGIN_LOGGERS:
        lg = logging.getLogger(name)
        for inherited in [h for h in lg.handlers if type(h).__name__ == "PluginLogTap"]:
            lg.removeHandler(inherited)
        lg.addHandler(tap)
        lg.propagate = not echo
        lg.setLevel(min(lg.getEffectiveLevel(), logging.INFO))


def plugin_info(switch: str, env: dict[str, str | None]) -> dict[str, Any]:
    """The plugin's entry point, and whether vLLM's general plugins imported it."""
    from importlib.metadata import entry_points

    eps = [ep for ep in entry_points(group=PLUGIN_GROUP) if ep.name == PLUGIN_NAME]
    dist = getattr(eps[0], "dist", None) if eps else None
    loaded = "vllm_specgraph" in sys.modules
    return {
        "switch": switch,
        "env": env,
        "entry_point": eps[0].value if eps else None,
        "dist": f"{dist.name} {dist.version}" if dist is not None else None,
        "loaded": loaded,
        "loaded_as_expected": loaded == (switch != "none"),
    }


def as_bytes(value: Any) -> int | str:
    return int(value) if isinstance(value, int | float) else repr(value)


def wrap(method: Callable, measure: Callable) -> Callable:
    return lambda self, *args, **kwargs: measure(method, self, *args, **kwargs)


class Meter:
    """Reads figures into ``mem`` (``cuda``: ``torch.cuda``) around vLLM's graph profile,
    production capture and KV-cache sizing (wrappers calling the methods they replace)."""

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

    def timed(self, key: str, method: Callable, *args: Any, **kwargs: Any) -> Any:
        """``method``'s answer; its wall time, to the GPU's end of it, in ``mem[key]``."""
        self.cuda.synchronize()
        t0 = time.perf_counter()
        out = method(*args, **kwargs)
        self.cuda.synchronize()
        self.mem[key] = round(time.perf_counter() - t0, 3)
        return out

    def profile(self, method: Callable, runner: Any) -> Any:
        self.cuda.empty_cache()
        free = self.cuda.mem_get_info()[0]
        estimate = self.timed("profile_wall_s", method, runner)  # ends synchronized
        self.mem["profile_driver_left_taken"] = free - self.cuda.mem_get_info()[0]
        self.mem["profile_estimate_bytes"] = as_bytes(estimate)
        self.cuda.empty_cache()  # what the profile freed goes back before the KV cache is taken
        return estimate

    def capture(self, method: Callable, runner: Any, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("profile_only"):  # the profile's own captures: part of ``profile``
            return method(runner, *args, **kwargs)
        self.mem["capture_started"] = True  # a run that dies in the capture says so
        actual = self.timed("capture_wall_s", method, runner, *args, **kwargs)
        self.mem["capture_actual_bytes"] = as_bytes(actual)
        return actual

    def budget(self, method: Callable, worker: Any) -> Any:
        """vLLM 0.33.0's KV-cache budget as its worker kept it: ``requested`` and the
        headroom (the profile's activation peak above the graph estimate subtracted)."""
        kv = method(worker)
        self.mem["kv_cache_bytes"] = int(kv)
        estimate = getattr(worker, "cudagraph_memory_estimate", None)  # None: it kept none
        self.mem["worker_cudagraph_memory_estimate"] = -1 if estimate is None else int(estimate)
        needed = ("init_snapshot", "requested_memory", "peak_activation_memory")
        if not all(getattr(worker, name, None) is not None for name in needed):
            return kv  # it did not profile: kv_cache_memory_bytes was set
        self.mem["init_free_bytes"] = int(worker.init_snapshot.free_memory)
        self.mem["requested_bytes"] = int(worker.requested_memory)
        subtracted = 0 if estimate is None else int(estimate)
        self.mem["activation_headroom_bytes"] = int(worker.peak_activation_memory) - subtracted
        return kv

    def at_rest(self) -> None:
        """Driver-level free bytes with nothing cached by the allocator."""
        gc.collect()
        self.cuda.synchronize()
        self.cuda.empty_cache()
        self.mem["free_at_rest_bytes"] = int(self.cuda.mem_get_info()[0])


def prompts_token_ids(n: int, vocab: int) -> list[list[int]]:
    """``smoke``'s prompts, ids in [1, vocab - 2]; the odd ones repeat (n-gram matches)."""
    out = []
    for i in range(n):
        if i % 2 == 0:
            out.append([(7 + 31 * i + 13 * j) % (vocab - 2) + 1 for j in range(12 + 3 * i)])
        else:
            out.append([(11 * i + 5 * j) % (vocab - 2) + 1 for j in range(6)] * 4)
    return out


def load_requests(vocab: int, n: int, max_model_len: int, seed: int) -> list[Request]:
    """``load``'s seeded requests: prompts of 16 to max_model_len / 2 tokens, outputs to / 4."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        prompt_len = rng.randint(LOAD_MIN_LEN, max_model_len // 2)
        max_tokens = rng.randint(LOAD_MIN_LEN, max_model_len // 4)
        out.append(([rng.randint(1, vocab - 2) for _ in range(prompt_len)], max_tokens))
    return out


def read_spec_counters(metrics: list[Any]) -> dict[str, int]:
    """``llm.get_metrics()``'s spec-decode counts and engine steps (``ENGINE_STEPS``)."""
    out: dict[str, int] = {}
    for m in metrics:
        if "spec_decode" in m.name and isinstance(getattr(m, "value", None), int | float):
            out[m.name] = int(m.value)
        elif m.name == ENGINE_STEPS:
            out[m.name] = out.get(m.name, 0) + int(m.count)
    return out


def spec_summary(before: dict[str, int], after: dict[str, int]) -> dict[str, Any]:
    """Acceptance figures of the spec-decode counts between two reads (None: none)."""
    out: dict[str, Any] = {}
    for name in ("drafts", "draft_tokens", "accepted_tokens"):
        key = f"vllm:spec_decode_num_{name}"
        out[name] = after[key] - before.get(key, 0) if key in after else None
    drafted, accepted = out["draft_tokens"], out["accepted_tokens"]
    ok = drafted and accepted is not None
    out["acceptance_rate"] = round(accepted / drafted, 4) if ok else None
    return out


def plugin_share(
    generate: Generate, requests: list[Request], package_dir: str, read_counters: Counters
) -> dict[str, Any]:
    """One generate under cProfile: the share of its time in the functions under
    ``package_dir`` (their ``tottime``), and that time per engine step."""
    profiler = cProfile.Profile()
    steps_before = read_counters().get(ENGINE_STEPS, 0)
    profiler.runcall(generate, requests)
    steps = read_counters().get(ENGINE_STEPS, 0) - steps_before
    stats = pstats.Stats(profiler).stats  # (file, line, name) -> (cc, calls, tottime, cum, _)
    total = sum(tottime for _, _, tottime, _, _ in stats.values())
    seconds = sum(v[2] for key, v in stats.items() if key[0].startswith(package_dir))
    return {
        "plugin_share": round(seconds / total, 6) if total else None,
        "plugin_us_per_step": round(1e6 * seconds / steps, 2) if steps else None,
    }


def run_workload(
    args: argparse.Namespace,
    generate: Generate,
    read_counters: Counters,
    result: dict[str, Any],
    share_of: str | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> None:
    """``smoke`` (one generate) or ``load`` (a warm-up, then timed repeats, each one's
    tokens/s and step time, and ``share_of``'s share); spec figures of the timed only."""
    vocab, most = vocab_size(args.size), SIZES[args.size]["max_model_len"]
    if args.workload == "smoke":
        requests = [(ids, SMOKE_MAX_TOKENS) for ids in prompts_token_ids(SMOKE_PROMPTS, vocab)]
        repeats = 1
    else:
        requests = load_requests(vocab, args.load_requests, most, LOAD_SEED)
        warmup = load_requests(vocab, LOAD_WARMUP_REQUESTS, most, LOAD_SEED + 1)
        generate([(ids, min(n, LOAD_WARMUP_MAX_TOKENS)) for ids, n in warmup])
        repeats = args.load_repeats
    first = last = read_counters()
    timings, outputs = [], []
    for _ in range(repeats):
        start = clock()
        outputs.append(generate(requests))
        wall, now = clock() - start, read_counters()
        steps = now[ENGINE_STEPS] - last[ENGINE_STEPS] if ENGINE_STEPS in last else None
        generated, last = sum(len(t) for t in outputs[-1]), now
        timings.append({"wall_s": round(wall, 4), "generated_tokens": generated})
        timings[-1]["tokens_per_s"] = round(generated / wall, 1) if wall > 0 else None
        timings[-1]["engine_steps"] = steps
        timings[-1]["step_ms"] = round(1000 * wall / steps, 3) if steps else None
    result |= {"tokens": outputs[0], "spec": spec_summary(first, last)}
    result["generate_s"] = round(sum(t["wall_s"] for t in timings), 2)
    if args.workload == "load":
        load = {"num_requests": len(requests), "repeats": timings, "spec": result["spec"]}
        result["load"] = load | {"repeats_equal": all(out == outputs[0] for out in outputs)}
        if share_of is not None:
            half = requests[: max(1, len(requests) // 2)]
            result["load"]["plugin_share"] = plugin_share(generate, half, share_of, read_counters)


def speculative_config(case: str, size: str) -> dict[str, Any] | None:
    if case == "base":
        return None
    spec = {"method": SPEC_METHODS[case], "num_speculative_tokens": NUM_SPEC}
    if case == "ngram":
        return spec | {"prompt_lookup_min": 2, "prompt_lookup_max": 4}
    return spec | {"model": os.path.join(CONFIGS, SIZES[size][SPEC_MODELS[case]])}


def llm_kwargs(
    size: str, case: str, graph_mode: str = "compile", tp: int = 1, custom_all_reduce: bool = False
) -> dict[str, Any]:
    """``LLM(...)``'s arguments (``tp`` > 1: the multiprocess executor and the extension)."""
    preset = SIZES[size]
    compilation = {**GRAPH_MODES[graph_mode], "custom_ops": ["none"]}
    if preset["capture_sizes"] is not None:
        compilation["cudagraph_capture_sizes"] = list(preset["capture_sizes"])
    model = os.path.join(CONFIGS, preset["model"])
    kw = {"model": model, "skip_tokenizer_init": True, "load_format": "dummy"}
    kw |= {"seed": 0} | {key: preset[key] for key in ENGINE_SETTINGS.split()}
    kw |= {
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
    """Floating parameters refilled in place, N(0, std) seeded by name (norms: 1), storage
    shared with the target left the target's; ``tp_rank`` > 0: a shard's seed names it."""
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


def sharded_parameter_names(model: Any, split: tuple = (), weight_only: tuple = ()) -> set[str]:
    """The parameters of one rank's shard: all of a ``split`` layer's (column-parallel,
    vocabulary-parallel), the weight of a ``weight_only`` one's (row-parallel)."""
    if not split:
        from vllm.model_executor.layers.linear import ColumnParallelLinear, RowParallelLinear
        from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

        split = (ColumnParallelLinear, VocabParallelEmbedding)
        weight_only = (RowParallelLinear,)
    ids: set[int] = set()
    for _, module in model.named_modules():
        if getattr(module, "tp_size", 1) <= 1:
            continue
        if isinstance(module, split):
            ids.update(id(p) for p in module.parameters(recurse=False))
        elif isinstance(module, weight_only) and getattr(module, "weight", None) is not None:
            ids.add(id(module.weight))
    return {name for name, p in model.named_parameters() if id(p) in ids}


class E2EWorkerExtension:
    """Mixed into vLLM's worker class by ``worker_extension_cls`` (no name a worker's)."""

    def init_worker_extension(self) -> None:
        """The log tap and, once per process, the wrappers over the plugin's patches."""
        tap_plugin_logs(STATE["plugin_log"])
        if STATE["meter"] is None:
            import torch
            from vllm.v1.worker import gpu_worker
            from vllm.v1.worker.gpu import model_runner as mr2

            STATE["meter"] = Meter(torch.cuda, {}).install(mr2.GPUModelRunner, gpu_worker.Worker)

    def e2e_rank_record(self, _switch: str = "") -> dict[str, Any]:
        """This rank's figures and what the plugin left on its runner, as plain data."""
        meter, runner = STATE["meter"], getattr(self, "model_runner", None)
        report = getattr(runner, "specgraph_profile", None)
        outcome = getattr(runner, "specgraph_capture_once", None)
        return {
            "rank": int(getattr(self, "rank", 0)),
            "gpu": {"name": meter.cuda.get_device_name()},
            "mem": dict(meter.mem),
            "wrappers_intact": meter.intact(),
            "plugin_log": list(STATE["plugin_log"]),
            "plugin_report": None if report is None else report.to_dict(),
            "capture_once": None if outcome is None else dataclasses.asdict(outcome),
            "capture_once_fallback": getattr(runner, "specgraph_capture_once_fallback", None),
        }

    def e2e_reinit_weights(self, std: float | str) -> dict[str, Any]:
        """``refill_weights`` on this rank (its TP rank); ``std`` may come as a string."""
        rank = int(getattr(self, "rank", 0))
        return {"rank": rank} | refill_weights(self.model_runner, float(std), rank)


def on_workers(llm: Any, tp: int, method: str, *args: Any) -> list[dict]:
    """An ``E2EWorkerExtension`` method's answer from every rank, in rank order."""
    if tp == 1:
        worker = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker
        return [getattr(E2EWorkerExtension, method)(worker, *args)]
    return sorted(llm.collective_rpc(method, args=args), key=lambda r: r["rank"])


def prepare_workers(out: str) -> None:
    """Let the workers import the extension (``sys.path``, ``PYTHONPATH``)."""
    if HERE not in sys.path:
        sys.path.insert(0, HERE)
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if HERE not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([HERE, *paths])


def save(run: dict[str, Any], path: str, stage: str | None = None) -> None:
    """The run's JSON, written at every stage: a run cut off keeps what it measured."""
    run["stage"] = stage or run["stage"]
    run["measured_utc"] = time.strftime("%Y-%m-%d %H:%M", time.gmtime())
    with open(path, "w") as f:
        json.dump(run, f, indent=1, default=str)


def record_ranks(llm: Any, tp: int, run: dict[str, Any]) -> None:
    """Every rank's record (TP=1: in the run's own fields), and the wrappers' state."""
    ranks = on_workers(llm, tp, "e2e_rank_record")
    intact = [r["wrappers_intact"] for r in ranks]
    run["plugin"]["wrappers_intact"] = {name: all(i[name] for i in intact) for name in intact[0]}
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    run["gpu"] = {"name": ranks[0]["gpu"]["name"], "visible_devices": visible}
    if tp == 1:
        run |= {k: ranks[0][k] for k in ("plugin_report", "capture_once", "capture_once_fallback")}
    else:
        run["ranks"] = ranks


def run_engine(args: argparse.Namespace, run: dict[str, Any]) -> None:
    """Load the plugin, start the engine (``STATE["llm"]``), record what it resolved,
    refill the weights; then the workload from rest, greedy with ``ignore_eos``."""
    import torch
    import vllm
    from vllm.plugins import load_general_plugins

    run |= {"torch": torch.__version__, "vllm": vllm.__version__, "plugin_log": STATE["plugin_log"]}
    tap_plugin_logs(STATE["plugin_log"])
    load_general_plugins()
    run["plugin"] = plugin_info(args.plugin, run["plugin"]["env"])
    if args.tp == 1:
        E2EWorkerExtension.init_worker_extension(None)
        run["mem"] = STATE["meter"].mem
    kw = llm_kwargs(args.size, args.case, args.graph_mode, args.tp, args.custom_all_reduce)
    run["llm_kwargs"] = kw
    save(run, args.out, "init")
    t0 = time.perf_counter()
    llm = STATE["llm"] = vllm.LLM(**kw)
    run["startup_s"] = round(time.perf_counter() - t0, 2)
    vc = llm.llm_engine.vllm_config
    cc, compilation = vc.cache_config, vc.compilation_config
    run["resolved"] = {
        "cudagraph_mode": str(compilation.cudagraph_mode),
        "compilation_mode": str(compilation.mode),
        "capture_sizes": compilation.cudagraph_capture_sizes,
        "num_capture_sizes": len(compilation.cudagraph_capture_sizes or []),
        "num_gpu_blocks": cc.num_gpu_blocks,
        "block_size": cc.block_size,
        "spec_method": vc.speculative_config.method if vc.speculative_config else None,
    }
    run["kv_tokens"] = int(cc.num_gpu_blocks or 0) * int(cc.block_size)
    record_ranks(llm, args.tp, run)
    refilled = on_workers(llm, args.tp, "e2e_reinit_weights", REINIT_STD)
    if min(r["params"] for r in refilled) <= 0:
        raise RuntimeError(f"the weight refill refilled nothing: {refilled!r:.300}")
    save(run, args.out, "generate")  # the start-up figures, even if generation is cut off

    def generate(requests: list[Request]) -> list[list[int]]:
        prompts = [vllm.TokensPrompt(prompt_token_ids=ids) for ids, _ in requests]
        how = {"ignore_eos": True, "detokenize": False, "temperature": 0.0}
        params = [vllm.SamplingParams(max_tokens=n, **how) for _, n in requests]
        return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]

    share_of = None  # at TP > 1 the plugin's hot path runs out of this profiler's sight
    if args.tp == 1:
        STATE["meter"].at_rest()
        if args.plugin == "on":
            share_of = os.path.dirname(sys.modules["vllm_specgraph"].__file__) + os.sep
    run_workload(args, generate, lambda: read_spec_counters(llm.get_metrics()), run, share_of)
    record_ranks(llm, args.tp, run)


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
    if args.tp < 1 or args.load_repeats < 1:
        ap.error("--tp and --load-repeats must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    env = set_env(args.plugin, plugin_allreduce=args.tp > 1 and not args.custom_all_reduce)
    run: dict[str, Any] = {"size": args.size, "case": args.case, "graph_mode": args.graph_mode}
    run |= {"plugin": {"switch": args.plugin, "env": env}, "ok": False, "stage": "import"}
    run |= {"commit": os.environ.get(COMMIT_ENV), "workload": args.workload}
    if args.workload == "load":  # in the result: a run that fails early still says it
        run["load_round"] = args.load_round
    if args.tp > 1:
        run["tp"] = args.tp
        prepare_workers(args.out)
    try:
        run_engine(args, run)
        run["ok"] = True
        save(run, args.out, "done")
        return 0
    except BaseException as e:
        run["error"], run["traceback"] = repr(e), traceback.format_exc()
        traceback.print_exc()
        save(run, args.out)
        return 1
    finally:
        if STATE["llm"] is not None and args.tp > 1:  # the workers' GPU memory, freed
            try:
                STATE["llm"].llm_engine.engine_core.shutdown()
            except Exception:
                traceback.print_exc()


if __name__ == "__main__":
    rc = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)  # skip slow/fragile interpreter teardown of engine threads
