# SPDX-License-Identifier: Apache-2.0
"""Offline vLLM 0.33.0 run on a dummy-weight Llama: Model Runner V2, FULL CUDA
graphs, optional speculator, vllm-specgraph plugin on or off. One run per process.

    python run_llm.py --size tiny|1b|8b --case base|draft|accept|ngram|eagle \
        --plugin off|on|none|noest [--capture default|small] [--graph-mode full|compile] \
        [--allocator default|expandable] [--memory-history FILE] [--gpu-mem-util U] \
        [--workload smoke|peak|load [--load-round N]] \
        [--tp N [--custom-all-reduce]] --out result.json

``--plugin`` (set in the environment before vLLM is imported):

* ``on``: ``VLLM_PLUGINS=specgraph``; the plugin loads and patches vLLM.
* ``off``: ``VLLM_PLUGINS=specgraph`` and ``VLLM_SPECGRAPH=0``; the plugin loads
  through its entry point and patches nothing (its own off switch).
* ``none``: ``VLLM_PLUGINS=`` (empty); no plugin is loaded at all.
* ``noest``: as ``off``, and ``VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=0``:
  vLLM still profiles its graphs but subtracts nothing from the KV cache.

``--capture``: ``default`` is the size's capture sizes (vLLM's default for the
1B size, 1 to 32 for tiny); ``small`` is 1, 2, 4, 8, 16, 32 for every size.
``--allocator``: ``default`` is PyTorch's caching allocator as it comes
(``PYTORCH_CUDA_ALLOC_CONF`` and ``PYTORCH_ALLOC_CONF`` removed from the
environment), ``expandable`` sets ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``
(one growing segment per pool and stream), before torch allocates anything.
``--memory-history FILE``: the caching allocator's history over the whole run,
dumped as torch's memory snapshot (open it at https://pytorch.org/memory_viz);
TP=1 only.
``--workload`` (``workloads.py``): ``smoke`` (6 prompts), ``peak`` (one full
step, measured) or ``load`` (a few hundred mixed requests, timed);
``--load-round``: which of the device script's rounds of a load case this run
is, recorded as ``load_round``.
``--gpu-mem-util``: replaces the size's ``gpu_memory_utilization`` (a run at
the limit: ``peak`` with the utilization that leaves the free memory).

Prompts are token ids (no tokenizer), weights are vLLM's deterministic dummy
weights (``load_format="dummy"``) re-randomised in place by parameter name, so
every process builds the same model and greedy outputs can be compared across
processes.

The only things this script changes inside vLLM are measurement wrappers (they
call the method they replace and read ``torch.cuda.mem_get_info`` and
``time.perf_counter`` around it) and a log handler that copies the plugin's log
lines into the result; vLLM's own log lines are printed as usual.

``--tp N`` (N > 1): tensor parallelism through vLLM's multiprocess executor
(``distributed_executor_backend="mp"``; custom all-reduce disabled unless
``--custom-all-reduce``). The model runs in one worker process per rank, so the
wrappers, the log tap and the weight refill run there: vLLM loads
``e2e_worker.E2EWorkerExtension`` (``worker_extension_cls``) into each worker,
and this script reads each rank's figures back with ``llm.collective_rpc`` into
``ranks`` of the result. TP=1 runs in this process, as before.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import sys
import time
import traceback
import zlib
from contextlib import nullcontext
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import memory_budget  # noqa: E402  (this directory, made importable just above)
import workloads  # noqa: E402
from measure import install_wrappers, plugin_report, wrappers_intact  # noqa: E402
from workloads import prompts_token_ids, spec_summary  # noqa: E402

REPO = os.path.dirname(os.path.dirname(HERE))
CONFIGS = os.path.join(REPO, "configs")
# The tiny model's configs ship with the package, for its demo: found where the
# package is installed (found, not imported: nothing may load before set_env).
DEMO_CONFIGS = os.path.join(
    importlib.util.find_spec("vllm_specgraph.demo").submodule_search_locations[0], "configs"
)

MiB = 1 << 20
CASES = ("base", "draft", "accept", "ngram", "eagle")
"""``accept``: the draft model with the target's own config; the refill by name then
gives it the target's weights, so it agrees with the target nearly always."""
PLUGIN_SWITCHES = ("off", "on", "none", "noest")
PLUGIN_NAME = "specgraph"  # the vllm.general_plugins entry point in pyproject.toml
PLUGIN_GROUP = "vllm.general_plugins"
PLUGIN_LOGGERS = ("vllm.specgraph", "vllm_specgraph")
PLUGIN_LOG_PREFIX = "SPECGRAPH-LOG"
PLUGIN_LOG_LIMIT = 500
PLUGIN_LOG_ECHO_ENV = "E2E_PLUGIN_LOG_ECHO"
# vLLM imports it in every worker process at TP > 1 (this directory is on their path).
WORKER_EXTENSION = "e2e_worker.E2EWorkerExtension"
# Where the workers also write their figures as they are taken, so that a run that
# fails after the profile still has them: the result path plus this suffix.
RANK_DIR_ENV = "E2E_RANK_DIR"

