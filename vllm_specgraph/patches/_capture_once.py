"""Capture once: the KV cache is backed after the production graphs exist, not before.

``VLLM_SPECGRAPH_PROFILE=capture-once`` makes start-up run in this order, with
no disposable capture:

1. The graph-memory profile captures nothing and returns 0, so vLLM sizes the
   KV cache for the most blocks the GPU could hold without graphs
   (:func:`plan_capture_once`, from the ``cudagraph_utils`` patch).
2. ``allocate_kv_cache`` lays the KV cache over a reserved virtual range of that
   size, backed only where warm-up and capture write (:func:`reserved_kv_allocation`,
   from the ``attn_utils`` patch); vLLM makes its per-layer views as it would.
3. Warm-up and the production capture run as shipped; the capture is measured per
   owner (the ``model_runner`` patch).
4. What the GPU gave since the plan, less the KV pages, is what the runner's
   state made after vLLM's memory profile (the speculator's attention state, block
   tables), warm-up and the graphs took; the KV cache is backed up to the worker's
   KV budget less that (:func:`back_within_budget`, from the ``gpu_worker`` patch).
5. The engine core gives the scheduler the fewest blocks any worker backed
   (:func:`backed_kv_blocks`, from the ``engine.core`` patch).

Where it cannot apply, :func:`capture_once_blocker` says why before the KV cache
is sized, and the exact profile runs instead.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from vllm_specgraph.meter import OwnerMemory, describe_owners, settled_free_bytes
from vllm_specgraph.reserve import BlockBacking, ReservedRange, StridedPlacement

__all__ = [
    "CAPTURE_ONCE_BACKENDS",
    "CaptureOnceOutcome",
    "abandon_plan",
    "back_within_budget",
    "backed_kv_blocks",
    "capture_once_blocker",
    "plan_capture_once",
    "planned_runner",
    "record_graphs",
    "reserved_kv_allocation",
    "warmup_blocks",
]

logger = logging.getLogger("vllm.specgraph")

_MIB = 1 << 20

CAPTURE_ONCE_BACKENDS = frozenset({"TRITON_ATTN", "FLASH_ATTN"})
"""Attention backends whose capture-time state does not depend on the block count."""


@dataclass(frozen=True)
class CaptureOnceOutcome:
    """What capture-once backed on one worker (bytes at driver level)."""

    max_blocks: int  # what the reserved range holds: the KV cache sized without graphs
    num_blocks: int  # backed, what the scheduler may use
    reserved_bytes: int
    mapped_bytes: int  # of KV pages, at the end
    taken_bytes: int  # given out since the plan beside the KV pages: state, warm-up, graphs
    budget_bytes: int  # the worker's KV budget less taken_bytes
    seconds: float  # backing and zeroing
    graphs: tuple[OwnerMemory, ...] = ()  # the production capture, per owner


@dataclass
class _Plan:
    runner: Any
    free_before: int
    backing: BlockBacking | None = None
    graphs: tuple[OwnerMemory, ...] = ()


_plan: _Plan | None = None


def capture_once_blocker(runner: Any) -> str | None:
    """Why capture-once cannot run for ``runner``, or None where it can.

    Decided before the KV cache is sized: after that, the KV cache is sized
    without graphs and there is no way back.
    """
    from vllm import envs
    from vllm.config import get_layers_from_vllm_config
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    try:
        import cuda.bindings.driver  # noqa: F401
    except ImportError:
        return "NVIDIA's cuda-bindings package is not installed (pip install cuda-bindings)"
    config = runner.vllm_config
    ranks = config.parallel_config.world_size_across_dp
    if ranks > 1:
        return f"it runs on one GPU only so far, and this engine has {ranks} ranks"
    if config.model_config.enable_sleep_mode:
        return "sleep mode keeps the KV cache in its own cuMem pool"
    if config.kv_transfer_config is not None:
        return "a KV connector registers or provides the KV cache's memory"
    if config.attention_config.hisparse_config is not None:
        return "HiSparse keeps part of the KV cache in host memory"
    if not envs.VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS:
        return "VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=0 leaves graphs out of the KV budget"
    specs = runner.get_kv_cache_spec()
    if not specs:
        return "the model has no KV cache"
    odd = sorted({type(s).__name__ for s in specs.values() if type(s) is not FullAttentionSpec})
    if odd:
        return f"its KV cache has layers other than full attention ({', '.join(odd)})"
    layers = get_layers_from_vllm_config(config, AttentionLayerBase, specs)
    backends = {layer.get_attn_backend().get_name() for layer in layers.values()}
    if backends - CAPTURE_ONCE_BACKENDS:
        return (
            f"attention backend {', '.join(sorted(backends - CAPTURE_ONCE_BACKENDS))} may size "
            f"capture-time state by the block count (it supports {sorted(CAPTURE_ONCE_BACKENDS)})"
        )
    return None


def plan_capture_once(runner: Any) -> None:
    """Arm capture-once for ``runner``: the next KV allocation is laid over a reserved range.

    Called where vLLM's memory profile has just measured what the KV budget leaves
    out; the free memory read here is what everything the runner makes from now on
    besides the KV pages is counted against.
    """
    global _plan
    _plan = _Plan(runner, settled_free_bytes(runner.device))


def planned_runner() -> Any:
    """The runner capture-once is armed for and has not backed yet, or None."""
    return None if _plan is None else _plan.runner


def record_graphs(owners: tuple[OwnerMemory, ...]) -> None:
    """What the production capture took, per owner, for the outcome and the log line."""
    if _plan is not None:
        _plan.graphs = owners


def warmup_blocks(runner: Any, kv_cache_config: Any) -> int:
    """The most block ids vLLM's warm-up and capture write, plus the null block.

    Warm-up decode steps give at most ``max_num_seqs`` requests ``6 q + 1`` tokens
    each (``q`` the decode query length) in every KV cache group; its mixed
    prefill step one request of at most ``max_num_batched_tokens``; dummy runs
    and the capture write block 0 or, for state slots, blocks ``1 .. max_num_seqs``.
    """
    scheduler = runner.scheduler_config
    groups = kv_cache_config.kv_cache_groups
    block_size = min(g.kv_cache_spec.block_size for g in groups)
    query = int(getattr(runner, "decode_query_len", 1))
    per_request = -(-(6 * query + 1) // block_size)
    prefill = -(-scheduler.max_num_batched_tokens // block_size) + 2
    return 1 + scheduler.max_num_seqs * (1 + len(groups) * per_request) + len(groups) * prefill


def _placements(kv_cache_config: Any) -> list[StridedPlacement]:
    from vllm.v1.kv_cache_interface import UniformTypeKVCacheSpecs

    placements = []
    for tensor in kv_cache_config.kv_cache_tensors:
        group = next(
            g for g in kv_cache_config.kv_cache_groups if tensor.layers[0] in g.layer_names
        )
        spec = group.kv_cache_spec
        if isinstance(spec, UniformTypeKVCacheSpecs):
            spec = spec.kv_cache_specs[tensor.layers[0]]
        if tensor.host_resident or not spec.has_layer_views:
            raise RuntimeError(
                f"capture-once cannot place KV tensor {tensor.layers[0]!r} "
                f"({type(spec).__name__}); set VLLM_SPECGRAPH_PROFILE=exact"
            )
        placements.append(
            StridedPlacement(
                tensor.offset,
                tensor.layer_stride,
                tensor.block_stride,
                len(tensor.layers),
                spec.page_size_bytes,
            )
        )
    return placements


class _ZerosFromBacking:
    """``torch`` as ``vllm.v1.worker.utils`` sees it, for one call of ``allocate_kv_cache``:
    its one ``torch.zeros(size, dtype=torch.int8, ...)`` is the backing's range."""

    def __init__(self, backing: BlockBacking, nbytes: int) -> None:
        self._backing, self._nbytes = backing, nbytes

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)

    def zeros(self, *size: Any, dtype: torch.dtype | None = None, **kwargs: Any) -> torch.Tensor:
        if size == (self._nbytes,) and dtype == torch.int8:
            return self._backing.tensor()[: self._nbytes]
        return torch.zeros(*size, dtype=dtype, **kwargs)


