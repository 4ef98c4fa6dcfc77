"""CPU tests for owner lanes: every rule of ``vllm_specgraph.lanes``."""

import asyncio
import re
import threading
from contextlib import contextmanager

import numpy as np
import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

from vllm_specgraph.lanes import (
    ALIGNMENT_BYTES,
    LaneWorkspace,
    WorkspaceLockedError,
    current_owner,
    use_lane,
    use_owner,
)
from vllm_specgraph.spans import overlapping_pairs, spans_overlap, tensor_span


def _viewed_by_a_capture(numel: int) -> LaneWorkspace:
    """A workspace whose target buffer of ``numel`` floats a graph took views of.

    A stand-in capture: capturing needs a GPU. The eager warm-up sizes the lane first.
    """
    capturing = [False]
    ws = LaneWorkspace("cpu", is_capturing=lambda: capturing[0])
    ws.get_simultaneous(((numel,), torch.float32))
    capturing[0] = True
    ws.get_simultaneous(((numel,), torch.float32))
    capturing[0] = False
    return ws


def test_use_owner_default_is_target():
    assert current_owner() == "target"


def test_use_owner_nested_restores_outer_owner():
    with use_owner("draft"):
        with use_owner("target"):
            assert current_owner() == "target"
        assert current_owner() == "draft"
    assert current_owner() == "target"


def test_use_owner_exception_restores_owner():
    with pytest.raises(KeyError), use_owner("draft"):
        raise KeyError("boom")
    assert current_owner() == "target"


