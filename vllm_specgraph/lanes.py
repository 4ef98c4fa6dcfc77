"""Owner lanes: one reusable workspace buffer per (ubatch, lane).

A captured CUDA graph bakes in the addresses of every workspace view it took.
Target and speculator graphs must therefore never take views of the same
buffer, and a buffer must outlive every graph that viewed it. This module
gives each execution owner (target, draft, ...) its own lane, and each
(ubatch, lane) its own buffer:

* :func:`use_owner` selects the owner for the current execution context
  (thread or asyncio task); :class:`LaneWorkspace` resolves it to a lane.
* Growth never frees a buffer a graph may still read: a buffer that handed out
  views during a capture is *retired* when it is outgrown and kept alive until
  the caller says, through :meth:`LaneWorkspace.release_retired`, that the
  graphs which took views of it are destroyed. A buffer no capture viewed is
  freed on growth, as vLLM's own manager does.
* :meth:`LaneWorkspace.lock` turns any further growth into an error that names
  the caller, so a late allocation cannot silently move memory under a graph.
* Growth during a capture is refused, naming the caller: the new buffer would
  be carved from the capturing graph's private pool (the caching allocator
  serves a capturing stream from it, and no other allocation is permitted
  while a capture is active), yet it is shared by every later graph of its
  lane. The eager warm-up before each capture must size the lane.
* :class:`LaneThread` starts a thread in the lane of the code that starts it.

:class:`LaneWorkspace` has the interface of vLLM's ``WorkspaceManager``
(``get_simultaneous``, ``get_persistent_resource``, ``get_persistent``,
``lock``/``unlock``/``is_locked``), so the vLLM patch installs it as that
manager: one workspace implementation, not two.

Torch only: this module never imports vLLM.
"""

from __future__ import annotations

import contextvars
import itertools
import numbers
import operator
import os
import sys
import threading
import weakref
from collections.abc import Callable, Hashable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from math import prod
from typing import TypeVar

import numpy
import torch

from vllm_specgraph._checks import (
    check_bool,
    check_callable,
    check_device,
    check_instance,
    check_int,
    check_str,
)

__all__ = [
    "ALIGNMENT_BYTES",
    "DEFAULT_OWNER_LANES",
    "LaneCheckpoint",
    "LaneThread",
    "LaneWorkspace",
    "OwnerBytes",
    "WorkspaceLockedError",
    "current_owner",
    "current_owner_name",
    "use_lane",
    "use_owner",
]

ALIGNMENT_BYTES = 256
"""Every view starts at a multiple of this many bytes (vectorised kernels assume it)."""

DEFAULT_OWNER_LANES: Mapping[str, int] = {"target": 0, "draft": 1}
"""Target runs in lane 0; every speculator phase (load, propose, capture) in lane 1."""
_LANES_FIX = "target uses lane 0, draft lane 1"
_MB = 1 << 20
_REFUSED_WHILE = {"locked": "after locking", "in a CUDA-graph capture": "during a capture"}

T = TypeVar("T")

Owner = str | int
"""An owner name, or a lane index chosen directly (vLLM's ``use_workspace_lane``)."""

_checkpoint_tokens = itertools.count()

_current_owner: contextvars.ContextVar[Owner] = contextvars.ContextVar(
    "vllm_specgraph_owner", default="target"
)


current_owner: Callable[[], Owner] = _current_owner.get
"""The owner selected for this thread or asyncio task ("target" unless set).

The context variable's own ``get``: a decode step asks several times, and this
costs no Python call."""

_LANE_OWNERS = {lane: owner for owner, lane in DEFAULT_OWNER_LANES.items()}


def current_owner_name() -> str:
    """The current owner by name; a lane vLLM selected by index maps back through
    :data:`DEFAULT_OWNER_LANES` (``"lane N"`` for one it does not name)."""
    owner = current_owner()
    return owner if isinstance(owner, str) else _LANE_OWNERS.get(owner, f"lane {owner}")