# Per size: config dirs under configs/ and the engine settings that differ.
# capture_sizes None means vLLM's default capture sizes.
SIZES: dict[str, dict[str, Any]] = {
    "tiny": {
        "model": os.path.join(DEMO_CONFIGS, "tiny-llama"),
        "draft": os.path.join(DEMO_CONFIGS, "tiny-llama-draft"),
        "eagle": os.path.join(DEMO_CONFIGS, "tiny-llama-draft"),  # the same 1-layer config
        "dtype": "float32",
        "capture_sizes": [1, 2, 4, 8, 16, 32],
        "max_num_seqs": 8,
        "max_model_len": 256,
        "max_num_batched_tokens": 512,
        "gpu_memory_utilization": 0.1,
    },
    "1b": {
        "model": "llama-1b",
        "draft": "llama-1b-draft",
        "eagle": "llama-1b-eagle",
        "dtype": "bfloat16",
        "capture_sizes": None,
        "max_num_seqs": 256,
        "max_model_len": 1024,
        "max_num_batched_tokens": 2048,
        "gpu_memory_utilization": 0.5,
    },
}
# The 8B-class model runs with the 1B model's engine settings.
SIZES["8b"] = SIZES["1b"] | {
    "model": "llama-8b",
    "draft": "llama-8b-draft",
    "eagle": "llama-8b-eagle",
}

GRAPH_MODES: dict[str, dict[str, Any]] = {
    "full": {"mode": 0, "cudagraph_mode": "FULL"},
    "compile": {"mode": 3, "cudagraph_mode": "FULL_AND_PIECEWISE"},
}
"""``--graph-mode``: ``full`` is compilation off with FULL graphs; ``compile`` is vLLM's
default for Model Runner V2, torch.compile (``VLLM_COMPILE``) with FULL_AND_PIECEWISE."""
COMMIT_ENV = "SPECGRAPH_COMMIT"
"""The plugin commit a run measures, as the device script read it; kept in the result."""

# Capture-size sets: "default" is each size's own (above), "small" the same short
# explicit list for every size.
CAPTURE_SETS = ("default", "small")
ALLOCATORS = {"default": None, "expandable": "expandable_segments:True"}
"""``--allocator``: the ``PYTORCH_CUDA_ALLOC_CONF`` each one runs with (None: unset)."""
ALLOC_CONF_ENVS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
SMALL_CAPTURE_SIZES = [1, 2, 4, 8, 16, 32]

BASE_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_USE_V2_MODEL_RUNNER": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "VLLM_LOGGING_LEVEL": "INFO",
    "VLLM_USE_FLASHINFER_SAMPLER": "0",  # flashinfer is not carried
    "TVM_FFI_DISABLE_TORCH_C_DLPACK": "1",
}


