"""Patch for ``vllm.v1.worker.gpu.model_runner`` (vLLM 0.33.0).

vLLM does: ``GPUModelRunner`` runs the speculator in workspace lane 1 only for
DSpark (``_draft_workspace_lane``), and even then leaves some draft phases in
lane 0 (construction, ``set_attn`` and ``init_cudagraph_manager`` in
``initialize_kv_cache``, the LoRA-state refresh of the draft head). Its graph
memory profile is ``_profile_cudagraph_memory``, a by-value alias of
``cudagraph_utils.profile_cudagraph_memory``.

This patch changes: with any speculative method, the speculator is built in
the draft lane and every public method of it runs there (``use_workspace_lane``
and ``lock_workspace`` keep working, now on the core workspace); the draft-head
refresh runs there too. ``_profile_cudagraph_memory`` is the exact disposable
profile of :mod:`vllm_specgraph.patches.v1.worker.gpu.cudagraph_utils`, and
``capture_model`` measures the production capture per owner the same way and
logs it against the profile's estimate.

Why: a speculator phase in lane 0 takes views of, or grows, the target's
buffer, under the target's captured graphs; an estimate is only worth the
KV-cache bytes it frees if it is checked against what production took.
"""

from __future__ import annotations

import functools
import inspect
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from contextvars import ContextVar
from dataclasses import asdict, dataclass, field
from types import ModuleType

import torch

from vllm_specgraph.lanes import DEFAULT_OWNER_LANES, current_owner, use_lane
from vllm_specgraph.patches._patching import PatchSet
from vllm_specgraph.profile import GraphMemoryReport, OwnerMemory, allocator_segments

__all__ = [
    "CaptureFootprint",
    "CaptureMeter",
    "SpecgraphCapture",
    "install",
    "metering",
    "run_speculator_in_draft_lane",
]

logger = logging.getLogger("vllm.specgraph")

DRAFT_LANE = DEFAULT_OWNER_LANES["draft"]
_MIB = 1 << 20

ESTIMATE_TOLERANCE_FRACTION = 0.01
ESTIMATE_TOLERANCE_BYTES = 2 * _MIB
"""An estimate further than max(1 %, 2 MiB) from the production capture is warned about."""


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


@contextmanager
def metering(meter: CaptureMeter) -> Iterator[CaptureMeter]:
    """Let speculator captures inside the block report into ``meter``."""
    token = _active_meter.set(meter)
    try:
        yield meter
    finally:
        _active_meter.reset(token)


def _in_draft_lane(method: Callable, name: str) -> Callable:
    # Every speculator method of a decode step comes through here: the common
    # paths make no Python call but the lane's own scope.
    if name == "capture":

        @functools.wraps(method)
        def in_draft_lane(*args, **kwargs):
            meter = _active_meter.get()
            if meter is None and current_owner() == DRAFT_LANE:
                return method(*args, **kwargs)
            with use_lane(DRAFT_LANE), meter.measure("draft") if meter else nullcontext():
                return method(*args, **kwargs)

    else:

        @functools.wraps(method)
        def in_draft_lane(*args, **kwargs):
            if current_owner() == DRAFT_LANE:
                return method(*args, **kwargs)  # a speculator method calling another one
            with use_lane(DRAFT_LANE):
                return method(*args, **kwargs)

    in_draft_lane.__specgraph_lane__ = DRAFT_LANE
    return in_draft_lane


def run_speculator_in_draft_lane(speculator: object) -> object:
    """Make every public method of ``speculator`` run in the draft lane; returns it.

    Methods are wrapped on the instance, so every speculator class (EAGLE, MTP,
    DFlash family, draft model, ngram, ...) is covered, including methods a
    subclass adds. ``capture`` also reports its bytes to an active
    :class:`CaptureMeter`.
    """
    for name, _ in inspect.getmembers(type(speculator), inspect.isfunction):
        if not name.startswith("_"):
            setattr(speculator, name, _in_draft_lane(getattr(speculator, name), name))
    return speculator


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
        }


def _footprint_dict(footprint: CaptureFootprint | None) -> dict[str, int] | None:
    return None if footprint is None else asdict(footprint)


def _wrap_init(original: Callable) -> Callable:
    @functools.wraps(original)
    def __init__(self, *args, **kwargs) -> None:
        original(self, *args, **kwargs)
        if self.speculative_config is not None:
            self._draft_workspace_lane = DRAFT_LANE

    return __init__


def _wrap_init_speculator(original: Callable) -> Callable:
    build_in_draft_lane = _in_draft_lane(original, original.__name__)

    @functools.wraps(original)
    def init_speculator(*args, **kwargs):
        return run_speculator_in_draft_lane(build_in_draft_lane(*args, **kwargs))

    return init_speculator


