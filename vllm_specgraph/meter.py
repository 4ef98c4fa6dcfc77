"""What one capture call took, per owner: read alike for the estimate and the actual.

The profile's passes and the production capture measure their captures with
the same :class:`CaptureMeter`, so that the estimate and the actual are one
reading taken twice. A capture of one owner may run inside another's (a
speculator's graphs are captured inside the engine's capture call): the inner
owner is measured explicitly and the outer one gets the rest of the call.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import torch

from vllm_specgraph._checks import check_callable, check_str

__all__ = [
    "CaptureFootprint",
    "CaptureMeter",
    "OwnerMemory",
    "allocator_segments",
    "current_meter",
    "describe_owners",
    "live_blocks",
    "metering",
    "segment_blocks",
    "settled_free_bytes",
]

_MIB = 1 << 20


@dataclass(frozen=True)
class OwnerMemory:
    """What one owner's graphs took: driver-level bytes and the allocator's share."""

    owner: str
    num_graphs: int
    driver_bytes: int
    allocator_bytes: int


def describe_owners(owners: tuple[OwnerMemory, ...]) -> str:
    """One line of owners: ``target 90.0 MiB (51 graphs), draft ...``."""
    return ", ".join(
        f"{o.owner} {o.driver_bytes / _MIB:.1f} MiB ({o.num_graphs} graphs)" for o in owners
    )


def settled_free_bytes(device: torch.device | None = None) -> int:
    """Driver-level free bytes of ``device`` (the current one by default) once nothing
    cached or in flight distorts the reading.

    Collects garbage, synchronises and empties the allocator cache first.
    Not legal during capture.
    """
    gc.collect()
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info(device)[0]


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


@dataclass(frozen=True)
class CaptureFootprint:
    """Where the driver-level bytes of one capture call went.

    Split by the caching allocator's segments on this device: those of graph
    pools (the graphs' own memory), those of the default pools (blocks made
    during the call that outlive it keep their segments), and the rest, which
    the allocator does not hold (kernel code loaded on first launch, graph
    instantiation). A profile that matches production in total but not here
    points at the part that differs.
    """

    graph_pool_bytes: int
    default_pool_bytes: int
    outside_allocator_bytes: int

    @property
    def allocator_bytes(self) -> int:
        return self.graph_pool_bytes + self.default_pool_bytes

    def describe(self) -> str:
        return (
            f"graph pools {self.graph_pool_bytes / _MIB:.1f}, default pools "
            f"{self.default_pool_bytes / _MIB:.1f}, outside the allocator "
            f"{self.outside_allocator_bytes / _MIB:.1f} MiB"
        )


def _segment_bytes() -> tuple[int, int]:
    """Bytes in this device's allocator segments: (graph pools, default pools)."""
    graph = default = 0
    for segment in allocator_segments():
        if tuple(segment.get("segment_pool_id", (0, 0))) == (0, 0):
            default += segment["total_size"]
        else:
            graph += segment["total_size"]
    return graph, default


@dataclass
class CaptureMeter:
    """Bytes and graphs that each owner's part of one capture call took.

    Arguments:
        graphs_captured: the number of graphs captured so far in the process (or
            by the recorders the call uses); the meter counts its differences.
        rest_owner: the owner that gets what no explicitly measured owner took.

    Read the way vLLM's ``capture_model`` reads its own total: synchronise,
    then driver-level free memory, no cache flush, so that the owners add up to
    the call's figure; the allocator's reserved bytes are read alongside.
    :meth:`whole_call` measures the call's totals and splits them
    (``footprint``); :meth:`measure` measures one owner inside it.
    """

    graphs_captured: Callable[[], int]
    rest_owner: str = "target"
    driver_bytes: dict[str, int] = field(default_factory=dict)
    allocator_bytes: dict[str, int] = field(default_factory=dict)
    num_graphs: dict[str, int] = field(default_factory=dict)
    footprint: CaptureFootprint | None = None
    total_driver_bytes: int | None = None
    total_graphs: int | None = None

    def __post_init__(self) -> None:
        check_callable("graphs_captured", self.graphs_captured, "pass a function of no arguments")
        check_str("rest_owner", self.rest_owner, "name the owner, e.g. 'target'")

    @contextmanager
    def whole_call(self) -> Iterator[None]:
        """Measure the block as one capture call; sets the totals and ``footprint``
        on success.

        Empties the allocator's cache first, as ``capture_model`` itself does on
        entry, so both start their readings from the same state.
        """
        torch.cuda.empty_cache()
        torch.cuda.synchronize()
        free_before = torch.cuda.mem_get_info()[0]
        graph_before, default_before = _segment_bytes()
        graphs_before = self.graphs_captured()
        yield
        torch.cuda.synchronize()
        taken = free_before - torch.cuda.mem_get_info()[0]
        graph_after, default_after = _segment_bytes()
        graph, default = graph_after - graph_before, default_after - default_before
        self.footprint = CaptureFootprint(graph, default, taken - graph - default)
        self.total_driver_bytes = taken
        self.total_graphs = self.graphs_captured() - graphs_before

    @contextmanager
    def measure(self, owner: str) -> Iterator[None]:
        """Count the block's bytes and graphs to ``owner`` (added up over blocks)."""
        torch.cuda.synchronize()
        free_before = torch.cuda.mem_get_info()[0]
        reserved_before = torch.cuda.memory_reserved()
        graphs_before = self.graphs_captured()
        try:
            yield
        finally:
            torch.cuda.synchronize()
            taken = free_before - torch.cuda.mem_get_info()[0]
            reserved = torch.cuda.memory_reserved() - reserved_before
            graphs = self.graphs_captured() - graphs_before
            self.driver_bytes[owner] = self.driver_bytes.get(owner, 0) + taken
            self.allocator_bytes[owner] = self.allocator_bytes.get(owner, 0) + reserved
            self.num_graphs[owner] = self.num_graphs.get(owner, 0) + graphs

    def owners(self, total_bytes: int | None = None) -> tuple[OwnerMemory, ...]:
        """The rest owner (the call's totals less every measured owner's) first,
        then each measured owner.

        ``total_bytes`` replaces the call's driver-level total where the caller
        has its own figure of the same reading (vLLM's ``capture_model`` returns one).
        *Requires*: the call was measured with :meth:`whole_call`.
        """
        if self.footprint is None or self.total_graphs is None:
            raise RuntimeError("CaptureMeter.owners needs a call measured with whole_call()")
        total = self.total_driver_bytes if total_bytes is None else total_bytes
        measured = [
            OwnerMemory(o, self.num_graphs[o], b, self.allocator_bytes[o])
            for o, b in self.driver_bytes.items()
            if o != self.rest_owner
        ]
        rest = OwnerMemory(
            self.rest_owner,
            self.total_graphs - sum(m.num_graphs for m in measured),
            total - sum(m.driver_bytes for m in measured),
            self.footprint.allocator_bytes - sum(m.allocator_bytes for m in measured),
        )
        return (rest, *measured)


_active_meter: ContextVar[CaptureMeter | None] = ContextVar("specgraph_capture_meter", default=None)
current_meter = _active_meter.get
"""The meter of the capture call being measured in this thread or task, else None."""


@contextmanager
def metering(meter: CaptureMeter) -> Iterator[CaptureMeter]:
    """Let owner captures nested inside the block report into ``meter``."""
    token = _active_meter.set(meter)
    try:
        yield meter
    finally:
        _active_meter.reset(token)
