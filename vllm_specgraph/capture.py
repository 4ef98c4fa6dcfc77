"""Graph capture bound to an owner: its pool, its workspace lane, fresh channels.

:class:`GraphRecorder` is how the core's owners capture graphs, in the
profile's passes and in production alike (:func:`~vllm_specgraph.profile.measure_captures`),
so that what the profile measures is what production builds. In vLLM, vLLM's
own capture code runs instead, measured by the same meter.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager

import torch

from vllm_specgraph._checks import check_items, check_pool_handle, check_str
from vllm_specgraph.channels import ChannelPool
from vllm_specgraph.lanes import use_owner

__all__ = ["GraphRecorder"]


class GraphRecorder:
    """Captures and keeps one owner's CUDA graphs.

    Arguments:
        pool: the memory pool handle every graph is captured into
            (``torch.cuda.graph_pool_handle()`` or ``graph.pool()``).
        owner: the lane owner ("target", "draft", ...) the captures run as.
        channel_pools: each capture gets a fresh channel from each of these.

    *Owns*: the graphs it captured, until :meth:`reset`.
    *Borrows*: the pool (the caller owns it and must outlive the graphs) and
    the channel pools (whose channels the graphs bake in).
    """

    def __init__(
        self, pool: tuple[int, int], owner: str, channel_pools: Sequence[ChannelPool] = ()
    ) -> None:
        self.pool = check_pool_handle("pool", pool, "pass torch.cuda.graph_pool_handle()")
        check_str("owner", owner, "name the lane owner, e.g. 'draft'")
        self.owner = owner
        self.channel_pools = check_items(
            "channel_pools", channel_pools, ChannelPool, "pass a list of ChannelPools"
        )
        self._graphs: list[torch.cuda.CUDAGraph] = []

    @property
    def graphs(self) -> tuple[torch.cuda.CUDAGraph, ...]:
        return tuple(self._graphs)

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)

    @contextmanager
    def capture(self, stream: torch.cuda.Stream | None = None) -> Iterator[torch.cuda.CUDAGraph]:
        """Capture the block into a new graph kept by this recorder.

        Channels are taken before capture begins (creating one may be
        collective and allocates). The block runs as :attr:`owner`. A graph
        whose capture raised is reset at once and not kept.

        .. warning:: Tensors the block allocates live in :attr:`pool`; whoever
           keeps them must drop them before the pool can be released.
        """
        if stream is not None and not isinstance(stream, torch.cuda.Stream):
            raise TypeError(
                f"stream must be a torch.cuda.Stream or None, got {stream!r} "
                f"({type(stream).__name__}); pass the side stream to capture on, or None"
            )
        graph = torch.cuda.CUDAGraph()
        try:
            with ExitStack() as stack:
                stack.enter_context(use_owner(self.owner))
                for channel_pool in self.channel_pools:
                    stack.enter_context(channel_pool.capture(self.owner))
                stack.enter_context(torch.cuda.graph(graph, pool=self.pool, stream=stream))
                yield graph
        except BaseException:
            graph.reset()
            raise
        self._graphs.append(graph)

    def reset(self) -> None:
        """Destroy every kept graph. *Requires*: their replays have finished (synchronize)."""
        for graph in self._graphs:
            graph.reset()
        self._graphs.clear()
