"""Patch for ``vllm.v1.worker.gpu_model_runner`` (vLLM 0.33.0).

vLLM does: the V1 runner's ``profile_cudagraph_memory`` captures its graphs once,
inside ``graph_capture``, into a throwaway pool, and clears the wrappers' and the
encoder's before it returns (dual-batch-overlap graphs, captured in micro-batch
threads, outlive it; those threads do not see the capture's channel binding on
Python 3.11-3.13, so their all-reduces take vLLM's chain and no rolled-back
channel is in them).

This patch changes: where the plugin's peer all-reduce serves a group (the
``cuda_communicator`` patch), the channels those throwaway captures bound are
rolled back on every rank once the profile returns, also on error: the core's
channel checkpoint before it, the coordinated rollback after. Workspace buffers
those captures made the workspace retire are freed then too, without
micro-batching (its graphs outlive the profile), as vLLM frees an outgrown
buffer. ``profile_run`` (the memory profile's
dummy run) runs marked as such (:mod:`vllm_specgraph.patches._profile_run`), for
the patches that reserve memory there.

Why: each ``graph_capture`` block binds a fresh channel, which holds its buffer
and signal pad (10 MiB per rank with the default 8 MiB buffer) on every rank;
the profile's graphs are gone, so nothing reads them, yet without the rollback
they stay for the life of the process, outside any memory budget.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from types import ModuleType

import torch

from vllm_specgraph.channels import checkpoint_channel_pools, rollback_channel_pools
from vllm_specgraph.patches._patching import PatchSet
from vllm_specgraph.patches._profile_run import wrap_profile_run
from vllm_specgraph.patches.distributed.parallel_state import group_channel_pools
from vllm_specgraph.patches.v1.worker.workspace import plugin_workspace

__all__ = ["install"]


def _rolling_back_channels(profile: Callable) -> Callable:
    @functools.wraps(profile)
    def profile_cudagraph_memory(self) -> int:
        channel_pools = group_channel_pools()
        checkpoint = checkpoint_channel_pools(channel_pools) if channel_pools else None
        try:
            estimate = profile(self)
        finally:
            # vLLM's profile cleared its graphs; the rollback synchronises first.
            if checkpoint is not None:
                rollback_channel_pools(checkpoint)
        if not self.parallel_config.use_ubatching:
            _forget_workspace_graphs()
        return estimate

    return profile_cudagraph_memory


def _forget_workspace_graphs() -> None:
    """The profile's graphs are gone and no other exists yet (micro-batch graphs
    outlive the profile, hence not with ubatching): the workspace frees what they
    made it retire, and frees its current buffers on growth again, as vLLM does."""
    manager = plugin_workspace()
    if manager is not None:
        if manager.device.type == "cuda":
            torch.cuda.synchronize(manager.device)
        manager.forget_graphs()


def install(patches: PatchSet, gpu_model_runner: ModuleType) -> None:
    patches.wrap(
        gpu_model_runner.GPUModelRunner,
        "profile_cudagraph_memory",
        _rolling_back_channels,
        parameters=("self",),
    )
    patches.wrap(gpu_model_runner.GPUModelRunner, "profile_run", wrap_profile_run)
