"""Stand-ins the end-to-end harness's CPU tests share: the harness's modules loaded
from scripts/vllm_e2e, a ``torch.cuda`` whose usage they move, a runner and a worker
that move it as vLLM would, and run_llm.py results made by run_llm.py's own meter and
workload. The byte counts are test inputs, not measurements."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import sys
from types import ModuleType, SimpleNamespace
from typing import Any

SCRIPTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts")
MiB = 1 << 20


def _load(name: str) -> ModuleType:
    path = os.path.join(SCRIPTS, "vllm_e2e", f"{name}.py")
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # what the scripts import of each other, as from their folder
    spec.loader.exec_module(mod)
    return mod


run_llm, summarize, device = _load("run_llm"), _load("summarize"), _load("device")
# The meter collects garbage at rest; with vLLM imported that is slow, and needless here.
run_llm.gc = SimpleNamespace(collect=lambda: 0)
ESTIMATE_ENV = "VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS"  # vLLM's; run_llm.py resets it
HEADROOM = 100 * MiB  # the stand-in worker's activation headroom
UPSTREAM = {"est": 41 * MiB, "retained": 32 * MiB, "actual": 36 * MiB, "kv": 7 << 30}
EXACT = {"est": 34 * MiB, "retained": 4 * MiB, "actual": 30 * MiB, "kv": 8 << 30}
# Capture-once: nothing estimated, the KV cache sized (and reserved) for EXACT's KV plus
# its estimate, the pages held those less what the capture took.
KV_MAX = EXACT["kv"] + EXACT["est"]
ONCE = EXACT | {"est": 0, "retained": 0, "kv": KV_MAX, "held": KV_MAX - EXACT["actual"]}


def kv(text: str) -> dict[str, str]:
    """``"A=x y; B=z"`` as {"A": "x y", "B": "z"}."""
    return dict(item.strip().split("=", 1) for item in text.split(";") if item.strip())


def pick(rows: list[dict], keys: str) -> str:
    """The ``keys`` of each row: a row's values joined by spaces, the rows by "; "."""
    return "; ".join(" ".join(str(row[k]) for k in keys.split()) for row in rows)


def fake_cuda() -> SimpleNamespace:
    """``torch.cuda`` whose driver-level usage the stand-ins below move (``used``); the
    allocator's peaks are what a generate set (``peak``, ``reserved``)."""
    cuda = SimpleNamespace(total=80 << 30, used=10 << 30, reserved=0, peak=0)
    cuda.synchronize = cuda.empty_cache = cuda.reset_peak_memory_stats = lambda: None
    cuda.mem_get_info = lambda: (cuda.total - cuda.used, cuda.total)
    cuda.memory_reserved = cuda.max_memory_reserved = lambda: cuda.reserved
    cuda.memory_allocated, cuda.max_memory_allocated = lambda: 0, lambda: cuda.peak
    return cuda


def fake_classes(
    cuda: SimpleNamespace, est: int, retained: int, actual: int, kv: int, held: int | None = None
) -> tuple:
    """A runner and a worker that move ``cuda`` as vLLM would: the profile leaves
    ``retained`` taken, the worker sizes the KV cache at ``kv`` (its limit ``kv +
    headroom + estimate``, as vLLM's formula gives) and takes it (capture-once: ``held``
    of it), the capture ``actual``."""

    class Runner:
        def profile_cudagraph_memory(self) -> int:
            cuda.used += retained
            return est

        def capture_model(self, *, profile_only: bool = False) -> int:
            cuda.used += 0 if profile_only else actual
            return 0 if profile_only else actual

    class Worker:
        cudagraph_memory_estimate = est

        def determine_available_memory(self) -> int:
            self.init_snapshot = SimpleNamespace(free_memory=cuda.total - cuda.used)
            self.init_snapshot.total_memory = cuda.total
            self.requested_memory = kv + HEADROOM + est
            self.peak_activation_memory = HEADROOM + est
            self.available_kv_cache_memory_bytes = kv
            Runner().profile_cudagraph_memory()
            cuda.used += kv if held is None else held
            return kv

    return Runner, Worker


