"""Patch for ``vllm.v1.worker.gpu.cudagraph_utils`` (vLLM 0.33.0).

vLLM does: ``profile_cudagraph_memory`` swaps the global graph pool for a
throwaway one, builds a minimal KV cache, captures PIECEWISE, encoder and
speculator graphs in full but only the two largest FULL graphs, and
extrapolates the rest (``first + (N-1) * max(second, 1 MiB)``). It clears the
wrappers' graphs before synchronising, restores the pools only of wrappers
that existed before it ran, finds speculator graph managers by scanning the
speculator's attributes, and leaves the profile's capture streams' cuBLAS
workspaces taken (32 MiB per graph manager).

This patch changes: ``profile_cudagraph_memory`` runs ``capture_model`` over
every graph production will capture, inside the core's
:func:`~vllm_specgraph.profile.disposable_graph_pass`, as passes of the core's
engine (:func:`~vllm_specgraph.profile.measure_graph_memory`), and takes vLLM's
own measure of it; the draft's share is read around the speculator's capture. Both
the profile's captures and production's run with expandable segments where the
allocator allows it (:mod:`vllm_specgraph.patches._capture_allocator`), so both
pack the same requests alike. A pass that leaves memory taken met one-time
process state: the budget holds it. If it is all outside the allocator or in
blocks made before the capture began, the pass's allocator bytes are the
graphs; otherwise the profile measures again with the state in place. One pass
costs about one production capture, the process's first-launch work included:
the pass freezes every older object out of garbage collection, so the
collections vLLM's capture and teardown make visit only what the pass made.
Teardown, on success and on error: synchronise, destroy every graph (wrappers,
speculator managers through their own ``init_cudagraph_manager``, the runner's
profiling state) while the private pool is still the global one, free the
capture streams' cuBLAS workspaces, give production pools back to every
wrapper (also those made during the profile), roll the workspace lanes back
(buffers and lock), release the pool. ``VLLM_SPECGRAPH_PROFILE=extrapolate``
selects vLLM's estimator instead; ``capture-once`` captures nothing here and
arms :mod:`vllm_specgraph.patches._capture_once`, or says why it cannot and
runs the exact profile.

Why: the estimate is what the KV-cache budget leaves for graphs; a sample
and a formula under-count by a fifth on a 1B model (the KV cache is sized too
large) and over-count on small ones, and bytes the profile leaves behind are
lost to the KV cache.
"""

from __future__ import annotations

import gc
import logging
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from types import ModuleType
from typing import TYPE_CHECKING, Any

import torch

from vllm_specgraph.lanes import LaneWorkspace
from vllm_specgraph.meter import (
    CaptureFootprint,
    CaptureMeter,
    describe_owners,
    live_blocks,
    metering,
)
from vllm_specgraph.patches._capture_allocator import (
    expandable_segments_blocker,
    expandable_segments_for_capture,
)
from vllm_specgraph.patches._capture_once import capture_once_blocker, plan_capture_once
from vllm_specgraph.patches._measurements import (
    KVSetUpState,
    SpecgraphCapture,
    graphs_captured,
)
from vllm_specgraph.patches._patching import PatchSet
from vllm_specgraph.patches.distributed.parallel_state import group_channel_pools
from vllm_specgraph.profile import (
    GraphMemoryReport,
    PassReading,
    disposable_graph_pass,
    measure_graph_memory,
    release_capture_stream_workspaces,
)
from vllm_specgraph.ranks import on_any_rank
from vllm_specgraph.switches import PROFILE_MODES, current_switches

if TYPE_CHECKING:
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner


__all__ = [
    "PROFILE_MODES",
    "ProfileOutcome",
    "budget_bytes",
    "exact_cudagraph_memory",
    "install",
    "profile_mode",
]

logger = logging.getLogger("vllm.specgraph")

_MIB = 1 << 20


def profile_mode() -> str:
    """``VLLM_SPECGRAPH_PROFILE`` as the plugin read it: ``exact`` unless set."""
    return current_switches().profile


@dataclass(frozen=True)
class ProfileOutcome:
    """What :func:`exact_cudagraph_memory` measured, and how."""

    report: GraphMemoryReport
    phase_seconds: dict[str, float]
    footprint: CaptureFootprint | None  # where the last pass's bytes went
    passes: int
    expandable_segments: bool  # during the passes' captures
    expandable_segments_blocker: str | None  # why not, if not
    kv_state_bytes: int  # of the KV-cache set-up's own state, what production makes anew
    kv_state_kept_bytes: int  # what of it outlived the pass, in the one-time bytes


