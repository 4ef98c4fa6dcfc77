"""Graph-scoped communication channels for custom collectives.

A *channel* is the device memory a communicator's kernels run on (staging buffers, signal
slots, peers' imported IPC memory). A captured CUDA graph bakes in its channel, so graphs
sharing one corrupt each other's data, and a throwaway graph's leftover channel leaks memory
and peer mappings. :class:`ChannelPool` gives every capture its own channel, keeps it alive
until rollback/close, and closes channels in a rank-coordinated order. Enter the channel
pool *before* the graph: creating a channel allocates and may be collective::

    with channel_pool.capture(owner="target") as channel:
        with torch.cuda.graph(graph, pool=graph_pool):
            run_model(channel)

Naming: a bare "pool" is a CUDA graph memory pool; the channel side is always a channel
pool (``channel_pool``, ``channel_pools``).

This module depends on torch only and never imports vLLM.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import ExitStack, contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch

from vllm_specgraph._checks import check_callable, check_instance, check_items, check_str
from vllm_specgraph.device_channel import DeviceChannel, device_channel_factory

_logger = logging.getLogger("vllm.specgraph")

__all__ = [
    "Channel",
    "ChannelCheckpoint",
    "ChannelCloseError",
    "ChannelPool",
    "ChannelPoolsCheckpoint",
    "CreateChannelFn",
    "DeviceChannel",
    "checkpoint_channel_pools",
    "device_channel_factory",
    "rollback_channel_pools",
    "stream_is_capturing",
]

# Process-wide counters: channel pool serials never repeat (unlike id()), and checkpoint tokens are
# ordered, so a rollback can invalidate every checkpoint taken after its own.
_channel_pool_serials = itertools.count()
_checkpoint_tokens = itertools.count()

_FIX_CAPTURE_ORDER = "enter channel_pool.capture() before torch.cuda.graph(...)"


@runtime_checkable
class Channel(Protocol):
    """Device memory used by one communicator's kernels and baked into captured graphs.

    Requires: ``close_imports`` is called on every rank before ``free_exports`` on any rank
    (the pool's barriers enforce this), each at most once, and only after every graph that
    references the channel is destroyed and the device is synchronized.
    """

    channel_id: int

    def close_imports(self) -> None:
        """Unmap the peers' memory this rank imported. Not legal during capture."""
        ...

    def free_exports(self) -> None:
        """Free this rank's own exported memory. Not legal during capture."""
        ...


CreateChannelFn = Callable[[int, str], Channel]
"""``create_channel(channel_id, owner) -> Channel``; may be collective across ranks."""


@dataclass(frozen=True, slots=True)
class ChannelCheckpoint:
    """Opaque token returned by :meth:`ChannelPool.checkpoint`; usable for one rollback."""

    channel_pool_name: str
    channel_pool_serial: int  # identifies the channel pool; names may repeat
    num_channels: int  # channels that existed when the checkpoint was taken
    token: int  # unique and increasing across the process


@dataclass(frozen=True, slots=True)
class ChannelPoolsCheckpoint:
    """Checkpoints of several distinct channel pools, in the order they were taken."""

    channel_pools: tuple[ChannelPool, ...]
    checkpoints: tuple[ChannelCheckpoint, ...]


def _no_op() -> None:
    pass


def _synchronize_device() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class ChannelCloseError(RuntimeError):
    """Closing channels failed part-way; the pool still owns every channel not yet freed.

    Attributes:
        channel_pool_name: the channel pool's name.
        channel_ids: ids of the channels still owned and not freed, newest first (see
            :attr:`ChannelPool.unclosed_channels`); :meth:`ChannelPool.retry_close` finishes
            them.
    """

    def __init__(self, message: str, channel_pool_name: str, channel_ids: tuple[int, ...]) -> None:
        super().__init__(message)
        self.channel_pool_name = channel_pool_name
        self.channel_ids = channel_ids


@dataclass(slots=True)
class _Closing:
    """A channel on its way out and the close steps it completed, so a retry can resume."""

    channel: Channel
    done: set[str] = field(default_factory=set)  # "close_imports", "free_exports"


class _CloseStepError(RuntimeError):
    """One close step failed for some channels; the message names each and its error."""


def _close_step(closing: list[_Closing], step: str) -> None:
    """Run ``step`` on every channel not past it yet; one failure does not stop the others."""
    failures: list[tuple[int, Exception]] = []
    for entry in closing:
        if step in entry.done:
            continue
        try:
            getattr(entry.channel, step)()
        except Exception as exc:
            failures.append((entry.channel.channel_id, exc))
        else:
            entry.done.add(step)
    if failures:
        detail = "; ".join(f"channel {cid}: {exc!r}" for cid, exc in failures)
        raise _CloseStepError(f"{step} failed for {detail}") from failures[0][1]


def stream_is_capturing() -> bool:
    """Whether the current CUDA stream is capturing a graph (False without CUDA)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


class ChannelPool:
    """Hands out one channel per graph capture and one eager channel; frees them coordinated.

    Arguments:
        name: label used in errors (e.g. ``"tp"``, ``"dcp"``).
        create_channel: factory ``(channel_id, owner) -> Channel``. Channel ids are assigned
            by the pool in creation order and never reused, so ranks that create channels in
            the same order agree on ids.
        barrier: collective barrier across the communicator's ranks; no-op by default
            (single process).
        synchronize: device synchronization; ``torch.cuda.synchronize`` when CUDA is
            available, else a no-op.

    Owns: every channel it created, until :meth:`rollback` or :meth:`close` closes it.
    Captured graphs only borrow channels; callers must destroy them first.
    """

    def __init__(
        self,
        name: str,
        create_channel: CreateChannelFn,
        *,
        barrier: Callable[[], object] | None = None,
        synchronize: Callable[[], object] | None = None,
    ) -> None:
        check_str("name", name, "label the pool after its communicator, e.g. 'tp'")
        check_callable(
            "create_channel", create_channel, "pass a factory (channel_id, owner) -> Channel"
        )
        for arg, fn in (("barrier", barrier), ("synchronize", synchronize)):
            if fn is not None:
                check_callable(arg, fn, f"pass a function of no arguments, or leave {arg} out")
        self._name = name
        self._serial = next(_channel_pool_serials)
        self._create_channel = create_channel
        self._barrier = barrier if barrier is not None else _no_op
        self._synchronize = synchronize if synchronize is not None else _synchronize_device
        self._channels: list[Channel] = []
        self._eager: Channel | None = None
        self._next_channel_id = 0
        self._live_tokens: set[int] = set()
        # The capture blocks not yet exited, across all threads and tasks: a context's
        # stack below binds only the channels of blocks still in this set.
        self._active_blocks: set[object] = set()
        self._closed = False
        # Channels cut back or closed whose close failed part-way, newest first: still owned
        # (their memory may not be freed) until retry_close() finishes them.
        self._unclosed: list[_Closing] = []
        # Reentrant so a factory that inspects the pool cannot deadlock itself.
        self._lock = threading.RLock()
        # Per pool and per context: threads and asyncio tasks each see their own captures,
        # as (block, channel) entries.
        self._stack: ContextVar[tuple[tuple[object, Channel], ...]] = ContextVar(
            f"channel_pool_{self._serial}_stack", default=()
        )

    @property
    def name(self) -> str:
        return self._name

    @property
    def num_channels(self) -> int:
        with self._lock:
            return len(self._channels)

    @property
    def channels(self) -> tuple[Channel, ...]:
        """Snapshot of every live channel, oldest first (eager channel included)."""
        with self._lock:
            return tuple(self._channels)

    @property
    def unclosed_channels(self) -> tuple[Channel, ...]:
        """Channels a failed rollback or close left owned and not freed, newest first.

        They are no longer handed out; :meth:`retry_close` finishes closing them.
        """
        with self._lock:
            return tuple(entry.channel for entry in self._unclosed)

    @contextmanager
    def capture(self, owner: str = "capture") -> Iterator[Channel]:
        """Bind a fresh channel to the capture made inside this block.

        The outermost block creates the channel on entry; a nested block (side streams of
        the same capture) reuses the enclosing block's channel and ignores ``owner``.

        Requires: the current stream is not capturing yet (raises RuntimeError otherwise).
        Guarantees: :meth:`current` returns this channel inside the block, in this thread or
        task only; the previous binding is restored on exit, also on exceptions. A block
        exited in another thread or task, or before a block nested in it, ends all the
        same: the pool stops counting it, and no context sees its channel bound.
        """
        check_str("owner", owner, "name the capture's owner, e.g. owner='draft'")
        block = object()
        # Picking (or creating) the channel and counting the capture are one step: a
        # rollback in another thread either cuts back before the channel exists or sees
        # this capture and refuses, so it can never close the channel handed out here.
        with self._lock:
            bound = self._bound()
            channel = bound[-1][1] if bound else self._create(owner)
            self._active_blocks.add(block)
        self._stack.set((*bound, (block, channel)))
        try:
            yield channel
        finally:
            # Exits in any order and from any context (another thread or task) end the
            # block: it is no longer counted, and no context sees its channel bound.
            with self._lock:
                self._active_blocks.discard(block)
            entries = self._stack.get()
            if all(entry is not block for entry, _ in entries):
                _logger.warning(
                    "ChannelPool %r: a capture() block was exited in another thread or task "
                    "than the one that entered it; it has ended, so a rollback may now close "
                    "its channel even if a graph is still being captured there",
                    self._name,
                )
            self._stack.set(tuple(e for e in entries if e[0] is not block))

    def _bound(self) -> tuple[tuple[object, Channel], ...]:
        """This context's entries of blocks not yet exited, outermost first."""
        return tuple(e for e in self._stack.get() if e[0] in self._active_blocks)

    def in_capture(self) -> bool:
        """Whether this thread or task is inside a :meth:`capture` block of this pool."""
        with self._lock:
            return bool(self._bound())

    def current(self) -> Channel:
        """Channel of the active capture, else the eager channel (created on first use).

        Legal during capture only inside :meth:`capture`: a stream that captures outside
        every capture block of this pool (in this thread or task) gets RuntimeError, also
        when the eager channel exists, since the graph would bake it in and share it with
        eager calls.
        """
        if self._stack.get():  # eager calls, the common case, skip the lock here
            with self._lock:
                bound = self._bound()
            if bound:
                return bound[-1][1]
        if stream_is_capturing():
            raise RuntimeError(
                f"ChannelPool {self._name!r}: current() called while the current stream is "
                f"capturing a CUDA graph outside a capture() block of this channel pool; the "
                f"graph would bake in the eager channel. {_FIX_CAPTURE_ORDER}"
            )
        with self._lock:
            if self._eager is None:
                self._eager = self._create("eager")
            return self._eager

    def checkpoint(self) -> ChannelCheckpoint:
        """Record the current channels so :meth:`rollback` can close every newer one.

        Requires: no capture is active on this pool, in any thread (RuntimeError otherwise).
        """
        with self._lock:
            self._check_idle("checkpoint()")
            cp = ChannelCheckpoint(
                self._name, self._serial, len(self._channels), next(_checkpoint_tokens)
            )
            self._live_tokens.add(cp.token)
            return cp

    def rollback(self, cp: ChannelCheckpoint) -> None:
        """Close every channel created after ``cp``, newest first, coordinated across ranks.

        Order: synchronize; barrier; every ``close_imports``; barrier; every
        ``free_exports``; barrier. An eager channel created after ``cp`` is dropped too, and
        the next eager use creates a new one. Collective: every rank must call it.

        If a step fails, the step still runs for the other channels, then the sequence
        stops and :class:`ChannelCloseError` names the channels not yet freed; the pool
        keeps them in :attr:`unclosed_channels` for :meth:`retry_close`. Channels an
        earlier failure left there are retried along with the ones this call closes.

        Requires: every graph that references those channels is already destroyed and the
        device synchronized; no capture is active on this pool in any thread; ``cp`` came
        from this pool and was neither used nor invalidated by an earlier rollback. A refused
        call changes nothing. Guarantees: ``cp`` and every checkpoint taken after it become
        unusable; the pool's lock is held throughout, so no capture starts meanwhile.
        """
        check_instance("cp", cp, ChannelCheckpoint, "pass what checkpoint() returned")
        with self._lock:
            self._check_rollback(cp)
            doomed = self._channels[cp.num_channels :]
            del self._channels[cp.num_channels :]
            if self._eager is not None and any(ch is self._eager for ch in doomed):
                self._eager = None
            self._live_tokens = {t for t in self._live_tokens if t < cp.token}
            self._close_coordinated(doomed[::-1], "rollback()")

    def close(self) -> None:
        """Close every channel, newest first, in the coordinated order of :meth:`rollback`.

        Requires: as for :meth:`rollback`. Guarantees: the pool refuses further use;
        a second call does nothing. Channels that an earlier failed rollback left unclosed
        are closed too; if this close fails, :meth:`retry_close` still works.
        """
        with self._lock:
            if self._closed:
                return
            self._check_idle("close()")
            doomed = self._channels[::-1]
            self._channels.clear()
            self._eager = None
            self._live_tokens.clear()
            self._closed = True
            self._close_coordinated(doomed, "close()")

    def retry_close(self) -> None:
        """Finish closing :attr:`unclosed_channels`, each from the step where it stopped.

        Collective, in the order of :meth:`rollback`: every rank calls it, also a rank with
        nothing left to close (a failure on one rank can leave its peers with nothing), so
        every rank takes part in the same barriers. Legal after :meth:`close`. Raises
        :class:`ChannelCloseError` again if a step fails again.
        """
        with self._lock:
            self._run_close_steps("retry_close()")

    def _create(self, owner: str) -> Channel:
        if stream_is_capturing():
            raise RuntimeError(
                f"ChannelPool {self._name!r}: cannot create a channel for {owner!r} while the "
                f"current stream is capturing a CUDA graph; {_FIX_CAPTURE_ORDER}"
            )
        with self._lock:
            self._check_open()
            channel_id = self._next_channel_id
            channel = self._create_channel(channel_id, owner)
            if not isinstance(channel, Channel):
                raise TypeError(
                    f"ChannelPool {self._name!r}: create_channel({channel_id}, {owner!r}) "
                    f"returned {channel!r} ({type(channel).__name__}), not a Channel; return "
                    f"an object with channel_id, close_imports() and free_exports()"
                )
            self._next_channel_id += 1
            self._channels.append(channel)
            return channel

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"ChannelPool {self._name!r} is closed; create a new ChannelPool")

    def _check_idle(self, what: str) -> None:
        self._check_open()
        if self._active_blocks:
            raise RuntimeError(
                f"ChannelPool {self._name!r}: {what} refused while "
                f"{len(self._active_blocks)} capture block(s) are active; a captured graph "
                f"may still bind these channels. Call it after leaving every channel_pool.capture()"
            )

    def _check_rollback(self, cp: ChannelCheckpoint) -> None:
        if cp.channel_pool_serial != self._serial:
            raise ValueError(
                f"ChannelPool {self._name!r}: checkpoint belongs to ChannelPool "
                f"{cp.channel_pool_name!r} (serial {cp.channel_pool_serial}), not to "
                f"{self._name!r} (serial {self._serial}); roll it back on the channel pool "
                f"that created it"
            )
        self._check_idle("rollback()")
        if cp.token not in self._live_tokens:
            raise RuntimeError(
                f"ChannelPool {self._name!r}: checkpoint {cp.token} was already used or "
                f"invalidated by an earlier rollback; take a new checkpoint()"
            )

    def _close_coordinated(self, newest_first: list[Channel], what: str) -> None:
        if not newest_first:
            return
        # Owned until freed: a failure below must not make the pool forget them.
        self._unclosed[:0] = [_Closing(channel) for channel in newest_first]
        self._run_close_steps(what)

    def _run_close_steps(self, what: str) -> None:
        closing = self._unclosed
        # No rank may unmap or free while a peer's kernel can still touch the memory, and no
        # rank may free its exports while a peer still maps them; the barriers order that.
        steps: list[tuple[str, Callable[[], object]]] = [
            ("synchronize", self._synchronize),
            ("the first barrier", self._barrier),
            ("close_imports", lambda: _close_step(closing, "close_imports")),
            ("the second barrier", self._barrier),
            ("free_exports", lambda: _close_step(closing, "free_exports")),
            ("the last barrier", self._barrier),
        ]
        for label, step in steps:
            try:
                step()
            except Exception as exc:
                self._unclosed = [e for e in closing if "free_exports" not in e.done]
                raise self._close_error(what, label, exc) from exc
        self._unclosed = []

    def _close_error(self, what: str, label: str, exc: Exception) -> ChannelCloseError:
        ids = tuple(entry.channel.channel_id for entry in self._unclosed)
        if ids:
            outcome = (
                f"the pool still owns channel(s) {list(ids)}, not yet freed. Fix the cause, "
                f"then call retry_close() on every rank"
            )
        else:
            outcome = "every channel was freed, but the ranks may be out of step"
        cause = str(exc) if isinstance(exc, _CloseStepError) else repr(exc)
        return ChannelCloseError(
            f"ChannelPool {self._name!r}: {what} failed in {label} ({cause}); {outcome}",
            self._name,
            ids,
        )