def set_env(plugin: str, allocator: str = "default") -> dict[str, str | None]:
    """Set the engine's, the plugin switch's and the allocator's environment; call
    before importing vLLM (``vllm.envs`` reads ``VLLM_PLUGINS`` when plugins load)
    and before torch allocates. The plugin and allocator variables are forced, not
    defaulted, so an inherited value cannot turn one switch into another."""
    if allocator not in ALLOCATORS:
        raise ValueError(f"allocator must be one of {tuple(ALLOCATORS)}, got {allocator!r}")
    for key, value in BASE_ENV.items():
        os.environ.setdefault(key, value)
    for key in ALLOC_CONF_ENVS:
        os.environ.pop(key, None)
    if ALLOCATORS[allocator] is not None:
        os.environ[ALLOC_CONF_ENVS[0]] = ALLOCATORS[allocator]
    os.environ.pop(memory_budget.ESTIMATE_ENV, None)  # vLLM's default: subtract the estimate
    if plugin == "none":
        os.environ["VLLM_PLUGINS"] = ""
        os.environ.pop("VLLM_SPECGRAPH", None)
    elif plugin in ("off", "noest"):
        os.environ["VLLM_PLUGINS"] = PLUGIN_NAME
        os.environ["VLLM_SPECGRAPH"] = "0"
        if plugin == "noest":
            os.environ[memory_budget.ESTIMATE_ENV] = "0"
    elif plugin == "on":
        os.environ["VLLM_PLUGINS"] = PLUGIN_NAME
        os.environ.pop("VLLM_SPECGRAPH", None)  # the plugin's default: on
    else:
        raise ValueError(f"plugin switch must be one of {PLUGIN_SWITCHES}, got {plugin!r}")
    return {
        k: os.environ.get(k)
        for k in ("VLLM_PLUGINS", "VLLM_SPECGRAPH", memory_budget.ESTIMATE_ENV, ALLOC_CONF_ENVS[0])
    }


class PluginLogTap(logging.Handler):
    """Prints the plugin's log records with a fixed prefix (vLLM's format names the
    file, not the logger) and keeps the first ``limit`` of them for the result.
    With ``echo`` false it only keeps them, and vLLM's own handlers print them."""

    def __init__(self, sink: list[str], limit: int = PLUGIN_LOG_LIMIT, echo: bool = True) -> None:
        super().__init__(logging.DEBUG)
        self.sink = sink
        self.limit = limit
        self.echo = echo

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
    """Route the plugin's loggers (``vllm.specgraph`` through vLLM's logger, and the
    package's own ``vllm_specgraph``) through one tap. Call after vLLM configured
    logging; ``propagate`` is cleared so each line is printed once. Where
    ``E2E_PLUGIN_LOG_ECHO=0`` (serve.py: the server's own log is what is checked)
    the tap only keeps the lines and vLLM's logging prints them as it would."""
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
    """Where the plugin's entry point comes from and whether the package was
    imported, read after vLLM loaded its general plugins."""
    from importlib.metadata import entry_points

    info: dict[str, Any] = {"switch": switch, "env": env}
    eps = [ep for ep in entry_points(group=PLUGIN_GROUP) if ep.name == PLUGIN_NAME]
    info["entry_point"] = eps[0].value if eps else None
    info["entry_points_found"] = len(eps)
    dist = getattr(eps[0], "dist", None) if eps else None
    info["dist"] = f"{dist.name} {dist.version}" if dist is not None else None
    info["dist_location"] = str(dist.locate_file("")) if dist is not None else None
    mod = sys.modules.get("vllm_specgraph")
    info["loaded"] = mod is not None
    info["module_file"] = getattr(mod, "__file__", None)
    info["loaded_as_expected"] = info["loaded"] == (switch != "none")
    return info


def reinit_weights(
    model: Any,
    std: float,
    skip: set[int] | None = None,
    *,
    tp_rank: int = 0,
    sharded: set[str] | None = None,
) -> tuple[int, set[int]]:
    """Refill every parameter in place with seeded N(0, std) values (norm
    weights: 1.0), seeded by parameter name. vLLM's dummy loader fills every
    same-shaped tensor with the same +-1e-3 values, which makes greedy output
    one repeated token per prompt; this gives a non-degenerate model. The
    target is identical in every process, and a draft or EAGLE head that uses
    the target's parameter names (embedding, first layers, head) gets the same
    values there, so it agrees with the target often but not always. In place:
    captured CUDA graphs keep reading the same addresses.

    Parameters whose storage is in ``skip`` (data pointers) are left alone: an
    EAGLE head shares the target's embedding and head, possibly under another
    name, and must not re-seed them. Returns (parameters refilled, data pointers
    of every parameter seen).

    Tensor parallelism: a parameter named in ``sharded`` holds one rank's shard,
    and on rank ``tp_rank`` > 0 its seed also names the rank, so the shards of
    one tensor differ (else, e.g., every vocabulary shard of the head would be
    the same and the logits would tie across shards). Replicated parameters keep
    the name's seed, so every rank holds the same values. TP=1 is unchanged."""
    import torch

    n = 0
    seen: set[int] = set()
    with torch.inference_mode():
        for name, p in model.named_parameters():
            ptr = p.data_ptr()
            seen.add(ptr)
            if not p.is_floating_point() or (skip is not None and ptr in skip):
                continue
            if name.endswith("norm.weight"):
                p.data.fill_(1.0)
            else:
                key = name
                if tp_rank > 0 and sharded is not None and name in sharded:
                    key = f"{name}@tp{tp_rank}"
                g = torch.Generator(device=p.device)
                g.manual_seed(zlib.crc32(key.encode()))
                p.data.normal_(0.0, std, generator=g)
            n += 1
    torch.cuda.synchronize()
    return n, seen