def exact_cudagraph_memory(runner: GPUModelRunner) -> ProfileOutcome | None:
    """Capture every graph ``runner.capture_model()`` will capture, measure, give it all back.

    None when, once the minimal KV cache is set up, the runner has no graph to
    capture (its modes resolved to none, an encoder-only runner): vLLM's own
    profile returns 0 there, and so does the plugin's, without a capture.

    Runs the core's :func:`~vllm_specgraph.profile.measure_graph_memory` over
    disposable passes of vLLM's own ``capture_model``: one pass, or two where
    the first kept memory a capture made (its docstring says when). The KV
    cache is sized after the profile, so the budget (:func:`budget_bytes`)
    counts the one-time bytes and whatever the last pass left taken
    (``retained_bytes``). Every rank of the engine takes the same passes.

    *Requires*: called before the KV cache exists and before any graph was
    captured (``Worker.determine_available_memory``); no capture is active.
    *Guarantees*, on success and on error: the runner's KV and graph state is
    torn down as vLLM's own profile leaves it, every graph wrapper and the
    global graph pool hold the production pool, the workspace lanes hold what
    they held before, the allocator's config is the user's, and no cuBLAS
    workspace of a profiling stream is left.
    """
    from vllm.v1.worker.workspace import current_workspace_manager

    workspace = current_workspace_manager()
    if not isinstance(workspace, LaneWorkspace):
        raise RuntimeError(
            f"the workspace manager is a {type(workspace).__name__}, not the plugin's "
            "LaneWorkspace; the workspace patch must be installed before the worker starts"
        )
    clock = _PhaseClock()
    # No graph exists yet, so nothing can still point into a retired buffer.
    workspace.release_retired()
    # vLLM's memory profiling has just collected garbage and emptied the cache:
    # what is left to settle is work in flight and earlier streams' cuBLAS workspaces.
    torch.cuda.synchronize()
    release_capture_stream_workspaces()
    profile = measure_graph_memory(
        lambda index: _measured_pass(runner, workspace, clock, " again" if index else ""),
        agree=_on_any_rank_of_the_engine,
        log=lambda line: logger.info("vllm-specgraph: %s", line),
    )
    if profile is None:
        return None
    last = profile.last
    return ProfileOutcome(
        replace(profile.report, wall_seconds=clock.total()),
        clock.phases,
        last.footprint,
        profile.passes,
        last.expandable_segments,
        expandable_segments_blocker(runner.vllm_config),
        kv_state_bytes=last.kv_state.freed_bytes(profile.blocks_after),
        kv_state_kept_bytes=last.kv_state.kept_bytes(profile.blocks_after),
    )


def _on_any_rank_of_the_engine(flag: bool) -> bool:
    """``flag`` voted over vLLM's world group (every TP, PP and DP rank), on its CPU group."""
    from vllm.distributed import parallel_state

    world = getattr(parallel_state, "_WORLD", None)
    return on_any_rank(flag, None if world is None else world.cpu_group)


def budget_bytes(report: GraphMemoryReport) -> int:
    """What the KV-cache budget must leave: the graphs, and all the profile kept."""
    return report.total_driver_bytes + report.one_time_bytes + max(report.retained_bytes, 0)


@dataclass(frozen=True)
class _Pass(PassReading):
    footprint: CaptureFootprint | None = None  # where the capture's bytes went
    kv_state: KVSetUpState | None = None  # what the minimal KV-cache set-up made beside it


