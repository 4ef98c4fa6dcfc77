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
logs it against the profile's estimate (under capture-once, for its log line).
``profile_run`` (the memory profile's dummy run) runs marked as such
(:mod:`vllm_specgraph.patches._profile_run`), for the patches that reserve
memory there.

Why: a speculator phase in lane 0 takes views of, or grows, the target's
buffer, under the target's captured graphs; an estimate is only worth the
KV-cache bytes it frees if it is checked against what production took.
"""

from __future__ import annotations

import functools
import inspect
import logging
import time
from collections.abc import Callable
from contextlib import nullcontext
from types import ModuleType

from vllm_specgraph.lanes import DEFAULT_OWNER_LANES, current_owner, use_lane
from vllm_specgraph.meter import CaptureMeter, current_meter, live_blocks, metering
from vllm_specgraph.patches._capture_once import planned_runner, record_graphs
from vllm_specgraph.patches._measurements import (
    KVSetUpState,
    SpecgraphCapture,
    graphs_captured,
)
from vllm_specgraph.patches._patching import PatchSet
from vllm_specgraph.patches._profile_run import wrap_profile_run

__all__ = ["install", "run_speculator_in_draft_lane"]

logger = logging.getLogger("vllm.specgraph")

DRAFT_LANE = DEFAULT_OWNER_LANES["draft"]
_MIB = 1 << 20

ESTIMATE_TOLERANCE_FRACTION = 0.01
ESTIMATE_TOLERANCE_BYTES = 2 * _MIB
"""An estimate further than max(1 %, 2 MiB) from the production capture is warned about."""


def _in_draft_lane(method: Callable, name: str) -> Callable:
    # Every speculator method of a decode step comes through here: the common
    # paths make no Python call but the lane's own scope.
    if name == "capture":

        @functools.wraps(method)
        def in_draft_lane(*args, **kwargs):
            meter = current_meter()
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
        # Measured where the exact profile ran, and under capture-once (no profile).
        measured = outcome is not None or planned_runner() is self
        if profile_only or current_meter() is not None or not measured:
            return original(self, profile_only=profile_only)
        from vllm_specgraph.patches._capture_allocator import expandable_segments_for_capture

        started = time.perf_counter()
        with (
            expandable_segments_for_capture(self.vllm_config),
            metering(CaptureMeter(graphs_captured)) as meter,
            meter.whole_call(),
        ):
            total = original(self, profile_only=profile_only)
        if outcome is None:
            record_graphs(meter.owners(int(total)))
            return total
        outcome.capture_wall_seconds = time.perf_counter() - started
        outcome.actual = meter.owners(int(total))
        outcome.actual_footprint = meter.footprint
        _log_estimate_vs_actual(outcome)
        return total

    return capture_model


def _wrap_initialize_kv_cache(original: Callable) -> Callable:
    @functools.wraps(original)
    def initialize_kv_cache(
        self, kv_cache_config, is_profiling=False, kv_cache_allocation_context=None
    ):
        """vLLM's, and after production's (the profile has run): what it made
        beside the KV cache, for the estimate-vs-actual line."""
        call = functools.partial(
            original,
            self,
            kv_cache_config,
            is_profiling=is_profiling,
            kv_cache_allocation_context=kv_cache_allocation_context,
        )
        outcome: SpecgraphCapture | None = getattr(self, "specgraph_profile", None)
        if is_profiling or outcome is None:
            return call()
        blocks_before = live_blocks()
        result = call()
        outcome.actual_kv_state_bytes = KVSetUpState.read(self, blocks_before).own_segments_bytes()
        return result

    return initialize_kv_cache


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
    kv_state = (
        ""
        if outcome.actual_kv_state_bytes is None
        else f"; KV-cache set-up beside the cache: production made "
        f"{outcome.actual_kv_state_bytes / _MIB:.1f} MiB, the budget held "
        f"{outcome.kv_state_bytes / _MIB:.1f} MiB for it and "
        f"{outcome.kv_state_kept_bytes / _MIB:.1f} MiB of the profile's own in its one-time bytes"
    )
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
        "(%+.2f%%); the budget also held %.1f MiB the profile left taken (one-time, retained)%s; "
        "production capture %.2f s, profile %.2f s (%.2fx)%s",
        ", ".join(parts),
        total_estimate / _MIB,
        total_actual / _MIB,
        100.0 * (total_estimate - total_actual) / max(total_actual, 1),
        kept / _MIB,
        kv_state,
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
    patches.wrap(runner, "profile_run", wrap_profile_run)
    patches.wrap(
        runner,
        "initialize_kv_cache",
        _wrap_initialize_kv_cache,
        parameters=("kv_cache_config", "is_profiling", "kv_cache_allocation_context"),
    )
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
