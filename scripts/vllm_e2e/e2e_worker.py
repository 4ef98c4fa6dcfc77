# SPDX-License-Identifier: Apache-2.0
"""The measurement side of run_llm.py inside vLLM's worker processes (TP > 1).

At tensor parallelism > 1, vLLM 0.33's multiprocess executor runs one worker
process per rank, and the model runner lives there, out of reach of the wrappers
that run_llm.py would install in its own process. run_llm.py therefore passes
``worker_extension_cls="e2e_worker.E2EWorkerExtension"``: each worker imports
this module while it initialises (after ``load_general_plugins()``, so the
plugin has patched vLLM first, as in the TP=1 process) and vLLM adds the class
to the worker's bases. Then:

* ``init_worker_extension`` (vLLM calls it once the worker's device is set,
  before the model is loaded or memory is profiled) installs run_llm.py's own
  wrappers (``install_wrappers``) on the same classes, with this process's
  ``torch.cuda``, and the plugin's log tap. The figures go into a dict that is
  also written to ``$E2E_RANK_DIR/rank<N>.json`` whenever a figure is set, so a
  run that dies after its profile still has them.
* ``e2e_rank_record`` (through ``llm.collective_rpc``) returns the rank's
  figures: the wrappers' numbers (profile estimate, actual capture, bytes still
  taken after the profile, KV bytes, ...), the plugin's report
  (``runner.specgraph_profile.to_dict()``), its log lines, the stand-in op
  counts, the plugin's provenance and the environment the worker inherited.
* ``e2e_reinit_weights`` refills the weights the way run_llm.py does at TP=1,
  with shard-aware seeds (``run_llm.reinit_weights``).

Every name a vLLM worker class could have is avoided (vLLM asserts that), and
nothing here changes what vLLM computes.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import sys
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import run_llm  # noqa: E402  (this directory, made importable just above)

# What a worker inherited and how it was started; checked on the GPU machine.
WORKER_ENV_KEYS = (
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


class RankFigures(dict):
    """The wrappers' figures for this rank; each assignment is also written to
    ``path`` (if set), replacing the previous copy."""

    def __init__(self, rank: int, path: str | None) -> None:
        super().__init__()
        self.rank = rank
        self.path = path

    def __setitem__(self, key: str, value: Any) -> None:
        super().__setitem__(key, value)
        self.persist()

    def persist(self) -> None:
        """Best effort: a figure that cannot be written must not stop the engine
        (it is still read back through ``collective_rpc``)."""
        if not self.path:
            return
        tmp = self.path + ".tmp"
        try:
            with open(tmp, "w") as f:
                record = {"rank": self.rank, "pid": os.getpid(), "mem": dict(self)}
                json.dump(record, f, default=str)
            os.replace(tmp, self.path)
        except OSError as e:
            print(f"e2e_worker: cannot write {self.path}: {e!r}", file=sys.stderr, flush=True)


# Per process: one worker per process under the multiprocess executor.
STATE: dict[str, Any] = {"mem": None, "installed": None, "plugin_log": [], "cuda": None}


def install(rank: int, runner_cls: Any, worker_cls: Any, cuda: Any) -> RankFigures:
    """Install run_llm.py's wrappers once in this process; returns the figures."""
    if STATE["installed"] is not None:
        return STATE["mem"]
    rank_dir = os.environ.get(run_llm.RANK_DIR_ENV)
    mem = RankFigures(rank, os.path.join(rank_dir, f"rank{rank}.json") if rank_dir else None)
    mem.persist()  # the file says the worker got this far even before any figure
    STATE["mem"] = mem
    STATE["cuda"] = cuda
    STATE["installed"] = run_llm.install_wrappers(runner_cls, worker_cls, cuda, mem)
    return mem


def sharded_parameter_names(
    model: Any,
    split: tuple[type, ...] | None = None,
    split_weight_only: tuple[type, ...] | None = None,
) -> set[str]:
    """Names (as ``model.named_parameters()`` gives them) of the parameters that
    hold one rank's shard, in layers with more than one rank: every parameter of
    a ``split`` layer (default: vLLM's column-parallel linears and
    vocabulary-parallel embeddings and heads), and the weight of a
    ``split_weight_only`` layer (default: row-parallel linears, whose bias is
    whole on every rank)."""
    if split is None or split_weight_only is None:
        from vllm.model_executor.layers.linear import ColumnParallelLinear, RowParallelLinear
        from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

        split = (ColumnParallelLinear, VocabParallelEmbedding)
        split_weight_only = (RowParallelLinear,)
    shard_ids: set[int] = set()
    for _, module in model.named_modules():
        if getattr(module, "tp_size", 1) <= 1:
            continue
        if isinstance(module, split):
            shard_ids.update(id(p) for p in module.parameters(recurse=False))
        elif isinstance(module, split_weight_only):
            weight = getattr(module, "weight", None)
            if weight is not None:
                shard_ids.add(id(weight))
    return {name for name, p in model.named_parameters() if id(p) in shard_ids}


