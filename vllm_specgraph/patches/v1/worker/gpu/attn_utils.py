"""Patch for ``vllm.v1.worker.gpu.attn_utils`` (vLLM 0.33.0).

vLLM does: ``init_kv_cache`` calls ``allocate_kv_cache`` (imported by value from
``vllm.v1.worker.utils``), which backs every KV-cache tensor of the worker with
one zeroed allocation of the full size.

This patch changes: where capture-once is armed
(``VLLM_SPECGRAPH_PROFILE=capture-once``), that allocation is a reserved
virtual range backed only where warm-up and capture write
(:func:`~vllm_specgraph.patches._capture_once.reserved_kv_allocation`); vLLM
makes its views of it as it would. Elsewhere, vLLM's allocation.

Why: the graphs are captured against the KV cache's final addresses before its
memory exists, so the KV cache is backed with what they left, not an estimate.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from types import ModuleType

from vllm_specgraph.patches._capture_once import reserved_kv_allocation
from vllm_specgraph.patches._patching import PatchSet

__all__ = ["install"]


def _allocate_kv_cache(original: Callable) -> Callable:
    @functools.wraps(original)
    def allocate_kv_cache(kv_cache_config, device, *args, **kwargs):
        return reserved_kv_allocation(original, kv_cache_config, device, *args, **kwargs)

    return allocate_kv_cache


def install(patches: PatchSet, attn_utils: ModuleType) -> None:
    patches.wrap(
        attn_utils,
        "allocate_kv_cache",
        _allocate_kv_cache,
        parameters=("kv_cache_config", "device", "layout", "kernel_block_sizes"),
    )
