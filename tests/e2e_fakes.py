"""Stand-ins the end-to-end harness's CPU tests share: the harness's modules loaded
from scripts/vllm_e2e, a ``torch.cuda`` whose usage they move, a runner and a worker
that move it as vLLM would, and run_llm.py results made by run_llm.py's own wrappers
and workload. The byte counts are test inputs, not measurements."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from types import ModuleType, SimpleNamespace
from typing import Any

SCRIPTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts")
MiB = 1 << 20


def _load(name: str) -> ModuleType:
    path = os.path.join(SCRIPTS, "vllm_e2e", f"{name}.py")
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


run_llm, summarize, device = _load("run_llm"), _load("summarize"), _load("device")
# free_at_rest collects garbage; with vLLM imported that is slow, and needless here.
run_llm.gc = SimpleNamespace(collect=lambda: 0)
ESTIMATE_ENV = run_llm.ESTIMATE_ENV
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


class FakeCuda:
    """``torch.cuda`` whose driver-level usage the stand-ins below move."""

    total = 80 << 30

    def __init__(self) -> None:
        self.used, self.reserved, self.allocated = 10 << 30, 0, 0
        self.peak_allocated = self.peak_reserved = 0

    def synchronize(self) -> None:
        pass

    empty_cache = reset_peak_memory_stats = synchronize

    def mem_get_info(self) -> tuple[int, int]:
        return self.total - self.used, self.total

    def memory_reserved(self) -> int:
        return self.reserved

    def memory_allocated(self) -> int:
        return self.allocated

    def max_memory_allocated(self) -> int:
        return self.peak_allocated

    def max_memory_reserved(self) -> int:
        return self.peak_reserved


def fake_classes(
    cuda: FakeCuda, est: int, retained: int, actual: int, kv: int, held: int | None = None
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
            applied = est if run_llm.estimate_applied() else 0
            free = cuda.total - cuda.used
            self.init_snapshot = SimpleNamespace(free_memory=free, total_memory=cuda.total)
            self.requested_memory = kv + HEADROOM + applied
            self.peak_activation_memory = HEADROOM + applied
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
    """A run_llm.py result made by its own wrappers and ``run_workload``: start-up moves
    the stand-in GPU by ``fig`` (est, retained, actual, kv), then the workload
    (``workload``) generates ``tokens`` with a step that keeps ``step`` bytes; ``once``
    and ``fallback``: what capture-once left on the runner."""
    cuda, report, step = FakeCuda(), kw.get("report"), kw.get("step", 0)
    held = fig.get("held", fig["kv"])
    runner_cls, worker_cls = fake_classes(
        cuda, fig["est"], fig["retained"], fig["actual"], fig["kv"], held
    )
    mem: dict[str, Any] = {}
    installed = run_llm.install_wrappers(runner_cls, worker_cls, cuda, mem)
    worker_cls().determine_available_memory()
    runner_cls().capture_model(profile_only=True)
    runner_cls().capture_model()
    runner = SimpleNamespace(specgraph_profile=report and SimpleNamespace(to_dict=lambda: report))
    runner.specgraph_capture_once = kw.get("once")
    runner.specgraph_capture_once_fallback = kw.get("fallback")
    result = {"size": size, "case": case, "capture": kw.get("capture", "default"), "ok": True}
    result |= {"workload": kw.get("workload", "smoke"), "mem": mem, "startup_s": 12.5}
    result["plugin"] = {"switch": plugin, "wrappers_intact": run_llm.wrappers_intact(installed)}
    result["resolved"] = {
        "num_gpu_blocks": held >> 14,
        "block_size": 16,
        "num_capture_sizes": 6,
    }
    result |= {"kv_tokens": held >> 10, "plugin_report": run_llm.plugin_report(runner)}
    result |= run_llm.capture_once_of(runner)

    def generate(requests: list, sampling: dict | None = None) -> list[list[int]]:
        cuda.used += step
        cuda.reserved += step
        cuda.peak_allocated, cuda.peak_reserved = cuda.allocated + step, cuda.reserved
        result.setdefault("sampled_with", []).append(sampling)
        return [list(t) for t in tokens]

    args = SimpleNamespace(workload=result["workload"], max_tokens=3, num_prompts=2, seed=0)
    args.load_requests, args.load_repeats = 4, 2
    llm = SimpleNamespace(get_metrics=lambda: metrics(10, 30, 12))
    run_llm.run_workload(args, run_llm.SIZES[size], 512, generate, llm, cuda, mem, result)
    return result


@dataclasses.dataclass(frozen=True)
class Outcome:
    """The plugin's ``CaptureOnceOutcome``, the fields run_llm.py reads."""

    max_blocks: int
    num_blocks: int
    reserved_bytes: int
    mapped_bytes: int
    taken_bytes: int
    budget_bytes: int
    seconds: float


def once_run(case: str, tokens: list, held: int = ONCE["held"]) -> dict:
    """A ``once`` run whose capture-once backed ``held`` bytes of KV pages."""
    budget = KV_MAX - ONCE["actual"]
    outcome = Outcome(KV_MAX >> 14, held >> 14, KV_MAX, held, ONCE["actual"], budget, 0.5)
    return fake_run("tiny", case, "once", tokens, ONCE | {"held": held}, once=outcome)
