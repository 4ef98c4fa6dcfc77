# SPDX-License-Identifier: Apache-2.0
"""What a run_llm.py run generates, and the figures read around it.

* ``smoke``: 6 prompts, 32 greedy tokens each (the workload of the earlier runs).
* ``peak``: one full step first: ``max_num_seqs`` prompts whose lengths add up
  to ``max_num_batched_tokens`` (the shape of vLLM's profile run), 16 tokens
  each, sampled with the features of vLLM's sampler warm-up
  (:data:`PEAK_SAMPLING`). The driver-level bytes the generate takes from rest
  are measured.
* ``load``: a few hundred requests of mixed prompt and output lengths (seeded),
  all submitted at once, after a warm-up generate; the timed generate runs
  ``repeats`` times and only ``generate()`` is timed. Batches shrink as
  requests finish, so replays cover many capture sizes, target and draft
  interleaved.

A request is ``(prompt token ids, max_tokens)``; ``generate`` turns requests
into token ids (``ignore_eos``; greedy unless given sampling keywords), so
this module needs neither vLLM nor a GPU and is tested on a CPU.
"""

from __future__ import annotations

import cProfile
import gc
import pstats
import random
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

Request = tuple[list[int], int]
# generate(requests, sampling): greedy token ids; ``sampling`` (SamplingParams
# keywords) replaces greedy decoding when given.
Generate = Callable[..., list[list[int]]]

WORKLOADS = ("smoke", "peak", "load")
PEAK_MAX_TOKENS = 16
# The full step samples with the features of vLLM's own sampler warm-up
# (SamplingParams.for_sampler_warmup), whose fp32 pipeline vLLM's profile run
# budgets as activation headroom; greedy sampling would leave most of that
# headroom unused and hide what the budget missed. Prompt logprobs, bad words and
# watermarking are left out: the profile does not budget the first, and the
# others add nothing to the peak. Seeded, so both switches sample the same.
PEAK_SAMPLING: dict[str, Any] = {
    "temperature": 0.9,
    "top_p": 0.9,
    "top_k": 50,
    "min_p": 0.1,
    "frequency_penalty": 0.5,
    "presence_penalty": 0.5,
    "repetition_penalty": 1.2,
    "logit_bias": {0: -1.0, 1: 0.5},
    "logprobs": 5,
    "seed": 0,
}
LOAD_MIN_LEN = 16
LOAD_WARMUP_REQUESTS = 16
LOAD_WARMUP_MAX_TOKENS = 32

__all__ = [
    "PEAK_SAMPLING",
    "WORKLOADS",
    "counter_delta",
    "free_at_rest",
    "load_requests",
    "measure_step",
    "peak_requests",
    "plugin_share",
    "prompts_token_ids",
    "read_spec_counters",
    "run_load",
    "spec_summary",
]


def prompts_token_ids(n: int, vocab: int) -> list[list[int]]:
    """Deterministic prompts, every id in [1, vocab - 2]; the odd ones repeat a
    pattern so that the n-gram speculator finds matches."""
    out = []
    for i in range(n):
        if i % 2 == 0:
            ids = [(7 + 31 * i + 13 * j) % (vocab - 2) + 1 for j in range(12 + 3 * i)]
        else:
            pat = [(11 * i + 5 * j) % (vocab - 2) + 1 for j in range(6)]
            ids = pat * 4
        out.append(ids)
    return out


def peak_requests(vocab: int, max_num_seqs: int, max_num_batched_tokens: int) -> list[Request]:
    """``max_num_seqs`` prompts of (nearly) equal length adding up to
    ``max_num_batched_tokens``: the first step prefills a full token budget
    over the most requests, as vLLM's profile run does."""
    if max_num_batched_tokens < max_num_seqs:
        raise ValueError(
            f"max_num_batched_tokens ({max_num_batched_tokens}) must be at least "
            f"max_num_seqs ({max_num_seqs})"
        )
    base, extra = divmod(max_num_batched_tokens, max_num_seqs)
    out = []
    for i in range(max_num_seqs):
        length = base + (i >= max_num_seqs - extra)
        ids = [(3 + 17 * i + 29 * j) % (vocab - 2) + 1 for j in range(length)]
        out.append((ids, PEAK_MAX_TOKENS))
    return out


