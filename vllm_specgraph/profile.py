"""Disposable CUDA-graph memory profile.

Before the KV cache exists, capture every owner's graphs (target, draft, ...)
into a private pool, read what they cost at driver level, destroy them while
the pool is still ours, give every byte back, roll back the channels they
made, and hand back the production state exactly as it was.

Order (each step's reason is at the step):

1. settle (gc, sync, empty_cache); run each owner's eager warm-up;
2. baseline at driver level (``mem_get_info``) and allocator level;
3. checkpoint channels and workspace lanes;
4. capture each owner's graphs, each inside its own lane, into one private
   pool (redirected into the caller's graph managers if asked); measure per owner;
5. sync; destroy every graph while the private pool is still owned; restore
   the lanes and production pools; release the pool (empty_cache);
6. roll back channels; measure what is left. If the pass left memory taken,
   it met state the process keeps once loaded (kernel code, say): that is
   one-time, and steps 3-6 run again with it in place, unless the pass shows
   that none of it came from a capture (:func:`measure_graph_memory`).

Steps 3-6 run with every older object frozen out of garbage collection, so a
collection there visits only what the pass made: milliseconds where a full one
takes about half a second in a served model's process.

:func:`measure_graph_memory` is the one engine: :func:`profile_graph_memory`
runs it over :class:`OwnerGraphs`, and the vLLM patch over vLLM's own
``capture_model``; both measure each capture with
:class:`~vllm_specgraph.meter.CaptureMeter`, as production's capture is measured.

An exception at any step runs the same teardown and re-raises the original.
"""

from __future__ import annotations

import gc
import json
import logging
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from contextvars import ContextVar
from dataclasses import asdict, dataclass, replace
from typing import Generic, TypeVar

import torch

from vllm_specgraph._checks import (
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
from vllm_specgraph.meter import (
    CaptureMeter,
    OwnerMemory,
    allocator_segments,
    describe_owners,
    live_blocks,
    settled_free_bytes,
)

__all__ = [
    "ONE_TIME_THRESHOLD_BYTES",
    "DisposablePass",
    "GraphMemoryProfile",
    "GraphMemoryReport",
    "OwnerGraphs",
    "PassReading",
    "current_disposable_pass",
    "disposable_graph_pass",
    "measure_captures",
    "measure_graph_memory",
    "profile_graph_memory",
    "release_capture_stream_workspaces",
]

_logger = logging.getLogger("vllm_specgraph")

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
class GraphMemoryReport:
    """Result of :func:`measure_graph_memory`; all sizes in bytes.

    Attributes:
        owners: each owner's graphs, as production will take them.
        one_time_bytes: what the first pass left taken that production will not
            take again (kernel code loaded on first launch);
            from :func:`profile_graph_memory`, also what the eager warm-up took.
        transient_peak_bytes: the allocator's reserved peak during the last
            pass, above its reserved bytes when the profile began.
        retained_bytes: what the last pass left taken (at most the threshold
            after one pass; what the second left after two). May be negative.
        retained_allocator_bytes: of all the profile kept (one-time and
            retained), the allocator's reserved share.
        wall_seconds: the profile's time.
    """

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
            f"{self.transient_peak_bytes / _MIB:.2f} MiB, retained "
            f"{self.retained_bytes / _MIB:.2f} MiB (allocator "
            f"{self.retained_allocator_bytes / _MIB:.2f} MiB), {self.wall_seconds:.2f} s"
        )
        return "\n".join(rows)


PoolRedirect = Callable[[tuple[int, int]], AbstractContextManager[object]]
"""Points the caller's graph managers at the private pool for the duration of the block."""

Step = Callable[[], object]


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


ONE_TIME_THRESHOLD_BYTES = 1 << 20
"""A pass that leaves more than this taken met process state for the first time."""


@dataclass(frozen=True)
class PassReading:
    """What one disposable pass measured, as a pass function gives it back.

    A caller may give back a subclass that carries more of what its pass read.

    Attributes:
        owners: each owner's bytes and graphs in this pass.
        blocks_before_capture: the allocator's allocated blocks (``live_blocks()``)
            when the first capture of the pass began.
        expandable_segments: whether the captures ran with expandable segments,
            whose packing follows the order of the requests alone.
    """

    owners: tuple[OwnerMemory, ...]
    blocks_before_capture: frozenset[tuple[int, int]]
    expandable_segments: bool = False


R = TypeVar("R", bound=PassReading)