@contextmanager
def _torch_seen_by(module: Any, stand_in: Any) -> Iterator[None]:
    module.torch = stand_in
    try:
        yield
    finally:
        module.torch = torch


def reserved_kv_allocation(
    allocate: Callable[..., dict[str, torch.Tensor]],
    kv_cache_config: Any,
    device: torch.device,
    *args: Any,
    **kwargs: Any,
) -> dict[str, torch.Tensor]:
    """vLLM's ``allocate_kv_cache`` over a reserved range, where capture-once is armed.

    Only the blocks warm-up and capture write are backed (and zeroed); the rest
    of the range has addresses and no memory. Elsewhere, vLLM's allocation.
    On any failure the reservation is released and the plan dropped.
    """
    from vllm.v1.worker import utils

    plan = _plan
    if plan is None or plan.backing is not None or not kv_cache_config.kv_cache_tensors:
        return allocate(kv_cache_config, device, *args, **kwargs)
    (nbytes,) = {t.size for t in kv_cache_config.kv_cache_tensors}
    reserved = ReservedRange(nbytes, device)
    backing = None
    try:
        backing = BlockBacking(reserved, _placements(kv_cache_config), kv_cache_config.num_blocks)
        backing.back(min(warmup_blocks(plan.runner, kv_cache_config), backing.max_blocks))
        with _torch_seen_by(utils, _ZerosFromBacking(backing, nbytes)):
            kv_caches = allocate(kv_cache_config, device, *args, **kwargs)
    except BaseException:
        _drop_plan(backing, reserved)
        raise
    plan.backing = backing
    return kv_caches