def speculative_config(
    case: str, draft: str, eagle: str, num_spec: int, target: str = ""
) -> dict | None:
    if case in ("draft", "accept"):
        model = target if case == "accept" else draft
        return {"method": "draft_model", "model": model, "num_speculative_tokens": num_spec}
    if case == "eagle":
        return {"method": "eagle", "model": eagle, "num_speculative_tokens": num_spec}
    if case == "ngram":
        return {
            "method": "ngram",
            "num_speculative_tokens": num_spec,
            "prompt_lookup_min": 2,
            "prompt_lookup_max": 4,
        }
    return None


def capture_sizes(preset: dict[str, Any], capture: str) -> list[int] | None:
    """The explicit capture sizes of a capture-size set; None: vLLM's default."""
    if capture == "small":
        return list(SMALL_CAPTURE_SIZES)
    if capture != "default":
        raise ValueError(f"capture-size set must be one of {CAPTURE_SETS}, got {capture!r}")
    return None if preset["capture_sizes"] is None else list(preset["capture_sizes"])


def llm_kwargs(args: argparse.Namespace, preset: dict[str, Any]) -> dict[str, Any]:
    """The ``LLM(...)`` arguments. At TP=1 exactly those of earlier runs; at
    ``args.tp`` > 1 also the multiprocess executor, custom all-reduce off unless
    ``args.custom_all_reduce``, and the worker extension that measures each rank."""
    compilation: dict[str, Any] = {
        **GRAPH_MODES[getattr(args, "graph_mode", "compile")],
        "custom_ops": ["none"],
    }
    sizes = capture_sizes(preset, getattr(args, "capture", "default"))
    if sizes is not None:
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
            "ir_op_priority": {
                "rms_norm": ["native"],
                "fused_add_rms_norm": ["native"],
            }
        },
        "speculative_config": speculative_config(
            args.case, args.draft, args.eagle, args.num_spec, args.model
        ),
        "disable_log_stats": False,  # keep spec-decode counters for get_metrics()
    }
    tp = getattr(args, "tp", 1)
    if tp > 1:
        kw["tensor_parallel_size"] = tp
        kw["distributed_executor_backend"] = "mp"
        kw["disable_custom_all_reduce"] = not getattr(args, "custom_all_reduce", False)
        kw["worker_extension_cls"] = WORKER_EXTENSION
    return kw


def prepare_workers(out: str) -> dict[str, str]:
    """TP > 1: let the worker processes import the worker extension, and give
    them a directory for their figures. Spawned workers get this process's
    ``sys.path``; ``PYTHONPATH`` covers any other start. Returns what was set."""
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
    """What the workers wrote as they measured (for a run that failed before the
    figures could be read back through ``collective_rpc``)."""
    ranks = []
    if not os.path.isdir(rank_dir):
        return ranks
    for name in sorted(os.listdir(rank_dir)):
        if name.startswith("rank") and name.endswith(".json"):
            try:
                with open(os.path.join(rank_dir, name)) as f:
                    ranks.append(json.load(f))
            except (OSError, ValueError):
                continue
    return sorted(ranks, key=lambda r: r.get("rank", 0))


def collect_ranks(llm: Any, switch: str) -> list[dict]:
    """Each worker's record (``E2EWorkerExtension.e2e_rank_record``), by rank."""
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
    """Stop the engine and its worker processes (TP > 1), so that their GPU
    memory is free before the next run starts. Returns the seconds it took."""
    t0 = time.perf_counter()
    llm.llm_engine.engine_core.shutdown()
    return round(time.perf_counter() - t0, 2)