@dataclass(frozen=True)
class GraphMemoryProfile(Generic[R]):
    """What :func:`measure_graph_memory` found: the report, the passes it took, the
    last pass's reading and the allocator's blocks once that pass had ended."""

    report: GraphMemoryReport
    passes: int
    last: R
    blocks_after: frozenset[tuple[int, int]]


def _alone(flag: bool) -> bool:
    return flag


def measure_graph_memory(
    run_pass: Callable[[int], R | None],
    *,
    agree: Callable[[bool], bool] = _alone,
    log: Callable[[str], None] = _logger.info,
) -> GraphMemoryProfile[R] | None:
    """Measure graph memory by one disposable pass, or two where one cannot tell.

    ``run_pass(index)`` (index 0, then 1) runs one disposable pass (steps 3-6:
    every graph captured into a private pool, measured per owner, destroyed,
    every byte given back) and gives back its :class:`PassReading`, or None when
    there is no graph to capture. A pass that leaves more than
    :data:`ONE_TIME_THRESHOLD_BYTES` taken met state the process keeps once
    loaded (kernel code, the draft's attention buffers for a profiling KV
    cache), which production will find in place: that is ``one_time_bytes``.
    One pass is still enough when its captures ran with expandable segments
    and what it left is, within the threshold, the owners' bytes outside the
    allocator plus blocks made before the capture began: no block a capture
    made was kept, so each owner's allocator bytes are what production will
    take. Otherwise a second pass measures with that state in place.

    ``agree`` turns this rank's "measure again" into every rank's decision
    (``functools.partial(on_any_rank, group=cpu_group)``): a pass runs
    collectives, so ranks must not differ. It is called once per profile, also
    when the first pass finds nothing to capture. ``log`` gets a line where the
    profile decides.

    *Requires*: no capture is active; work in flight is what the caller wants
    measured.
    *Guarantees*: what ``run_pass`` guarantees. The engine itself changes only
    the allocator's cache (emptied before its baseline) and its peak statistics
    (reset before each pass, for ``transient_peak_bytes``).
    """
    check_callable("run_pass", run_pass, "pass a function of the pass index")
    check_callable("agree", agree, "pass a function of this rank's flag")
    check_callable("log", log, "pass a function of a line")
    started = time.perf_counter()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    free_start, reserved_start = torch.cuda.mem_get_info()[0], torch.cuda.memory_reserved()
    blocks_start = live_blocks()
    torch.cuda.reset_peak_memory_stats()
    first = run_pass(0)
    if first is None:
        agree(False)  # the ranks that captured wait for this vote
        return None
    # A pass ends by settling (its teardown empties the cache): plain readings will do.
    free_after, blocks_after = torch.cuda.mem_get_info()[0], live_blocks()
    peak = torch.cuda.max_memory_reserved() - reserved_start
    left = free_start - free_after
    owners, one_time, retained, one_pass = first.owners, 0, left, True
    if left > ONE_TIME_THRESHOLD_BYTES:
        one_time, retained = left, 0
        outside_allocator = sum(o.driver_bytes - o.allocator_bytes for o in first.owners)
        in_allocator = torch.cuda.memory_reserved() - reserved_start
        made_while_capturing = blocks_after - blocks_start - first.blocks_before_capture
        one_pass = (
            first.expandable_segments
            and not made_while_capturing
            and abs(outside_allocator + in_allocator - left) <= ONE_TIME_THRESHOLD_BYTES
        )
        if one_pass:
            owners = tuple(replace(o, driver_bytes=o.allocator_bytes) for o in first.owners)
            log(
                f"the profiling pass left {left / _MIB:.1f} MiB taken, all one-time: "
                f"{outside_allocator / _MIB:.1f} MiB outside the allocator and "
                f"{in_allocator / _MIB:.1f} MiB of blocks made before capturing; its "
                f"allocator bytes are the graphs: {describe_owners(owners)}"
            )
    last, passes = first, 1
    if agree(not one_pass):
        # A block a capture made and kept, or allocator packing that may differ
        # (without expandable segments, on an H200, a 1B model's first pass
        # missed production by a segment), here or on another rank: a second
        # pass finds the one-time state in place, as production will.
        for_another_rank = " (another rank's pass asks for a second)" if one_pass else ""
        log(
            f"the first profiling pass took {describe_owners(first.owners)} and left "
            f"{one_time / _MIB:.1f} MiB taken"
            f"{for_another_rank}; "
            "measuring again with that state in place"
        )
        torch.cuda.reset_peak_memory_stats()
        again = run_pass(1)
        if again is None:
            raise RuntimeError(
                "the second profiling pass found no graph to capture where the first found "
                "some; the pass function must capture the same graphs every time"
            )
        free_again, blocks_after = torch.cuda.mem_get_info()[0], live_blocks()
        peak = torch.cuda.max_memory_reserved() - reserved_start
        last, passes = again, 2
        owners, retained = again.owners, free_after - free_again
    report = GraphMemoryReport(
        owners=owners,
        one_time_bytes=one_time,
        transient_peak_bytes=peak,
        retained_bytes=retained,
        retained_allocator_bytes=torch.cuda.memory_reserved() - reserved_start,
        wall_seconds=time.perf_counter() - started,
    )
    return GraphMemoryProfile(report, passes, last, blocks_after)


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
    agree: Callable[[bool], bool] = _alone,
) -> GraphMemoryReport:
    """Measure what each owner's CUDA graphs cost, then give every byte back.

    Runs each owner's eager warm-up, then :func:`measure_graph_memory` over
    disposable passes of every owner's captures: one pass where it leaves
    nothing taken, two where the first met one-time process state (kernel
    modules loaded on first capture). ``one_time_bytes`` holds both what the
    eager warm-up took and what the first pass left. ``agree`` is as there:
    where the channel pools span several ranks (their creation and rollback are
    collective), pass ``functools.partial(on_any_rank, group=cpu_group)``, or
    ranks whose readings differ take different passes and wait for each other.

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
    owners = check_items("owners", owners, OwnerGraphs, _OWNERS_FIX)
    channel_pools = _checked_pass_arguments(channel_pools, workspace, redirect_pools)
    check_callable("agree", agree, "pass a function of this rank's flag")
    _check_owners(owners, workspace, channel_pools)
    started = time.perf_counter()
    free_before_warmup = settled_free_bytes()
    for o in owners:
        if o.warmup is not None:
            with use_owner(o.owner):
                o.warmup()
    warmup_bytes = free_before_warmup - settled_free_bytes()

    def run_pass(index: int) -> PassReading:
        with disposable_graph_pass(
            channel_pools=channel_pools, workspace=workspace, redirect_pools=redirect_pools
        ) as disposable:
            recorders: list[GraphRecorder] = []
            disposable.on_destroy(lambda: [recorder.reset() for recorder in recorders])
            for o in owners:
                if o.release is not None:
                    disposable.on_destroy(o.release)
            disposable.on_destroy(recorders.clear)
            blocks_before_capture = live_blocks()
            measured = measure_captures(owners, disposable.pool, channel_pools, recorders)
        return PassReading(measured, blocks_before_capture)

    profile = measure_graph_memory(run_pass, agree=agree)
    assert profile is not None, "a pass over OwnerGraphs always captures"
    return replace(
        profile.report,
        one_time_bytes=warmup_bytes + profile.report.one_time_bytes,
        wall_seconds=time.perf_counter() - started,
    )


def measure_captures(
    owners: Sequence[OwnerGraphs],
    pool: tuple[int, int],
    channel_pools: Sequence[ChannelPool],
    recorders: list[GraphRecorder],
) -> tuple[OwnerMemory, ...]:
    """Capture each owner's graphs into ``pool``, in order, and measure each owner.

    Appends one :class:`GraphRecorder` per owner to ``recorders`` as it is made,
    so that after an error midway the caller can still destroy what was captured.
    The profile's step 4, and how production capture is measured, so both
    follow one path: a :class:`~vllm_specgraph.meter.CaptureMeter` over the
    whole call, the first owner getting what the others did not take. Not legal
    during capture.
    """
    owners = check_items("owners", owners, OwnerGraphs, _OWNERS_FIX)
    channel_pools = check_items("channel_pools", channel_pools, ChannelPool, _CHANNEL_POOLS_FIX)
    check_pool_handle("pool", pool, "pass torch.cuda.graph_pool_handle()")
    check_instance("recorders", recorders, list, "pass a list, to which the recorders are added")
    if not owners:
        raise ValueError("owners is empty; pass at least the target's OwnerGraphs")
    meter = CaptureMeter(lambda: sum(r.num_graphs for r in recorders), rest_owner=owners[0].owner)
    with meter.whole_call():
        for o in owners:
            recorders.append(GraphRecorder(pool, o.owner, channel_pools))
            with (
                use_owner(o.owner),
                meter.measure(o.owner) if o is not owners[0] else nullcontext(),
            ):
                o.capture(recorders[-1])
    return meter.owners()


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
