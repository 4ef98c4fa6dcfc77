"""What the two patches that measure ``capture_model`` share, beside the core's meter.

The production capture (the ``model_runner`` patch) and the exact profile's
passes (the ``cudagraph_utils`` patch) measure ``capture_model`` alike, with
the core's :class:`~vllm_specgraph.meter.CaptureMeter`; here is what is
vLLM's own: :class:`KVSetUpState` for what ``initialize_kv_cache`` makes beside
the KV cache (read around the profile's set-up and production's), and
:class:`SpecgraphCapture` for what the plugin keeps on a runner.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from vllm_specgraph.meter import CaptureFootprint, OwnerMemory, allocator_segments, segment_blocks
from vllm_specgraph.profile import GraphMemoryReport

__all__ = ["KVSetUpState", "SpecgraphCapture", "graphs_captured"]


def graphs_captured() -> int:
    """The graphs vLLM has captured in this process (its compilation counter)."""
    from vllm.compilation.counter import compilation_counter

    return compilation_counter.num_cudagraph_captured


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
