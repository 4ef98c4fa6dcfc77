"""Disposable CUDA-graph memory profile.

Before the KV cache exists, capture every owner's graphs (target, draft, ...)
into a private pool, read what they cost at driver level, destroy them while
the pool is still ours, give every byte back, roll back the channels they
made, and hand back the production state exactly as it was.

Order (each step's reason is at the step):

1. settle (gc, sync, empty_cache); run each owner's eager warm-up, then steps
   3-6 once unmeasured, and report what that took as a one-time process cost;
2. baseline at driver level (``mem_get_info``) and allocator level;
3. checkpoint channels and workspace lanes;
4. capture each owner's graphs, each inside its own lane, into one private
   pool (redirected into the caller's graph managers if asked); measure per owner;
5. sync; destroy every graph while the private pool is still owned; restore
   the lanes and production pools; release the pool (empty_cache);
6. roll back channels; measure what is left.

Steps 3-6 run with every older object frozen out of garbage collection, so a
collection there visits only what the pass made: milliseconds where a full one
takes about half a second in a served model's process.

An exception at any step runs the same teardown and re-raises the original.
"""

from __future__ import annotations

import gc
import json
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from contextvars import ContextVar
from dataclasses import asdict, dataclass
from typing import Any

import torch

from vllm_specgraph._checks import (
    check_bool,
    check_callable,
    check_instance,
    check_items,
    check_pool_handle,
    check_str,
)
from vllm_specgraph.capture import GraphRecorder
from vllm_specgraph.channels import (
    ChannelPool,
    checkpoint_channel_pools,
    rollback_channel_pools,
)
from vllm_specgraph.lanes import LaneWorkspace, use_owner

__all__ = [
    "DisposablePass",
    "GraphMemoryReport",
    "OwnerGraphs",
    "OwnerMemory",
    "allocator_segments",
    "current_disposable_pass",
    "disposable_graph_pass",
    "live_blocks",
    "measure_captures",
    "profile_graph_memory",
    "release_capture_stream_workspaces",
    "segment_blocks",
    "settled_free_bytes",
]

_MIB = 1 << 20


@dataclass(frozen=True)
class OwnerGraphs:
    """What the profile needs to know about one owner's graphs.

    Attributes:
        owner: lane owner name ("target", "draft", ...); unique per profile.
        capture: captures the owner's graphs through the recorder it is given
            (``with recorder.capture(): ...``). Runs as ``owner``.
        warmup: eager run(s) that load kernels and size workspaces; runs once
            before the baseline so its cost is reported as one-time, not per graph.
        release: drops whatever ``capture`` kept that lives in the graph pool
            (static outputs); called in teardown, also after an error.
    """

    owner: str
    capture: Callable[[GraphRecorder], None]
    warmup: Callable[[], None] | None = None
    release: Callable[[], None] | None = None

    def __post_init__(self) -> None:
        # Checked when made, not mid-pass with graphs captured.
        check_str("OwnerGraphs.owner", self.owner, "name the owner, e.g. 'target'")
        check_callable("OwnerGraphs.capture", self.capture, "pass a function of the recorder")
        for name in ("warmup", "release"):
            value = getattr(self, name)
            if value is not None:
                check_callable(f"OwnerGraphs.{name}", value, "pass a function, or None")


@dataclass(frozen=True)
class OwnerMemory:
    owner: str
    num_graphs: int
    driver_bytes: int
    allocator_bytes: int


