"""Patch for ``vllm.distributed.elastic_ep.elastic_execute`` (vLLM 0.33.0).

vLLM does: on an elastic-EP scale event, ``ElasticEPScalingExecutor`` drops
every CUDA graph (``_release_cuda_graphs``), unlocks the workspace, lets it
grow for the new expert count, and captures again; vLLM's own manager frees
an outgrown buffer at once.

This patch changes: once the graphs are dropped, the workspace frees the
buffers it retired (the core keeps an outgrown buffer for as long as a
captured graph may read it, and no graph is left to read them), and where the
plugin's peer all-reduce serves a group, the channels its captures bound are
closed on every rank of the group, in the coordinated order; its eager channel
stays.

Why: without it every scale event would keep the outgrown buffers, and each
re-capture would bind fresh channels (10 MiB per rank with the default 8 MiB
buffer) beside the dropped graphs' ones, for the life of the process. A
buffer outgrown after the release, before the next capture, is freed at the
next scale event: at most one per (ubatch, lane). Every rank of a group drops
its graphs in the same scale step (vLLM releases them on every worker it
reconfigures), so the close, which is collective, meets on all of them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from types import ModuleType

from vllm_specgraph.lanes import LaneWorkspace
from vllm_specgraph.patches._patching import PatchSet
from vllm_specgraph.patches.distributed.parallel_state import group_channel_pools

__all__ = ["install"]


def _then_release_retired(release_cuda_graphs: Callable) -> Callable:
    @functools.wraps(release_cuda_graphs)
    def _release_cuda_graphs(self) -> None:
        from vllm.v1.worker.workspace import (
            current_workspace_manager,
            is_workspace_manager_initialized,
        )

        release_cuda_graphs(self)
        for channel_pool in reversed(dict.fromkeys(group_channel_pools())):
            channel_pool.close_capture_channels()
        if is_workspace_manager_initialized():
            workspace = current_workspace_manager()
            if isinstance(workspace, LaneWorkspace):
                workspace.release_retired()

    return _release_cuda_graphs


def install(patches: PatchSet, elastic_execute: ModuleType) -> None:
    executor = elastic_execute.ElasticEPScalingExecutor
    patches.wrap(
        executor,
        "_release_cuda_graphs",
        _then_release_retired,
        parameters=("self",),
    )
