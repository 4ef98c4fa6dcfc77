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
channel checkpoint before it, the coordinated rollback after. Elsewhere it
calls vLLM's profile and nothing else. ``profile_run`` (the memory profile's
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

from vllm_specgraph.channels import checkpoint_channel_pools, rollback_channel_pools
from vllm_specgraph.patches._patching import PatchSet
from vllm_specgraph.patches._profile_run import wrap_profile_run
from vllm_specgraph.patches.distributed.parallel_state import group_channel_pools

__all__ = ["install"]


def _rolling_back_channels(profile: Callable) -> Callable:
    @functools.wraps(profile)
    def profile_cudagraph_memory(self) -> int:
        channel_pools = group_channel_pools()
        if not channel_pools:
            return profile(self)
        checkpoint = checkpoint_channel_pools(channel_pools)
        try:
            return profile(self)
        finally:
            # vLLM's profile cleared its graphs; the rollback synchronises first.
            rollback_channel_pools(checkpoint)

    return profile_cudagraph_memory


def install(patches: PatchSet, gpu_model_runner: ModuleType) -> None:
    patches.wrap(
        gpu_model_runner.GPUModelRunner,
        "profile_cudagraph_memory",
        _rolling_back_channels,
        parameters=("self",),
    )
    patches.wrap(gpu_model_runner.GPUModelRunner, "profile_run", wrap_profile_run)