def _measured_pass(
    runner: GPUModelRunner, workspace: LaneWorkspace, clock: _PhaseClock, suffix: str = ""
) -> _Pass | None:
    """One disposable pass over ``capture_model``: the owners, the allocator's blocks
    when the capture began, whether it ran with expandable segments, where its bytes
    went and the KV-cache set-up's state. None, after the pass's teardown, when the
    runner set up for the minimal KV cache has no graph to capture."""
    from vllm.compilation.counter import compilation_counter
    from vllm.compilation.cudagraph_pool import capture_outside_cumem_pool
    from vllm.config import set_current_vllm_config
    from vllm.v1.worker.gpu.cudagraph_utils import _init_minimal_kv_cache_for_profiling

    if not suffix:
        clock.lap("settle")  # the engine's baseline included
    counters = (
        compilation_counter.num_cudagraph_captured,
        compilation_counter.num_gpu_runner_capture_triggers,
    )
    try:
        with disposable_graph_pass(
            channel_pools=group_channel_pools(),
            workspace=workspace,
            redirect_pools=_pools_redirected,
        ) as disposable:
            disposable.on_destroy(lambda: _destroy_profiling_graphs(runner))
            disposable.on_destroy(release_capture_stream_workspaces)
            blocks_before_init = live_blocks()
            with set_current_vllm_config(runner.vllm_config):
                _init_minimal_kv_cache_for_profiling(runner)
            clock.lap("minimal KV cache" + suffix)
            if not runner.needs_cudagraph_capture():
                return None
            kv_state = KVSetUpState.read(runner, blocks_before_init)
            blocks_before_capture = kv_state.blocks_after
            # Production's own path, adaptive-verification runs and lock included
            # (the pass restores the lock): what it measures is what production does.
            with (
                capture_outside_cumem_pool(),
                _capture_in_frozen_pass(),
                expandable_segments_for_capture(runner.vllm_config) as expandable,
                metering(CaptureMeter(graphs_captured)) as meter,
                meter.whole_call(),
            ):
                total = int(runner.capture_model(profile_only=False))
            clock.lap("capture" + suffix)
    finally:
        (
            compilation_counter.num_cudagraph_captured,
            compilation_counter.num_gpu_runner_capture_triggers,
        ) = counters
    clock.lap("teardown" + suffix)
    return _Pass(
        meter.owners(total),
        blocks_before_capture,
        expandable,
        footprint=meter.footprint,
        kv_state=kv_state,
    )


@contextmanager
def _capture_in_frozen_pass() -> Iterator[None]:
    """Run ``capture_model`` with vLLM's capture-time gc handling, fitted to the pass.

    vLLM collects, freezes the heap and turns collection off for the capture,
    then thaws everything and collects again. The disposable pass has frozen
    every older object already: a thaw here would make each later collection
    visit the whole heap again (about half a second each in a served model's
    process). So: collect what the pass made, turn collection off as vLLM does,
    and leave the closing collection to the pass's teardown, where it can free
    pool memory.
    """
    from vllm import envs

    # Looked up, not imported: the runner being profiled has imported it already.
    model_runner = sys.modules["vllm.v1.worker.gpu.model_runner"]

    @contextmanager
    def collection_off() -> Iterator[None]:
        enabled = gc.isenabled()
        gc.collect()
        if not envs.VLLM_ENABLE_CUDAGRAPH_GC:
            gc.disable()
        try:
            yield
        finally:
            if enabled:
                gc.enable()

    production = model_runner.freeze_gc_for_cudagraph_capture
    model_runner.freeze_gc_for_cudagraph_capture = collection_off
    try:
        yield
    finally:
        model_runner.freeze_gc_for_cudagraph_capture = production


class _PhaseClock:
    def __init__(self) -> None:
        self._started = self._last = time.perf_counter()
        self.phases: dict[str, float] = {}

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.phases[phase] = now - self._last
        self._last = now

    def total(self) -> float:
        return self._last - self._started


@contextmanager
def _pools_redirected(pool: tuple[int, int]) -> Iterator[None]:
    """Make ``pool`` the global graph pool and every graph wrapper's pool, for the block.

    On exit the global pool is restored, every wrapper that existed gets its
    pool back, and a wrapper made during the block gets the production pool.
    """
    from vllm.compilation.breakable_cudagraph import BreakableCUDAGraphWrapper
    from vllm.compilation.cuda_graph import CUDAGraphWrapper
    from vllm.platforms import current_platform

    def wrappers() -> list[Any]:
        return [*CUDAGraphWrapper._all_instances, *BreakableCUDAGraphWrapper._all_instances]

    platform_cls = type(current_platform)
    saved_global = platform_cls._global_graph_pool
    saved = {id(w): (w, w.graph_pool) for w in wrappers()}
    platform_cls._global_graph_pool = pool
    try:
        for wrapper, _ in saved.values():
            wrapper.graph_pool = pool
        yield
    finally:
        platform_cls._global_graph_pool = saved_global
        for wrapper in wrappers():
            if id(wrapper) in saved:
                wrapper.graph_pool = saved[id(wrapper)][1]
            elif wrapper.graph_pool == pool:
                wrapper.graph_pool = current_platform.get_global_graph_pool()