def test_use_owner_threads_are_isolated():
    barrier = threading.Barrier(2)
    seen: dict[str, str] = {}

    def run(owner: str) -> None:
        with use_owner(owner):
            barrier.wait()  # both threads are inside their block at once
            seen[owner] = current_owner()
            barrier.wait()

    threads = [threading.Thread(target=run, args=(o,)) for o in ("target", "draft")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen == {"target": "target", "draft": "draft"}
    assert current_owner() == "target"


def test_use_owner_asyncio_tasks_are_isolated():
    async def run(owner: str, gate: asyncio.Event, other: asyncio.Event) -> str:
        with use_owner(owner):
            gate.set()
            await other.wait()  # the other task has set its owner by now
            return str(current_owner())

    async def main() -> list[str]:
        a, b = asyncio.Event(), asyncio.Event()
        return await asyncio.gather(run("draft", a, b), run("target", b, a))

    assert asyncio.run(main()) == ["draft", "target"]


def test_use_lane_negative_raises_value_error():
    with pytest.raises(ValueError, match="lane must be non-negative, got -1"), use_lane(-1):
        pass


def test_use_owner_empty_name_raises_value_error():
    with pytest.raises(ValueError, match="owner must be a non-empty str, got ''"), use_owner(""):
        pass


def test_init_negative_lane_raises_value_error():
    with pytest.raises(ValueError, match="owner_lanes\\['draft'\\] must be >= 0, got -2"):
        LaneWorkspace("cpu", owner_lanes={"target": 0, "draft": -2})


def test_init_no_lanes_raises_value_error():
    with pytest.raises(ValueError, match=r"owner_lanes maps no owner.*or pass num_lanes"):
        LaneWorkspace("cpu", owner_lanes={})


@pytest.mark.parametrize("num_lanes", [0, -1, np.int64(0)])
def test_init_num_lanes_below_one_raises_vllms_words(num_lanes):
    with pytest.raises(ValueError, match=rf"^num_lanes must be at least one, got {num_lanes}\.$"):
        LaneWorkspace("cpu", owner_lanes={}, num_lanes=num_lanes)


def test_init_owner_beyond_num_lanes_raises_value_error():
    with pytest.raises(ValueError, match="raise num_lanes"):
        LaneWorkspace("cpu", owner_lanes={"target": 0, "draft": 1}, num_lanes=1)


def test_lane_of_unconfigured_lane_raises_runtime_error():
    ws = LaneWorkspace("cpu")
    with use_lane(2), pytest.raises(RuntimeError, match=r"lane 2 is not configured.*2 lane"):
        ws.get_simultaneous(((4,), torch.float32))


def test_lane_of_unknown_owner_raises_runtime_error():
    ws = LaneWorkspace("cpu")
    with use_owner("encoder"), pytest.raises(RuntimeError, match="'encoder' has no lane"):
        ws.get_simultaneous(((4,), torch.float32))


def test_lane_of_extra_owners_configurable():
    ws = LaneWorkspace("cpu", owner_lanes={"target": 0, "draft": 1, "encoder": 2, "eager": 0})
    assert [ws.lane_of(o) for o in ("target", "draft", "encoder", "eager")] == [0, 1, 2, 0]
    assert ws.num_lanes == 3


def test_get_simultaneous_views_aligned_and_disjoint():
    ws = LaneWorkspace("cpu")
    views = ws.get_simultaneous(((3,), torch.float16), ((5, 7), torch.float32), ((1,), torch.int8))
    assert [tuple(v.shape) for v in views] == [(3,), (5, 7), (1,)]
    assert [v.dtype for v in views] == [torch.float16, torch.float32, torch.int8]
    for v in views:
        assert v.data_ptr() % ALIGNMENT_BYTES == 0
    assert overlapping_pairs([tensor_span(v) for v in views]) == []


def test_get_simultaneous_repeat_call_reuses_memory():
    ws = LaneWorkspace("cpu")
    (a,) = ws.get_simultaneous(((64,), torch.float32))
    (b,) = ws.get_simultaneous(((32,), torch.float32))
    assert a.data_ptr() == b.data_ptr()
    assert ws.usage()["target"].retired_bytes == 0


def test_get_simultaneous_no_two_slots_share_storage():
    ws = LaneWorkspace("cpu", num_ubatches=2, owner_lanes={"target": 0, "draft": 1, "enc": 2})
    spans = []
    for ubatch in range(2):
        for owner in ("target", "draft", "enc"):
            with use_owner(owner):
                (v,) = ws.get_simultaneous(((128,), torch.float32), ubatch=ubatch)
                v.fill_(ubatch * 10 + ws.lane_of(owner))
                spans.append(tensor_span(v))
    assert len(spans) == 6
    assert overlapping_pairs(spans) == []


def test_get_simultaneous_shared_lane_aliases():
    ws = LaneWorkspace("cpu", owner_lanes={"target": 0, "draft": 0})
    (t,) = ws.get_simultaneous(((16,), torch.float32))
    with use_owner("draft"):
        (d,) = ws.get_simultaneous(((16,), torch.float32))
    assert spans_overlap(tensor_span(t), tensor_span(d))


def test_get_simultaneous_bad_ubatch_raises_value_error():
    ws = LaneWorkspace("cpu", num_ubatches=2)
    with pytest.raises(ValueError, match=r"ubatch must be in \[0, 2\), got 2"):
        ws.get_simultaneous(((4,), torch.float32), ubatch=2)


def test_get_simultaneous_growth_retires_a_buffer_a_capture_viewed_and_keeps_it_alive():
    capturing = [False]
    ws = LaneWorkspace("cpu", is_capturing=lambda: capturing[0])  # a capture needs a GPU
    ws.get_simultaneous(((16,), torch.float32))  # the eager warm-up sizes the lane
    capturing[0] = True
    (small,) = ws.get_simultaneous(((16,), torch.float32))  # a graph takes a view
    capturing[0] = False
    small_ptr, old_buffer = small.data_ptr(), StorageWeakRef(small.untyped_storage())
    del small  # from here on only the workspace can keep the old buffer alive
    (big,) = ws.get_simultaneous(((4096,), torch.float32))
    assert big.data_ptr() != small_ptr
    # A graph captured with views of the old buffer still reads and writes it on replay.
    assert not old_buffer.expired(), "growth freed a buffer a captured graph may still use"
    usage = ws.usage()["target"]
    assert usage.retired_bytes >= 16 * 4
    assert usage.live_bytes >= 4096 * 4
    assert ws.usage()["draft"].total_bytes == 0
    ws.release_retired()
    assert old_buffer.expired()
    ws.get_simultaneous(((8192,), torch.float32))
    assert ws.usage()["target"].retired_bytes == 0, "no capture viewed the grown buffer"


def test_get_simultaneous_growth_frees_a_buffer_no_capture_viewed_as_vllm_does():
    ws = LaneWorkspace("cpu")  # no speculator, no graphs, enforce_eager: vLLM's behaviour
    (small,) = ws.get_simultaneous(((16,), torch.float32))
    old_buffer = StorageWeakRef(small.untyped_storage())
    del small
    for n in (1 << 10, 1 << 12, 1 << 14):
        ws.get_simultaneous(((n,), torch.float32))
    assert old_buffer.expired(), "growth kept a buffer no graph can read"
    usage = ws.usage()["target"]
    assert usage.retired_bytes == 0 and usage.live_bytes >= (1 << 14) * 4


def test_release_retired_frees_only_retired():
    ws = _viewed_by_a_capture(16)
    ws.get_simultaneous(((1024,), torch.float32))
    retired = ws.usage()["target"].retired_bytes
    assert ws.release_retired() == retired > 0
    assert ws.usage()["target"].retired_bytes == 0
    assert ws.usage()["target"].live_bytes >= 1024 * 4
    assert ws.release_retired() == 0


def test_lock_growth_raises_with_location_owner_lane_bytes():
    ws = LaneWorkspace("cpu", num_ubatches=2)
    with use_owner("draft"):
        ws.get_simultaneous(((16,), torch.float32), ubatch=1)
    ws.lock()
    with use_owner("draft"), pytest.raises(WorkspaceLockedError) as info:
        ws.get_simultaneous(((1024,), torch.float32), ubatch=1)
    message = str(info.value)
    assert "test_lanes.py" in message
    assert "test_lock_growth_raises_with_location_owner_lane_bytes" in message
    assert "owner='draft'" in message and "lane=1" in message and "ubatch=1" in message
    assert "4096 bytes asked, 256 held" in message
    assert ws.usage()["draft"].retired_bytes == 0  # the refused call changed nothing


def test_lock_within_capacity_still_serves():
    ws = LaneWorkspace("cpu")
    (a,) = ws.get_simultaneous(((256,), torch.float32))
    ws.lock()
    (b,) = ws.get_simultaneous(((100,), torch.float32))
    assert a.data_ptr() == b.data_ptr()
    ws.unlock()
    assert not ws.is_locked()
    ws.get_simultaneous(((1024,), torch.float32))


def test_get_persistent_same_key_same_tensor_per_slot():
    ws = LaneWorkspace("cpu")
    a = ws.get_persistent("cu_seqlens", (9,), torch.int32, zero_init=True)
    assert torch.count_nonzero(a) == 0
    assert ws.get_persistent("cu_seqlens", (9,), torch.int32) is a
    with use_owner("draft"):
        d = ws.get_persistent("cu_seqlens", (9,), torch.int32)
    assert d is not a
    assert ws.usage()["target"].persistent_bytes == 36


def test_get_persistent_shape_mismatch_raises_value_error():
    ws = LaneWorkspace("cpu")
    ws.get_persistent("k", (4,), torch.int32)
    mismatch = r"has shape=\(4,\), dtype=torch.int32; requested shape=\(5,\)"
    with pytest.raises(ValueError, match=mismatch):
        ws.get_persistent("k", (5,), torch.int32)


def test_get_persistent_new_key_after_lock_raises():
    ws = LaneWorkspace("cpu")
    ws.get_persistent("old", (4,), torch.int32)
    ws.lock()
    assert ws.get_persistent("old", (4,), torch.int32).numel() == 4
    refused = r"'new'\) was not allocated during warmup.*owner='target'"
    with pytest.raises(WorkspaceLockedError, match=refused):
        ws.get_persistent("new", (4,), torch.int32)


def test_rollback_restores_buffers_retired_and_persistent():
    ws = LaneWorkspace("cpu")
    (before,) = ws.get_simultaneous(((16,), torch.float32))
    ws.get_persistent("kept", (2,), torch.int32)
    checkpoint = ws.checkpoint()
    usage_before = ws.usage()
    with use_owner("draft"):
        ws.get_simultaneous(((512,), torch.float32))
    ws.get_simultaneous(((512,), torch.float32))
    ws.get_persistent("new", (2,), torch.int32)
    ws.rollback(checkpoint)
    assert ws.usage() == usage_before
    (after,) = ws.get_simultaneous(((16,), torch.float32))
    assert after.data_ptr() == before.data_ptr()


def test_rollback_forgets_the_captures_of_the_graphs_it_outlives():
    """A disposable profile's graphs viewed the buffer; once they are destroyed and the
    lanes rolled back, no graph reads it, and the next growth frees it."""
    capturing = [False]
    ws = LaneWorkspace("cpu", is_capturing=lambda: capturing[0])
    ws.get_simultaneous(((16,), torch.float32))
    checkpoint = ws.checkpoint()
    capturing[0] = True
    ws.get_simultaneous(((16,), torch.float32))
    capturing[0] = False
    ws.rollback(checkpoint)
    del checkpoint  # the checkpoint's own reference
    ws.get_simultaneous(((4096,), torch.float32))
    assert ws.usage()["target"].retired_bytes == 0


def test_rollback_foreign_checkpoint_raises_value_error():
    a, b = LaneWorkspace("cpu"), LaneWorkspace("cpu")
    with pytest.raises(ValueError, match="another LaneWorkspace"):
        a.rollback(b.checkpoint())


def test_get_persistent_resource_factory_called_once_per_slot():
    ws = LaneWorkspace("cpu", num_ubatches=2)
    calls = []

    def factory():
        calls.append(current_owner())
        return {"plan": len(calls)}

    first = ws.get_persistent_resource("plan", factory)
    assert ws.get_persistent_resource("plan", factory) is first
    with use_owner("draft"):
        assert ws.get_persistent_resource("plan", factory) is not first
    assert ws.get_persistent_resource("plan", factory, ubatch=1) is not first
    assert calls == ["target", "draft", "target"]
    ws.lock()
    with pytest.raises(WorkspaceLockedError, match=r"'other'.*lane=0, ubatch=0"):
        ws.get_persistent_resource("other", factory)


def test_alloc_context_every_allocation_happens_inside_it(monkeypatch):
    inside = [False]
    allocations: list[tuple[str, bool]] = []

    @contextmanager
    def alloc_context():
        inside[0] = True
        try:
            yield
        finally:
            inside[0] = False

    def recording(name, real):
        def allocate(*args, **kwargs):
            allocations.append((name, inside[0]))
            return real(*args, **kwargs)

        return allocate

    for name in ("empty", "zeros"):
        monkeypatch.setattr(torch, name, recording(name, getattr(torch, name)))
    ws = LaneWorkspace("cpu", alloc_context=alloc_context)
    ws.get_simultaneous(((16,), torch.float32))
    ws.get_simultaneous(((8,), torch.float32))  # fits: no allocation
    ws.get_persistent("k", (2,), torch.int32)
    ws.get_persistent("z", (2,), torch.int32, zero_init=True)
    ws.get_persistent_resource("plan", lambda: allocations.append(("factory", inside[0])))
    assert allocations == [("empty", True), ("empty", True), ("zeros", True), ("factory", True)]


def test_get_persistent_without_zero_init_is_uninitialised_like_vllm(monkeypatch):
    made = []
    real_empty = torch.empty

    def recording_empty(*args, **kwargs):
        made.append("empty")
        return real_empty(*args, **kwargs)

    monkeypatch.setattr(torch, "empty", recording_empty)
    LaneWorkspace("cpu").get_persistent("scratch", (4,), torch.int32)
    assert made == ["empty"]


def test_slot_follows_ubatch_id_callable_when_no_ubatch_given():
    current = [0]
    ws = LaneWorkspace("cpu", num_ubatches=2, ubatch_id=lambda: current[0])
    (u0,) = ws.get_simultaneous(((64,), torch.float32))
    current[0] = 1
    (u1,) = ws.get_simultaneous(((64,), torch.float32))
    assert not spans_overlap(tensor_span(u0), tensor_span(u1))
    current[0] = 2
    with pytest.raises(ValueError, match=r"ubatch must be in \[0, 2\), got 2"):
        ws.get_simultaneous(((4,), torch.float32))


def test_num_ubatches_none_means_one_like_vllm():
    assert LaneWorkspace("cpu", num_ubatches=None).num_ubatches == 1


@pytest.mark.parametrize("owner", [True, False, 1.0, None, b"draft"])
def test_use_owner_rejects_bool_and_other_types_naming_the_value(owner):
    match = rf"owner must be a non-empty str .*or an int lane, got {re.escape(repr(owner))}"
    with pytest.raises(TypeError, match=match), use_owner(owner):
        pass


@pytest.mark.parametrize("select", [use_owner, use_lane])
def test_numpy_integer_lane_selects_that_lane_as_a_plain_int(select):
    ws = LaneWorkspace("cpu")
    with select(np.int64(1)):
        assert type(current_owner()) is int and current_owner() == 1
        ws.get_simultaneous(((4,), torch.float32))
    assert ws.usage()["draft"].live_bytes > 0 and ws.usage()["target"].live_bytes == 0


def test_negative_numpy_lane_raises_like_a_negative_int():
    with pytest.raises(ValueError, match="lane must be >= 0, got -1"), use_owner(np.int64(-1)):
        pass
    with (
        pytest.raises(ValueError, match="Workspace lane must be non-negative, got -1"),
        use_lane(np.int64(-1)),
    ):
        pass


@pytest.mark.parametrize("lane", [True, 1.0, None])
def test_use_lane_bad_type_names_the_lane(lane):
    match = rf"lane must be a non-empty str .*or an int lane, got {re.escape(repr(lane))}"
    with pytest.raises(TypeError, match=match), use_lane(lane):
        pass


@pytest.mark.parametrize(
    ("owner", "error", "match"),
    [
        (None, TypeError, "owner must be a non-empty str .*got None"),
        (1.5, TypeError, "owner must be a non-empty str .*got 1.5"),
        (True, TypeError, "owner must be a non-empty str .*got True"),
        ("", ValueError, "owner must be a non-empty str, got ''"),
        (-1, ValueError, "lane must be >= 0, got -1"),
    ],
)
def test_lane_of_neither_name_nor_lane_names_the_owner(owner, error, match):
    with pytest.raises(error, match=match):
        LaneWorkspace("cpu").lane_of(owner)


def test_lane_of_numpy_integer_is_that_lane():
    ws = LaneWorkspace("cpu")
    assert ws.lane_of(np.int64(1)) == 1 and type(ws.lane_of(np.int64(1))) is int


@pytest.mark.parametrize("shape", [(-1,), (4, -2), (2.5,), (True,)])
def test_get_simultaneous_negative_or_non_int_dimension_raises(shape):
    ws = LaneWorkspace("cpu")
    with pytest.raises(ValueError, match="negative or non-integer dimension"):
        ws.get_simultaneous(((8,), torch.float32), (shape, torch.float32))
    assert ws.usage()["target"].live_bytes == 0


def test_rollback_checkpoint_of_collected_workspace_refused_by_new_one():
    import gc

    old = LaneWorkspace("cpu")
    checkpoint = old.checkpoint()
    del old
    gc.collect()
    for _ in range(50):  # a new object often takes the collected one's id()
        fresh = LaneWorkspace("cpu")
        with pytest.raises(ValueError, match="another LaneWorkspace"):
            fresh.rollback(checkpoint)


def test_rollback_restores_lock_state():
    ws = LaneWorkspace("cpu")
    checkpoint = ws.checkpoint()
    ws.lock()
    ws.rollback(checkpoint)
    assert not ws.is_locked()
    ws.lock()
    locked = ws.checkpoint()
    ws.unlock()
    ws.rollback(locked)
    assert ws.is_locked()


def test_locked_error_is_also_assertion_error_like_vllm():
    ws = LaneWorkspace("cpu")
    ws.lock()
    with pytest.raises(AssertionError):
        ws.get_simultaneous(((8,), torch.float32))


def test_lane_thread_runs_in_starting_lane_plain_thread_does_not():
    from vllm_specgraph.lanes import LaneThread, current_owner

    seen = {}

    def probe(name):
        seen[name] = current_owner()

    with use_owner("draft"):
        threads = [
            LaneThread(target=probe, args=("lane_thread",)),
            threading.Thread(target=probe, args=("plain_thread",)),
        ]
    for thread in threads:
        thread.start()
        thread.join()
    assert seen == {"lane_thread": "draft", "plain_thread": "target"}


@pytest.mark.parametrize("request_kind", ["scratch", "persistent"])
def test_growth_during_capture_refused_naming_caller_nothing_added(monkeypatch, request_kind):
    # Never allocates here: the request is refused first. A capture needs a GPU.
    ws = LaneWorkspace("cuda", is_capturing=lambda: True)
    before = ws.usage()
    with use_owner("draft"), pytest.raises(WorkspaceLockedError) as info:
        if request_kind == "scratch":
            ws.get_simultaneous(((1024,), torch.float32))
        else:
            ws.get_persistent("plan", (8,), torch.int32)
    message = str(info.value)
    assert "in a CUDA-graph capture" in message and "test_lanes.py" in message
    assert "owner='draft'" in message and "before capture" in message
    assert ws.usage() == before


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"owner_lanes": {"draft": "1"}}, TypeError, r"owner_lanes\['draft'\] must be an int"),
        ({"owner_lanes": {"draft": True}}, TypeError, r"owner_lanes\['draft'\] must be an int"),
        ({"owner_lanes": {"draft": -1}}, ValueError, r"owner_lanes\['draft'\] must be >= 0"),
        ({"owner_lanes": {1: 0}}, TypeError, "an owner_lanes key must be a non-empty str"),
        ({"num_lanes": "2"}, TypeError, "num_lanes must be an int, got '2'"),
        ({"num_ubatches": 2.0}, TypeError, "num_ubatches must be an int, got 2.0"),
        ({"num_lanes": True}, TypeError, "num_lanes must be an int, got True"),
        (
            {"owner_lanes": {"": 0}},
            ValueError,
            "an owner_lanes key must be a non-empty str, got ''",
        ),
        ({"owner_lanes": None}, TypeError, "owner_lanes must be a Mapping, got None"),
        ({"owner_lanes": [("target", 0)]}, TypeError, r"owner_lanes must be a Mapping, got \["),
        ({"device": None}, TypeError, "device must be a torch.device, .*got None"),
        ({"device": True}, TypeError, "device must be a torch.device, .*got True"),
        ({"device": 1.0}, TypeError, "device must be a torch.device, .*got 1.0"),
        ({"device": "gpu"}, ValueError, "device 'gpu' is not a device torch can use"),
        ({"device": ""}, ValueError, "device '' is not a device torch can use"),
        ({"alloc_context": None}, TypeError, "alloc_context must be callable, got None"),
        ({"ubatch_id": 0}, TypeError, "ubatch_id must be callable, got 0"),
        ({"is_capturing": False}, TypeError, "is_capturing must be callable, got False"),
    ],
)
def test_lane_workspace_bad_argument_type_or_range_names_it(kwargs, error, message):
    with pytest.raises(error, match=message):
        LaneWorkspace(**{"device": "cpu"} | kwargs)