@dataclass(frozen=True)
class GraphMemoryReport:
    """Result of :func:`profile_graph_memory`; all sizes in bytes."""

    owners: tuple[OwnerMemory, ...]
    one_time_bytes: int
    transient_peak_bytes: int
    retained_bytes: int
    retained_allocator_bytes: int
    wall_seconds: float

    @property
    def total_driver_bytes(self) -> int:
        return sum(o.driver_bytes for o in self.owners)

    @property
    def total_allocator_bytes(self) -> int:
        return sum(o.allocator_bytes for o in self.owners)

    def to_json(self) -> str:
        return json.dumps(asdict(self) | {"total_driver_bytes": self.total_driver_bytes}, indent=2)

    def format_table(self) -> str:
        rows = [f"{'owner':<10} {'graphs':>6} {'driver MiB':>11} {'allocator MiB':>14}"]
        for o in self.owners:
            rows.append(
                f"{o.owner:<10} {o.num_graphs:>6} {o.driver_bytes / _MIB:>11.2f} "
                f"{o.allocator_bytes / _MIB:>14.2f}"
            )
        total_graphs = sum(o.num_graphs for o in self.owners)
        rows.append(
            f"{'total':<10} {total_graphs:>6} {self.total_driver_bytes / _MIB:>11.2f} "
            f"{self.total_allocator_bytes / _MIB:>14.2f}"
        )
        rows.append(
            f"one-time process cost {self.one_time_bytes / _MIB:.2f} MiB, transient peak "
            f"{self.transient_peak_bytes / _MIB:.2f} MiB, retained after teardown "
            f"{self.retained_bytes / _MIB:.2f} MiB (allocator "
            f"{self.retained_allocator_bytes / _MIB:.2f} MiB), {self.wall_seconds:.2f} s"
        )
        return "\n".join(rows)


PoolRedirect = Callable[[tuple[int, int]], AbstractContextManager[object]]
"""Points the caller's graph managers at the private pool for the duration of the block."""

Step = Callable[[], object]


def settled_free_bytes() -> int:
    """Driver-level free bytes once nothing cached or in flight distorts the reading.

    Collects garbage, synchronises and empties the allocator cache first.
    Not legal during capture.
    """
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info()[0]


def allocator_segments() -> list[dict[str, Any]]:
    """This device's segments in the caching allocator's snapshot, with their blocks.

    About a millisecond; legal during capture.
    """
    device = torch.cuda.current_device()
    return [s for s in torch.cuda.memory_snapshot() if s.get("device", device) == device]


def live_blocks() -> frozenset[tuple[int, int]]:
    """``(address, size)`` of every allocated block of the caching allocator on this device.

    Two readings tell which blocks were made in between and are still alive.
    """
    return frozenset(block for segment in allocator_segments() for block in segment_blocks(segment))


def segment_blocks(segment: dict[str, Any]) -> frozenset[tuple[int, int]]:
    """``(address, size)`` of the allocated blocks of one of :func:`allocator_segments`."""
    try:  # costs nothing unless it raises
        blocks = segment["blocks"]
    except (TypeError, KeyError) as exc:
        raise (ValueError if isinstance(exc, KeyError) else TypeError)(
            f"segment must be a segment dict with 'blocks', as allocator_segments() returns "
            f"them, got {segment!r} ({type(segment).__name__})"
        ) from None
    return frozenset(
        (block["address"], block["size"])
        for block in blocks
        if block["state"] == "active_allocated"
    )


@contextmanager
def _older_objects_frozen() -> Iterator[Callable[[], None]]:
    """Leave every object that exists now out of garbage collection until the block exits.

    Yields ``thaw``, which ends the freeze early. ``gc.unfreeze`` thaws every
    frozen object: a heap frozen before the block comes out thawed, as vLLM's
    own capture-time freeze leaves it.
    """
    gc.freeze()
    frozen = True

    def thaw() -> None:
        nonlocal frozen
        if frozen:
            gc.unfreeze()
            frozen = False

    try:
        yield thaw
    finally:
        thaw()


def _release_pool(pool: tuple[int, int], thaw: Callable[[], None]) -> None:
    """Collect what the pass made, then give the pool's memory back to the driver.

    An object older than the pass may still hold a pool tensor through a
    reference cycle that only a collection of the whole heap finds: if the pool
    keeps a segment, thaw and collect everything once.
    """
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    if any(tuple(s.get("segment_pool_id", ())) == tuple(pool) for s in allocator_segments()):
        thaw()
        gc.collect()
        torch.cuda.empty_cache()


