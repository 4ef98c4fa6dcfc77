# SPDX-License-Identifier: Apache-2.0
"""The caching allocator's history around each ``capture_model`` call, and a
comparison of two such histories.

Why: a graph estimate that matches production in requests can still miss it
by an allocator segment. Recording both captures and comparing them tells
"the profile captured something else" (the requests differ) from "the
allocator placed the same requests differently" (the requests agree, the
segments they were served from do not).

    python3 allocator_trace.py compare TRACE_A TRACE_B

``install`` wraps ``capture_model`` (run_llm.py's ``--allocator-trace DIR``):
every call, profiling passes and the production capture alike, is recorded
with ``torch.cuda.memory._record_memory_history`` (no stack traces) and
written to ``DIR/capture-N.json.gz``, N counting the calls in the process:
with the plugin on, 1 and 2 are the profile's passes (2 only when it measured
twice) and the last is the production capture. Recording starts and stops
around each call, also when the call raises.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import sys
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["TraceComparison", "compare", "install", "load", "main"]

MiB = 1 << 20
SEGMENT_ACTIONS = ("segment_alloc", "segment_free", "segment_map", "segment_unmap")
MAX_ENTRIES = 4_000_000


def install(runner_cls: Any, memory: Any, device: Callable[[], int], out_dir: str) -> Callable:
    """Wrap ``runner_cls.capture_model`` to record each call into ``out_dir``.

    ``memory`` is ``torch.cuda.memory`` and ``device`` returns the current
    device index (both passed in, so that the tests can pass stand-ins).
    Returns the wrapper.
    """
    original = runner_cls.capture_model
    calls = [0]

    def capture_model(self: Any, *args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        memory._record_memory_history(
            enabled="all", context=None, stacks="python", max_entries=MAX_ENTRIES
        )
        try:
            return original(self, *args, **kwargs)
        finally:
            snapshot = memory._snapshot()
            memory._record_memory_history(enabled=None)
            _write(out_dir, calls[0], kwargs.get("profile_only", False), snapshot, device())

    runner_cls.capture_model = capture_model
    return capture_model


def _write(out_dir: str, call: int, profile_only: bool, snapshot: dict, device: int) -> None:
    traces = snapshot.get("device_traces") or []
    events = [
        [e["action"], e["addr"], e["size"], e.get("stream", 0)]
        for e in (traces[device] if device < len(traces) else [])
    ]
    segments = [
        [s["address"], s["total_size"], list(s.get("segment_pool_id", (0, 0)))]
        for s in snapshot.get("segments", [])
        if s.get("device", device) == device
    ]
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"capture-{call}.json.gz")
    with gzip.open(path, "wt") as f:
        json.dump(
            {"call": call, "profile_only": profile_only, "events": events, "segments": segments},
            f,
        )


def load(path: str) -> dict[str, Any]:
    with gzip.open(path, "rt") as f:
        return json.load(f)


@dataclass(frozen=True)
class TraceComparison:
    """What two recorded captures have in common and where they part.

    ``same_requests``: the allocations and frees, in order, with their sizes,
    are the same. ``first_placement_difference``: the first request (index
    among the requests) that one capture served from memory the allocator held
    and the other from a new segment (or from a differently sized one), with
    the segments each made for it. ``live_at_end``: the sizes of the blocks
    still allocated when each recording stopped. ``new_segments``: per
    capture, the segments made and not freed, counted by (graph pool?, size).
    """

    requests: tuple[int, int]
    same_requests: bool
    first_request_difference: int | None
    first_placement_difference: tuple[int, int, list[int], list[int]] | None
    live_at_end: tuple[list[int], list[int]]
    new_segments: tuple[dict[tuple[bool, int], int], dict[tuple[bool, int], int]]


def _requests(events: list) -> tuple[list[tuple[str, int]], dict[int, list[int]]]:
    """The requests (action, size), and the sizes of the segments made just before each."""
    requests: list[tuple[str, int]] = []
    made: dict[int, list[int]] = {}
    pending: list[int] = []
    for action, _, size, _ in events:
        if action in SEGMENT_ACTIONS:
            if action in ("segment_alloc", "segment_map"):
                pending.append(size)
            continue
        if pending:
            made[len(requests)] = pending
            pending = []
        requests.append((action, size))
    return requests, made


def _live(events: list) -> list[int]:
    live: dict[int, int] = {}
    for action, addr, size, _ in events:
        if action == "alloc":
            live[addr] = size
        elif action == "free_completed":
            live.pop(addr, None)
    return sorted(live.values(), reverse=True)


def _new_segments(trace: dict) -> dict[tuple[bool, int], int]:
    made: dict[int, int] = {}
    for action, addr, size, _ in trace["events"]:
        if action == "segment_alloc":
            made[addr] = size
        elif action == "segment_free":
            made.pop(addr, None)
    pools = {addr: tuple(pool) != (0, 0) for addr, _, pool in trace["segments"]}
    counts = Counter((pools.get(addr, False), size) for addr, size in made.items())
    return dict(sorted(counts.items()))


def compare(a: dict[str, Any], b: dict[str, Any]) -> TraceComparison:
    """Compare two recorded captures (``load``'s dicts)."""
    req_a, made_a = _requests(a["events"])
    req_b, made_b = _requests(b["events"])
    first_request = next(
        (i for i, (x, y) in enumerate(zip(req_a, req_b, strict=False)) if x != y),
        None if len(req_a) == len(req_b) else min(len(req_a), len(req_b)),
    )
    common = len(req_a) if first_request is None else first_request
    first_placement = next(
        (
            (i, req_a[i][1], made_a.get(i, []), made_b.get(i, []))
            for i in sorted(set(made_a) | set(made_b))
            if i < common and made_a.get(i, []) != made_b.get(i, [])
        ),
        None,
    )
    return TraceComparison(
        requests=(len(req_a), len(req_b)),
        same_requests=first_request is None,
        first_request_difference=first_request,
        first_placement_difference=first_placement,
        live_at_end=(_live(a["events"]), _live(b["events"])),
        new_segments=(_new_segments(a), _new_segments(b)),
    )


def _mib(n: int) -> str:
    return f"{n / MiB:.3g} MiB" if n >= MiB else f"{n} B"


def _segments_text(counts: dict[tuple[bool, int], int]) -> str:
    return ", ".join(
        f"{n} x {_mib(size)} {'graph pool' if graph else 'default pool'}"
        for (graph, size), n in counts.items()
    )


def report(c: TraceComparison) -> str:
    lines = [f"requests: {c.requests[0]} / {c.requests[1]}"]
    if c.same_requests:
        lines.append("the same requests, in the same order, with the same sizes")
    else:
        lines.append(f"the requests part at request {c.first_request_difference}")
    if c.first_placement_difference is None:
        lines.append("every request common to both was placed alike")
    else:
        i, size, made_a, made_b = c.first_placement_difference
        lines.append(
            f"first placed differently: request {i} ({_mib(size)}); new segments before it: "
            f"[{', '.join(map(_mib, made_a))}] / [{', '.join(map(_mib, made_b))}]"
        )
    for name, live, made in zip("AB", c.live_at_end, c.new_segments, strict=True):
        lines.append(f"{name}: still allocated {', '.join(map(_mib, live)) or 'nothing'}")
        lines.append(f"{name}: segments made and kept: {_segments_text(made) or 'none'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    cmp = sub.add_parser("compare", help="compare two capture-N.json.gz files")
    cmp.add_argument("a")
    cmp.add_argument("b")
    args = ap.parse_args(argv)
    print(report(compare(load(args.a), load(args.b))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
