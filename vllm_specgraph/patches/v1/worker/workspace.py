"""Patch for ``vllm.v1.worker.workspace`` (vLLM 0.33.0).

vLLM does: ``WorkspaceManager`` keeps one scratch buffer per (ubatch, lane),
selected by its own ``use_workspace_lane``; growth frees the old buffer at
once (``del`` + ``empty_cache``), although captured graphs may still point
into it, and a growth during a capture lands in that graph's pool.

This patch changes: ``WorkspaceManager`` is the core's
:class:`~vllm_specgraph.lanes.LaneWorkspace` (same interface), and
``use_workspace_lane`` is the core's :func:`~vllm_specgraph.lanes.use_lane`,
so there is one workspace and one lane selector. Growth retires the old
buffer instead of freeing it where a capture took views of it (a graph may
still read it), and frees it as vLLM does where none did (no graphs, the
eager warm-up, a lane no capture used yet); growth during a capture is refused
with an error naming the caller (vLLM warms up each graph eagerly right before
capturing it, so a correct caller never grows there). ``VLLM_DEBUG_WORKSPACE``
logs growth, lock and unlock in vLLM's words, through vLLM's logger.

Why: a freed buffer that a captured graph still reads is reused by the next
allocation, and target replays read foreign data; a buffer grown inside a
capture is carved from that graph's pool (the throwaway profiling pool, say)
while every later graph of the lane keeps using it.
"""

from __future__ import annotations

import functools
import logging
import operator
import sys
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from types import ModuleType
from typing import Any

import torch

from vllm_specgraph.lanes import (
    DEFAULT_OWNER_LANES,
    LaneWorkspace,
    Owner,
    caller_location,
    use_lane,
)
from vllm_specgraph.patches._patching import PatchSet

__all__ = ["LaneWorkspaceManager", "install", "plugin_workspace"]

_VLLM_WORKSPACE = "vllm.v1.worker.workspace"
_MB = 1024 * 1024


class LaneWorkspaceManager(LaneWorkspace):
    """:class:`LaneWorkspace` built the way vLLM builds its ``WorkspaceManager``.

    The ubatch comes from vLLM's dual-batch-overlap context; owners are named
    for the lanes configured (``target`` 0, ``draft`` 1 when there are two).
    """

    def __init__(
        self,
        device: torch.device,
        num_ubatches: int | None = None,
        num_lanes: int = 1,
        alloc_context: Callable[[], AbstractContextManager[object]] = nullcontext,
    ) -> None:
        if type(num_lanes) is int and num_lanes < 1:
            raise ValueError(f"num_lanes must be at least one, got {num_lanes}.")
        super().__init__(
            device,
            num_ubatches=num_ubatches,
            owner_lanes={o: lane for o, lane in DEFAULT_OWNER_LANES.items() if lane < num_lanes},
            num_lanes=num_lanes,
            alloc_context=alloc_context,
            # Looked up in vLLM's workspace module at each call, as its manager
            # looks it up (what replaces it there replaces it here); C callables,
            # so the request path gains no Python frame.
            ubatch_id=functools.partial(
                operator.methodcaller("dbo_current_ubatch_id"),
                sys.modules[_VLLM_WORKSPACE],
            ),
        )

    def _grow(self, slot: Any, required: int, owner: Owner, lane: int, ubatch: int) -> torch.Tensor:
        held = 0 if slot.buffer is None else slot.buffer.numel()
        buffer = super()._grow(slot, required, owner, lane, ubatch)
        if _debugging():
            _vllm_logger().info(
                "[WORKSPACE DEBUG] Resized workspace from '%s': %.2f MB -> "
                "%.2f MB (ubatch %d, lane %d)",
                caller_location(),
                held / _MB,
                required / _MB,
                ubatch,
                lane,
            )
        return buffer

    def lock(self) -> None:
        super().lock()
        self._log_sizes("locked")

    def unlock(self) -> None:
        super().unlock()
        self._log_sizes("unlocked")

    def _log_sizes(self, what: str) -> None:
        if _debugging():
            sizes = [ws.numel() / _MB for ws in self._current_workspaces if ws is not None]
            _vllm_logger().info("[WORKSPACE DEBUG] Workspace %s. Current sizes: %s", what, sizes)

    @property
    def _device(self) -> torch.device:
        # vLLM's init_workspace_manager logs the old manager's device by this name.
        return self.device

    @property
    def _current_workspaces(self) -> list[torch.Tensor | None]:
        """Each (ubatch, lane) slot's current buffer, in vLLM's order
        (``ubatch * num_lanes + lane``), as vLLM's manager keeps them."""
        return [
            self._slots[(ubatch, lane)].buffer
            for ubatch in range(self.num_ubatches)
            for lane in range(self.num_lanes)
        ]


def plugin_workspace() -> LaneWorkspace | None:
    """vLLM's current workspace manager where one exists and it is the plugin's."""
    from vllm.v1.worker import workspace

    if not workspace.is_workspace_manager_initialized():
        return None
    manager = workspace.current_workspace_manager()
    return manager if isinstance(manager, LaneWorkspace) else None


def _debugging() -> bool:
    """``VLLM_DEBUG_WORKSPACE``, read at each use as vLLM's manager reads it."""
    from vllm import envs

    return bool(envs.VLLM_DEBUG_WORKSPACE)


def _vllm_logger() -> logging.Logger:
    return sys.modules[_VLLM_WORKSPACE].logger


def install(patches: PatchSet, workspace: ModuleType) -> None:
    patches.replace(
        workspace,
        "WorkspaceManager",
        LaneWorkspaceManager,
        parameters=("device", "num_ubatches", "num_lanes", "alloc_context"),
    )
    patches.replace(workspace, "use_workspace_lane", use_lane, parameters=("lane",))