def test_lane_workspace_numpy_integers_count_as_ints():
    ws = LaneWorkspace(
        torch.device("cpu"),
        num_ubatches=np.int64(2),
        owner_lanes={"target": np.int64(0), "draft": np.int64(1)},
        num_lanes=np.int64(3),
    )
    assert (ws.num_ubatches, ws.num_lanes, dict(ws.owner_lanes)) == (
        2,
        3,
        {"target": 0, "draft": 1},
    )
    assert all(type(v) is int for v in (ws.num_ubatches, ws.num_lanes, *ws.owner_lanes.values()))


def _lane_state(ws: LaneWorkspace) -> tuple:
    return ws.usage(), [(key, tuple(slot.persistent)) for key, slot in ws._slots.items()]


@pytest.mark.parametrize(
    ("request_args", "error", "match"),
    [
        ((("k",), 3), TypeError, "factory must be callable, got 3"),
        (((["k"],), dict), TypeError, r"key must be hashable, got \['k'\] \(list\)"),
    ],
)
def test_get_persistent_resource_bad_request_names_it_and_keeps_nothing(request_args, error, match):
    ws = LaneWorkspace("cpu")
    ws.get_persistent_resource("held", dict)
    before = _lane_state(ws)
    (key,), factory = request_args
    with pytest.raises(error, match=match):
        ws.get_persistent_resource(key, factory)
    assert _lane_state(ws) == before


