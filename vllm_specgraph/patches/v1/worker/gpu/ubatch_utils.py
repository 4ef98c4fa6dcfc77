"""Patch for ``vllm.v1.worker.gpu.ubatch_utils`` (vLLM 0.33.0).

vLLM does: the dual-batch-overlap runner starts one ``threading.Thread`` per
micro-batch; a new thread starts with an empty context, so in the target lane.

This patch changes: those threads are :class:`~vllm_specgraph.lanes.LaneThread`,
which run in the lane of the code that started them (the module's
``threading`` name is rebound to a copy whose ``Thread`` is ``LaneThread``).

Why: micro-batches of a speculator phase must take the speculator's scratch.
The threads see every other context variable of their starter too (vLLM's
``skip_dp_coordination`` flag, for instance), as code run inline would.
"""

from __future__ import annotations

import threading
from types import ModuleType

from vllm_specgraph.lanes import LaneThread
from vllm_specgraph.patches._patching import PatchSet

__all__ = ["install"]


def _threading_with_lane_threads() -> ModuleType:
    module = ModuleType("threading", threading.__doc__)
    vars(module).update(vars(threading))
    module.Thread = LaneThread
    return module


def install(patches: PatchSet, ubatch_utils: ModuleType) -> None:
    patches.replace(ubatch_utils, "threading", _threading_with_lane_threads())
