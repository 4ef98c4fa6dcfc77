# SPDX-License-Identifier: Apache-2.0
"""Offline vLLM 0.33.0 run on a tiny dummy-weight Llama: Model Runner V2, FULL
CUDA graphs, optional speculator. One case per process.

    python run_llm.py --case base|draft|ngram --out result.json

Prompts are token ids (no tokenizer), weights are vLLM's deterministic dummy
weights (``load_format="dummy"``), so every process builds the same model and
greedy outputs can be compared across processes.

The only things this script changes inside vLLM are measurement wrappers
(they call the original method and read ``torch.cuda.mem_get_info`` around
it); vLLM's own log lines are printed as usual.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "1")
os.environ.setdefault("VLLM_PLUGINS", "")  # no third-party plugins in this run
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "INFO")
os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")  # flashinfer is not carried
os.environ.setdefault("TVM_FFI_DISABLE_TORCH_C_DLPACK", "1")

MiB = 1 << 20


def reinit_weights(model, std: float) -> int:
    """Refill every parameter in place with seeded N(0, std) values (norm
    weights: 1.0), seeded by parameter name. vLLM's dummy loader fills every
    same-shaped tensor with the same +-1e-3 values, which makes greedy output
    one repeated token per prompt; this gives a non-degenerate model. The
    target is identical in every process, and the 1-layer draft shares the
    target's embedding, first layer and head (same names), so it agrees with
    the target often but not always. In place: captured CUDA graphs keep
    reading the same addresses."""
    import zlib

    import torch

    n = 0
    with torch.inference_mode():
        for name, p in model.named_parameters():
            if not p.is_floating_point():
                continue
            if name.endswith("norm.weight"):
                p.data.fill_(1.0)
            else:
                g = torch.Generator(device=p.device)
                g.manual_seed(zlib.crc32(name.encode()))
                p.data.normal_(0.0, std, generator=g)
            n += 1
    torch.cuda.synchronize()
    return n


def prompts_token_ids(n: int, vocab: int) -> list[list[int]]:
    """Deterministic prompts; the later ones repeat a pattern so that the
    n-gram speculator finds matches."""
    out = []
    for i in range(n):
        if i % 2 == 0:
            ids = [(7 + 31 * i + 13 * j) % (vocab - 2) + 1 for j in range(12 + 3 * i)]
        else:
            pat = [(11 * i + 5 * j) % (vocab - 2) + 1 for j in range(6)]
            ids = pat * 4
        out.append(ids)
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--case", choices=["base", "draft", "ngram"], required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default=os.path.join(REPO, "configs", "tiny-llama"))
    ap.add_argument("--draft", default=os.path.join(REPO, "configs", "tiny-llama-draft"))
    ap.add_argument("--num-spec", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--num-prompts", type=int, default=6)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--gpu-mem-util", type=float, default=0.1)
    ap.add_argument("--cudagraph-mode", default="FULL")
    ap.add_argument(
        "--reinit-std",
        type=float,
        default=0.05,
        help="re-randomise weights after start-up (0: keep vLLM's dummy weights)",
    )
    args = ap.parse_args()

    result: dict = {"case": args.case, "ok": False, "stage": "import"}

    def dump():
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1, default=str)

    try:
        import torch

        result["torch"] = torch.__version__
        t0 = time.time()
        import vllm
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt

        result["vllm"] = vllm.__version__
        result["import_s"] = round(time.time() - t0, 1)

        # ---- measurement wrappers (call through to vLLM's own code) -------
        from vllm.v1.worker import gpu_worker
        from vllm.v1.worker.gpu import model_runner as mr2

        mem: dict = {}
        result["mem"] = mem

        def drv_used() -> int:
            torch.cuda.synchronize()
            free, total = torch.cuda.mem_get_info()
            return total - free

        orig_prof = mr2.GPUModelRunner.profile_cudagraph_memory

        def prof_wrapper(self):
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            b_used = drv_used()
            b_res = torch.cuda.memory_reserved()
            est = orig_prof(self)
            a_used = drv_used()
            a_res = torch.cuda.memory_reserved()
            torch.cuda.empty_cache()
            a2_used = drv_used()
            mem["profile_estimate_bytes"] = int(est)
            mem["profile_driver_used_before"] = b_used
            mem["profile_driver_left_taken"] = a_used - b_used
            mem["profile_driver_left_taken_after_empty_cache"] = a2_used - b_used
            mem["profile_allocator_reserved_delta"] = a_res - b_res
            return est

        mr2.GPUModelRunner.profile_cudagraph_memory = prof_wrapper

        orig_cap = mr2.GPUModelRunner.capture_model

        def cap_wrapper(self, *a, **kw):
            if kw.get("profile_only"):
                return orig_cap(self, *a, **kw)
            b_used = drv_used()
            b_res = torch.cuda.memory_reserved()
            actual = orig_cap(self, *a, **kw)
            mem["capture_actual_bytes"] = int(actual)
            mem["capture_driver_delta"] = drv_used() - b_used
            mem["capture_allocator_reserved_delta"] = torch.cuda.memory_reserved() - b_res
            return actual

        mr2.GPUModelRunner.capture_model = cap_wrapper

        orig_dam = gpu_worker.Worker.determine_available_memory

        def dam_wrapper(self):
            r = orig_dam(self)
            mem["kv_cache_bytes"] = int(r)
            mem["worker_cudagraph_memory_estimate"] = int(
                getattr(self, "cudagraph_memory_estimate", -1)
            )
            return r

        gpu_worker.Worker.determine_available_memory = dam_wrapper

        # ---- engine ----------------------------------------------------
        with open(os.path.join(args.model, "config.json")) as f:
            vocab = json.load(f)["vocab_size"]

        spec = None
        if args.case == "draft":
            spec = {
                "method": "draft_model",
                "model": args.draft,
                "num_speculative_tokens": args.num_spec,
            }
        elif args.case == "ngram":
            spec = {
                "method": "ngram",
                "num_speculative_tokens": args.num_spec,
                "prompt_lookup_min": 2,
                "prompt_lookup_max": 4,
            }

        kw = dict(
            model=args.model,
            skip_tokenizer_init=True,
            load_format="dummy",
            dtype=args.dtype,
            seed=0,
            max_model_len=256,
            max_num_seqs=8,
            max_num_batched_tokens=512,
            gpu_memory_utilization=args.gpu_mem_util,
            enforce_eager=False,
            enable_prefix_caching=False,
            attention_config={"backend": "TRITON_ATTN"},
            compilation_config={
                "mode": 0,  # CompilationMode.NONE: no dynamo/inductor on torch 2.11
                "cudagraph_mode": args.cudagraph_mode,
                "custom_ops": ["none"],
                "cudagraph_capture_sizes": [1, 2, 4, 8, 16, 32],
            },
            kernel_config={
                "ir_op_priority": {
                    "rms_norm": ["native"],
                    "fused_add_rms_norm": ["native"],
                }
            },
            speculative_config=spec,
            disable_log_stats=False,  # keep spec-decode counters for get_metrics()
        )
        result["llm_kwargs"] = kw
        result["stage"] = "init"
        dump()
        t0 = time.time()
        llm = LLM(**kw)
        result["init_s"] = round(time.time() - t0, 1)

        vc = llm.llm_engine.vllm_config
        result["resolved"] = {
            "use_v2_model_runner": vc.use_v2_model_runner,
            "cudagraph_mode": str(vc.compilation_config.cudagraph_mode),
            "compilation_mode": str(vc.compilation_config.mode),
            "capture_sizes": vc.compilation_config.cudagraph_capture_sizes,
            "num_gpu_blocks": vc.cache_config.num_gpu_blocks,
            "spec_method": vc.speculative_config.method if vc.speculative_config else None,
        }
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
            runner = None
            result["resolved"]["introspect_error"] = repr(e)

        if args.reinit_std > 0:
            n = reinit_weights(runner.model, args.reinit_std)
            spec_model = getattr(getattr(runner, "speculator", None), "model", None)
            if spec_model is not None:
                n += reinit_weights(spec_model, args.reinit_std)
            result["reinit_params"] = n

        # ---- generate --------------------------------------------------
        result["stage"] = "generate"
        dump()  # keep the start-up figures even if generation is cut off
        prompts = [
            TokensPrompt(prompt_token_ids=p) for p in prompts_token_ids(args.num_prompts, vocab)
        ]
        sp = SamplingParams(
            temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True, detokenize=False
        )
        t0 = time.time()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        result["generate_s"] = round(time.time() - t0, 2)
        result["tokens"] = [list(o.outputs[0].token_ids) for o in outs]

        try:
            metrics = llm.get_metrics()
            sd = {}
            for m in metrics:
                if "spec_decode" in m.name:
                    v = getattr(m, "value", None)
                    if v is None:
                        v = getattr(m, "values", None)
                    sd[m.name] = v
            result["spec_metrics"] = sd
        except Exception as e:
            result["spec_metrics"] = {"error": repr(e)}

        try:
            shim = sys.modules.get("vllm._C_stable_libtorch")
            result["shim_calls"] = dict(getattr(shim, "CALLS", {}) or {})
            result["shim_active"] = bool(getattr(shim, "IS_SHIM", False))
        except Exception:
            pass
        result["ok"] = True
        result["stage"] = "done"
        dump()
        return 0
    except BaseException as e:
        result["error"] = repr(e)
        result["traceback"] = traceback.format_exc()
        traceback.print_exc()
        dump()
        return 1


if __name__ == "__main__":
    rc = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)  # skip slow/fragile interpreter teardown of engine threads