@pytest.mark.parametrize(
    ("shape", "dtype", "kwargs", "error", "match"),
    [
        ((4,), "float32", {}, TypeError, "dtype must be a dtype, got 'float32'"),
        ((4,), None, {}, TypeError, "dtype must be a dtype, got None"),
        (4, torch.float32, {}, TypeError, r"shape must be a sequence of ints, got 4 \(int\)"),
        (None, torch.float32, {}, TypeError, "shape must be a sequence of ints, got None"),
        ((2, -1), torch.float32, {}, ValueError, r"shape\[1\] must be >= 0, got -1"),
        ((True,), torch.float32, {}, TypeError, r"shape\[0\] must be an int, got True"),
        ((2.0,), torch.float32, {}, TypeError, r"shape\[0\] must be an int, got 2.0"),
        ((4,), torch.float32, {"zero_init": "no"}, TypeError, "zero_init must be a bool"),
        ((4,), torch.float32, {"zero_init": None}, TypeError, "zero_init must be a bool"),
    ],
)
def test_get_persistent_bad_request_names_it_and_keeps_nothing(shape, dtype, kwargs, error, match):
    ws = LaneWorkspace("cpu")
    ws.get_persistent("held", (2,), torch.int32)
    before = _lane_state(ws)
    with pytest.raises(error, match=match):
        ws.get_persistent("new", shape, dtype, **kwargs)
    assert _lane_state(ws) == before


