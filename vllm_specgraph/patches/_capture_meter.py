"""What one ``capture_model`` call took, per owner: the measuring shared by two patches.

The production capture (the ``model_runner`` patch) and the exact profile's
passes (the ``cudagraph_utils`` patch) measure ``capture_model`` alike, so that
the estimate and the actual are one reading taken twice: :class:`CaptureMeter`
for each owner's bytes and graphs, :class:`CaptureFootprint` for where the
call's bytes went, :class:`KVSetUpState` for what ``initialize_kv_cache`` makes
beside the KV cache (read around the profile's set-up and production's), and
:class:`SpecgraphCapture` for what the plugin keeps on a runner.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from vllm_specgraph.profile import (
    GraphMemoryReport,
    OwnerMemory,
    allocator_segments,
    segment_blocks,
)

__all__ = [
    "CaptureFootprint",
    "CaptureMeter",
    "KVSetUpState",
    "SpecgraphCapture",
    "current_meter",
    "metering",
]

_MIB = 1 << 20


@dataclass(frozen=True)
class CaptureFootprint:
    """Where the driver-level bytes of one ``capture_model`` call went.

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
    """Bytes and graphs that each owner's part of one ``capture_model`` call took.

    Read the way ``capture_model`` reads its own total: synchronise, then
    driver-level free memory, no cache flush, so that the owners add up to
    vLLM's figure; the allocator's reserved bytes are read alongside. Owners not
    measured explicitly get the rest (``target``). :meth:`whole_call` measures
    the call's totals and splits them (``footprint``).
    """

    driver_bytes: dict[str, int] = field(default_factory=dict)
    allocator_bytes: dict[str, int] = field(default_factory=dict)
    num_graphs: dict[str, int] = field(default_factory=dict)
    footprint: CaptureFootprint | None = None

    @contextmanager
    def whole_call(self) -> Iterator[None]:
        """Measure the block as one ``capture_model`` call; sets ``footprint`` on success.

        Empties the allocator's cache first, as ``capture_model`` itself does on
        entry, so both start their readings from the same state.
        """
        torch.cuda.empty_cache()
        torch.cuda.synchronize()
        free_before = torch.cuda.mem_get_info()[0]
        graph_before, default_before = _segment_bytes()
        yield
        torch.cuda.synchronize()
        taken = free_before - torch.cuda.mem_get_info()[0]
        graph_after, default_after = _segment_bytes()
        graph, default = graph_after - graph_before, default_after - default_before
        self.footprint = CaptureFootprint(graph, default, taken - graph - default)

    @contextmanager
    def measure(self, owner: str) -> Iterator[None]:
        from vllm.compilation.counter import compilation_counter

        torch.cuda.synchronize()
        free_before = torch.cuda.mem_get_info()[0]
        reserved_before = torch.cuda.memory_reserved()
        graphs_before = compilation_counter.num_cudagraph_captured
        try:
            yield
        finally:
            torch.cuda.synchronize()
            taken = free_before - torch.cuda.mem_get_info()[0]
            reserved = torch.cuda.memory_reserved() - reserved_before
            graphs = compilation_counter.num_cudagraph_captured - graphs_before
            self.driver_bytes[owner] = self.driver_bytes.get(owner, 0) + taken
            self.allocator_bytes[owner] = self.allocator_bytes.get(owner, 0) + reserved
            self.num_graphs[owner] = self.num_graphs.get(owner, 0) + graphs

    def owners(self, total_bytes: int, total_graphs: int) -> tuple[OwnerMemory, ...]:
        """``target`` (the rest of the totals) first, then each measured owner.

        *Requires*: the call was measured with :meth:`whole_call`.
        """
        measured = [
            OwnerMemory(o, self.num_graphs[o], b, self.allocator_bytes[o])
            for o, b in self.driver_bytes.items()
        ]
        rest = OwnerMemory(
            "target",
            total_graphs - sum(m.num_graphs for m in measured),
            total_bytes - sum(m.driver_bytes for m in measured),
            self.footprint.allocator_bytes - sum(m.allocator_bytes for m in measured),
        )
        return (rest, *measured)


_active_meter: ContextVar[CaptureMeter | None] = ContextVar("specgraph_capture_meter", default=None)
current_meter = _active_meter.get
"""The meter of the ``capture_model`` call being measured in this thread or task, else None."""


@contextmanager
def metering(meter: CaptureMeter) -> Iterator[CaptureMeter]:
    """Let speculator captures inside the block report into ``meter``."""
    token = _active_meter.set(meter)
    try:
        yield meter
    finally:
        _active_meter.reset(token)


