"""scripts/vllm_e2e/allocator_trace.py: recording around capture_model, and the comparison.

The allocator histories are built by hand (recording needs a GPU), in the shape
``torch.cuda.memory._snapshot()`` gives them; the case is the one seen on an
H200 with the 1B model and ngram: the same requests, one of them served from a
held block in production and from a new segment in the profile.
"""

import gzip
import importlib.util
import json
import os
import sys

import pytest

MiB = 1 << 20
PATH = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    "scripts",
    "vllm_e2e",
    "allocator_trace.py",
)
spec = importlib.util.spec_from_file_location("vllm_e2e_allocator_trace", PATH)
allocator_trace = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = allocator_trace  # its dataclass looks its module up there
spec.loader.exec_module(allocator_trace)


def event(action: str, addr: int, size: int) -> dict:
    return {"action": action, "addr": addr, "size": size, "stream": 7}


def capture_history(*, held_block: bool) -> list[dict]:
    """A 2 MiB block kept, an 8 MiB temporary; without a held block the 8 MiB
    request needs a segment of its own."""
    out = [
        event("segment_alloc", 0x1000, 20 * MiB),
        event("alloc", 0x1000, 2 * MiB),
        event("alloc", 0x1000 + 2 * MiB, 4 * MiB),
        event("free_requested", 0x1000 + 2 * MiB, 4 * MiB),
        event("free_completed", 0x1000 + 2 * MiB, 4 * MiB),
    ]
    if held_block:
        out.append(event("alloc", 0x1000 + 2 * MiB, 8 * MiB))
        addr = 0x1000 + 2 * MiB
    else:
        out += [event("segment_alloc", 0x9000000, 20 * MiB), event("alloc", 0x9000000, 8 * MiB)]
        addr = 0x9000000
    out += [event("free_requested", addr, 8 * MiB), event("free_completed", addr, 8 * MiB)]
    return out


def trace(history: list[dict], graph_segments: tuple[int, ...] = ()) -> dict:
    segments = {e["addr"]: e["size"] for e in history if e["action"] == "segment_alloc"}
    return {
        "events": [[e["action"], e["addr"], e["size"], e["stream"]] for e in history],
        "segments": [
            [addr, size, [0, 1] if addr in graph_segments else [0, 0]]
            for addr, size in segments.items()
        ],
    }


def test_same_requests_placed_differently_names_the_request_and_the_segments():
    profile = trace(capture_history(held_block=False), graph_segments=(0x9000000,))
    production = trace(capture_history(held_block=True))
    c = allocator_trace.compare(profile, production)
    assert c.requests == (7, 7) and c.same_requests
    assert c.first_placement_difference == (4, 8 * MiB, [20 * MiB], [])
    assert c.live_at_end == ([2 * MiB], [2 * MiB])
    assert c.new_segments == (
        {(False, 20 * MiB): 1, (True, 20 * MiB): 1},
        {(False, 20 * MiB): 1},
    )
    text = allocator_trace.report(c)
    assert "the same requests, in the same order, with the same sizes" in text
    assert "first placed differently: request 4 (8 MiB); new segments before it: [20 MiB] / []" in (
        text
    )
    assert "B: segments made and kept: 1 x 20 MiB default pool" in text


def test_different_requests_are_told_apart_from_placement():
    a = trace(capture_history(held_block=True))
    b = trace(capture_history(held_block=True)[:-2])  # the 8 MiB block is never freed
    c = allocator_trace.compare(a, b)
    assert not c.same_requests and c.first_request_difference == 5
    assert c.first_placement_difference is None
    assert c.live_at_end == ([2 * MiB], [8 * MiB, 2 * MiB])
    assert "the requests part at request 5" in allocator_trace.report(c)


class FakeMemory:
    """``torch.cuda.memory``'s recording calls; the snapshot holds two devices."""

    def __init__(self, history: list[dict]) -> None:
        self.history = history
        self.recording: list[object] = []

    def _record_memory_history(self, enabled=None, **kwargs) -> None:
        self.recording.append(enabled)

    def _snapshot(self) -> dict:
        return {
            "device_traces": [[event("alloc", 1, 1)], self.history],
            "segments": [
                {"device": 0, "address": 1, "total_size": 2 * MiB, "segment_pool_id": (0, 0)},
                {"device": 1, "address": 0x1000, "total_size": 20 * MiB},
            ],
        }


def test_install_records_every_capture_call_and_stops_also_on_error(tmp_path):
    class Runner:
        fail = False

        def capture_model(self, *, profile_only=False):
            if self.fail:
                raise RuntimeError("capture failed")
            return 5

    memory = FakeMemory(capture_history(held_block=True))
    allocator_trace.install(Runner, memory, lambda: 1, str(tmp_path))
    runner = Runner()
    assert runner.capture_model(profile_only=True) == 5
    runner.fail = True
    with pytest.raises(RuntimeError, match="capture failed"):
        runner.capture_model()
    assert memory.recording == ["all", None, "all", None]
    first, second = (allocator_trace.load(str(tmp_path / f"capture-{n}.json.gz")) for n in (1, 2))
    assert (first["call"], first["profile_only"], second["profile_only"]) == (1, True, False)
    assert first["events"][0] == ["segment_alloc", 0x1000, 20 * MiB, 7]  # device 1's only
    assert first["segments"] == [[0x1000, 20 * MiB, [0, 0]]]


def test_compare_command_prints_the_report(tmp_path, capsys):
    for name, held in (("a", False), ("b", True)):
        with gzip.open(tmp_path / f"{name}.json.gz", "wt") as f:
            json.dump(trace(capture_history(held_block=held)), f)
    assert (
        allocator_trace.main(["compare", str(tmp_path / "a.json.gz"), str(tmp_path / "b.json.gz")])
        == 0
    )
    out = capsys.readouterr().out
    assert out.startswith("requests: 7 / 7\n")
    assert "first placed differently: request 4 (8 MiB)" in out