@pytest.mark.parametrize(
    ("flag", "zeroed"), [(1, True), (np.int64(1), True), (np.True_, True), (0, False)]
)
def test_get_persistent_reads_zero_init_by_truth_like_vllm(monkeypatch, flag, zeroed):
    def garbage(*args, **kwargs):
        return torch.full(*args, 7, **kwargs)

    monkeypatch.setattr(torch, "empty", garbage)  # uninitialised memory, made visible
    made = LaneWorkspace("cpu").get_persistent("z", (3,), torch.int32, zero_init=flag)
    assert made.tolist() == ([0, 0, 0] if zeroed else [7, 7, 7])


def test_get_persistent_existing_key_asked_with_a_non_dtype_names_the_dtype():
    ws = LaneWorkspace("cpu")
    ws.get_persistent("held", (2,), torch.int32)
    with pytest.raises(TypeError, match="dtype must be a dtype, got 'int32'"):
        ws.get_persistent("held", (2,), "int32")


def test_get_persistent_numpy_shape_is_the_same_request_as_an_int_shape():
    ws = LaneWorkspace("cpu")
    first = ws.get_persistent("plan", (np.int64(3), 2), torch.int32)
    assert ws.get_persistent("plan", (3, 2), torch.int32) is first


def test_get_simultaneous_ubatch_of_wrong_type_names_it():
    ws = LaneWorkspace("cpu", num_ubatches=2)
    with pytest.raises(TypeError, match="ubatch must be an int, got '1'"):
        ws.get_simultaneous(((4,), torch.float32), ubatch="1")


