"""``make demo`` with vLLM: offline vLLM 0.33 with a draft-model speculator on the
tiny dummy-weight Llama, with vllm-specgraph on and, for vLLM's own estimate,
off; prints the CUDA-graph memory report and the generated tokens.

    python -m vllm_specgraph.demo.vllm_demo [--configs DIR] [--no-compare] [--out-dir DIR]

Each engine runs in its own child process (``--child on|off``), so each starts
on a GPU that holds nothing of the other; the engine core runs in that process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so the child reads the worker's
figures and the plugin's report (``runner.specgraph_profile``) through
``LLM.collective_rpc``. The parent prints the report from the children's JSON
records. The engine settings need no compiled vLLM op (Triton attention, native
layers, no torch.compile), so the same demo runs on a GPU machine without a vLLM
install: ``MODE=demo bash scripts/device-vllm-e2e.sh``.

*Requires*: CUDA and vLLM 0.33.x importable. The model configs ship with the package.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
import zlib
from typing import Any

__all__ = ["child_env", "engine_kwargs", "format_report", "main", "over_budget_bytes"]

_MIB = 1 << 20
NUM_SPECULATIVE_TOKENS = 3
CAPTURE_SIZES = [1, 2, 4, 8, 16, 32]
PLUGIN_GROUP, PLUGIN_NAME = "vllm.general_plugins", "specgraph"
_DEFAULT_CONFIGS = os.path.join(os.path.dirname(__file__), "configs")  # package data


def child_env(switch: str) -> dict[str, str]:
    """Environment of a child engine; set before vLLM is imported."""
    if switch not in ("on", "off"):
        raise ValueError(f"switch must be 'on' or 'off', got {switch!r}")
    return {
        "VLLM_USE_V2_MODEL_RUNNER": "1",  # the plugin acts on Model Runner V2
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # the engine core in this process
        "VLLM_PLUGINS": PLUGIN_NAME,
        "VLLM_SPECGRAPH": "1" if switch == "on" else "0",
    }


def engine_kwargs(configs: str, gpu_memory_utilization: float) -> dict[str, Any]:
    """``LLM(...)`` arguments: tiny Llama target, 1-layer draft, FULL graphs."""
    return {
        "model": os.path.join(configs, "tiny-llama"),
        "skip_tokenizer_init": True,
        "load_format": "dummy",
        "dtype": "float32",
        "seed": 0,
        "max_model_len": 256,
        "max_num_seqs": 8,
        "max_num_batched_tokens": 512,
        "gpu_memory_utilization": gpu_memory_utilization,
        "enable_prefix_caching": False,
        "attention_config": {"backend": "TRITON_ATTN"},
        "compilation_config": {
            "mode": 0,  # no torch.compile
            "cudagraph_mode": "FULL",
            "custom_ops": ["none"],
            "cudagraph_capture_sizes": CAPTURE_SIZES,
        },
        "kernel_config": {
            "ir_op_priority": {"rms_norm": ["native"], "fused_add_rms_norm": ["native"]}
        },
        "speculative_config": {
            "method": "draft_model",
            "model": os.path.join(configs, "tiny-llama-draft"),
            "num_speculative_tokens": NUM_SPECULATIVE_TOKENS,
        },
        "disable_log_stats": False,  # spec-decode counters for get_metrics()
    }


def prompts(vocab: int, num_prompts: int = 6) -> list[list[int]]:
    """Token-id prompts (no tokenizer); ids in [1, vocab - 2]."""
    return [
        [(7 + 31 * i + 13 * j) % (vocab - 2) + 1 for j in range(12 + 3 * i)]
        for i in range(num_prompts)
    ]


def refill_weights(worker: Any, std: float = 0.05) -> int:
    """``collective_rpc`` target: refill the target's and the draft's weights in
    place, seeded by parameter name (norms: 1). vLLM's dummy weights make greedy
    output one token repeated; a draft sharing the target's names then agrees
    with it often but not always. Returns the parameters refilled."""
    import torch

    runner = worker.model_runner
    models = [runner.model, getattr(getattr(runner, "speculator", None), "model", None)]
    seen: set[int] = set()
    count = 0
    with torch.inference_mode():
        for model in filter(None, models):
            for name, p in model.named_parameters():
                if not p.is_floating_point() or p.data_ptr() in seen:
                    continue
                seen.add(p.data_ptr())
                if name.endswith("norm.weight"):
                    p.data.fill_(1.0)
                else:
                    g = torch.Generator(device=p.device).manual_seed(zlib.crc32(name.encode()))
                    p.data.normal_(0.0, std, generator=g)
                count += 1
    return count


def worker_record(worker: Any) -> dict[str, Any]:
    """``collective_rpc`` target, called at rest after start-up: vLLM's memory
    budget as the worker kept it, the free memory now, the plugin's report."""
    import torch

    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    estimate = int(getattr(worker, "cudagraph_memory_estimate", 0))
    applied = (
        estimate if os.environ.get("VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS", "1") != "0" else 0
    )
    report = getattr(worker.model_runner, "specgraph_profile", None)
    return {
        "graph_estimate_bytes": estimate,
        "init_free_bytes": int(worker.init_snapshot.free_memory),
        "requested_bytes": int(worker.requested_memory),
        "activation_headroom_bytes": int(worker.peak_activation_memory) - applied,
        "free_at_rest_bytes": int(torch.cuda.mem_get_info()[0]),
        "plugin_report": None if report is None else report.to_dict(),
    }