def metrics(drafts: int, draft_tokens: int, accepted: int, steps: int = 0) -> list:
    """``llm.get_metrics()`` entries as vLLM's reader makes them."""
    out = [SimpleNamespace(name="vllm:iteration_tokens_total", count=steps)]
    for name, value in (("drafts", drafts), ("draft_tokens", draft_tokens)):
        out.append(SimpleNamespace(name=f"vllm:spec_decode_num_{name}", value=value))
    out.append(SimpleNamespace(name="vllm:spec_decode_num_accepted_tokens", value=accepted))
    out.append(SimpleNamespace(name="vllm:spec_decode_num_accepted_tokens_per_pos", values=[5, 4]))
    return [*out, SimpleNamespace(name="vllm:num_requests_running", value=0)]


def fake_run(size: str, case: str, plugin: str, tokens: list, fig: dict, **kw: Any) -> dict:
    """A run_llm.py result made by its own meter, runner record and ``run_workload``:
    start-up moves the stand-in GPU by ``fig`` (est, retained, actual, kv, held), then
    the workload (``workload``) generates ``tokens`` with a step that keeps ``step``
    bytes; ``report``, ``once`` and ``fallback``: what the plugin left on the runner."""
    cuda, step = fake_cuda(), kw.get("step", 0)
    held = fig.get("held", fig["kv"])
    figures = (fig["est"], fig["retained"], fig["actual"], fig["kv"], held)
    runner_cls, worker_cls = fake_classes(cuda, *figures)
    mem: dict[str, Any] = {}
    meter = run_llm.Meter(cuda, mem).install(runner_cls, worker_cls)
    worker_cls().determine_available_memory()
    runner_cls().capture_model(profile_only=True)
    runner_cls().capture_model()
    report = kw.get("report")
    runner = SimpleNamespace(specgraph_profile=report and SimpleNamespace(to_dict=lambda: report))
    runner.specgraph_capture_once = kw.get("once")
    runner.specgraph_capture_once_fallback = kw.get("fallback")
    record = run_llm.runner_record(runner)
    result = {"size": size, "case": case, "ok": True, "workload": kw.get("workload", "smoke")}
    result |= {"mem": mem, "startup_s": 12.5, "kv_tokens": held >> 10}
    result["plugin"] = {"switch": plugin, "wrappers_intact": meter.intact()}
    result["resolved"] = {"num_gpu_blocks": held >> 14, "block_size": 16, "num_capture_sizes": 6}
    result |= {key: record[key] for key in run_llm.RUNNER_KEYS}

    def generate(requests: list) -> list[list[int]]:
        cuda.used += step
        cuda.reserved += step
        cuda.peak = step
        return [list(t) for t in tokens]

    args = SimpleNamespace(workload=result["workload"], size=size, load_requests=4, load_repeats=2)
    counters = lambda: run_llm.read_spec_counters(metrics(10, 30, 12))  # noqa: E731
    run_llm.run_workload(args, 512, generate, counters, meter, result)
    return result


# The plugin's CaptureOnceOutcome, the fields run_llm.py reads.
OUTCOME_FIELDS = "max_blocks num_blocks reserved_bytes mapped_bytes taken_bytes budget_bytes"
Outcome = dataclasses.make_dataclass("Outcome", [*OUTCOME_FIELDS.split(), "seconds"], frozen=True)


def once_run(case: str, tokens: list, held: int = ONCE["held"]) -> dict:
    """A ``once`` run whose capture-once backed ``held`` bytes of KV pages."""
    budget = KV_MAX - ONCE["actual"]
    outcome = Outcome(KV_MAX >> 14, held >> 14, KV_MAX, held, ONCE["actual"], budget, 0.5)
    return fake_run("tiny", case, "once", tokens, ONCE | {"held": held}, once=outcome)