def test_lane_thread_runs_inside_the_threads_own_context_like_python_3_14():
    import contextvars

    from vllm_specgraph.lanes import LaneThread, current_owner

    seen = []
    with use_owner("draft"):
        thread = LaneThread(target=lambda: seen.append(current_owner()))
    # Python 3.14's Thread enters its own ``_context`` around run(); entering one
    # context twice raises, so LaneThread must keep the starter's copy elsewhere.
    own = getattr(thread, "_context", None) or contextvars.copy_context()
    own.run(thread.run)
    assert seen == ["draft"]


def test_get_simultaneous_accepts_numpy_integer_dimensions_like_vllm():
    import numpy as np

    ws = LaneWorkspace("cpu")
    (view,) = ws.get_simultaneous(((np.int64(4), 3), torch.float32))
    assert tuple(view.shape) == (4, 3)
    with pytest.raises(ValueError, match="negative or non-integer dimension"):
        ws.get_simultaneous(((np.int64(-4),), torch.float32))


def test_failed_growth_of_a_captured_buffer_leaves_the_slot_as_it_was():
    capturing, fail = [False], [False]

    @contextmanager
    def alloc_context():
        if fail[0]:
            raise torch.OutOfMemoryError("no memory for the new buffer")
        yield

    ws = LaneWorkspace("cpu", is_capturing=lambda: capturing[0], alloc_context=alloc_context)
    ws.get_simultaneous(((16,), torch.float32))
    capturing[0] = True
    ws.get_simultaneous(((16,), torch.float32))  # a graph views it
    capturing[0] = False
    before = ws.usage()
    fail[0] = True
    with pytest.raises(torch.OutOfMemoryError):
        ws.get_simultaneous(((4096,), torch.float32))
    assert ws.usage() == before and ws.release_retired() == 0


