"""Patch for ``vllm.distributed.device_communicators.cuda_communicator`` (vLLM 0.33.0).

vLLM does: ``CudaCommunicator.all_reduce`` tries FlashInfer (PCIe IPC, then
fused), NCCL symmetric memory, AITER and QuickReduce (ROCm), the custom
all-reduce (a compiled library), torch symmetric memory, then NCCL. On a GPU
node where none of those fast paths comes up (no compiled custom all-reduce,
no FlashInfer, NVLink multicast off or absent, which turns torch symmetric
memory off), every tensor-parallel all-reduce is an NCCL call, captured graphs
included. ``__init__`` ends, for groups of more than one rank, by logging which
backends it enabled (``_log_all_reduce_backend_selection``).

This patch changes: at that point, once vLLM has built its own backends, the
TP group's communicator gets the core's
:class:`~vllm_specgraph.allreduce.PeerAllReduce` (torch symmetric memory, peer
loads and stores only, never multicast, one channel per graph capture) at the
head of its dispatch; vLLM's selection line names it (``SPECGRAPH_P2P``).
``VLLM_SPECGRAPH_ALLREDUCE`` says when: ``auto`` (default) where vLLM's selection
line names no fast path (any backend but NCCL, by vLLM's own rules) and the user
has not disabled custom all-reduce (``disable_custom_all_reduce``), ``1`` always,
``0`` never; never under ``VLLM_BATCH_INVARIANT`` or elastic EP (whose re-captures
would leave the dropped graphs' channels behind; ``1`` raises there); in the first two only if the
group's ranks vote that they all sit on one node, each with peer access to the
GPUs of the others (``1`` raises otherwise, naming the fix). It serves graph captures
only: eager calls (prefill, steps without a graph) take vLLM's own chain, since
launched one by one from the host the peer kernels are slower than NCCL
(``bench/allreduce.py``). So do inputs it would send to NCCL (dtypes its
kernels lack, sizes above its channel) and a graph captured outside
``GroupCoordinator.graph_capture`` (which gives each capture its channel; see
the ``parallel_state`` patch).

Why: a channel that belongs to one capture cannot be overwritten by another
owner's replay, and the disposable profile rolls back the channels of its
throwaway graphs on every rank. Graph-replayed, the peer all-reduce is also
faster than NCCL at every size up to its channel on two H200s
(``bench/allreduce.py``).

vLLM private names used: ``CudaCommunicator._log_all_reduce_backend_selection``
(wrapped), the module's ``logger`` (swapped for the duration of that call, to read
the line vLLM would log) and ``parallel_state._ENABLE_CUSTOM_ALL_REDUCE`` (read);
the patch adds ``CudaCommunicator.specgraph_all_reduce``.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist

from vllm_specgraph.allreduce import Algorithm, PeerAllReduce
from vllm_specgraph.channels import stream_is_capturing
from vllm_specgraph.patches._patching import PatchSet
from vllm_specgraph.ranks import on_any_rank
from vllm_specgraph.switches import ALLREDUCE_MODES, current_switches

__all__ = ["ALLREDUCE_MODES", "BACKEND_NAME", "allreduce_mode", "install"]

logger = logging.getLogger("vllm.specgraph")


BACKEND_NAME = "SPECGRAPH_P2P"
"""The name vLLM's backend-selection line gives the peer all-reduce."""
_NCCL_BACKEND = "PYNCCL"
"""vLLM's NCCL fallback: every other backend in its line is a fast path."""


def allreduce_mode() -> str:
    """``VLLM_SPECGRAPH_ALLREDUCE`` as the plugin read it: ``auto`` unless set."""
    return current_switches().allreduce


def _wants_peer_all_reduce(communicator: Any, vllm_backends: list[str]) -> bool:
    """Whether the TP group's communicator takes the peer all-reduce; ``vllm_backends``
    are the backends vLLM enabled for it, as its selection line names them.

    Every rank of the group decides alike: the switches, vLLM's backends and the
    reachability vote are the same on all of them.
    """
    from vllm import envs
    from vllm.distributed import parallel_state

    mode = allreduce_mode()
    if mode == "0" or communicator.unique_name.split(":")[0] != "tp":
        return False
    if communicator.world_size < 2 or communicator.device.type != "cuda":
        return False
    if envs.VLLM_BATCH_INVARIANT:
        # Its sums are exact at two ranks but their order is not fixed above that.
        return _keeps_vllms(communicator, "VLLM_BATCH_INVARIANT is set")
    if _elastic_ep():
        # A scale event drops graphs and captures again, but vLLM's release leaves
        # some alive (the V1 runner's drafter graphs, graphs of compiled modules
        # nested below the model): the channels of the dropped graphs cannot be
        # told from those still replayed, so they would pile up, outside any budget.
        if mode == "1":
            raise RuntimeError(
                "VLLM_SPECGRAPH_ALLREDUCE=1 with elastic EP (enable_elastic_ep): each scale "
                "event re-captures graphs, and the peer all-reduce's channels of the dropped "
                "graphs would stay for the life of the process; set VLLM_SPECGRAPH_ALLREDUCE="
                "auto (or 0) to keep vLLM's all-reduce"
            )
        return _keeps_vllms(
            communicator, "elastic EP re-captures graphs, and the channels would outlive them"
        )
    if mode == "auto":
        if not parallel_state._ENABLE_CUSTOM_ALL_REDUCE:
            return _keeps_vllms(communicator, "custom all-reduce is disabled")
        fast = [b for b in vllm_backends if b != _NCCL_BACKEND]
        if fast:
            return _keeps_vllms(communicator, f"vLLM has fast all-reduce backends {fast}")
    if _peers_reachable(communicator.cpu_group):
        return True
    if mode == "1":
        raise RuntimeError(
            f"VLLM_SPECGRAPH_ALLREDUCE=1, but the ranks of {communicator.unique_name} are not "
            "all on this node with peer access between their GPUs, which the peer "
            "all-reduce needs; set VLLM_SPECGRAPH_ALLREDUCE=auto (or 0) to use vLLM's"
        )
    return _keeps_vllms(
        communicator, "its ranks are not all on one node with peer access between their GPUs"
    )


