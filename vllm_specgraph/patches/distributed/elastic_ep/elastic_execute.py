"""Patch for ``vllm.distributed.elastic_ep.elastic_execute`` (vLLM 0.33.0).

vLLM does: on an elastic-EP scale event, ``ElasticEPScalingExecutor`` drops
every CUDA graph (``_release_cuda_graphs``), unlocks the workspace, lets it
grow for the new expert count, and captures again; vLLM's own manager frees
an outgrown buffer at once.

This patch changes: once the graphs are dropped, the workspace frees the
buffers it retired (the core keeps an outgrown buffer for as long as a
captured graph may read it), if no CUDA graph object is left in the process.
vLLM's release does not drop every graph (the V1 runner's drafter graphs,
graphs of compiled modules nested below the model); where one survives, the
retired buffers stay, since it may read them.

Why: without it every scale event would keep the outgrown buffers for the
life of the process. A buffer outgrown after the release, before the next
capture, is freed at the next scale event: at most one per (ubatch, lane).
"""

from __future__ import annotations

import functools
import gc
import logging
from collections.abc import Callable
from types import ModuleType

import torch

from vllm_specgraph.patches._patching import PatchSet
from vllm_specgraph.patches.v1.worker.workspace import plugin_workspace

__all__ = ["install"]

logger = logging.getLogger("vllm.specgraph")


def _graphs_alive() -> int:
    """CUDA graph objects left in the process (their Python objects are tracked by gc)."""
    return sum(isinstance(o, torch.cuda.CUDAGraph) for o in gc.get_objects())


def _then_release_retired(release_cuda_graphs: Callable) -> Callable:
    @functools.wraps(release_cuda_graphs)
    def _release_cuda_graphs(self) -> None:
        release_cuda_graphs(self)
        workspace = plugin_workspace()
        if workspace is not None:
            alive = _graphs_alive()  # a scale event is rare: a heap scan is cheap here
            if alive:
                logger.info(
                    "vllm-specgraph: %d CUDA graphs outlived elastic EP's release; the "
                    "workspace keeps the buffers it retired, which they may read",
                    alive,
                )
            else:
                workspace.forget_graphs()

    return _release_cuda_graphs


def install(patches: PatchSet, elastic_execute: ModuleType) -> None:
    executor = elastic_execute.ElasticEPScalingExecutor
    patches.wrap(
        executor,
        "_release_cuda_graphs",
        _then_release_retired,
        parameters=("self",),
    )
