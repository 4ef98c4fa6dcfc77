# SPDX-License-Identifier: Apache-2.0
"""run_llm.py's measurement wrappers and the plugin's report, read from a runner.

The wrappers only read numbers: each calls the vLLM method it replaces
unchanged, and reads ``torch.cuda`` (passed in, so that the tests can pass a
stand-in) and ``time.perf_counter`` around it. They run in run_llm.py's process
at TP=1 and in every worker process at TP > 1 (``e2e_worker.py``).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import memory_budget

__all__ = ["install_wrappers", "plugin_report", "wrappers_intact"]


def install_wrappers(runner_cls: Any, worker_cls: Any, cuda: Any, mem: dict[str, Any]) -> dict:
    """Wrap three vLLM methods to read numbers; each wrapper calls the method it
    replaces unchanged. ``cuda`` is ``torch.cuda``. Returns {attribute: wrapper} so
    the caller can check later that nothing replaced them.

    * ``runner_cls.profile_cudagraph_memory``: the estimate, its wall time, and
      the driver-level memory still taken after it returned (before and after
      an ``empty_cache``).
    * ``runner_cls.capture_model``: for the production capture, the actual graph
      memory (vLLM's own return value) and its wall time; profiling captures
      (``profile_only=True``) are only counted and timed; ``capture_started``
      is set before the production capture runs, so a run that dies in it says so.
    * ``worker_cls.determine_available_memory``: the KV cache bytes, and the
      budget figures the worker kept (``memory_budget.worker_budget``).
    """

    def drv_used() -> int:
        cuda.synchronize()
        free, total = cuda.mem_get_info()
        return total - free

    orig_prof = runner_cls.profile_cudagraph_memory

    def prof_wrapper(self: Any) -> int:
        cuda.synchronize()
        cuda.empty_cache()
        b_used = drv_used()
        b_res = cuda.memory_reserved()
        t0 = time.perf_counter()
        est = orig_prof(self)
        cuda.synchronize()
        wall = time.perf_counter() - t0
        a_used = drv_used()
        a_res = cuda.memory_reserved()
        cuda.empty_cache()
        a2_used = drv_used()
        mem["profile_estimate_bytes"] = int(est) if isinstance(est, int | float) else repr(est)
        mem["profile_wall_s"] = round(wall, 3)
        mem["profile_driver_used_before"] = b_used
        mem["profile_driver_left_taken"] = a_used - b_used
        mem["profile_driver_left_taken_after_empty_cache"] = a2_used - b_used
        mem["profile_allocator_reserved_delta"] = a_res - b_res
        if os.environ.get("E2E_PROFILE_REPEAT") == "1":
            # Diagnosis: what a second profile in the same process measures and keeps,
            # i.e. which part of the first one was a one-time cost of the process.
            again = orig_prof(self)
            cuda.synchronize()
            cuda.empty_cache()
            mem["profile_repeat_estimate_bytes"] = int(again)
            mem["profile_repeat_driver_left_taken"] = drv_used() - a2_used
        return est

    orig_cap = runner_cls.capture_model

    def cap_wrapper(self: Any, *a: Any, **kw: Any) -> int:
        if kw.get("profile_only"):
            t0 = time.perf_counter()
            r = orig_cap(self, *a, **kw)
            mem["profile_only_capture_calls"] = mem.get("profile_only_capture_calls", 0) + 1
            mem["profile_only_capture_wall_s"] = round(
                mem.get("profile_only_capture_wall_s", 0.0) + time.perf_counter() - t0, 3
            )
            return r
        mem["capture_started"] = True
        b_used = drv_used()
        b_res = cuda.memory_reserved()
        t0 = time.perf_counter()
        actual = orig_cap(self, *a, **kw)
        cuda.synchronize()
        wall = time.perf_counter() - t0
        mem["capture_calls"] = mem.get("capture_calls", 0) + 1
        mem["capture_actual_bytes"] = (
            int(actual) if isinstance(actual, int | float) else repr(actual)
        )
        mem["capture_wall_s"] = round(wall, 3)
        mem["capture_driver_delta"] = drv_used() - b_used
        mem["capture_allocator_reserved_delta"] = cuda.memory_reserved() - b_res
        return actual

    orig_dam = worker_cls.determine_available_memory

    def dam_wrapper(self: Any) -> int:
        t0 = time.perf_counter()
        r = orig_dam(self)
        mem["determine_available_memory_wall_s"] = round(time.perf_counter() - t0, 3)
        mem["kv_cache_bytes"] = int(r)
        mem["worker_cudagraph_memory_estimate"] = int(
            getattr(self, "cudagraph_memory_estimate", -1)
        )
        applied = memory_budget.estimate_applied()
        for key, value in memory_budget.worker_budget(self, applied).items():
            mem[key] = value
        return r

    runner_cls.profile_cudagraph_memory = prof_wrapper
    runner_cls.capture_model = cap_wrapper
    worker_cls.determine_available_memory = dam_wrapper
    return {
        "profile_cudagraph_memory": (runner_cls, prof_wrapper),
        "capture_model": (runner_cls, cap_wrapper),
        "determine_available_memory": (worker_cls, dam_wrapper),
    }


def wrappers_intact(installed: dict) -> dict[str, bool]:
    return {name: getattr(cls, name) is fn for name, (cls, fn) in installed.items()}


def plugin_report(runner: Any) -> dict | None:
    """The plugin's own profile report, if it attached one to the runner."""
    prof = getattr(runner, "specgraph_profile", None)
    if prof is None:
        return None
    to_dict: Callable[[], dict] | None = getattr(prof, "to_dict", None)
    if to_dict is None:
        return {"error": f"{type(prof).__name__} has no to_dict()"}
    return to_dict()