def checkpoint_channel_pools(channel_pools: Iterable[ChannelPool]) -> ChannelPoolsCheckpoint:
    """Checkpoint each distinct channel pool once, in first-seen order (groups may share one).

    Requires: no capture is active on any of them (RuntimeError otherwise, and none is
    checkpointed). Every one's lock is held throughout, so no capture starts in between.
    """
    if isinstance(channel_pools, ChannelPool):
        raise TypeError(
            f"channel_pools must be an iterable of ChannelPool, got the single ChannelPool "
            f"{channel_pools.name!r}; pass [channel_pool]"
        )
    distinct: dict[int, ChannelPool] = {}
    for channel_pool in check_items(
        "channel_pools", channel_pools, ChannelPool, "pass a list of ChannelPools"
    ):
        distinct.setdefault(id(channel_pool), channel_pool)
    ordered = tuple(distinct.values())
    with _locked(ordered):
        for channel_pool in ordered:
            channel_pool._check_idle("checkpoint_channel_pools()")
        return ChannelPoolsCheckpoint(ordered, tuple(c.checkpoint() for c in ordered))


def rollback_channel_pools(cp: ChannelPoolsCheckpoint) -> None:
    """Roll back every channel pool of ``cp`` in reverse checkpoint order.

    Requires: as for :meth:`ChannelPool.rollback`, on every one. All are checked before any
    is rolled back, and every one's lock is held from the checks to the end, so a refused
    call changes nothing and no capture starts in between. One whose channels fail to
    close does not stop the others; the first :class:`ChannelCloseError` is raised once
    all were rolled back, with the others as notes.
    """
    fix = "pass what checkpoint_channel_pools() returned"
    check_instance("cp", cp, ChannelPoolsCheckpoint, fix)
    pairs = list(zip(cp.channel_pools, cp.checkpoints, strict=True))
    failures: list[ChannelCloseError] = []
    with _locked(cp.channel_pools):
        for channel_pool, channel_pool_cp in pairs:
            channel_pool._check_rollback(channel_pool_cp)
        for channel_pool, channel_pool_cp in reversed(pairs):
            try:
                channel_pool.rollback(channel_pool_cp)
            except ChannelCloseError as exc:
                failures.append(exc)  # the others still roll back, in the same order
    if failures:
        for other in failures[1:]:
            failures[0].add_note(f"also: {other}")
        raise failures[0]


@contextmanager
def _locked(channel_pools: Iterable[ChannelPool]) -> Iterator[None]:
    """Hold every channel pool's lock, taken in serial order so two callers cannot deadlock."""
    with ExitStack() as stack:
        for channel_pool in sorted(channel_pools, key=lambda c: c._serial):
            stack.enter_context(channel_pool._lock)
        yield
