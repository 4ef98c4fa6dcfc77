"""Patch for ``vllm.model_executor.layers.sparse_attn_indexer`` (vLLM 0.33.0).

vLLM does: with decode context parallelism (DCP world size N > 1) the sparse
attention indexer merges each rank's local top-K into the global one
(``_merge_dcp_topk_global``): it packs (score, index) candidates into
``[R, K, 2]`` float32, all-gathers them over the DCP group (the collective's
output ``[N*R, K, 2]`` and its candidate-major copy ``[R, N*K, 2]``, both live
while the copy is made) and selects in place; R is the rows of one indexer
chunk, at most the top-k buffer's rows (``max_num_batched_tokens``), K its
width. In the memory profile the indexer returns before the merge; its
profiling branch reserves the row-shard exchange's transient
(``_reserve_row_shard_exchange_transient``) but not the merge's.

This patch changes: that reservation also makes and drops the merge's
buffers, sized from the top-k buffer, when the DCP group has more than one
rank; with one rank it is vLLM's own.

Why: the merge runs on every sparse layer of every batch; its peak on the
largest batch is memory the KV cache must leave free.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from types import ModuleType

import torch

from vllm_specgraph.patches._patching import PatchSet
from vllm_specgraph.patches.model_executor.layers.attention.mla_attention import (
    Transient,
    profiling,
    reserve,
)

__all__ = ["install", "merge_transients"]


def merge_transients(rows: int, width: int, world_size: int) -> list:
    """The global top-K merge's transients for ``rows`` x ``width`` candidates."""
    if world_size <= 1 or rows <= 0:
        return []
    return [
        ("make", Transient("packed", (rows, width, 2), torch.float32)),
        ("make", Transient("gather_out", (world_size * rows, width, 2), torch.float32)),
        ("make", Transient("gathered", (rows, world_size * width, 2), torch.float32)),
        ("drop", "gather_out"),
    ]


def _wrap_reserve(indexer: ModuleType) -> Callable[[Callable], Callable]:
    def wrap(original: Callable) -> Callable:
        @functools.wraps(original)
        def _reserve_row_shard_exchange_transient(topk_indices_buffer, device):
            if profiling():
                world_size = indexer.get_dcp_group().world_size
                rows, width = topk_indices_buffer.shape[:2]
                steps = merge_transients(rows, width, world_size)
                reserve(steps, device, "the indexer's top-K merge")
            return original(topk_indices_buffer, device)

        return _reserve_row_shard_exchange_transient

    return wrap


def install(patches: PatchSet, sparse_attn_indexer: ModuleType) -> None:
    if not callable(getattr(sparse_attn_indexer, "get_dcp_group", None)):
        raise RuntimeError(
            f"vllm-specgraph cannot patch {sparse_attn_indexer.__name__}: it no longer "
            "imports get_dcp_group, which the top-K merge reservation reads; set "
            "VLLM_SPECGRAPH=0 for this vLLM"
        )
    patches.wrap(
        sparse_attn_indexer,
        "_reserve_row_shard_exchange_transient",
        _wrap_reserve(sparse_attn_indexer),
        parameters=("topk_indices_buffer", "device"),
    )
