"""What the end-to-end harness's CPU tests share: its modules, and run_llm.py results
made by its own meter, rank record and workload on a stand-in GPU (test byte counts)."""

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
run_llm.gc = SimpleNamespace(collect=lambda: 0)  # at rest: slow with vLLM imported, needless
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


def fake_run(size: str, case: str, plugin: str, tokens: list, fig: dict, **kw: Any) -> dict:
    """A run_llm.py result: start-up moves the GPU by ``fig`` (est retained actual kv held),
    the workload generates ``tokens``; ``report``, ``once``, ``fallback``: on the runner."""
    cuda = SimpleNamespace(total=80 << 30, used=10 << 30, get_device_name=lambda: "Stand-in")
    cuda.synchronize = cuda.empty_cache = lambda: None
    cuda.mem_get_info = lambda: (cuda.total - cuda.used, cuda.total)
    held = fig.get("held", fig["kv"])

    class Stand:  # vLLM's runner and worker in one, moving the GPU as they would
        cudagraph_memory_estimate = fig["est"]

        def profile_cudagraph_memory(self) -> int:
            cuda.used += fig["retained"]
            return fig["est"]

        def capture_model(self, *, profile_only: bool = False) -> int:
            cuda.used += 0 if profile_only else fig["actual"]
            return 0 if profile_only else fig["actual"]

        def determine_available_memory(self) -> int:  # the KV cache of vLLM's formula
            self.init_snapshot = SimpleNamespace(free_memory=cuda.total - cuda.used)
            self.requested_memory = fig["kv"] + HEADROOM + fig["est"]
            self.peak_activation_memory = HEADROOM + fig["est"]
            self.profile_cudagraph_memory()
            cuda.used += held
            return fig["kv"]

    meter = run_llm.Meter(cuda, {}).install(Stand, Stand)
    Stand().determine_available_memory()
    Stand().capture_model(profile_only=True)
    Stand().capture_model()
    report = kw.get("report")
    runner = SimpleNamespace(specgraph_profile=report and SimpleNamespace(to_dict=lambda: report))
    runner.specgraph_capture_once = kw.get("once")
    runner.specgraph_capture_once_fallback = kw.get("fallback")
    result = {"size": size, "case": case, "ok": True, "workload": kw.get("workload", "smoke")}
    result |= {"mem": meter.mem, "startup_s": 12.5, "kv_tokens": held >> 10}
    result["plugin"] = {"switch": plugin}
    result["resolved"] = {"num_gpu_blocks": held >> 14, "block_size": 16, "num_capture_sizes": 6}
    saved = dict(run_llm.STATE)  # this process's measuring side and engine, as at TP=1
    run_llm.STATE.update(meter=meter, plugin_log=[])
    worker = SimpleNamespace(model_runner=runner)
    executor = SimpleNamespace(driver_worker=SimpleNamespace(worker=worker))
    core = SimpleNamespace(engine_core=SimpleNamespace(model_executor=executor))
    run_llm.record_ranks(SimpleNamespace(llm_engine=SimpleNamespace(engine_core=core)), 1, result)
    run_llm.STATE.update(saved)
    meter.at_rest()
    args = SimpleNamespace(workload=result["workload"], size=size, load_requests=4, load_repeats=2)
    run_llm.run_workload(args, lambda requests: [list(t) for t in tokens], dict, result)
    return result


# The plugin's CaptureOnceOutcome, the fields run_llm.py reads.
OUTCOME_FIELDS = "max_blocks num_blocks reserved_bytes mapped_bytes taken_bytes budget_bytes"
Outcome = dataclasses.make_dataclass("Outcome", [*OUTCOME_FIELDS.split(), "seconds"], frozen=True)


def once_run(case: str, tokens: list, held: int = ONCE["held"]) -> dict:
    """A ``once`` run whose capture-once backed ``held`` bytes of KV pages."""
    budget = KV_MAX - ONCE["actual"]
    outcome = Outcome(KV_MAX >> 14, held >> 14, KV_MAX, held, ONCE["actual"], budget, 0.5)
    return fake_run("tiny", case, "once", tokens, ONCE | {"held": held}, once=outcome)