def use_owner(owner: Owner) -> AbstractContextManager[None]:
    """Run the block as ``owner``; the previous owner is restored on exit, also on error.

    The selection lives in a :class:`contextvars.ContextVar`, so it is private to
    the current thread or asyncio task. Legal during capture (it allocates nothing).
    Cheap enough for per-step calls: a plain class, not a generator, and a valid
    owner costs no call beyond it.
    """
    if (type(owner) is str and owner) or (type(owner) is int and owner >= 0):
        return _OwnerScope(owner)
    return _OwnerScope(_checked_owner("owner", owner))


def _checked_owner(name: str, owner: object) -> Owner:
    """``owner`` as a name or a plain-int lane (numpy integers are lanes too), else raise."""
    if isinstance(owner, str):
        check_str(name, owner, "name an owner, e.g. 'draft'")
        return owner
    if isinstance(owner, bool) or not hasattr(type(owner), "__index__"):
        raise TypeError(
            f"{name} must be a non-empty str (e.g. 'draft') or an int lane, got {owner!r} "
            f"({type(owner).__name__})"
        )
    return check_int("lane", owner, 0, _LANES_FIX)


class _OwnerScope:
    __slots__ = ("_owner", "_tokens")

    def __init__(self, owner: Owner) -> None:
        self._owner = owner
        self._tokens: list[contextvars.Token[Owner]] = []

    def __enter__(self) -> None:
        self._tokens.append(_current_owner.set(self._owner))

    def __exit__(self, *exc_info: object) -> None:
        _current_owner.reset(self._tokens.pop())


def use_lane(lane: int) -> AbstractContextManager[None]:
    """Select a lane by index rather than by owner name (same rules as :func:`use_owner`)."""
    if type(lane) is int and lane >= 0:
        return _OwnerScope(lane)
    if not isinstance(lane, bool) and hasattr(type(lane), "__index__") and lane < 0:
        # vLLM's use_workspace_lane words it so, and its tests match these words.
        raise ValueError(f"Workspace lane must be non-negative, got {lane}; {_LANES_FIX}")
    return _OwnerScope(_checked_owner("lane", lane))


class LaneThread(threading.Thread):
    """A thread whose target runs in a copy of the starting thread's context.

    A plain :class:`threading.Thread` starts with an empty context, i.e. in the
    target lane; work that a speculator phase hands to a thread (micro-batch
    overlap, for instance) must stay in the speculator's lane.
    """

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        # Not "_context": Python 3.14's Thread runs itself in its own _context, and
        # entering one context twice raises.
        self._starter_context = contextvars.copy_context()

    def run(self) -> None:
        self._starter_context.run(super().run)


class WorkspaceLockedError(RuntimeError, AssertionError):
    """A locked or capturing workspace was asked for memory it does not already hold.

    Also an AssertionError, which is what vLLM's own manager raises, so
    handlers written against vLLM keep matching.
    """


@dataclass(frozen=True)
class OwnerBytes:
    """Bytes held for one owner across all ubatches."""

    live_bytes: int
    retired_bytes: int
    persistent_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.live_bytes + self.retired_bytes + self.persistent_bytes


@dataclass(frozen=True)
class LaneCheckpoint:
    """Opaque record of a workspace's buffers, taken by :meth:`LaneWorkspace.checkpoint`."""

    workspace_serial: int
    token: int  # the order checkpoints were taken in, over every workspace
    locked: bool
    slots: tuple[tuple[tuple[int, int], _SlotState], ...]


@dataclass(frozen=True)
class _SlotState:
    buffer: torch.Tensor | None
    captured: bool
    retired: tuple[torch.Tensor, ...]
    persistent: tuple[tuple[Hashable, object], ...]