def _destroy_profiling_graphs(runner: GPUModelRunner) -> None:
    """Drop every graph the profile captured, and the profiling KV state."""
    from vllm.compilation.breakable_cudagraph import BreakableCUDAGraphWrapper
    from vllm.compilation.cuda_graph import CUDAGraphWrapper
    from vllm.config.compilation import CUDAGraphMode
    from vllm.v1.worker.gpu.cudagraph_utils import _teardown_profiling_state

    CUDAGraphWrapper.clear_all_graphs()
    BreakableCUDAGraphWrapper.clear_all_graphs()
    if runner.cudagraph_manager is not None:
        # Others may still hold the profiling manager (the fast-prefill helper does).
        runner.cudagraph_manager.release_graphs()
    runner.fast_prefill = None  # holds that manager's outputs; the real KV init remakes it
    # DeepSeek-V4.1's model state records metadata graphs of its own at capture and
    # drops them only at the next capture.
    release_inner_graphs = getattr(getattr(runner.model_state, "graphs", None), "release", None)
    if callable(release_inner_graphs):
        release_inner_graphs()
    if runner.speculator is not None:
        # The speculator's own way to replace its graph managers; the real
        # initialize_kv_cache builds the production ones.
        runner.speculator.init_cudagraph_manager(CUDAGraphMode.NONE)
    _teardown_profiling_state(runner)


def _profile_cudagraph_memory(upstream: Callable[[Any], int]) -> Callable[[Any], int]:
    def profile_cudagraph_memory(runner: GPUModelRunner) -> int:
        """vLLM's graph-memory estimate entry point, answered by the exact profile."""
        from vllm.config.compilation import CUDAGraphMode
        from vllm.platforms import current_platform

        # The exact profile reads CUDA's driver and cuBLAS state; elsewhere (XPU, ROCm)
        # vLLM's own estimate stands.
        if profile_mode() == "extrapolate" or not current_platform.is_cuda():
            return upstream(runner)
        if (
            runner.compilation_config.cudagraph_mode == CUDAGraphMode.NONE
            and not runner.needs_cudagraph_capture()
        ):
            return 0
        if profile_mode() == "capture-once":
            blocker = capture_once_blocker(runner)
            if blocker is None:
                plan_capture_once(runner)
                logger.info(
                    "vllm-specgraph: capture-once: no profile capture; the KV cache is "
                    "reserved for the most blocks and backed after the production capture"
                )
                return 0
            runner.specgraph_capture_once_fallback = blocker
            logger.info("vllm-specgraph: capture-once falls back to the exact profile: %s", blocker)
        from vllm_specgraph.patches.distributed.device_communicators import (
            flashinfer_pcie_ipc_all_reduce as pcie_ipc,
        )

        outcome = exact_cudagraph_memory(runner)
        if outcome is None:
            return 0
        report, phases = outcome.report, outcome.phase_seconds
        runner.specgraph_profile = SpecgraphCapture(
            estimate=report,
            phase_seconds=phases,
            estimate_footprint=outcome.footprint,
            profile_passes=outcome.passes,
            expandable_segments=outcome.expandable_segments,
            expandable_segments_blocker=outcome.expandable_segments_blocker,
            kv_state_bytes=outcome.kv_state_bytes,
            kv_state_kept_bytes=outcome.kv_state_kept_bytes,
        )
        # What vLLM makes after sizing the KV cache comes out of it too: the KV
        # initialisation's own state and communicator workspaces.
        kv_state = outcome.kv_state_bytes
        communicators = pcie_ipc.communicator_bytes_after_kv_cache(runner)
        after_kv_cache = kv_state + communicators
        made_after = [
            f"{nbytes / _MIB:.1f} MiB of {what}"
            for nbytes, what in (
                (kv_state, "KV-cache initialisation state"),
                (communicators, "communicator workspace"),
            )
            if nbytes
        ]
        logger.info(
            "vllm-specgraph: CUDA graph memory profile: %s; graphs %.1f MiB in %d graphs; "
            "left taken: one-time %.2f MiB, retained %.2f MiB; "
            "budget %.1f MiB%s; %d %s, expandable segments %s; %.2f s (%s)",
            describe_owners(report.owners),
            report.total_driver_bytes / _MIB,
            sum(o.num_graphs for o in report.owners),
            report.one_time_bytes / _MIB,
            report.retained_bytes / _MIB,
            (budget_bytes(report) + after_kv_cache) / _MIB,
            f" (with {' and '.join(made_after)} made after the KV cache)" if made_after else "",
            outcome.passes,
            "pass" if outcome.passes == 1 else "passes",
            "on" if outcome.expandable_segments else f"off ({outcome.expandable_segments_blocker})",
            report.wall_seconds,
            ", ".join(f"{phase} {seconds:.2f} s" for phase, seconds in phases.items()),
        )
        return budget_bytes(report) + after_kv_cache

    profile_cudagraph_memory.__specgraph__ = True
    return profile_cudagraph_memory


def install(patches: PatchSet, cudagraph_utils: ModuleType) -> None:
    patches.wrap(
        cudagraph_utils,
        "profile_cudagraph_memory",
        _profile_cudagraph_memory,
        parameters=("runner",),
    )