def workload_requests(
    args: argparse.Namespace, preset: dict[str, Any], vocab: int
) -> list[workloads.Request]:
    """The requests of ``args.workload`` (smoke or peak) for this size."""
    if args.workload == "peak":
        return workloads.peak_requests(
            vocab, preset["max_num_seqs"], preset["max_num_batched_tokens"]
        )
    return [(ids, args.max_tokens) for ids in prompts_token_ids(args.num_prompts, vocab)]


def run_workload(
    args: argparse.Namespace,
    preset: dict[str, Any],
    vocab: int,
    generate: workloads.Generate,
    llm: Any,
    cuda: Any,
    mem: dict[str, Any] | None,
    result: dict[str, Any],
) -> None:
    """Run ``args.workload`` and record its tokens, timings and spec-decode
    figures into ``result``. ``mem`` (TP=1: the figures of this process's GPU)
    also gets the free memory at rest and, around a smoke or peak generate,
    what that step took."""
    if mem is not None:
        mem["free_at_rest_bytes"] = workloads.free_at_rest(cuda)
    if args.workload == "load":
        requests = workloads.load_requests(
            vocab, args.load_requests, preset["max_model_len"], args.seed
        )
        warmup = workloads.load_requests(
            vocab, workloads.LOAD_WARMUP_REQUESTS, preset["max_model_len"], args.seed + 1
        )
        warmup = [(ids, min(n, workloads.LOAD_WARMUP_MAX_TOKENS)) for ids, n in warmup]
        load = workloads.run_load(
            generate,
            lambda: workloads.read_spec_counters(llm.get_metrics()),
            requests,
            warmup,
            args.load_repeats,
        )
        # At TP > 1 the plugin's hot path runs in the worker processes, out of this
        # process's profiler's sight: no share is measured there.
        if getattr(args, "plugin", None) == "on" and getattr(args, "tp", 1) == 1:
            import vllm_specgraph

            load["plugin_share"] = workloads.plugin_share(
                generate,
                requests[: max(1, len(requests) // 2)],
                os.path.dirname(vllm_specgraph.__file__) + os.sep,
                lambda: workloads.read_spec_counters(llm.get_metrics()).get(workloads.ENGINE_STEPS),
            )
        result["tokens"] = load.pop("tokens")
        result["load"] = load
        result["spec"] = load["spec"]
        result["generate_s"] = sum(r["wall_s"] for r in load["repeats"])
        return
    requests = workload_requests(args, preset, vocab)
    sampling = workloads.PEAK_SAMPLING if args.workload == "peak" else None
    t0 = time.time()
    with workloads.measure_step(cuda, mem) if mem is not None else nullcontext():
        result["tokens"] = generate(requests, sampling)
    result["generate_s"] = round(time.time() - t0, 2)
    try:
        counters = workloads.read_spec_counters(llm.get_metrics())
        result["spec_metrics"] = counters
        result["spec"] = spec_summary(counters)
    except Exception as e:
        result["spec_metrics"] = {"error": repr(e)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--case", choices=CASES, required=True)
    ap.add_argument("--size", choices=sorted(SIZES), default="tiny")
    ap.add_argument("--plugin", choices=PLUGIN_SWITCHES, default="off")
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", help="target config dir (default: the size's)")
    ap.add_argument("--draft", help="draft_model config dir (default: the size's)")
    ap.add_argument("--eagle", help="EAGLE config dir (default: the size's)")
    ap.add_argument("--num-spec", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--num-prompts", type=int, default=6)
    ap.add_argument("--dtype", help="default: the size's")
    ap.add_argument("--gpu-mem-util", type=float, help="default: the size's")
    ap.add_argument("--graph-mode", choices=tuple(GRAPH_MODES), default="compile")
    ap.add_argument("--capture", choices=CAPTURE_SETS, default="default")
    ap.add_argument("--allocator", choices=tuple(ALLOCATORS), default="default")
    ap.add_argument(
        "--memory-history",
        metavar="FILE",
        help="dump the allocator's history of the whole run into FILE (TP=1 only)",
    )
    ap.add_argument("--workload", choices=workloads.WORKLOADS, default="smoke")
    ap.add_argument("--load-requests", type=int, default=256)
    ap.add_argument("--load-repeats", type=int, default=2)
    ap.add_argument("--load-round", type=int, default=1, help="the load case's round")
    ap.add_argument("--seed", type=int, default=0, help="seed of the load requests")
    ap.add_argument(
        "--tp",
        type=int,
        default=1,
        help="tensor_parallel_size; above 1, vLLM's multiprocess executor, one worker per rank",
    )
    ap.add_argument(
        "--custom-all-reduce",
        action="store_true",
        help="at --tp > 1, leave vLLM's custom all-reduce enabled (default: disabled)",
    )
    ap.add_argument(
        "--reinit-std",
        type=float,
        default=0.05,
        help="re-randomise weights after start-up (0: keep vLLM's dummy weights)",
    )
    args = ap.parse_args()
    if args.tp < 1:
        ap.error("--tp must be at least 1")
    if args.memory_history and args.tp > 1:
        ap.error("--memory-history records in this process: use it at --tp 1")
    preset = SIZES[args.size]
    for key in ("model", "draft", "eagle"):
        if getattr(args, key) is None:
            setattr(args, key, os.path.join(CONFIGS, preset[key]))
    if args.dtype is None:
        args.dtype = preset["dtype"]
    utilization_given = args.gpu_mem_util is not None
    if not utilization_given:
        args.gpu_mem_util = preset["gpu_memory_utilization"]

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
    if utilization_given:  # a run at a limit of its own: a table group of its own
        result["utilization"] = args.gpu_mem_util
    if args.workload == "load":
        # In the result rather than read from the file name: the summary keys
        # every run by its own fields, the names are only the device script's,
        # and a run that fails early still says which round it was.
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

        # ---- plugin: load it now (vLLM's later calls are no-ops), so that the
        # wrappers below wrap whatever the plugin patched ----------------------
        tap_plugin_logs(plugin_log)
        result["plugin_log"] = plugin_log
        load_general_plugins()
        result["plugin"] = plugin_info(args.plugin, env)

        # ---- measurement wrappers (call through to vLLM's own code) -------
        from vllm.v1.worker import gpu_worker
        from vllm.v1.worker.gpu import model_runner as mr2

        # At TP > 1 the model runs in the worker processes, where the worker
        # extension installs the same wrappers; nothing is measured here.
        installed: dict = {}
        if args.tp == 1:
            mem: dict[str, Any] = {}
            result["mem"] = mem
            installed = install_wrappers(mr2.GPUModelRunner, gpu_worker.Worker, torch.cuda, mem)
            if args.memory_history:
                # Python stacks only: C++ unwinding would slow the timed phases.
                torch.cuda.memory._record_memory_history(stacks="python", max_entries=4_000_000)
                result["memory_history"] = args.memory_history

        # ---- engine ----------------------------------------------------
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
        else:
            # Read from the workers: no CUDA context is made in this process.
            ranks = collect_ranks(llm, args.plugin)
            result["ranks"] = ranks
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
        if args.tp > 1:
            # The runners live in the worker processes: rank 0's, as its worker read it.
            if result["ranks"]:
                result["resolved"].update(result["ranks"][0].get("resolved") or {})
        else:
            try:
                core = llm.llm_engine.engine_core.engine_core
                worker = core.model_executor.driver_worker.worker
                runner = worker.model_runner
                result["resolved"]["runner_class"] = (
                    f"{type(runner).__module__}.{type(runner).__name__}"
                )
                result["resolved"]["speculator_class"] = type(
                    getattr(runner, "speculator", None)
                ).__name__
                result["resolved"]["attn_backend"] = (
                    [g.backend.get_name() for gs in runner.attn_groups for g in gs]
                    if hasattr(runner, "attn_groups")
                    else None
                )
            except Exception as e:  # informational only
                result["resolved"]["introspect_error"] = repr(e)

            try:
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

        # ---- generate --------------------------------------------------
        result["stage"] = "generate"
        dump()  # keep the start-up figures even if generation is cut off

        def generate(
            requests: list[workloads.Request], sampling: dict[str, Any] | None = None
        ) -> list[list[int]]:
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

        try:
            shim = sys.modules.get("vllm._C_stable_libtorch")
            result["shim_calls"] = dict(getattr(shim, "CALLS", {}) or {})
            result["shim_active"] = bool(getattr(shim, "IS_SHIM", False))
        except Exception:
            pass
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
    finally:
        # Also for a run that stopped: often the one worth reading.
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