def _tp_rank(worker: Any) -> int:
    try:
        from vllm.distributed import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())
    except Exception:
        return int(getattr(worker, "rank", 0))


def _gpu(cuda: Any) -> dict[str, Any]:
    try:
        index = cuda.current_device()
        return {
            "index": index,
            "name": cuda.get_device_name(index),
            "total_bytes": cuda.mem_get_info()[1],
        }
    except Exception as e:
        return {"error": repr(e)}


def _resolved(runner: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    try:
        out["runner_class"] = f"{type(runner).__module__}.{type(runner).__name__}"
        out["speculator_class"] = type(getattr(runner, "speculator", None)).__name__
        out["attn_backend"] = (
            [g.backend.get_name() for gs in runner.attn_groups for g in gs]
            if hasattr(runner, "attn_groups")
            else None
        )
    except Exception as e:  # informational only
        out["introspect_error"] = repr(e)
    return out


class E2EWorkerExtension:
    """Mixed into vLLM's worker class by ``worker_extension_cls``."""

    def init_worker_extension(self) -> None:
        import torch
        from vllm.v1.worker import gpu_worker
        from vllm.v1.worker.gpu import model_runner as mr2

        # A forked worker inherits the launching process's tap (another class
        # object, from its __main__); one tap per process prints each line once.
        for name in run_llm.PLUGIN_LOGGERS:
            lg = logging.getLogger(name)
            for h in [h for h in lg.handlers if type(h).__name__ == "PluginLogTap"]:
                lg.removeHandler(h)
        run_llm.tap_plugin_logs(STATE["plugin_log"])
        install(int(getattr(self, "rank", 0)), mr2.GPUModelRunner, gpu_worker.Worker, torch.cuda)

    def e2e_rank_record(self, switch: str) -> dict[str, Any]:
        mem = STATE["mem"]
        runner = getattr(self, "model_runner", None)
        shim = sys.modules.get("vllm._C_stable_libtorch")
        env = {k: os.environ.get(k) for k in ("VLLM_PLUGINS", "VLLM_SPECGRAPH")}
        record: dict[str, Any] = {
            "rank": int(getattr(self, "rank", 0)),
            "tp_rank": _tp_rank(self),
            "local_rank": int(getattr(self, "local_rank", 0)),
            "pid": os.getpid(),
            "start_method": multiprocessing.get_start_method(allow_none=True),
            "env": {k: os.environ.get(k) for k in WORKER_ENV_KEYS},
            "gpu": _gpu(STATE["cuda"]) if STATE["cuda"] is not None else None,
            "mem": dict(mem) if mem is not None else None,
            "wrappers_intact": (
                run_llm.wrappers_intact(STATE["installed"]) if STATE["installed"] else None
            ),
            "plugin": run_llm.plugin_info(switch, env),
            "plugin_log": list(STATE["plugin_log"]),
            "resolved": _resolved(runner),
            "shim_calls": dict(getattr(shim, "CALLS", {}) or {}),
            "shim_active": bool(getattr(shim, "IS_SHIM", False)),
        }
        try:
            record["plugin_report"] = run_llm.plugin_report(runner)
        except Exception as e:
            record["plugin_report"] = {"error": repr(e)}
        return record

    def e2e_reinit_weights(self, std: float | str) -> dict[str, Any]:
        std = float(std)  # serve.py sends it through /collective_rpc as a string
        runner = self.model_runner
        tp_rank = _tp_rank(self)
        model = runner.model
        n, target_ptrs = run_llm.reinit_weights(
            model, std, tp_rank=tp_rank, sharded=sharded_parameter_names(model)
        )
        out: dict[str, Any] = {
            "rank": int(getattr(self, "rank", 0)),
            "tp_rank": tp_rank,
            "params": n,
            "spec_params": 0,
            "spec_model": False,
        }
        spec_model = getattr(getattr(runner, "speculator", None), "model", None)
        if spec_model is not None:
            n_spec, _ = run_llm.reinit_weights(
                spec_model,
                std,
                skip=target_ptrs,
                tp_rank=tp_rank,
                sharded=sharded_parameter_names(spec_model),
            )
            out["spec_params"] = n_spec
            out["spec_model"] = True
        return out