def _elastic_ep() -> bool:
    from vllm.config import get_current_vllm_config_or_none

    config = get_current_vllm_config_or_none()
    return config is not None and bool(config.parallel_config.enable_elastic_ep)


def _keeps_vllms(communicator: Any, why: str) -> bool:
    logger.info("vllm-specgraph: %s keeps vLLM's all-reduce: %s", communicator.unique_name, why)
    return False


def _peers_reachable(cpu_group: Any) -> bool:
    """All ranks on one node, each with peer access to the GPU of every other rank.

    Collective over the group's gloo group: each rank's GPU is gathered by its
    UUID (device indices depend on each process's ``CUDA_VISIBLE_DEVICES``), a
    GPU this process does not see counts as out of reach, and the answer is a
    vote, so every rank gets the same one.
    """
    from vllm.distributed.parallel_state import in_the_same_node_as

    same_node = all(in_the_same_node_as(cpu_group, source_rank=0))
    this = torch.cuda.current_device()
    visible = {_gpu_uuid(index): index for index in range(torch.cuda.device_count())}
    mine = _gpu_uuid(this)
    others = [visible.get(uuid) for uuid in _group_gpus(cpu_group, mine) if uuid != mine]
    reachable = same_node and all(
        index is not None and torch.cuda.can_device_access_peer(this, index) for index in others
    )
    return not on_any_rank(not reachable, cpu_group)


def _gpu_uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


def _group_gpus(cpu_group: Any, mine: str) -> list[str]:
    """The GPU UUID of every rank of the group (collective)."""
    gpus: list[Any] = [None] * dist.get_world_size(cpu_group)
    dist.all_gather_object(gpus, mine, group=cpu_group)
    return gpus


class _SelectionLine:
    """Stands in for vLLM's logger during its selection line: records the line, logs nothing."""

    def __init__(self, vllm_logger: Any) -> None:
        self._logger = vllm_logger
        self.call: tuple[str, tuple[Any, ...], dict[str, Any]] | None = None

    def info_once(self, message: str, *args: Any, **kwargs: Any) -> None:
        self.call = (message, args, kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._logger, name)


def _backend_names(rendered: str) -> list[str]:
    # vLLM renders its lists as "['A', 'B']", or "[]".
    inner = rendered.removeprefix("[").removesuffix("]")
    return [name.strip().strip("'") for name in inner.split(",") if name.strip()]


def _listed_first(backends: str) -> str:
    rest = backends.removeprefix("[").removesuffix("]")
    return f"['{BACKEND_NAME}'" + (f", {rest}]" if rest else "]")


def _wrap_log_selection(
    log_selection: Callable[[Any], None], cuda_communicator: ModuleType
) -> Callable[[Any], None]:
    @functools.wraps(log_selection)
    def _log_all_reduce_backend_selection(self: Any) -> None:
        # vLLM calls this last in __init__, for groups of more than one rank: its own
        # backends exist, and its line names the ones it enabled, by its own rules.
        self.specgraph_all_reduce = None
        vllm_logger = cuda_communicator.logger
        line = _SelectionLine(vllm_logger)
        cuda_communicator.logger = line
        try:
            log_selection(self)
        finally:
            cuda_communicator.logger = vllm_logger
        if line.call is None:  # vLLM logged nothing: nothing to decide from
            return
        message, (enabled, group, potential), kwargs = line.call
        if _wants_peer_all_reduce(self, _backend_names(enabled)):
            self.specgraph_all_reduce = PeerAllReduce(self.device_group, self.device)
            enabled, potential = _listed_first(enabled), _listed_first(potential)
        vllm_logger.info_once(message, enabled, group, potential, **kwargs)

    return _log_all_reduce_backend_selection


def _wrap_all_reduce(all_reduce: Callable[[Any, torch.Tensor], torch.Tensor]) -> Callable:
    warned: list[bool] = []

    @functools.wraps(all_reduce)
    def all_reduce_peer_first(self: Any, input_: torch.Tensor) -> torch.Tensor:
        peer: PeerAllReduce | None = getattr(self, "specgraph_all_reduce", None)
        if peer is None or not stream_is_capturing() or peer.select(input_) is Algorithm.NCCL:
            return all_reduce(self, input_)
        if not peer.channel_pool.in_capture():
            if not warned:
                warned.append(True)
                logger.warning(
                    "vllm-specgraph: a graph captured outside GroupCoordinator.graph_capture "
                    "all-reduces over %s; it has no channel of its own, so it uses vLLM's "
                    "all-reduce",
                    self.unique_name,
                )
            return all_reduce(self, input_)
        return peer.all_reduce(input_)

    return all_reduce_peer_first


def install(patches: PatchSet, cuda_communicator: ModuleType) -> None:
    communicator = cuda_communicator.CudaCommunicator
    patches.wrap(
        communicator,
        "_log_all_reduce_backend_selection",
        functools.partial(_wrap_log_selection, cuda_communicator=cuda_communicator),
        parameters=("self",),
    )
    patches.wrap(
        communicator,
        "all_reduce",
        _wrap_all_reduce,
        parameters=("self", "input_"),
    )
