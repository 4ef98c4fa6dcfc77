"""Patch for ``vllm.distributed.device_communicators.flashinfer_pcie_ipc_all_reduce`` (vLLM 0.33.0).

vLLM does: with ``VLLM_ALLREDUCE_USE_FLASHINFER_PCIE_IPC=1``, the TP group's
``FlashInferPcieIpcAllReduce`` makes its workspace in ``kernel_warmup``
(``warmup_flashinfer_pcie_ipc_allreduce`` -> ``setup``), after the KV cache is
sized and just before graph capture: one slab per rank, ``cudaMalloc``-ed and
shared over CUDA IPC, of the size FlashInfer's ``workspace_size(world_size,
max_numel, elem_size, max_blocks)`` reports for ``max_numel`` = the largest
capture size times the hidden size. In FlashInfer 0.7.2.post1 that is two
scratch regions of ``2 * world_size`` payloads each, copy-engine staging and
signals: a little under ``4 * world_size + 2`` payloads, 88 MiB at TP4 for 512
tokens of hidden 5120 in bf16. The KV-cache budget never counted it.

This patch changes: :func:`communicator_bytes_after_kv_cache` tells the graph
memory profile what that slab will take, asking FlashInfer's own size function
with the arguments vLLM's set-up will pass, rounded up to whole 2 MiB pages; the
profile adds it to the budget it returns. ``setup`` is measured, and what it
took is logged against that budget.

Why: what kernel warm-up allocates after the KV cache is sized comes out of the
headroom the budget left, so an uncounted workspace of tens of MiB can fail the
production capture or the first long prefill.

vLLM private names used: ``_SUPPORTED_DTYPES`` (read); the patch adds
``FlashInferPcieIpcAllReduce._specgraph_budget_bytes``.
"""

from __future__ import annotations

import functools
import inspect
import logging
import sys
from collections.abc import Callable
from types import ModuleType
from typing import TYPE_CHECKING, Any

import torch

from vllm_specgraph.patches._patching import PatchSet

if TYPE_CHECKING:
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner

__all__ = ["PAGE_BYTES", "communicator_bytes_after_kv_cache", "install", "pcie_ipc_workspace_bytes"]

logger = logging.getLogger("vllm.specgraph")

PAGE_BYTES = 2 << 20
"""Driver-level free memory moves in pages this large for a ``cudaMalloc`` of this size."""

_BUDGET = "_specgraph_budget_bytes"
_MIB = 1 << 20


def communicator_bytes_after_kv_cache(runner: GPUModelRunner) -> int:
    """Device bytes vLLM's kernel warm-up will allocate for communicators after KV sizing.

    Today that is the FlashInfer PCIe IPC all-reduce workspace
    (:func:`pcie_ipc_workspace_bytes`). Call it from the graph memory profile,
    before the KV cache is sized; it allocates nothing and is not collective.
    """
    return pcie_ipc_workspace_bytes(runner.vllm_config)