def test_rollback_refuses_a_checkpoint_used_or_undone_and_changes_nothing():
    ws = LaneWorkspace("cpu")
    ws.get_simultaneous(((16,), torch.float32))
    first = ws.checkpoint()
    ws.get_persistent("a", (2,), torch.int32)
    second = ws.checkpoint()
    ws.rollback(first)  # undoes what came after, the second checkpoint included
    usage = ws.usage()
    for stale in (second, first):
        with pytest.raises(ValueError, match="take a new checkpoint"):
            ws.rollback(stale)
    assert ws.usage() == usage
    with pytest.raises(TypeError, match="checkpoint must be a LaneCheckpoint, got None"):
        ws.rollback(None)


def test_release_retired_counts_no_bytes_a_live_checkpoint_still_holds():
    ws = _viewed_by_a_capture(1024)
    checkpoint = ws.checkpoint()  # holds that buffer
    ws.get_simultaneous(((4096,), torch.float32))  # retires it
    assert ws.usage()["target"].retired_bytes >= 1024 * 4
    assert ws.release_retired() == 0, "the checkpoint keeps the buffer: nothing freed"
    ws.rollback(checkpoint)  # brings it back as the live buffer
    assert ws.usage()["target"].live_bytes >= 1024 * 4


def test_get_persistent_same_key_other_dtype_raises_naming_both():
    ws = LaneWorkspace("cpu")
    ws.get_persistent("plan", (8,), torch.int32)
    with pytest.raises(
        ValueError, match=r"dtype=torch.int32; requested shape=\(8,\), dtype=torch.int64"
    ):
        ws.get_persistent("plan", (8,), torch.int64)