def load_requests(vocab: int, n: int, max_model_len: int, seed: int) -> list[Request]:
    """``n`` seeded requests: prompts of 16 to ``max_model_len // 2`` tokens,
    outputs of 16 to ``max_model_len // 4``, ids in [1, vocab - 2]."""
    if max_model_len < 4 * LOAD_MIN_LEN:
        raise ValueError(f"max_model_len must be at least {4 * LOAD_MIN_LEN}, got {max_model_len}")
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        prompt_len = rng.randint(LOAD_MIN_LEN, max_model_len // 2)
        max_tokens = rng.randint(LOAD_MIN_LEN, max_model_len // 4)
        out.append(([rng.randint(1, vocab - 2) for _ in range(prompt_len)], max_tokens))
    return out


def free_at_rest(cuda: Any) -> int:
    """Driver-level free bytes with nothing cached by the allocator; ``cuda`` is
    ``torch.cuda``. Not legal during a capture."""
    gc.collect()
    cuda.synchronize()
    cuda.empty_cache()
    return int(cuda.mem_get_info()[0])


@contextmanager
def measure_step(cuda: Any, mem: dict[str, Any]) -> Iterator[None]:
    """Around one generate from rest: driver-level free bytes after it (the
    allocator keeps its segments, so this is its peak plus what was loaded on
    first launch), and the allocator's peak above its start."""
    cuda.synchronize()
    cuda.reset_peak_memory_stats()
    allocated, reserved = cuda.memory_allocated(), cuda.memory_reserved()
    yield
    cuda.synchronize()
    mem["free_after_step_bytes"] = int(cuda.mem_get_info()[0])
    mem["step_allocated_peak_bytes"] = int(cuda.max_memory_allocated() - allocated)
    mem["step_reserved_peak_bytes"] = int(cuda.max_memory_reserved() - reserved)


ENGINE_STEPS = "vllm:iteration_tokens_total"
"""vLLM's histogram of tokens per engine step: its count is the number of steps."""


def read_spec_counters(metrics: list[Any]) -> dict[str, Any]:
    """The spec-decode counters of ``llm.get_metrics()``: name -> value (a
    counter) or values (the per-position vector); and, under ``ENGINE_STEPS``,
    the number of engine steps so far."""
    out: dict[str, Any] = {}
    for m in metrics:
        if "spec_decode" in m.name:
            value = getattr(m, "value", None)
            out[m.name] = value if value is not None else getattr(m, "values", None)
        elif m.name == ENGINE_STEPS:
            out[m.name] = out.get(m.name, 0) + int(m.count)
    return out


def counter_delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """``after - before`` per counter (element-wise for vectors)."""
    out: dict[str, Any] = {}
    for name, value in after.items():
        old = before.get(name)
        if isinstance(value, list):
            old = old if isinstance(old, list) else []
            out[name] = [v - (old[i] if i < len(old) else 0) for i, v in enumerate(value)]
        elif isinstance(value, int | float):
            out[name] = value - (old if isinstance(old, int | float) else 0)
    return out


def spec_summary(metrics: dict[str, Any]) -> dict[str, Any]:
    """Acceptance figures from vLLM's spec-decode counters (``get_metrics`` names)."""

    def count(name: str) -> int | None:
        v = metrics.get(f"vllm:spec_decode_{name}")
        return int(v) if isinstance(v, int | float) else None

    drafts = count("num_drafts")
    draft_tokens = count("num_draft_tokens")
    accepted = count("num_accepted_tokens")
    out: dict[str, Any] = {
        "drafts": drafts,
        "draft_tokens": draft_tokens,
        "accepted_tokens": accepted,
        "acceptance_rate": None,
        "mean_acceptance_length": None,
    }
    if accepted is not None and draft_tokens:
        out["acceptance_rate"] = round(accepted / draft_tokens, 4)
    if accepted is not None and drafts:
        out["mean_acceptance_length"] = round(1 + accepted / drafts, 3)
    return out


def plugin_share(
    generate: Generate,
    requests: list[Request],
    package_dir: str,
    read_steps: Callable[[], int | None],
) -> dict[str, Any]:
    """What the code under ``package_dir`` costs a step: one generate of ``requests``
    under ``cProfile``, and the time spent in that package's own functions (their
    ``tottime``) over the whole generate's.

    It counts the package's Python functions' own time, with the profiler's
    charge for each of their calls; the C calls they make (a context variable's
    set and reset, a few per step) are their callees' time and not counted. A
    reading of host time that the spread of wall-clock runs does not blur.
    ``read_steps``: the engine steps so far (``ENGINE_STEPS``)."""
    profiler = cProfile.Profile()
    steps_before = read_steps()
    profiler.enable()
    generate(requests)
    profiler.disable()
    steps = (read_steps() or 0) - (steps_before or 0)
    stats = pstats.Stats(profiler).stats  # (file, line, name) -> (cc, calls, tottime, cumtime, _)
    total = sum(tottime for _, _, tottime, _, _ in stats.values())
    ours = {key: value for key, value in stats.items() if key[0].startswith(package_dir)}
    seconds = sum(tottime for _, _, tottime, _, _ in ours.values())
    calls = sum(calls for _, calls, _, _, _ in ours.values())
    top = sorted(ours.items(), key=lambda kv: -kv[1][2])[:5]
    return {
        "profiled_s": round(total, 4),
        "plugin_s": round(seconds, 6),
        "plugin_share": round(seconds / total, 6) if total else None,
        "engine_steps": steps,
        "plugin_calls_per_step": round(calls / steps, 2) if steps else None,
        "plugin_us_per_step": round(1e6 * seconds / steps, 2) if steps else None,
        "plugin_top": [f"{name} {1e6 * v[2]:.0f} us / {v[1]} calls" for (_, _, name), v in top],
    }


def run_load(
    generate: Generate,
    read_counters: Callable[[], dict[str, Any]],
    requests: list[Request],
    warmup: list[Request],
    repeats: int,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, Any]:
    """Warm up, then time ``repeats`` generates of ``requests``.

    Returns tokens/s and the mean engine-step time per repeat (wall time over
    the steps vLLM counted), the best and median tokens/s, the median step
    time, the greedy tokens of the first repeat, whether every repeat gave the
    same tokens, and the spec-decode counters over the timed repeats only."""
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    generate(warmup)
    before = read_counters()
    timings, tokens, same = [], None, True
    for _ in range(repeats):
        steps_before = read_counters().get(ENGINE_STEPS)
        start = clock()
        out = generate(requests)
        wall = clock() - start
        steps_after = read_counters().get(ENGINE_STEPS)
        generated = sum(len(t) for t in out)
        timings.append({"wall_s": round(wall, 4), "generated_tokens": generated})
        timings[-1]["tokens_per_s"] = round(generated / wall, 1) if wall > 0 else None
        steps = None if None in (steps_before, steps_after) else steps_after - steps_before
        timings[-1]["engine_steps"] = steps
        timings[-1]["step_ms"] = round(1000 * wall / steps, 3) if steps else None
        if tokens is None:
            tokens = out
        same = same and out == tokens
    delta = counter_delta(before, read_counters())
    rates = [t["tokens_per_s"] for t in timings if t["tokens_per_s"] is not None]
    step_times = [t["step_ms"] for t in timings if t["step_ms"] is not None]
    return {
        "num_requests": len(requests),
        "prompt_tokens": sum(len(ids) for ids, _ in requests),
        "max_tokens": sum(n for _, n in requests),
        "warmup_requests": len(warmup),
        "repeats": timings,
        "tokens_per_s_best": max(rates) if rates else None,
        "tokens_per_s_median": statistics.median(rates) if rates else None,
        "step_ms_median": statistics.median(step_times) if step_times else None,
        "repeats_equal": same,
        "spec_counters": delta,
        "spec": spec_summary(delta),
        "tokens": tokens,
    }