def over_budget_bytes(record: dict[str, Any]) -> int:
    """What the started engine held beyond vLLM's limit minus its activation headroom."""
    held = record["init_free_bytes"] - record["free_at_rest_bytes"]
    return held - (record["requested_bytes"] - record["activation_headroom_bytes"])


def _arm_plugin() -> str:
    """Load the plugin as vLLM does; arm it directly when it is not installed."""
    from importlib.metadata import entry_points

    from vllm.plugins import load_general_plugins

    if entry_points(group=PLUGIN_GROUP, name=PLUGIN_NAME):
        load_general_plugins()
        return "entry point"
    import vllm_specgraph

    vllm_specgraph.register()
    return "vllm_specgraph.register() (not installed as a package)"


def run_child(switch: str, out: str, configs: str, gpu_memory_utilization: float) -> None:
    """One engine: start it, read its figures, generate, write ``out``."""
    os.environ.update(child_env(switch))
    record: dict[str, Any] = {"switch": switch, "plugin_loaded_by": _arm_plugin()}
    from vllm import LLM, SamplingParams, __version__
    from vllm.inputs import TokensPrompt

    record["vllm"] = __version__
    started = time.perf_counter()
    llm = LLM(**engine_kwargs(configs, gpu_memory_utilization))
    record["startup_s"] = round(time.perf_counter() - started, 2)
    llm.collective_rpc(refill_weights)
    record |= llm.collective_rpc(worker_record)[0]
    cache = llm.llm_engine.vllm_config.cache_config
    record["kv_tokens"] = int(cache.num_gpu_blocks) * int(cache.block_size)
    with open(os.path.join(configs, "tiny-llama", "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, detokenize=False)
    requests = [TokensPrompt(prompt_token_ids=p) for p in prompts(vocab)]
    outs = llm.generate(requests, params, use_tqdm=True)  # a progress bar
    record["tokens"] = [list(o.outputs[0].token_ids) for o in outs]
    counters = {m.name: getattr(m, "value", None) for m in llm.get_metrics()}
    drafted = counters.get("vllm:spec_decode_num_draft_tokens")
    accepted = counters.get("vllm:spec_decode_num_accepted_tokens")
    record["acceptance_rate"] = (
        round(accepted / drafted, 4) if drafted and accepted is not None else None
    )
    with open(out, "w") as f:
        json.dump(record, f, indent=1)


def _mib(x: float | None, sign: bool = False) -> str:
    if x is None:
        return "-"
    return f"{x / _MIB:+.1f} MiB" if sign else f"{x / _MIB:.1f} MiB"


def _owners(owners: list[dict[str, Any]] | None) -> str:
    if not owners:
        return ""
    return ": " + ", ".join(f"{o['owner']} {o['driver_bytes'] / _MIB:.1f}" for o in owners)


def format_report(on: dict[str, Any], off: dict[str, Any] | None = None) -> str:
    """The memory report of the plugin-on run, next to the plugin-off run if given."""
    report = on.get("plugin_report") or {}
    estimate = report.get("estimate") or {}
    owners = estimate.get("owners")
    graphs = sum(o["driver_bytes"] for o in owners) if owners else None
    actual = report.get("actual")
    taken = sum(o["driver_bytes"] for o in actual) if actual else None
    capture_s = report.get("capture_wall_seconds")
    profile_s = estimate.get("wall_seconds")
    side = off or {}

    def row(label: str, left: str, right: str) -> str:
        return f"{label:<44}{left:>16}   {right}"

    lines = [
        f"vLLM {on.get('vllm')}, Model Runner V2, FULL CUDA graphs at {len(CAPTURE_SIZES)} "
        f"sizes; tiny Llama (fp32) with a 1-layer draft model, {NUM_SPECULATIVE_TOKENS} "
        "speculative tokens; dummy weights refilled by name; greedy",
        row("", "vLLM alone" if off else "", "with vllm-specgraph"),
        row(
            "graph memory subtracted from the KV budget",
            _mib(side.get("graph_estimate_bytes")),
            _mib(on.get("graph_estimate_bytes")),
        ),
        row("  the plugin's graph estimate, per owner", "", _mib(graphs) + _owners(owners)),
        row(
            "  the profile left taken: one-time; retained",
            "",
            f"{_mib(estimate.get('one_time_bytes'))}; {_mib(estimate.get('retained_bytes'))}",
        ),
        row("graphs taken by the production capture", "", _mib(taken) + _owners(actual)),
        row(
            "held beyond the memory budget at rest",
            _mib(over_budget_bytes(off), sign=True) if off else "",
            _mib(over_budget_bytes(on), sign=True),
        ),
        row("KV cache tokens", f"{side['kv_tokens']:,}" if off else "", f"{on['kv_tokens']:,}"),
        row(
            "start-up (LLM constructor, kernels compiled)",
            f"{side['startup_s']:.1f} s" if off else "",
            f"{on['startup_s']:.1f} s",
        ),
        row(
            "profile / production capture",
            "",
            "-"
            if profile_s is None or capture_s is None
            else f"{profile_s:.2f} s / {capture_s:.2f} s",
        ),
        row(
            "draft acceptance rate",
            str(side.get("acceptance_rate")) if off else "",
            str(on.get("acceptance_rate")),
        ),
    ]
    if off:
        lines.append(f"greedy tokens equal, plugin off and on: {off['tokens'] == on['tokens']}")
    lines.append("generated token ids (plugin on), first 12 of the first 3 prompts:")
    lines += [f"  {tokens[:12]}" for tokens in on["tokens"][:3]]
    if off:
        lines += ["", *takeaways(on, off)]
    return "\n".join(lines)


def takeaways(on: dict[str, Any], off: dict[str, Any]) -> list[str]:
    """The lines a user should take from the report: memory, start-up, outputs."""
    actual = (on.get("plugin_report") or {}).get("actual")
    taken = sum(o["driver_bytes"] for o in actual) if actual else None
    return [
        f"* Graph memory: vLLM budgeted {_mib(off.get('graph_estimate_bytes'))}, the plugin "
        f"{_mib(on.get('graph_estimate_bytes'))}, for {_mib(taken)} the graphs took; at rest "
        f"the engine held {_mib(over_budget_bytes(off), sign=True)} beyond its memory budget "
        f"without the plugin, {_mib(over_budget_bytes(on), sign=True)} with it.",
        f"* Start-up, both engines after a warm-up engine compiled the kernels: "
        f"{off['startup_s']:.1f} s without the plugin, {on['startup_s']:.1f} s with it "
        "(its exact profile captures every graph once more).",
        f"* Outputs: greedy tokens {'equal' if off['tokens'] == on['tokens'] else 'DIFFER'} "
        "with the plugin off and on.",
    ]


def _missing_requirements(configs: str) -> str | None:
    """Why the demo cannot run here, naming what to do instead; None if it can."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        import torch
    except ImportError:
        return "the vLLM demo needs torch with CUDA; found no torch"
    if not torch.cuda.is_available():
        return f"the vLLM demo needs a CUDA GPU; torch {torch.__version__} sees none"
    try:
        found = version("vllm")
    except PackageNotFoundError:
        return (
            "the vLLM demo needs vLLM 0.33.x importable; on a GPU machine without a vLLM "
            "install run it through the end-to-end harness: MODE=demo bash "
            "scripts/device-vllm-e2e.sh (or make demo-e2e)"
        )
    if not found.startswith("0.33"):
        return f"the vLLM demo needs vLLM 0.33.x; found {found}"
    if not os.path.exists(os.path.join(configs, "tiny-llama", "config.json")):
        return f"no tiny-llama config under {configs}; pass --configs a folder that holds one"
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default=_DEFAULT_CONFIGS, help="this repository's configs/")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.1)
    ap.add_argument("--no-compare", action="store_true", help="skip the plugin-off engine")
    ap.add_argument("--out-dir", help="where the engines' records go (default: a temp dir)")
    ap.add_argument("--child", choices=("on", "off"), help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    configs = os.path.abspath(args.configs)
    if args.child:
        run_child(args.child, args.out, configs, args.gpu_memory_utilization)
        return 0
    problem = _missing_requirements(configs)
    if problem:
        print(problem, file=sys.stderr)
        return 2
    out_dir = args.out_dir or tempfile.mkdtemp(prefix="vllm-specgraph-demo-")
    os.makedirs(out_dir, exist_ok=True)
    records: dict[str, dict[str, Any]] = {}
    # The first engine on a machine compiles the Triton kernels (tens of seconds);
    # a warm-up engine takes that, so the two compared start alike.
    runs = (
        (("on", "on"),) if args.no_compare else (("warm-up", "off"), ("on", "on"), ("off", "off"))
    )
    for name, switch in runs:
        path = os.path.join(out_dir, f"{name}.json")
        print(f"==> vLLM with vllm-specgraph {switch} ({name}), in a child process", flush=True)
        child_argv = [sys.executable, "-m", "vllm_specgraph.demo.vllm_demo", "--child", switch]
        child_argv += ["--out", path, "--configs", configs]
        child_argv += ["--gpu-memory-utilization", str(args.gpu_memory_utilization)]
        rc = subprocess.run(child_argv, check=False).returncode
        if rc != 0 or not os.path.exists(path):
            print(f"the engine with the plugin {switch} failed (exit {rc})", file=sys.stderr)
            return 1
        with open(path) as f:
            records[name] = json.load(f)
    print(format_report(records["on"], records.get("off")), flush=True)
    off = records.get("off")
    return 0 if off is None or off["tokens"] == records["on"]["tokens"] else 1


if __name__ == "__main__":
    sys.exit(main())
