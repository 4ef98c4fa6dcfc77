"""Patch for ``vllm.distributed.device_communicators.custom_all_reduce`` (vLLM 0.33.0).

vLLM does: ``CustomAllreduce.capture()`` marks the communicator capturing and, on
exit, registers the capture's buffers: every rank broadcasts its IPC handles over
the gloo group, then calls the compiled ``register_graph_buffers``. The compiled
``all_reduce``, launched on a capturing stream, appends the address it reads (the
rank's input, or the registered staging buffer vLLM copies it into when built with
``register_graph_buffers=False``) to a pending list and bakes into the graph the
next free slot of its ``rank_data`` table; it does so for every captured launch,
registered or not (the 0.33.0 binary checks the capture status before any lookup;
its all-gather and reduce-scatter stage into the registered buffer and look it up,
capture or not, so they leave nothing pending). Registration exports each pending
address (``cudaIpcGetMemHandle``), opens every peer's (``cudaIpcOpenMemHandle``),
fills that many slots and clears the list. Nothing is unregistered before
``dispose``: graphs captured for profiling and then destroyed leave their slots,
and peer mappings of the freed profiling pool, for the life of the engine. Merely
not registering them would be worse: their addresses stay pending, and the next
capture's registration exports them too, failing on memory given back to the
driver or mapping whatever now lives at the address.

This patch changes: inside the core's disposable pass
(:func:`~vllm_specgraph.profile.current_disposable_pass`), a captured all-reduce of
this communicator records a copy of its input into the output vLLM allocated, in
place of the compiled launch. The graph pool sees vLLM's own allocations, the
graph one node per all-reduce, and the pending list nothing, so the registration
that closes the capture still runs on every rank and registers nothing.
``capture()`` first checks over the gloo group that every rank is in the same kind
of capture, and raises on every rank, before anything is captured, if not.
Production captures (target, draft, encoder) are unchanged: each registers its own
buffers, as in vLLM.

Why: a captured all-reduce reads its registered peer pointers only at replay, and
a profiling graph is destroyed without replay, so it needs no registration; the
ones it would leave hold peer mappings of freed memory. Registration is a
collective, so every rank must take the same branch.

vLLM private names used: ``CustomAllreduce._all_reduce_chunk`` (wrapped); the patch
adds ``CustomAllreduce._specgraph_disposable_capture``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist

from vllm_specgraph.patches._patching import PatchSet
from vllm_specgraph.profile import current_disposable_pass

__all__ = ["check_same_capture_kind", "install"]

_DISPOSABLE = "_specgraph_disposable_capture"


def check_same_capture_kind(group: Any, disposable: bool) -> None:
    """Raise on every rank of ``group`` unless all of them pass the same ``disposable``.

    Collective over ``group`` (vLLM's gloo group of the communicator): one
    all-reduce of two integers. Every rank reads the same result, so either all
    go on or all raise. Not legal during capture (it is a host collective, run
    before the capture starts).
    """
    flags = torch.tensor([int(disposable), -int(disposable)], dtype=torch.int64)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
    if int(flags[0]) != -int(flags[1]):  # max != min
        kind = "a disposable profiling" if disposable else "a production"
        raise RuntimeError(
            f"CustomAllreduce capture refused: this rank starts {kind} capture, another "
            "rank of its group does not; nothing was captured or registered. Every rank "
            "must run the graph memory profile (Worker.determine_available_memory) and "
            "the production capture together"
        )


def _wrap_capture(capture: Callable[[Any], Any]) -> Callable[[Any], Any]:
    @functools.wraps(capture)
    @contextmanager
    def scoped_capture(self: Any) -> Iterator[None]:
        disposable = current_disposable_pass() is not None
        if not self.disabled:  # vLLM's own registration collective runs under the same test
            check_same_capture_kind(self.group, disposable)
        outer = vars(self).get(_DISPOSABLE, False)
        setattr(self, _DISPOSABLE, disposable)
        try:
            with capture(self):
                yield
        finally:
            setattr(self, _DISPOSABLE, outer)

    return scoped_capture


def _wrap_all_reduce_chunk(all_reduce_chunk: Callable[..., None]) -> Callable[..., None]:
    @functools.wraps(all_reduce_chunk)
    def _all_reduce_chunk(self: Any, inp: torch.Tensor, out: torch.Tensor, registered: bool):
        if getattr(self, _DISPOSABLE, False) and torch.cuda.is_current_stream_capturing():
            # The compiled op would append to the pending list; a copy is one graph
            # node like the launch it replaces, and allocates nothing.
            out.copy_(inp)
            return
        all_reduce_chunk(self, inp, out, registered)

    return _all_reduce_chunk


def install(patches: PatchSet, custom_all_reduce: ModuleType) -> None:
    communicator = custom_all_reduce.CustomAllreduce
    patches.wrap(
        communicator,
        "capture",
        _wrap_capture,
        parameters=("self",),
    )
    patches.wrap(
        communicator,
        "_all_reduce_chunk",
        _wrap_all_reduce_chunk,
        parameters=("inp", "out", "registered"),
    )