@pytest.mark.parametrize(
    "request_",
    [(64, torch.float32), ((64,), "float32"), ((64,), None)],
    ids=["bare-int-shape", "string-dtype", "no-dtype"],
)
def test_get_simultaneous_bad_request_names_the_pair_and_changes_nothing(request_):
    ws = LaneWorkspace("cpu")
    before = ws.usage()
    with pytest.raises(TypeError, match=r"a workspace request is a \(shape, dtype\) pair"):
        ws.get_simultaneous(request_)
    assert ws.usage() == before


def test_numpy_integers_count_as_ints_for_sizes_lanes_and_ubatches():
    import numpy as np

    ws = LaneWorkspace("cpu", num_ubatches=np.int64(2), num_lanes=np.int32(2))
    (a,) = ws.get_simultaneous(((4,), torch.float32), ubatch=np.int64(1))
    (b,) = ws.get_simultaneous(((4,), torch.float32), ubatch=1)
    assert a.data_ptr() == b.data_ptr(), "the same slot"
    with pytest.raises(ValueError, match=r"ubatch must be in \[0, 2\), got 2"):
        ws.get_simultaneous(((4,), torch.float32), ubatch=np.int64(2))


def test_get_simultaneous_shape_and_dtype_passed_apart_names_the_pair():
    ws = LaneWorkspace("cpu")
    with pytest.raises(TypeError, match=r"a workspace request is a \(shape, dtype\) pair"):
        ws.get_simultaneous((64,), torch.float32)


def test_release_retired_counts_what_a_dropped_checkpoint_held_and_skips_a_held_retired_one():
    ws = _viewed_by_a_capture(1024)
    checkpoint = ws.checkpoint()
    ws.get_simultaneous(((4096,), torch.float32))  # retires the viewed buffer
    del checkpoint  # dropped, not rolled back: it holds nothing any more
    assert ws.release_retired() >= 1024 * 4
    ws = _viewed_by_a_capture(1024)
    ws.get_simultaneous(((4096,), torch.float32))  # retired first...
    kept = ws.checkpoint()  # ...then held by a checkpoint, among its retired buffers
    assert ws.release_retired() == 0 and kept is not None


def test_forget_graphs_frees_the_retired_and_lets_the_next_growth_free():
    """Once every graph is gone, no buffer is viewed: what was retired goes, and a
    buffer a gone graph viewed is freed when outgrown, as vLLM's manager frees it."""
    capturing = [False]
    workspace = LaneWorkspace("cpu", is_capturing=lambda: capturing[0])
    workspace.get_simultaneous(((1024,), torch.uint8))
    capturing[0] = True
    workspace.get_simultaneous(((1024,), torch.uint8))  # a graph takes views of it
    capturing[0] = False
    workspace.get_simultaneous(((2048,), torch.uint8))
    capturing[0] = True
    workspace.get_simultaneous(((2048,), torch.uint8))
    capturing[0] = False
    assert workspace.forget_graphs() > 0
    workspace.get_simultaneous(((4096,), torch.uint8))
    assert workspace.release_retired() == 0, "the outgrown buffer was freed, not retired"