@dataclass(frozen=True)
class KVSetUpState:
    """What ``initialize_kv_cache`` made beside the KV cache itself: attention
    metadata builders' buffers, block tables, the speculator's own.

    Production's ``initialize_kv_cache`` makes the same state again once the KV
    cache is sized, outside the KV budget. What of the profile's state outlives
    the pass is in the pass's one-time bytes already: production replaces it,
    and the old copy is cached until the capture empties the cache. What the
    profile's teardown freed, production makes anew. State sized by the block
    count (FlexAttention's metadata) is made with the minimal count here.
    """

    blocks: frozenset[tuple[int, int]]
    made: frozenset[tuple[int, int]]  # every block the set-up made, the KV cache's included
    # (driver bytes, allocated blocks) of every fixed-size segment that holds a
    # state block; an expandable segment (one per stream) says nothing of its own
    segments: tuple[tuple[int, frozenset[tuple[int, int]]], ...]
    blocks_after: frozenset[tuple[int, int]]  # every allocated block after the set-up

    @staticmethod
    def read(runner: Any, blocks_before: frozenset[tuple[int, int]]) -> KVSetUpState:
        kv_cache = {t.untyped_storage().data_ptr() for t in getattr(runner, "kv_caches", ())}
        segments = [
            (
                int(segment["total_size"]),
                segment_blocks(segment),
                bool(segment.get("is_expandable", False)),
            )
            for segment in allocator_segments()
        ]
        after = frozenset(block for _, blocks, _ in segments for block in blocks)
        made = after - blocks_before
        state = frozenset(b for b in made if b[0] not in kv_cache)
        held = tuple(
            (size, blocks)
            for size, blocks, expandable in segments
            if blocks & state and not expandable
        )
        return KVSetUpState(state, made, held, after)

    def own_segments_bytes(self) -> int:
        """Driver bytes of this state: the segments that hold nothing else, and
        never less than its blocks' bytes (blocks beside others, in an expandable
        segment or a segment shared with another owner, still cost their size)."""
        segments = sum(size for size, blocks in self.segments if blocks <= self.blocks)
        return max(segments, _bytes(self.blocks))

    def kept_bytes(self, alive: frozenset[tuple[int, int]]) -> int:
        """What of this state is still alive, as :meth:`own_segments_bytes` counts it."""
        kept = self.blocks & alive
        segments = sum(
            size for size, blocks in self.segments if blocks <= self.made and blocks & alive
        )
        return max(segments, _bytes(kept)) if kept else 0

    def freed_bytes(self, alive: frozenset[tuple[int, int]]) -> int:
        """What production's set-up takes again of what is freed now: the segments
        that held nothing but what the set-up made (the minimal KV cache included)
        and none of it alive, and never less than the freed state blocks' bytes."""
        freed = self.blocks - alive
        segments = sum(
            size for size, blocks in self.segments if blocks <= self.made and not blocks & alive
        )
        return max(segments, _bytes(freed))


def _bytes(blocks: frozenset[tuple[int, int]]) -> int:
    return sum(size for _, size in blocks)


@dataclass
class SpecgraphCapture:
    """What the plugin measured for one runner: the profile's estimate and the actual."""

    estimate: GraphMemoryReport
    phase_seconds: dict[str, float] = field(default_factory=dict)
    capture_wall_seconds: float | None = None
    actual: tuple[OwnerMemory, ...] | None = None
    estimate_footprint: CaptureFootprint | None = None  # the profile's last pass
    actual_footprint: CaptureFootprint | None = None
    profile_passes: int = 1
    expandable_segments: bool = False  # during the profile's and production's captures
    expandable_segments_blocker: str | None = None  # why not, if not
    kv_state_bytes: int = 0  # production's KV set-up state beside the cache, budgeted anew
    kv_state_kept_bytes: int = 0  # the profile's own, outliving it: in the one-time bytes
    actual_kv_state_bytes: int | None = None  # what production's set-up made beside the cache

    def to_dict(self) -> dict[str, object]:
        return {
            "estimate": asdict(self.estimate),
            "estimate_total_bytes": self.estimate.total_driver_bytes,
            "actual": None if self.actual is None else [asdict(o) for o in self.actual],
            "actual_total_bytes": None
            if self.actual is None
            else sum(o.driver_bytes for o in self.actual),
            "phase_seconds": self.phase_seconds,
            "capture_wall_seconds": self.capture_wall_seconds,
            "estimate_footprint": _footprint_dict(self.estimate_footprint),
            "actual_footprint": _footprint_dict(self.actual_footprint),
            "profile_passes": self.profile_passes,
            "expandable_segments": self.expandable_segments,
            "expandable_segments_blocker": self.expandable_segments_blocker,
            "kv_state_bytes": self.kv_state_bytes,
            "kv_state_kept_bytes": self.kv_state_kept_bytes,
            "actual_kv_state_bytes": self.actual_kv_state_bytes,
        }


def _footprint_dict(footprint: CaptureFootprint | None) -> dict[str, int] | None:
    return None if footprint is None else asdict(footprint)
