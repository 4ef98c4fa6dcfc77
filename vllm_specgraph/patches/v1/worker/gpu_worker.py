"""Patch for ``vllm.v1.worker.gpu_worker`` (vLLM 0.33.0).

vLLM does: ``_num_workspace_lanes`` gives the workspace a second lane only
for DSpark; a draft weight update (``start_draft_weight_update`` ->
``update_weights`` -> ``finish_weight_update``) runs in the target's lane.

This patch changes: two lanes whenever Model Runner V2 runs with any
speculative method, and a draft weight update session runs in the draft lane.
Under capture-once, ``compile_or_warm_up_model`` ends by backing the KV cache
with what warm-up and the production capture left
(:func:`~vllm_specgraph.patches._capture_once.back_within_budget`); if it fails,
the reserved range is given back.

Why: every speculator phase must take its scratch from the draft lane, or the
draft's growth moves memory under the target's captured graphs; capture-once
knows the graphs' cost only once they exist.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from contextlib import nullcontext
from types import ModuleType

from vllm_specgraph.lanes import DEFAULT_OWNER_LANES, use_lane
from vllm_specgraph.patches._capture_once import abandon_plan, back_within_budget, planned_runner
from vllm_specgraph.patches._patching import PatchSet

__all__ = ["install"]

DRAFT_LANE = DEFAULT_OWNER_LANES["draft"]


def _num_workspace_lanes(original: Callable) -> Callable:
    @functools.wraps(original)
    def num_workspace_lanes(vllm_config, use_v2_model_runner: bool) -> int:
        if use_v2_model_runner and vllm_config.speculative_config is not None:
            return max(DRAFT_LANE + 1, original(vllm_config, use_v2_model_runner))
        return original(vllm_config, use_v2_model_runner)

    return num_workspace_lanes


def _in_draft_lane_when(is_draft: Callable[..., bool], method: Callable) -> Callable:
    @functools.wraps(method)
    def in_lane(self, *args, **kwargs):
        with use_lane(DRAFT_LANE) if is_draft(self, *args, **kwargs) else nullcontext():
            return method(self, *args, **kwargs)

    return in_lane


def _compile_or_warm_up_model(original: Callable) -> Callable:
    @functools.wraps(original)
    def compile_or_warm_up_model(self):
        if planned_runner() is not self.model_runner:
            return original(self)
        try:
            compilation_times = original(self)
            back_within_budget(self)
        except BaseException:
            abandon_plan()
            raise
        return compilation_times

    return compile_or_warm_up_model


def install(patches: PatchSet, gpu_worker: ModuleType) -> None:
    patches.wrap(
        gpu_worker,
        "_num_workspace_lanes",
        _num_workspace_lanes,
        parameters=("vllm_config", "use_v2_model_runner"),
    )
    worker = gpu_worker.Worker
    patches.wrap(worker, "compile_or_warm_up_model", _compile_or_warm_up_model)
    starting_draft = lambda self, is_draft=False: is_draft  # noqa: E731
    in_draft_session = lambda self, *args, **kwargs: self._weight_update_is_draft  # noqa: E731
    for name, is_draft, parameters in (
        ("_start_weight_update", starting_draft, ("is_draft",)),
        ("update_weights", in_draft_session, ("update_info",)),
        ("finish_weight_update", in_draft_session, ()),
    ):
        patches.wrap(
            worker, name, functools.partial(_in_draft_lane_when, is_draft), parameters=parameters
        )