def release_capture_stream_workspaces() -> None:
    """Free the cuBLAS workspaces torch keeps per (handle, stream), but the current stream's.

    A capture stream that only throwaway graphs used would keep its workspace
    (32 MiB on Hopper) for the life of the process, while the production
    capture, on streams of its own, pays for new ones. The current stream's
    workspace is production state: it is made again at once. *Requires*: no
    work in flight (synchronise first). Not legal during capture.
    """
    torch._C._cuda_clearCublasWorkspaces()
    torch.cuda.current_blas_handle()


_OWNERS_FIX = "pass a list of OwnerGraphs, e.g. [OwnerGraphs('target', capture)]"
_CHANNEL_POOLS_FIX = "pass a list of ChannelPools"


def _checked_pass_arguments(
    channel_pools: Sequence[ChannelPool],
    workspace: LaneWorkspace | None,
    redirect_pools: PoolRedirect | None,
) -> tuple[ChannelPool, ...]:
    """The channel pools as a tuple, each argument of a pass checked.

    Checks types only and touches nothing, so it runs before any CUDA call.
    """
    if workspace is not None:
        check_instance("workspace", workspace, LaneWorkspace, "pass the LaneWorkspace, or None")
    if redirect_pools is not None:
        check_callable("redirect_pools", redirect_pools, "pass a function of the pool, or None")
    return check_items("channel_pools", channel_pools, ChannelPool, _CHANNEL_POOLS_FIX)


def _check_owners(
    owners: Sequence[OwnerGraphs],
    workspace: LaneWorkspace | None,
    channel_pools: Sequence[ChannelPool],
) -> None:
    if not owners:
        raise ValueError("owners is empty; pass at least the target's OwnerGraphs")
    names = [o.owner for o in owners]
    if len(set(names)) != len(names):
        raise ValueError(f"owner names must be unique, got {names}; merge their captures")
    if workspace is not None:
        for name in names:
            workspace.lane_of(name)  # raises, naming the fix, before anything is touched
    if not torch.cuda.is_available():
        raise RuntimeError("profile_graph_memory needs CUDA; torch sees no GPU")
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            "profile_graph_memory was called while the current stream is capturing a CUDA "
            "graph; call it before capture, when the engine sizes its KV cache"
        )
    checkpoint_channel_pools(channel_pools)  # a busy channel pool refuses here, before any warm-up


class DisposablePass:
    """A disposable pass in progress: its private graph pool and what to destroy.

    Made by :func:`disposable_graph_pass`. Register with :meth:`on_destroy`
    everything that keeps memory of :attr:`pool` alive (graphs, static outputs).
    """

    def __init__(self, pool: tuple[int, int]) -> None:
        self.pool = check_pool_handle("pool", pool, "pass torch.cuda.graph_pool_handle()")
        self._destroy_steps: list[Step] = []

    def on_destroy(self, step: Step) -> None:
        """Run ``step`` at teardown, after a synchronise, while the pool is still owned.

        Steps run in registration order, every one even if an earlier one fails.
        """
        check_callable("step", step, "pass a function of no arguments")
        self._destroy_steps.append(step)

    def _destroy(self, error: BaseException | None = None) -> None:
        steps, self._destroy_steps = [torch.cuda.synchronize, *self._destroy_steps], []
        _tear_down(steps, error)


_active_pass: ContextVar[DisposablePass | None] = ContextVar(
    "vllm_specgraph_disposable_pass", default=None
)


def current_disposable_pass() -> DisposablePass | None:
    """The disposable pass whose block is running in this thread or task, else None.

    Communicators ask it to tell a throwaway capture from a production one, and
    register with :meth:`DisposablePass.on_destroy` what they made for it. Set
    only by :func:`disposable_graph_pass`, for its block, and reset on exit,
    also on error. Legal during capture.
    """
    return _active_pass.get()


@contextmanager
def _marked_active(disposable: DisposablePass) -> Iterator[None]:
    token = _active_pass.set(disposable)
    try:
        yield
    finally:
        _active_pass.reset(token)


