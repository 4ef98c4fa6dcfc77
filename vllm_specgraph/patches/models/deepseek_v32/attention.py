"""Patch for ``vllm.models.deepseek_v32.attention`` (vLLM 0.33.0).

vLLM does: ``DeepseekV32Attention`` (the DeepSeek-V3.2 sparse MLA layer) runs
its own decode path in ``_sparse_indexer_and_attn``: with decode context
parallelism it gathers the query heads of every DCP rank, runs the sparse
decode kernel over all heads and combines the partial outputs, the same
transients as the generic MLA layer's. Without attention metadata (the memory
profile) it returns before any of them, reserving nothing.

This patch changes: in that case, when the layer has a DCP manager, the
decode path's transients are made and dropped first, as
:mod:`vllm_specgraph.patches.model_executor.layers.attention.mla_attention`
lists and sizes them, for every token of the dummy batch: a prefill longer than
the indexer's top-k takes this path with the whole batch.

Why: the same as for the generic layer: the profile's peak must hold what the
first long batch needs, or the KV cache is sized into it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from types import ModuleType

from vllm_specgraph.patches._patching import PatchSet
from vllm_specgraph.patches.model_executor.layers.attention.mla_attention import (
    decode_transients,
    profiling,
    reserve,
)

__all__ = ["install"]


def _wrap_sparse_indexer_and_attn(original: Callable) -> Callable:
    @functools.wraps(original)
    def _sparse_indexer_and_attn(self, positions, q_c, *args, **kwargs):
        # Not every layer vLLM builds (or its tests build) has a DCP manager.
        if getattr(self, "dcp_manager", None) is not None:
            from vllm.forward_context import get_forward_context

            if profiling(get_forward_context().attn_metadata):
                steps = decode_transients(self, q_c.size(0), q_c.dtype, with_ql_nope=False)
                reserve(steps, q_c.device, "the sparse MLA decode path")
        return original(self, positions, q_c, *args, **kwargs)

    return _sparse_indexer_and_attn


def install(patches: PatchSet, attention: ModuleType) -> None:
    patches.wrap(
        attention.DeepseekV32Attention,
        "_sparse_indexer_and_attn",
        _wrap_sparse_indexer_and_attn,
        parameters=("positions", "q_c"),
    )
