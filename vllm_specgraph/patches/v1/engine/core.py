"""Patch for ``vllm.v1.engine.core`` (vLLM 0.33.0).

vLLM does: ``EngineCore._initialize_kv_caches`` sizes the KV cache from the
workers' available memory, gives the scheduler that many blocks, logs the
capacity (``update_kv_cache_capacity``, imported by value), then has the
workers allocate, warm up and capture.

This patch changes: with ``VLLM_SPECGRAPH_PROFILE=capture-once``, the capacity
is stored and logged only after the workers have backed their KV caches: the
scheduler gets the fewest blocks any worker backed
(:func:`~vllm_specgraph.patches._capture_once.backed_kv_blocks`); a
``max_model_len`` those no longer hold stops start-up with an error naming
both. Where no worker ran capture-once (it fell back), vLLM's order and numbers.

Why: under capture-once the KV cache is backed after the production capture,
with what the graphs left, so the block count is known only then.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from types import ModuleType

from vllm_specgraph.patches._capture_once import backed_kv_blocks
from vllm_specgraph.patches._patching import PatchSet
from vllm_specgraph.switches import current_switches

__all__ = ["install"]


def _initialize_kv_caches(core: ModuleType) -> Callable[[Callable], Callable]:
    def wrap(original: Callable) -> Callable:
        @functools.wraps(original)
        def _initialize_kv_caches(self, vllm_config):
            if current_switches().profile != "capture-once":
                return original(self, vllm_config)
            shipped = core.update_kv_cache_capacity
            held: list[tuple] = []
            core.update_kv_cache_capacity = lambda *args: held.append(args)
            try:
                scheduler_kv_cache_config = original(self, vllm_config)
            finally:
                core.update_kv_cache_capacity = shipped
            backed = self.collective_rpc(backed_kv_blocks)
            if all(count is None for count in backed):
                for args in held:
                    shipped(*args)
                return scheduler_kv_cache_config
            if any(count is None for count in backed):
                raise RuntimeError(
                    f"capture-once ran on some workers and not on others (blocks backed per "
                    f"worker: {backed}); set VLLM_SPECGRAPH_PROFILE=exact"
                )
            _shrink(vllm_config, scheduler_kv_cache_config, min(backed))
            if held:  # vLLM logs it only where the model has KV cache groups
                shipped(vllm_config, scheduler_kv_cache_config)
            return scheduler_kv_cache_config

        return _initialize_kv_caches

    return wrap


def _shrink(vllm_config, scheduler_kv_cache_config, num_blocks: int) -> None:
    from vllm.v1.core.kv_cache_utils import get_kv_cache_capacity

    sized = scheduler_kv_cache_config.num_blocks
    scheduler_kv_cache_config.num_blocks = num_blocks
    tokens, _ = get_kv_cache_capacity(vllm_config, scheduler_kv_cache_config)
    max_model_len = vllm_config.model_config.max_model_len
    if tokens < max_model_len:
        scheduler_kv_cache_config.num_blocks = sized
        raise ValueError(
            f"capture-once backed {num_blocks} KV blocks ({tokens} tokens) once the graphs "
            f"were captured, fewer than max_model_len={max_model_len} needs; lower "
            "max_model_len or raise gpu_memory_utilization"
        )
    vllm_config.cache_config.num_gpu_blocks = num_blocks


def install(patches: PatchSet, core: ModuleType) -> None:
    patches.wrap(
        core.EngineCore,
        "_initialize_kv_caches",
        _initialize_kv_caches(core),
        parameters=("vllm_config",),
    )