@contextmanager
def disposable_graph_pass(
    *,
    channel_pools: Sequence[ChannelPool] = (),
    workspace: LaneWorkspace | None = None,
    redirect_pools: PoolRedirect | None = None,
) -> Iterator[DisposablePass]:
    """Capture into a private pool that is given back whole when the block exits.

    On entry: checkpoint ``channel_pools``, make a private pool, freeze every
    object that exists, checkpoint ``workspace``, make the pass
    :func:`current_disposable_pass`, enter ``redirect_pools(pool)``. On exit,
    on success and on error alike: synchronise and run the destroy steps while
    the pool is still owned, exit the redirect (production pools back), roll
    the lanes back (growth since may live in the pool), collect garbage
    (reference cycles may still hold pool tensors), release the pool (empty the
    cache), roll the channels back (their contract: every graph using them is
    destroyed and synchronised), thaw. An error in the block is re-raised with
    any teardown failures as notes.

    The freeze keeps every collection in the pass, the block's and the destroy
    steps' included, to what the pass made. The pass checks that the pool kept
    no segment, and collects the whole heap once if it did.

    *Requires*: no capture is active; nothing in the block unfreezes the heap.
    *Guarantees*: channels, lanes (buffers and lock state) and the redirected
    pools are left as they were found; the heap is left thawed.
    """
    channel_pools = _checked_pass_arguments(channel_pools, workspace, redirect_pools)
    channels_checkpoint = checkpoint_channel_pools(channel_pools)
    disposable = DisposablePass(torch.cuda.graph_pool_handle())
    with _older_objects_frozen() as thaw:
        restore: list[Step] = []
        if workspace is not None:
            lanes_checkpoint = workspace.checkpoint()
            restore.append(lambda: workspace.rollback(lanes_checkpoint))
        restore += [
            lambda: _release_pool(disposable.pool, thaw),
            lambda: rollback_channel_pools(channels_checkpoint),
        ]
        try:
            with (
                _marked_active(disposable),
                redirect_pools(disposable.pool) if redirect_pools else nullcontext(),
            ):
                try:
                    yield disposable
                except BaseException as exc:
                    disposable._destroy(exc)
                    raise
                disposable._destroy()
        except BaseException as exc:
            # The traceback's frames hold the failed capture's tensors, which live in
            # the private pool: clear them or the pool cannot go back to the driver.
            traceback.clear_frames(exc.__traceback__)
            _tear_down(restore, exc)
            raise
        _tear_down(restore)


def profile_graph_memory(
    owners: Sequence[OwnerGraphs],
    *,
    channel_pools: Sequence[ChannelPool] = (),
    workspace: LaneWorkspace | None = None,
    redirect_pools: PoolRedirect | None = None,
    warmup_capture: bool = True,
) -> GraphMemoryReport:
    """Measure what each owner's CUDA graphs cost, then give every byte back.

    With ``warmup_capture`` every graph is first captured and destroyed once,
    unmeasured: the first capture in a process loads kernel modules and driver
    state that stay with the process, and production capture will not pay them
    again. They are reported as ``one_time_bytes``; without the warm-up pass
    (half the time) they inflate the per-owner figures instead.

    *Requires*: no capture is active; the KV cache is not yet allocated (the
    profile measures free memory, and anything it cannot free is reported as
    retained); capture callables keep pool tensors only where ``release`` drops them.

    *Guarantees*, on success and on error: every graph captured here is
    destroyed, the private pools are released, channels made here are closed
    (``channel_pools`` rolled back), ``workspace`` holds the buffers it held
    after the owners' eager warm-up, and ``redirect_pools`` has been exited
    (production pools restored). The eager warm-up's effects (loaded kernels,
    sized workspace lanes, eager channels) are production state and stay.
    """
    check_bool("warmup_capture", warmup_capture, "pass True or False")
    owners = check_items("owners", owners, OwnerGraphs, _OWNERS_FIX)
    channel_pools = _checked_pass_arguments(channel_pools, workspace, redirect_pools)
    _check_owners(owners, workspace, channel_pools)
    started = time.perf_counter()
    free_initial = settled_free_bytes()
    for o in owners:
        if o.warmup is not None:
            with use_owner(o.owner):
                o.warmup()
    if warmup_capture:
        _run_disposable_pass(owners, channel_pools, workspace, redirect_pools)
    free_base = settled_free_bytes()
    reserved_base = torch.cuda.memory_reserved()
    torch.cuda.reset_peak_memory_stats()
    measured = _run_disposable_pass(owners, channel_pools, workspace, redirect_pools)
    peak = torch.cuda.max_memory_reserved() - reserved_base
    return GraphMemoryReport(
        owners=tuple(measured),
        one_time_bytes=free_initial - free_base,
        transient_peak_bytes=peak,
        retained_bytes=free_base - settled_free_bytes(),
        retained_allocator_bytes=torch.cuda.memory_reserved() - reserved_base,
        wall_seconds=time.perf_counter() - started,
    )