def back_within_budget(worker: Any) -> CaptureOnceOutcome | None:
    """Back the KV cache up to the worker's budget less what was taken since the plan.

    None where capture-once is not armed for this worker's runner. Raises
    RuntimeError when that leaves less than the warm-up blocks already
    hold, and :class:`~vllm_specgraph.reserve.PageMapError` when the driver refuses
    pages (naming requested and free bytes; nothing of the call stays mapped).
    """
    global _plan
    plan = _plan
    if plan is None or plan.backing is None or plan.runner is not worker.model_runner:
        return None
    started = time.perf_counter()
    backing = plan.backing
    free_now = settled_free_bytes(backing.reserved.device)
    taken = plan.free_before - free_now - backing.reserved.mapped_bytes
    kv_budget = int(worker.available_kv_cache_memory_bytes)
    budget = kv_budget - taken
    held = backing.pages_bytes(backing.num_blocks)
    if budget < held:
        raise RuntimeError(
            f"capture-once: state, warm-up and graphs took {taken / _MIB:.1f} MiB since "
            f"vLLM's memory profile, leaving "
            f"{max(budget, 0) / _MIB:.1f} MiB of the {kv_budget / _MIB:.1f} MiB KV budget, "
            f"less than the {held / _MIB:.1f} MiB its {backing.num_blocks} "
            "warm-up blocks hold; raise gpu_memory_utilization, lower max_num_seqs, or set "
            "VLLM_SPECGRAPH_PROFILE=exact"
        )
    backing.back(backing.most_blocks_within(budget))
    outcome = CaptureOnceOutcome(
        max_blocks=backing.max_blocks,
        num_blocks=backing.num_blocks,
        reserved_bytes=backing.reserved.reserved_bytes,
        mapped_bytes=backing.reserved.mapped_bytes,
        taken_bytes=taken,
        budget_bytes=budget,
        seconds=time.perf_counter() - started,
        graphs=plan.graphs,
    )
    plan.runner.specgraph_capture_once = outcome
    _plan = None
    logger.info(
        "vllm-specgraph: capture-once: graphs %s; state, warm-up and graphs took %.1f MiB beside "
        "the KV cache since vLLM's memory profile; backed %d of %d KV blocks "
        "(%.1f of %.1f MiB reserved) in %.2f s",
        describe_owners(outcome.graphs) or "none measured",
        taken / _MIB,
        outcome.num_blocks,
        outcome.max_blocks,
        outcome.mapped_bytes / _MIB,
        outcome.reserved_bytes / _MIB,
        outcome.seconds,
    )
    return outcome


def abandon_plan() -> None:
    """Drop an armed plan after a failed start-up step; its reservation goes back as
    soon as no view of it is left."""
    global _plan
    plan, _plan = _plan, None
    if plan is not None and plan.backing is not None:
        _drop_plan(plan.backing, plan.backing.reserved)


def _drop_plan(backing: BlockBacking | None, reserved: ReservedRange) -> None:
    global _plan
    _plan = None
    released = backing.release() if backing is not None else reserved.release_when_unviewed()
    if not released:
        logger.warning(
            "vllm-specgraph: capture-once failed with KV cache views alive; its reserved "
            "range goes back once they are dropped"
        )


def backed_kv_blocks(worker: Any) -> int | None:
    """The KV blocks capture-once backed on ``worker``, or None where it did not run
    (called on every worker through the executor's ``collective_rpc``)."""
    outcome = getattr(worker.model_runner, "specgraph_capture_once", None)
    return None if outcome is None else outcome.num_blocks
