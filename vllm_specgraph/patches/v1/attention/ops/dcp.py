"""Patch for ``vllm.v1.attention.ops.dcp`` (vLLM 0.33.0).

vLLM does: ``get_direct_dcp_a2a_workspace``, ``get_direct_dcp_q_gather_workspace``
and ``get_direct_dcp_kv_gather_workspace`` are ``functools.cache``d factories of
symmetric-memory workspaces (``DirectCPWorkspace``: receive buffers that peers
write into, signal slots and a device epoch per micro-batch, allocated and
rendezvoused collectively). MLA layers ask for the all-to-all and query-gather
ones when they are built (``MLADCPManager``), the MLA metadata builder for the
KV-gather one when the KV cache is set up, so the profile's minimal KV cache
makes that one first. Target and draft layers asking with the same arguments get
one workspace: their graphs share its signal slots and epoch. Nothing is released.

This patch changes: each factory keeps one workspace per (owner lane, arguments),
lane 0 for the target and 1 for the draft, from the core's current owner (the
draft's load, ``set_attn`` and captures run in the draft lane). A workspace made
inside the core's disposable pass is let go at the end of that pass, after its
synchronise; its memory goes with its last holder, the profile's KV state, as for
any tensor. A workspace the current lane lacks is refused during a capture: its
allocation and rendezvous are collective and must come before capture.

Why: a captured graph bakes in its workspace's buffers and epoch, so graphs of
two owners on one workspace share one signal protocol and stay correct only
while every rank replays target and draft in one total order; each owner's
graphs get their own. A workspace the profile made is profiling state: the
production KV set-up makes its own, and the profile leaves nothing behind.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Hashable
from types import ModuleType
from typing import Generic, TypeVar

from vllm_specgraph.channels import stream_is_capturing
from vllm_specgraph.lanes import DEFAULT_OWNER_LANES, current_owner
from vllm_specgraph.patches._patching import PatchSet
from vllm_specgraph.profile import current_disposable_pass

__all__ = ["FACTORIES", "LaneOwnedFactory", "install"]

FACTORIES = (
    "get_direct_dcp_a2a_workspace",
    "get_direct_dcp_q_gather_workspace",
    "get_direct_dcp_kv_gather_workspace",
)
"""vLLM's direct-workspace factories; each gets its own :class:`LaneOwnedFactory`."""

W = TypeVar("W")


def _current_lane() -> int:
    """The lane of the current owner: an int lane as is, a named owner by the core's map."""
    owner = current_owner()
    if isinstance(owner, int):
        return owner
    lane = DEFAULT_OWNER_LANES.get(owner)
    if lane is None:
        raise RuntimeError(
            f"owner {owner!r} has no lane; owners with lanes are "
            f"{dict(DEFAULT_OWNER_LANES)}: select one with use_owner() or use_lane()"
        )
    return lane


class LaneOwnedFactory(Generic[W]):
    """``create``'s results, one per (current owner lane, call arguments).

    Called like ``create``. The first call of a lane with given arguments makes
    the workspace; later calls of that lane return it. A call inside the core's
    disposable pass that makes one registers its release with the pass.

    *Owns*: a reference to every workspace it made, until a pass that made it
    ends; holders (layers, builders) keep theirs. *Legal during capture* only for
    a workspace the lane already has; making one there raises RuntimeError.
    """

    def __init__(self, create: Callable[..., W], name: str) -> None:
        self._create = create
        self._signature = inspect.signature(create)
        self._name = name
        self._made: dict[Hashable, W] = {}
        functools.update_wrapper(self, create)

    def __call__(self, *args: object, **kwargs: object) -> W:
        bound = self._signature.bind(*args, **kwargs)
        bound.apply_defaults()
        lane = _current_lane()
        key = (lane, *bound.arguments.items())
        if key in self._made:
            return self._made[key]
        if stream_is_capturing():
            raise RuntimeError(
                f"{self._name} was asked during a CUDA graph capture for a workspace that "
                f"lane {lane} does not have yet ({dict(bound.arguments)}); its allocation "
                "and rendezvous are collective: build the layer or metadata builder that "
                "asks for it before capture"
            )
        workspace = self._create(*bound.args, **bound.kwargs)
        disposable = current_disposable_pass()
        if disposable is not None:
            disposable.on_destroy(functools.partial(self._forget, key, workspace))
        self._made[key] = workspace
        return workspace

    def _forget(self, key: Hashable, workspace: W) -> None:
        # Only the one the pass made: after a cache_clear, the key may hold another.
        if self._made.get(key) is workspace:
            del self._made[key]

    def cache_clear(self) -> None:
        """Forget every lane's workspaces, as ``functools.cache``'s ``cache_clear`` does
        for vLLM's factory; holders keep theirs."""
        self._made.clear()

    @property
    def num_workspaces(self) -> int:
        """Workspaces held now, over all lanes (``None`` results of a disabled path included)."""
        return len(self._made)


def install(patches: PatchSet, dcp: ModuleType) -> None:
    for name in FACTORIES:
        cached = getattr(dcp, name)
        create = getattr(cached, "__wrapped__", None)
        if create is None:
            raise RuntimeError(
                f"vllm-specgraph cannot patch {dcp.__name__}.{name}: it is no longer a "
                "functools.cache'd factory; this vLLM is not the one the plugin supports "
                "(set VLLM_SPECGRAPH=0 to run without it)"
            )
        patches.replace(
            dcp,
            name,
            LaneOwnedFactory(create, f"{dcp.__name__}.{name}"),
            parameters=("group", "device", "num_ubatches"),
        )