def pcie_ipc_workspace_bytes(vllm_config: Any) -> int:
    """Bytes the TP group's FlashInfer PCIe IPC workspace will take once vLLM sets it up.

    0 when vLLM will not make one (the backend is off or disabled, micro-batching,
    no capture sizes, an unsupported dtype) or already has. Records the figure
    on the communicator, so that ``setup`` can log what it took against it.
    Raises RuntimeError if the installed FlashInfer lacks the size function.
    """
    import vllm.envs as envs
    from vllm.distributed.device_communicators import flashinfer_pcie_ipc_all_reduce as module

    if not envs.VLLM_ALLREDUCE_USE_FLASHINFER_PCIE_IPC:
        return 0
    pcie = _pcie_communicator()
    sizes = [int(s) for s in vllm_config.compilation_config.cudagraph_capture_sizes or () if s > 0]
    dtype = vllm_config.model_config.dtype
    if (
        pcie is None
        or pcie.disabled
        or pcie.workspace is not None  # already in the free memory the profile reads
        or vllm_config.parallel_config.use_ubatching
        or not sizes
        or dtype not in module._SUPPORTED_DTYPES
    ):
        return 0
    hidden = vllm_config.model_config.get_hidden_size()
    max_numel = max(sizes) * hidden
    slab = _flashinfer_workspace_size(module, pcie.world_size, max_numel, dtype)
    nbytes = -(-slab // PAGE_BYTES) * PAGE_BYTES
    setattr(pcie, _BUDGET, nbytes)
    logger.info(
        "vllm-specgraph: the KV-cache budget leaves %.1f MiB for the FlashInfer PCIe IPC "
        "all-reduce workspace (TP%d, %d tokens x hidden %d, %s) that kernel warm-up "
        "allocates after the KV cache is sized",
        nbytes / _MIB,
        pcie.world_size,
        max(sizes),
        hidden,
        dtype,
    )
    return nbytes


def _pcie_communicator() -> Any | None:
    from vllm.distributed.device_communicators.cuda_communicator import CudaCommunicator
    from vllm.distributed.parallel_state import get_tp_group

    communicator = get_tp_group().device_communicator
    if not isinstance(communicator, CudaCommunicator):
        return None
    return communicator.fi_pcie_ipc_ar_comm


def _flashinfer_workspace_size(
    module: ModuleType, world_size: int, max_numel: int, dtype: torch.dtype
) -> int:
    """FlashInfer's own answer, for the arguments vLLM's ``setup`` passes (the rest default)."""
    workspace_cls = module.flashinfer_comm.PcieIpcAllReduceWorkspace
    comm_module = getattr(sys.modules[workspace_cls.__module__], "get_pcie_ipc_comm_module", None)
    if comm_module is None:
        raise RuntimeError(
            f"{workspace_cls.__module__} has no get_pcie_ipc_comm_module, so the FlashInfer "
            "PCIe IPC workspace cannot be sized before the KV cache; install the FlashInfer "
            "vLLM 0.33 pins (flashinfer-python==0.7.2.post1) or set "
            "VLLM_ALLREDUCE_USE_FLASHINFER_PCIE_IPC=0"
        )
    max_blocks = inspect.signature(workspace_cls).parameters["max_blocks"].default
    elem_size = torch.empty((), dtype=dtype).element_size()
    return int(comm_module().workspace_size(world_size, max_numel, elem_size, max_blocks))


def _measured(setup: Callable[..., None]) -> Callable[..., None]:
    @functools.wraps(setup)
    def measured_setup(self: Any, *args: Any, **kwargs: Any) -> None:
        budget = getattr(self, _BUDGET, None)
        if budget is None or self.disabled or self.workspace is not None:
            setup(self, *args, **kwargs)
            return
        torch.cuda.synchronize(self.device)
        free_before = torch.cuda.mem_get_info(self.device)[0]
        reserved_before = torch.cuda.memory_reserved(self.device)
        setup(self, *args, **kwargs)
        torch.cuda.synchronize(self.device)
        taken = free_before - torch.cuda.mem_get_info(self.device)[0]
        cached = torch.cuda.memory_reserved(self.device) - reserved_before
        logger.info(
            "vllm-specgraph: FlashInfer PCIe IPC all-reduce workspace: budgeted %.1f MiB, "
            "set-up took %.1f MiB outside the caching allocator, and its tuning left "
            "%.1f MiB cached",
            budget / _MIB,
            (taken - cached) / _MIB,
            cached / _MIB,
        )

    return measured_setup


def install(patches: PatchSet, flashinfer_pcie_ipc_all_reduce: ModuleType) -> None:
    communicator = flashinfer_pcie_ipc_all_reduce.FlashInferPcieIpcAllReduce
    patches.wrap(
        communicator,
        "setup",
        _measured,
        parameters=("hidden_dim", "dtype", "capture_sizes", "tune_cache"),
    )
