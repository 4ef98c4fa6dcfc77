"""Patch for ``vllm.distributed.parallel_state`` (vLLM 0.33.0).

vLLM does: ``GroupCoordinator.graph_capture`` is the context every graph
manager enters for its whole capture (the target's, each speculator's, the
encoder's; the disposable profile's too): it switches to a capture stream and
enters the capture contexts of the group's custom all-reduce communicators.
Communicators that keep one persistent buffer (torch symmetric memory) share
it between every graph, target and draft alike.

This patch changes: when the group's communicator carries the plugin's peer
all-reduce (the ``cuda_communicator`` patch), ``graph_capture`` first binds a
fresh channel of it to the capture, owned by the lane the capture runs in
(``target``, or ``draft`` for the speculator's), and unbinds it on exit. The
channel is made, and rendezvoused across the group's ranks, before vLLM's
context and any graph capture begin: making one allocates and is collective.

Why: a graph bakes in the addresses of the channel it all-reduced through; a
channel of its own is one no other owner's replay writes, and one the
disposable profile can close on every rank once its throwaway graphs are gone.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from types import ModuleType
from typing import Any

from vllm_specgraph.channels import ChannelPool
from vllm_specgraph.lanes import current_owner_name
from vllm_specgraph.patches._patching import PatchSet

__all__ = ["group_channel_pools", "install"]


def _channel_for_capture(group: Any) -> AbstractContextManager[object]:
    peer = getattr(group.device_communicator, "specgraph_all_reduce", None)
    if peer is None:
        return nullcontext()
    return peer.channel_pool.capture(owner=current_owner_name())


def group_channel_pools() -> list[ChannelPool]:
    """The channel pools of the TP, DCP and PP groups' peer all-reduce, in that order.

    A communicator two groups share is listed twice and checkpointed once; a
    rollback goes in reverse order, on every rank of each group.
    """
    from vllm.distributed import parallel_state

    channel_pools = []
    for name in ("_TP", "_DCP", "_PP"):
        communicator = getattr(getattr(parallel_state, name, None), "device_communicator", None)
        peer = getattr(communicator, "specgraph_all_reduce", None)
        if peer is not None:
            channel_pools.append(peer.channel_pool)
    return channel_pools


def _wrap_graph_capture(graph_capture: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(graph_capture)
    @contextmanager
    def graph_capture_with_channel(self: Any, graph_capture_context: Any = None) -> Iterator[Any]:
        with (
            _channel_for_capture(self),
            graph_capture(self, graph_capture_context) as context,
        ):
            yield context

    return graph_capture_with_channel


def install(patches: PatchSet, parallel_state: ModuleType) -> None:
    coordinator = parallel_state.GroupCoordinator
    patches.wrap(
        coordinator,
        "graph_capture",
        _wrap_graph_capture,
        parameters=("self", "graph_capture_context"),
    )