def _run_disposable_pass(
    owners: Sequence[OwnerGraphs],
    channel_pools: Sequence[ChannelPool],
    workspace: LaneWorkspace | None,
    redirect_pools: PoolRedirect | None,
) -> list[OwnerMemory]:
    """One pass of steps 3-6: capture every owner into a private pool, then give it back."""
    with disposable_graph_pass(
        channel_pools=channel_pools, workspace=workspace, redirect_pools=redirect_pools
    ) as disposable:
        recorders: list[GraphRecorder] = []
        disposable.on_destroy(lambda: [recorder.reset() for recorder in recorders])
        for o in owners:
            if o.release is not None:
                disposable.on_destroy(o.release)
        disposable.on_destroy(recorders.clear)
        return measure_captures(owners, disposable.pool, channel_pools, recorders)


def measure_captures(
    owners: Sequence[OwnerGraphs],
    pool: tuple[int, int],
    channel_pools: Sequence[ChannelPool],
    recorders: list[GraphRecorder],
) -> list[OwnerMemory]:
    """Capture each owner's graphs into ``pool``, in order, and measure each owner.

    Appends one :class:`GraphRecorder` per owner to ``recorders`` as it is made,
    so that after an error midway the caller can still destroy what was captured.
    The profile's step 4, and how production capture is measured, so both
    follow one path. Not legal during capture.
    """
    owners = check_items("owners", owners, OwnerGraphs, _OWNERS_FIX)
    channel_pools = check_items("channel_pools", channel_pools, ChannelPool, _CHANNEL_POOLS_FIX)
    check_pool_handle("pool", pool, "pass torch.cuda.graph_pool_handle()")
    check_instance("recorders", recorders, list, "pass a list, to which the recorders are added")
    measured = []
    free_prev, reserved_prev = settled_free_bytes(), torch.cuda.memory_reserved()
    for o in owners:
        recorders.append(GraphRecorder(pool, o.owner, channel_pools))
        with use_owner(o.owner):
            o.capture(recorders[-1])
        free_now = settled_free_bytes()
        reserved_now = torch.cuda.memory_reserved()
        measured.append(
            OwnerMemory(
                o.owner,
                recorders[-1].num_graphs,
                driver_bytes=free_prev - free_now,
                allocator_bytes=reserved_now - reserved_prev,
            )
        )
        free_prev, reserved_prev = free_now, reserved_now
    return measured


def _tear_down(steps: Sequence[Step], error: BaseException | None = None) -> None:
    """Run every step even if some fail. With ``error`` in flight, failures become
    notes on it (the caller re-raises the original); otherwise the first one is raised."""
    failures: list[Exception] = []
    for step in steps:
        try:
            step()
        except Exception as exc:
            failures.append(exc)
    if error is not None:
        for failure in failures:
            error.add_note(f"profile teardown also failed: {failure!r}")
    elif failures:
        raise failures[0]