def _wrap_capture_model(original: Callable) -> Callable:
    @functools.wraps(original)
    def capture_model(self, *, profile_only: bool = False) -> int:
        outcome: SpecgraphCapture | None = getattr(self, "specgraph_profile", None)
        if profile_only or outcome is None or _active_meter.get() is not None:
            return original(self, profile_only=profile_only)
        from vllm.compilation.counter import compilation_counter

        from vllm_specgraph.patches._capture_allocator import expandable_segments_for_capture

        graphs_before = compilation_counter.num_cudagraph_captured
        started = time.perf_counter()
        with (
            expandable_segments_for_capture(self.vllm_config),
            metering(CaptureMeter()) as meter,
            meter.whole_call(),
        ):
            total = original(self, profile_only=profile_only)
        outcome.capture_wall_seconds = time.perf_counter() - started
        outcome.actual = meter.owners(
            int(total), compilation_counter.num_cudagraph_captured - graphs_before
        )
        outcome.actual_footprint = meter.footprint
        _log_estimate_vs_actual(outcome)
        return total

    return capture_model


def _log_estimate_vs_actual(outcome: SpecgraphCapture) -> None:
    estimated = {o.owner: o.driver_bytes for o in outcome.estimate.owners}
    parts = []
    for actual in outcome.actual or ():
        estimate = estimated.get(actual.owner, 0)
        parts.append(
            f"{actual.owner} {estimate / _MIB:.1f} vs {actual.driver_bytes / _MIB:.1f} MiB"
        )
    total_actual = sum(o.driver_bytes for o in outcome.actual or ())
    total_estimate = outcome.estimate.total_driver_bytes
    kept = outcome.estimate.one_time_bytes + max(outcome.estimate.retained_bytes, 0)
    footprints = [
        f"{name}: {footprint.describe()}"
        for name, footprint in (
            ("production", outcome.actual_footprint),
            ("the profile's last pass", outcome.estimate_footprint),
        )
        if footprint is not None
    ]
    logger.info(
        "vllm-specgraph: CUDA graph memory, estimate vs actual: %s; graphs %.1f vs %.1f MiB "
        "(%+.2f%%); the budget also held %.1f MiB the profile left with the process; "
        "production capture %.2f s, profile %.2f s (%.2fx)%s",
        ", ".join(parts),
        total_estimate / _MIB,
        total_actual / _MIB,
        100.0 * (total_estimate - total_actual) / max(total_actual, 1),
        kept / _MIB,
        outcome.capture_wall_seconds,
        outcome.estimate.wall_seconds,
        outcome.estimate.wall_seconds / max(outcome.capture_wall_seconds or 0.0, 1e-9),
        "".join(f"; {f}" for f in footprints),
    )
    missed = total_estimate - total_actual
    if abs(missed) > max(ESTIMATE_TOLERANCE_FRACTION * total_actual, ESTIMATE_TOLERANCE_BYTES):
        logger.warning(
            "vllm-specgraph: the estimate missed the production capture by %+.1f MiB, more "
            "than max(1 %%, 2 MiB). Most likely PyTorch's caching allocator packed the same "
            "requests into different segments: it breaks ties between free blocks of equal "
            "size by address, and addresses differ once the KV cache exists (the pools above "
            "show where)%s",
            missed / _MIB,
            ""
            if outcome.expandable_segments
            else "; the plugin captures with expandable segments, whose packing follows the "
            "order of the requests alone, but kept the allocator's setting because "
            f"{outcome.expandable_segments_blocker}",
        )


def install(patches: PatchSet, model_runner: ModuleType) -> None:
    from vllm.v1.worker.gpu import cudagraph_utils

    profile = cudagraph_utils.profile_cudagraph_memory
    if not getattr(profile, "__specgraph__", False):
        raise RuntimeError(
            "vllm-specgraph: cudagraph_utils must be patched before model_runner; "
            "install the patches through vllm_specgraph.patches.arm()"
        )
    runner = model_runner.GPUModelRunner
    patches.wrap(runner, "__init__", _wrap_init, parameters=("vllm_config",))
    patches.wrap(
        runner,
        "capture_model",
        _wrap_capture_model,
        parameters=("profile_only",),
    )
    patches.wrap(
        model_runner, "init_speculator", _wrap_init_speculator, parameters=("vllm_config",)
    )
    patches.wrap(
        model_runner,
        "refresh_quantized_lm_heads",
        functools.partial(_in_draft_lane, name="refresh_quantized_lm_heads"),
    )
    patches.replace(model_runner, "use_workspace_lane", use_lane, parameters=("lane",))
    patches.replace(
        model_runner,
        "_profile_cudagraph_memory",
        profile,
        parameters=("runner",),
    )