@dataclass
class _Slot:
    buffer: torch.Tensor | None = None
    captured: bool = False  # ``buffer`` handed out views during a capture
    retired: list[torch.Tensor] = field(default_factory=list)
    persistent: dict[Hashable, object] = field(default_factory=dict)

    def state(self) -> _SlotState:
        return _SlotState(
            self.buffer, self.captured, tuple(self.retired), tuple(self.persistent.items())
        )


def caller_location() -> str:
    """Where the workspace was asked, as vLLM's manager names it (``file:line:function``):
    the first frame outside this module and outside any workspace's methods (a
    subclass's included)."""
    frame = sys._getframe(1)
    while frame is not None and (
        frame.f_code.co_filename == __file__
        or isinstance(frame.f_locals.get("self"), LaneWorkspace)
    ):
        frame = frame.f_back
    if frame is None:
        return "unknown"
    code = frame.f_code
    return f"{os.path.basename(code.co_filename)}:{frame.f_lineno}:{code.co_name}"


class LaneWorkspace:
    """Scratch memory with one buffer per (ubatch, lane).

    Arguments:
        device: where buffers live.
        num_ubatches: micro-batches that run concurrently (dual-batch overlap uses 2).
        owner_lanes: owner name -> lane. Several owners may share a lane (an
            ``{"target": 0, "draft": 0}`` map reproduces upstream's single lane).
        num_lanes: lanes to configure; defaults to the highest mapped lane + 1.
        alloc_context: entered around every buffer allocation (vLLM's sleep
            mode allocates workspaces from its own memory pool this way).

        ubatch_id: which micro-batch the calling thread runs, for calls that
            pass no ``ubatch`` (vLLM passes its dual-batch-overlap ubatch id).
        is_capturing: whether the calling thread's stream is capturing a graph;
            by default CUDA's answer on a CUDA device, else never.

    *Owns*: every buffer, retired buffer and persistent tensor it hands views of.
    *Borrows*: nothing. Callers hold views only while the workspace lives.

    .. note:: Each (ubatch, lane) slot is used from one thread at a time; the
       owner selection is per thread / per task.
    """

    _serials = itertools.count()

    def __init__(
        self,
        device: torch.device | str,
        *,
        num_ubatches: int | None = 1,
        owner_lanes: Mapping[str, int] = DEFAULT_OWNER_LANES,
        num_lanes: int | None = None,
        alloc_context: Callable[[], AbstractContextManager[object]] = nullcontext,
        ubatch_id: Callable[[], int] = lambda: 0,
        is_capturing: Callable[[], bool] | None = None,
    ) -> None:
        device = check_device("device", device, "pass the device buffers live on, e.g. 'cuda:0'")
        if num_ubatches is None:
            num_ubatches = 1
        # Plain ints from here on (numpy integers are accepted): they key the slots.
        num_ubatches = check_int(
            "num_ubatches", num_ubatches, 1, "dual-batch overlap uses 2, else 1"
        )
        check_instance("owner_lanes", owner_lanes, Mapping, "map owner names to lanes")
        lanes: dict[str, int] = {}
        for owner, lane in owner_lanes.items():
            check_str("an owner_lanes key", owner, "name owners like 'target' or 'draft'")
            lanes[owner] = check_int(f"owner_lanes[{owner!r}]", lane, 0, _LANES_FIX)
        if num_lanes is None:
            if not lanes:
                raise ValueError(
                    "owner_lanes maps no owner, so no lane is configured; map at least one "
                    "(owner_lanes={'target': 0}) or pass num_lanes"
                )
            num_lanes = max(lanes.values()) + 1
        try:
            num_lanes = check_int("num_lanes", num_lanes, 1, "pass the number of lanes, e.g. 2")
        except ValueError:
            # vLLM's WorkspaceManager words it so, and its tests match these words.
            raise ValueError(f"num_lanes must be at least one, got {num_lanes}.") from None
        beyond = {o: lane for o, lane in lanes.items() if lane >= num_lanes}
        if beyond:
            raise ValueError(f"owners {beyond} map past num_lanes={num_lanes}; raise num_lanes")
        callables = {"alloc_context": alloc_context, "ubatch_id": ubatch_id}
        if is_capturing is not None:
            callables["is_capturing"] = is_capturing
        for arg, fn in callables.items():
            check_callable(arg, fn, f"pass a function of no arguments, or leave {arg} out")
        self.device = device
        self.num_ubatches = num_ubatches
        self.num_lanes = num_lanes
        self.owner_lanes: Mapping[str, int] = lanes
        self._alloc_context = alloc_context
        self._ubatch_id = ubatch_id
        if is_capturing is None:
            # bool() is False and costs no Python call on the request path.
            cuda = self.device.type == "cuda"
            is_capturing = torch.cuda.is_current_stream_capturing if cuda else bool
        self._is_capturing = is_capturing
        self._slots = {(u, lane): _Slot() for u in range(num_ubatches) for lane in range(num_lanes)}
        self._locked = False
        self._serial = next(self._serials)
        # Checkpoints a rollback may still take, by token; weakly held, so one the
        # caller dropped keeps nothing alive.
        self._live_checkpoints: weakref.WeakValueDictionary[int, LaneCheckpoint] = (
            weakref.WeakValueDictionary()
        )

    # -- lane resolution -------------------------------------------------------------

    def lane_of(self, owner: Owner) -> int:
        """The lane that ``owner`` (a name, or a lane index) runs in.

        Raises RuntimeError for an owner or lane this workspace was not configured with,
        TypeError or ValueError for what is neither a name nor a lane index.
        """
        owner = _checked_owner("owner", owner)
        if isinstance(owner, int):
            if owner >= self.num_lanes:
                raise RuntimeError(
                    f"lane {owner} is not configured: this workspace has {self.num_lanes} "
                    f"lane(s); build it with num_lanes>={owner + 1}"
                )
            return owner
        lane = self.owner_lanes.get(owner)
        if lane is None:
            raise RuntimeError(
                f"owner {owner!r} has no lane: configured owners are "
                f"{sorted(self.owner_lanes)}; add it to owner_lanes"
            )
        return lane

    def _slot(self, ubatch: int | None) -> tuple[_Slot, Owner, int, int]:
        if ubatch is None:
            ubatch = self._ubatch_id()
        if type(ubatch) is not int or not 0 <= ubatch < self.num_ubatches:
            ubatch = check_int("ubatch", ubatch, 0, "pass the micro-batch index")
            if ubatch >= self.num_ubatches:
                raise ValueError(f"ubatch must be in [0, {self.num_ubatches}), got {ubatch}")
        owner = current_owner()
        # Asked once per workspace request, in every layer that takes scratch memory:
        # a valid lane costs no Python call.
        if type(owner) is int and 0 <= owner < self.num_lanes:
            lane = owner
        else:
            lane = self.owner_lanes.get(owner) if type(owner) is str else None
            if lane is None:
                lane = self.lane_of(owner)  # raises, naming the fix
        return self._slots[(ubatch, lane)], owner, lane, ubatch

    # -- allocation ------------------------------------------------------------------

    def get_simultaneous(
        self, *shapes_and_dtypes: tuple[Sequence[int], torch.dtype], ubatch: int | None = None
    ) -> list[torch.Tensor]:
        """Views of the current owner's buffer, one per ``(shape, dtype)``, never overlapping.

        Each view starts on an :data:`ALIGNMENT_BYTES` boundary. Views of one call
        are valid together; a later call on the same (ubatch, lane) reuses the
        same memory. Grows the buffer if needed (see class notes); legal during
        capture only when no growth is needed (growth then raises
        :class:`WorkspaceLockedError`).
        """
        # Plain loops: no generator frames on a path every such layer takes.
        starts, nbytes, end = [], [], 0
        for pair in shapes_and_dtypes:
            try:
                shape, dtype = pair
                bad = False
                for d in shape:
                    bad = bad or (d < 0 if type(d) is int else _bad_dimension(d))
                n = prod(shape) * dtype.itemsize
            except (TypeError, AttributeError, ValueError):
                raise TypeError(
                    f"a workspace request is a (shape, dtype) pair such as ((64, 128), "
                    f"torch.bfloat16), got {pair!r}"
                ) from None
            if bad:
                raise ValueError(
                    f"workspace shape {tuple(shape)} has a negative or non-integer "
                    "dimension; pass the concrete sizes (>= 0) of every dimension"
                )
            starts.append(end)
            nbytes.append(n)
            end += -(-n // ALIGNMENT_BYTES) * ALIGNMENT_BYTES
        slot, owner, lane, ubatch = self._slot(ubatch)
        buffer = slot.buffer
        if buffer is None or buffer.numel() < end:
            buffer = self._grow(slot, end, owner, lane, ubatch)
        if not slot.captured and self._is_capturing():
            slot.captured = True  # a graph now reads this buffer: keep it when outgrown
        return [
            buffer[start : start + n].view(dtype).view(shape)
            for (shape, dtype), start, n in zip(shapes_and_dtypes, starts, nbytes, strict=True)
        ]

    def _grow(
        self, slot: _Slot, required: int, owner: Owner, lane: int, ubatch: int
    ) -> torch.Tensor:
        held = 0 if slot.buffer is None else slot.buffer.numel()
        refusal = self._refusal()
        if refusal:
            # Worded as vLLM's WorkspaceManager words it, so that what matches
            # its message matches this one.
            raise WorkspaceLockedError(
                f"Workspace is {refusal} but allocation from '{caller_location()}' requires "
                f"{required / _MB:.2f} MB, current size is {held / _MB:.2f} MB. Workspace "
                f"growth is not allowed {_REFUSED_WHILE[refusal]} (owner={owner!r}, "
                f"lane={lane}, ubatch={ubatch}, {required} bytes asked, {held} held); "
                "size the workspace during warm-up, before capture and lock()"
            )
        if slot.buffer is not None and not slot.captured:
            # No graph viewed it: free it before the new one is made, as vLLM does.
            slot.buffer = None
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
        with self._alloc_context():
            storage = torch.empty(
                required + ALIGNMENT_BYTES - 1, dtype=torch.uint8, device=self.device
            )
        # Keep only the aligned part, so every view's offset is a multiple of the
        # alignment; the slice keeps the whole allocation alive.
        start = (-storage.data_ptr()) % ALIGNMENT_BYTES
        if slot.buffer is not None:
            slot.retired.append(slot.buffer)  # a captured graph may still read it
        slot.buffer = storage[start : start + required]
        slot.captured = False
        return slot.buffer

    def _refusal(self) -> str:
        """Why no memory may be added now ("" if it may)."""
        if self._locked:
            return "locked"
        if self._is_capturing():
            return "in a CUDA-graph capture"
        return ""

    def get_persistent_resource(
        self, key: Hashable, factory: Callable[[], T], *, ubatch: int | None = None
    ) -> T:
        """The object kept under ``key`` for the current (ubatch, lane); made by ``factory``.

        The first request calls ``factory`` (inside ``alloc_context``); later ones
        return the same object. A new key after :meth:`lock` raises
        :class:`WorkspaceLockedError` naming the caller, owner, lane and ubatch.
        """
        slot, owner, lane, ubatch = self._slot(ubatch)
        try:  # costs nothing unless it raises
            if key in slot.persistent:
                return slot.persistent[key]
        except TypeError:
            raise TypeError(
                f"key must be hashable, got {key!r} ({type(key).__name__}); use a str, or a "
                "tuple of them"
            ) from None
        check_callable("factory", factory, "pass a function of no arguments that makes it")
        refusal = self._refusal()
        if refusal:
            raise WorkspaceLockedError(
                f"Workspace is {refusal} but {key!r} was not allocated during warmup for "
                f"the current ubatch and lane ({caller_location()} asks for it; "
                f"owner={owner!r}, lane={lane}, ubatch={ubatch}, "
                f"held={self._held_bytes(lane)} bytes); create it during warm-up, "
                "before capture and lock()"
            )
        with self._alloc_context():
            resource = factory()
        slot.persistent[key] = resource
        return resource

    def get_persistent(
        self,
        key: Hashable,
        shape: Sequence[int],
        dtype: torch.dtype,
        *,
        zero_init: bool = False,
        ubatch: int | None = None,
    ) -> torch.Tensor:
        """A tensor kept under ``key`` for the current (ubatch, lane).

        Zeroed when first made if ``zero_init``, else uninitialised. Same rules
        as :meth:`get_persistent_resource`; asking for an existing key with
        another shape or dtype raises ValueError.
        """
        try:  # costs nothing unless it raises
            shape = tuple(shape)
        except TypeError:
            raise TypeError(
                f"shape must be a sequence of ints, got {shape!r} ({type(shape).__name__}); "
                "pass e.g. (64, 128), or (64,) for one dimension"
            ) from None
        tensor = self.get_persistent_resource(
            (torch.Tensor, key),
            lambda: self._new_persistent(shape, dtype, zero_init),
            ubatch=ubatch,
        )
        if tuple(tensor.shape) != shape or tensor.dtype != dtype:
            check_instance("dtype", dtype, torch.dtype, "pass a torch dtype, e.g. torch.int32")
            raise ValueError(
                f"Persistent workspace {key!r} has shape={tuple(tensor.shape)}, "
                f"dtype={tensor.dtype}; requested shape={shape}, dtype={dtype} "
                f"(owner={current_owner()!r}, ubatch={ubatch}); use a new key for a new shape"
            )
        return tensor

    def _new_persistent(
        self, shape: tuple[int, ...], dtype: torch.dtype, zero_init: bool
    ) -> torch.Tensor:
        """A new persistent tensor; the request is checked here, once, not at each lookup."""
        for i, dimension in enumerate(shape):
            check_int(f"shape[{i}]", dimension, 0, f"pass concrete sizes, got shape={shape}")
        check_instance("dtype", dtype, torch.dtype, "pass a torch dtype, e.g. torch.int32")
        # vLLM reads zero_init by truth; numpy's bools and ints read the same way.
        if not isinstance(zero_init, numbers.Integral | numpy.bool_):  # bool is Integral
            check_bool("zero_init", zero_init, "pass True or False")
        make = torch.zeros if zero_init else torch.empty
        return make(shape, dtype=dtype, device=self.device)

    def _held_bytes(self, lane: int) -> int:
        live_and_persistent = 0
        for (_, slot_lane), slot in self._slots.items():
            if slot_lane == lane:
                live, _, persistent = _slot_bytes(slot)
                live_and_persistent += live + persistent
        return live_and_persistent

    # -- lock, release, accounting ---------------------------------------------------

    def is_locked(self) -> bool:
        return self._locked

    def lock(self) -> None:
        """Refuse growth and new persistent keys from now on (call after warm-up)."""
        self._locked = True

    def unlock(self) -> None:
        """Allow growth again (before a re-capture, for instance)."""
        self._locked = False

    def release_retired(self) -> int:
        """Let go of every retired buffer; returns the bytes that this frees.

        A buffer a live checkpoint still holds is let go but not freed (its rollback
        brings it back), so its bytes are not counted.

        *Requires*: every CUDA graph that took views of a retired buffer is
        destroyed (reset or deleted) and its work synchronised. Not legal during capture.
        """
        held = {
            id(t)
            for cp in self._live_checkpoints.values()
            for _, state in cp.slots
            for t in (state.buffer, *state.retired)
            if t is not None
        }
        released = 0
        for slot in self._slots.values():
            released += sum(_allocation_bytes(t) for t in slot.retired if id(t) not in held)
            slot.retired.clear()
        return released

    def forget_graphs(self) -> int:
        """No CUDA graph is left: let go of every retired buffer (as
        :meth:`release_retired`) and count no current buffer as viewed, so the next
        growth frees it as vLLM's manager does. Returns the bytes released.

        *Requires*: every CUDA graph that took views of this workspace is destroyed
        and its work synchronised. Not legal during capture.
        """
        released = self.release_retired()
        for slot in self._slots.values():
            slot.captured = False
        return released

    def usage(self) -> dict[str, OwnerBytes]:
        """Bytes held per configured owner, summed over ubatches.

        Owners sharing a lane report the same lane's bytes each.
        """
        per_lane: dict[int, list[int]] = {lane: [0, 0, 0] for lane in range(self.num_lanes)}
        for (_, lane), slot in self._slots.items():
            for i, nbytes in enumerate(_slot_bytes(slot)):
                per_lane[lane][i] += nbytes
        return {owner: OwnerBytes(*per_lane[lane]) for owner, lane in self.owner_lanes.items()}

    # -- checkpoint / rollback -------------------------------------------------------

    def checkpoint(self) -> LaneCheckpoint:
        """Record which buffers each slot holds and the lock state, for :meth:`rollback`.

        Allocates nothing.
        """
        cp = LaneCheckpoint(
            self._serial,
            next(_checkpoint_tokens),
            self._locked,
            tuple((k, s.state()) for k, s in self._slots.items()),
        )
        self._live_checkpoints[cp.token] = cp
        return cp

    def rollback(self, checkpoint: LaneCheckpoint) -> None:
        """Return every slot to the buffers it held at ``checkpoint``, and the lock state.

        Buffers and persistent tensors created since are dropped (freed once no
        view of them is left); buffers retired since become live again.

        *Requires*: every graph captured since the checkpoint is destroyed;
        ``checkpoint`` came from this workspace and was neither rolled back nor undone
        by the rollback of an earlier one (ValueError otherwise; a refused call
        changes nothing). *Guarantees*: ``checkpoint`` and every later one become unusable.
        """
        check_instance("checkpoint", checkpoint, LaneCheckpoint, "pass what checkpoint() returned")
        if checkpoint.workspace_serial != self._serial:
            raise ValueError("checkpoint was taken from another LaneWorkspace; roll back that one")
        if checkpoint.token not in self._live_checkpoints:
            raise ValueError(
                "checkpoint was rolled back already, or an earlier checkpoint's rollback "
                "undid it; take a new checkpoint()"
            )
        for token in [t for t in self._live_checkpoints if t >= checkpoint.token]:
            del self._live_checkpoints[token]
        self._locked = checkpoint.locked
        for key, state in checkpoint.slots:
            slot = self._slots[key]
            slot.buffer = state.buffer
            slot.captured = state.captured
            slot.retired = list(state.retired)
            slot.persistent = dict(state.persistent)


def _bad_dimension(dimension: object) -> bool:
    """Whether a dimension that is not a plain int is unusable (numpy ints are fine)."""
    if isinstance(dimension, bool) or not hasattr(type(dimension), "__index__"):
        return True
    return operator.index(dimension) < 0


def _slot_bytes(slot: _Slot) -> tuple[int, int, int]:
    live = 0 if slot.buffer is None else _allocation_bytes(slot.buffer)
    retired = sum(_allocation_bytes(t) for t in slot.retired)
    persistent = sum(
        t.numel() * t.element_size()
        for t in slot.persistent.values()
        if isinstance(t, torch.Tensor)
    )
    return live, retired, persistent


def _allocation_bytes(buffer: torch.Tensor) -> int:
    """Bytes of the allocation behind an aligned buffer slice (slack included)."""
    return buffer.untyped_storage().nbytes()
