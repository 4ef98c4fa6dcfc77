# SPDX-License-Identifier: Apache-2.0
"""vLLM's KV-cache budget as its worker computed it, and what the instance then
held beyond it.

vLLM 0.33.0 (``Worker.determine_available_memory``) sizes the KV cache as

    kv = requested - non_kv - graph_estimate_applied

``requested`` is ``ceil(total * gpu_memory_utilization)``, counted from the
worker's init snapshot (CUDA context, cuBLAS handles and NCCL are taken before
it); ``non_kv`` is what the profile run left taken plus the headroom of its
activation peak; ``graph_estimate_applied`` is what ``profile_cudagraph_memory``
returned, or 0 with ``VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=0``. Once
started, with the allocator cache emptied, the instance should hold at most
``requested - headroom`` more than at the snapshot: the headroom stays free for
the activation peak of a full step. What it holds beyond that (``over budget``)
is taken out of that headroom, and the first step that reaches the peak runs
out of memory when the GPU has no more than ``requested`` free.
"""

from __future__ import annotations

import os
from typing import Any

ESTIMATE_ENV = "VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS"

__all__ = ["ESTIMATE_ENV", "estimate_applied", "over_budget_bytes", "worker_budget"]


def estimate_applied(environ: dict[str, str] | None = None) -> bool:
    """Whether vLLM subtracts its graph estimate, read as ``vllm.envs`` reads it."""
    env = os.environ if environ is None else environ
    return bool(int(env.get(ESTIMATE_ENV, "1")))


def worker_budget(worker: Any, applied: bool) -> dict[str, int]:
    """The budget figures a vLLM worker kept after ``determine_available_memory``.

    Empty when the worker did not profile (``kv_cache_memory_bytes`` was set)."""
    snapshot = getattr(worker, "init_snapshot", None)
    needed = ("requested_memory", "peak_activation_memory", "available_kv_cache_memory_bytes")
    if snapshot is None or not all(hasattr(worker, name) for name in needed):
        return {}
    estimate = int(getattr(worker, "cudagraph_memory_estimate", 0))
    subtracted = estimate if applied else 0
    requested = int(worker.requested_memory)
    return {
        "init_free_bytes": int(snapshot.free_memory),
        "init_total_bytes": int(snapshot.total_memory),
        "requested_bytes": requested,
        "activation_headroom_bytes": int(worker.peak_activation_memory) - subtracted,
        "graph_estimate_applied_bytes": subtracted,
        "non_kv_bytes": requested - int(worker.available_kv_cache_memory_bytes) - subtracted,
    }


def over_budget_bytes(mem: dict[str, Any] | None) -> int | None:
    """What the started instance held beyond ``requested - headroom``, at rest."""
    mem = mem or {}
    keys = ("init_free_bytes", "free_at_rest_bytes", "requested_bytes", "activation_headroom_bytes")
    if not all(isinstance(mem.get(k), int) for k in keys):
        return None
    held = mem["init_free_bytes"] - mem["free_at_rest_bytes"]
    return held - (mem["requested_bytes"] - mem["activation_headroom_bytes"])
