"""The profile's order of operations and its error paths, on the CPU.

CUDA is faked here (graphs, pools, memory readings) because this machine has
no GPU: the fakes record events so the tests can check *when* each step runs.
tests/gpu/test_profile_gpu.py checks the real memory behaviour on a GPU.
"""

import re
from contextlib import contextmanager

import pytest
import torch

import vllm_specgraph.capture as capture_module
from vllm_specgraph.channels import ChannelPool
from vllm_specgraph.lanes import LaneWorkspace, current_owner
from vllm_specgraph.profile import OwnerGraphs, profile_graph_memory


class _FakeChannel:
    def __init__(self, channel_id: int, owner: str, events: list) -> None:
        self.channel_id, self.owner, self.events = channel_id, owner, events

    def close_imports(self) -> None:
        self.events.append(("close_imports", self.channel_id))

    def free_exports(self) -> None:
        self.events.append(("free_exports", self.channel_id))


class _FakeGraph:
    def __init__(self, events: list) -> None:
        self.events = events

    def reset(self) -> None:
        self.events.append(("graph_reset",))


@pytest.fixture
def cuda(monkeypatch):
    """Fake CUDA: each graph costs 10 MiB of driver memory until empty_cache after reset."""
    events: list = []
    state = {"free": 1000 << 20, "live_graphs": 0, "dead_graphs": 0, "pool": 0, "segments": list}
    cuda_ns = torch.cuda

    def empty_cache():
        events.append(("empty_cache",))
        state["free"] += state["dead_graphs"] * (10 << 20)
        state["dead_graphs"] = 0

    def graph_pool_handle():
        state["pool"] += 1
        events.append(("pool", state["pool"]))
        return (0, state["pool"])

    @contextmanager
    def graph(g, pool=None, stream=None):
        events.append(("capture_begin", pool, current_owner()))
        yield
        state["live_graphs"] += 1
        state["free"] -= 10 << 20
        events.append(("capture_end",))

    class Graph(_FakeGraph):
        def __init__(self):
            super().__init__(events)
            self.captured = False

        def reset(self):
            super().reset()
            state["dead_graphs"] += 1

    for name, fn in {
        "is_available": lambda: True,
        "is_current_stream_capturing": lambda: False,
        "synchronize": lambda device=None: events.append(("sync",)),
        "empty_cache": empty_cache,
        "mem_get_info": lambda device=None: (state["free"], 2000 << 20),
        "memory_reserved": lambda: 0,  # allocator level is checked on the GPU
        "max_memory_reserved": lambda: 0,
        "reset_peak_memory_stats": lambda: None,
        "graph_pool_handle": graph_pool_handle,
        "current_device": lambda: 0,
        # The allocator's segments; a test that needs some sets state["segments"].
        "memory_snapshot": lambda: state["segments"](),
    }.items():
        monkeypatch.setattr(cuda_ns, name, fn)
    monkeypatch.setattr(capture_module.torch.cuda, "CUDAGraph", Graph)
    monkeypatch.setattr(capture_module.torch.cuda, "graph", graph)
    return events, state


def _owner(name: str, events: list, num_graphs: int = 2, fail_after: int | None = None):
    kept: list = []

    def capture(recorder):
        for i in range(num_graphs):
            if fail_after is not None and i == fail_after:
                raise KeyError(f"{name} capture failed")
            with recorder.capture():
                kept.append(object())  # stands for a static output in the pool

    def release():
        events.append(("release", name))
        kept.clear()

    return OwnerGraphs(name, capture, warmup=lambda: events.append(("warm", name)), release=release)


def _channel_pool(events: list) -> ChannelPool:
    return ChannelPool(
        "tp",
        lambda cid, owner: _FakeChannel(cid, owner, events),
        barrier=lambda: events.append(("barrier",)),
        synchronize=lambda: events.append(("channel_sync",)),
    )


def test_profile_graph_memory_measures_each_owner_and_gives_bytes_back(cuda):
    events, state = cuda
    channel_pool = _channel_pool(events)
    report = profile_graph_memory(
        [_owner("target", events, 3), _owner("draft", events, 2)], channel_pools=[channel_pool]
    )
    assert [(o.owner, o.num_graphs, o.driver_bytes) for o in report.owners] == [
        ("target", 3, 30 << 20),
        ("draft", 2, 20 << 20),
    ]
    assert report.total_driver_bytes == 50 << 20
    assert report.retained_bytes == 0
    assert state["free"] == 1000 << 20
    assert channel_pool.num_channels == 0
    assert "total" in report.format_table() and '"total_driver_bytes"' in report.to_json()


def test_profile_graph_memory_captures_each_owner_in_its_lane_into_one_private_pool(cuda):
    events, _ = cuda
    profile_graph_memory([_owner("target", events, 1), _owner("draft", events, 1)])
    begins = [e for e in events if e[0] == "capture_begin"]
    assert [e[2] for e in begins] == ["target", "draft"]
    assert len({e[1] for e in begins}) == 1


def test_profile_graph_memory_teardown_order(cuda):
    events, _ = cuda
    channel_pool = _channel_pool(events)
    profile_graph_memory(
        [_owner("target", events, 1), _owner("draft", events, 1)],
        channel_pools=[channel_pool],
    )
    names = [e[0] for e in events]
    last_capture = max(i for i, n in enumerate(names) if n == "capture_end")
    tail = names[last_capture + 1 :]
    # graphs destroyed after a sync and before the owners drop their pool tensors;
    # the pool released (empty_cache) before channels close; channels close last.
    resets = [i for i, n in enumerate(tail) if n == "graph_reset"]
    releases = [i for i, n in enumerate(tail) if n == "release"]
    assert tail[min(resets) - 1] == "sync" and max(resets) < min(releases)
    closes = [i for i, n in enumerate(tail) if n == "close_imports"]
    assert max(releases) < tail.index("empty_cache", max(releases)) < min(closes)
    assert [e[1] for e in events if e[0] == "close_imports"] == [1, 0]  # newest first


def test_profile_graph_memory_measures_once_when_its_pass_leaves_nothing(cuda):
    events, state = cuda
    channel_pool = _channel_pool(events)
    report = profile_graph_memory([_owner("target", events, 2)], channel_pools=[channel_pool])
    names = [e[0] for e in events]
    assert names.index("warm") < names.index("pool")
    assert names.count("pool") == 1 and names.count("capture_begin") == 2
    assert [o.num_graphs for o in report.owners] == [2]
    assert report.owners[0].driver_bytes == 20 << 20
    assert report.one_time_bytes == 0
    assert channel_pool.num_channels == 0 and state["free"] == 1000 << 20


@pytest.mark.parametrize(("another_rank_asks", "passes"), [(False, 1), (True, 2)])
def test_profile_graph_memory_takes_the_passes_every_rank_agrees_on(
    cuda, another_rank_asks, passes
):
    events, _ = cuda
    votes = []

    def agree(flag):
        votes.append(flag)
        return flag or another_rank_asks

    report = profile_graph_memory([_owner("target", events, 2)], agree=agree)
    assert votes == [False], "this rank's pass left nothing: it asks for no second"
    assert [e[0] for e in events].count("pool") == passes
    assert report.owners[0].driver_bytes == 20 << 20


def test_profile_graph_memory_failing_draft_restores_everything(cuda):
    events, state = cuda
    channel_pool = _channel_pool(events)
    eager = channel_pool.current()
    workspace = LaneWorkspace("cpu")
    workspace.get_simultaneous(((16,), torch.float32))
    lanes_before = workspace.usage()
    redirected: list = []

    @contextmanager
    def redirect(pool):
        redirected.append(("in", pool))
        try:
            yield
        finally:
            redirected.append(("out", pool))

    target = _owner("target", events, 2)
    draft = _owner("draft", events, 3, fail_after=1)
    grow = OwnerGraphs(
        "draft",
        lambda rec: (workspace.get_simultaneous(((4096,), torch.float32)), draft.capture(rec)),
        release=draft.release,
    )
    with pytest.raises(KeyError, match="draft capture failed"):
        profile_graph_memory(
            [target, grow],
            channel_pools=[channel_pool],
            workspace=workspace,
            redirect_pools=redirect,
        )
    assert state["free"] == 1000 << 20, "graph memory was not given back"
    assert channel_pool.channels == (eager,)
    assert workspace.usage() == lanes_before
    assert [r[0] for r in redirected] == ["in", "out"]
    assert ("release", "target") in events and ("release", "draft") in events


def test_profile_graph_memory_failing_release_keeps_original_error(cuda):
    events, state = cuda

    def bad_release():
        raise OSError("release broke")

    failing = OwnerGraphs("target", _owner("target", events, 2, fail_after=1).capture)
    bad = OwnerGraphs("draft", lambda rec: None, release=bad_release)
    with pytest.raises(KeyError) as info:
        profile_graph_memory([failing, bad])
    assert any("release broke" in note for note in info.value.__notes__)
    assert state["free"] == 1000 << 20


def test_profile_graph_memory_bad_owners_raise_before_touching_state(cuda):
    events, _ = cuda
    with pytest.raises(ValueError, match="owners is empty"):
        profile_graph_memory([])
    with pytest.raises(ValueError, match="must be unique"):
        profile_graph_memory([_owner("target", events), _owner("target", events)])
    with pytest.raises(RuntimeError, match="'encoder' has no lane"):
        profile_graph_memory([_owner("encoder", events)], workspace=LaneWorkspace("cpu"))
    assert events == []


def test_profile_graph_memory_during_channel_capture_refused_and_state_kept(cuda):
    events, _ = cuda
    channel_pool = _channel_pool(events)
    with channel_pool.capture("target"), pytest.raises(RuntimeError, match="capture"):
        profile_graph_memory([_owner("target", events, 1)], channel_pools=[channel_pool])
    assert channel_pool.num_channels == 1
    assert ("warm", "target") not in events, "refuse before running any warm-up"


def test_profile_graph_memory_inside_stream_capture_refused(cuda, monkeypatch):
    events, _ = cuda
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match="call it before capture"):
        profile_graph_memory([_owner("target", events, 1)])
    assert events == []


def test_disposable_graph_pass_order_redirect_exits_after_destroy_before_release(cuda):
    from vllm_specgraph.profile import disposable_graph_pass

    events, _ = cuda
    workspace = LaneWorkspace("cpu")

    @contextmanager
    def redirect(pool):
        events.append(("redirect", pool))
        yield
        events.append(("restore_pools",))

    with disposable_graph_pass(workspace=workspace, redirect_pools=redirect) as disposable:
        workspace.lock()
        disposable.on_destroy(lambda: events.append(("destroy", "graphs")))
        disposable.on_destroy(lambda: events.append(("destroy", "outputs")))
    assert events == [
        ("pool", 1),
        ("redirect", (0, 1)),
        ("sync",),
        ("destroy", "graphs"),
        ("destroy", "outputs"),
        ("restore_pools",),
        ("sync",),
        ("empty_cache",),
    ]
    assert not workspace.is_locked(), "the pass restores the lock state"


class _Cycle:
    """Garbage only a collection frees: it refers to itself."""

    def __init__(self, payload: object = None) -> None:
        self.me, self.payload = self, payload


def test_disposable_graph_pass_collections_visit_only_what_the_pass_made(cuda):
    import gc
    import weakref

    from vllm_specgraph.profile import disposable_graph_pass

    events, _ = cuda
    older = weakref.ref(_Cycle())
    with disposable_graph_pass() as disposable:
        assert gc.get_freeze_count() > 0, "every older object is frozen for the pass"
        made = weakref.ref(_Cycle())
        gc.collect()
        assert made() is None, "garbage the pass made is collected"
        assert older() is not None, "an older object is not visited"
        disposable.on_destroy(lambda: events.append(("destroy",)))
    assert gc.get_freeze_count() == 0, "the heap is thawed"
    release = events[events.index(("destroy",)) + 1 :]
    assert release == [("sync",), ("empty_cache",)], "collect, then give the pool back"
    gc.collect()
    assert older() is None


def test_disposable_graph_pass_collects_the_whole_heap_when_its_pool_keeps_a_segment(cuda):
    """An object older than the pass, in a reference cycle, holds a pool tensor."""
    import gc
    import weakref

    from vllm_specgraph.profile import disposable_graph_pass

    events, state = cuda
    holder = _Cycle()
    with disposable_graph_pass() as disposable:
        output = torch.empty(0)  # stands for a static output in the pool
        holder.payload, in_pool = output, weakref.ref(output)
        del holder, output
        state["segments"] = lambda: (
            [{"device": 0, "segment_pool_id": disposable.pool, "blocks": []}]
            if in_pool() is not None
            else []
        )
    assert in_pool() is None, "the whole heap was collected"
    assert events[-2:] == [("empty_cache",), ("empty_cache",)], "and the pool given back"
    assert gc.get_freeze_count() == 0


def test_disposable_graph_pass_freezes_also_when_the_heap_was_frozen_before(cuda):
    """Objects made after an earlier freeze are older than the pass: frozen too."""
    import gc
    import weakref

    from vllm_specgraph.profile import disposable_graph_pass

    gc.freeze()
    try:
        older = weakref.ref(_Cycle())
        with disposable_graph_pass():
            gc.collect()
            assert older() is not None, "an older object is not visited"
        assert gc.get_freeze_count() == 0, "left thawed, as vLLM's capture leaves it"
    finally:
        gc.unfreeze()


def test_disposable_graph_pass_failing_destroy_step_still_restores_then_raises(cuda):
    from vllm_specgraph.profile import disposable_graph_pass

    events, _ = cuda
    channels = _channel_pool(events)

    def broken():
        raise OSError("destroy failed")

    with (
        pytest.raises(OSError, match="destroy failed"),
        disposable_graph_pass(channel_pools=[channels]) as disposable,
    ):
        with channels.capture("draft"):
            pass
        disposable.on_destroy(broken)
        disposable.on_destroy(lambda: events.append(("destroy", "after_broken")))
    assert ("destroy", "after_broken") in events
    assert channels.num_channels == 0, "channels made in the pass are rolled back"


def test_current_disposable_pass_is_the_pass_in_its_block_only_also_after_an_error(cuda):
    from vllm_specgraph.profile import current_disposable_pass, disposable_graph_pass

    assert current_disposable_pass() is None
    seen = []
    with disposable_graph_pass() as disposable:
        seen.append(current_disposable_pass())
        disposable.on_destroy(lambda: seen.append(current_disposable_pass()))
    assert seen == [disposable, disposable], "destroy steps still run in the pass"
    assert current_disposable_pass() is None
    with pytest.raises(KeyError, match="capture failed"), disposable_graph_pass():
        raise KeyError("capture failed")
    assert current_disposable_pass() is None, "reset on error too"


def test_disposable_graph_pass_thaws_the_heap_after_a_failed_pass(cuda):
    import gc

    from vllm_specgraph.profile import disposable_graph_pass

    with pytest.raises(KeyError, match="capture failed"), disposable_graph_pass():
        assert gc.get_freeze_count() > 0
        raise KeyError("capture failed")
    assert gc.get_freeze_count() == 0, "a failed pass left the whole heap frozen"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"owner": "target", "capture": None}, "OwnerGraphs.capture must be callable, got None"),
        ({"owner": None, "capture": print}, "OwnerGraphs.owner must be a non-empty str"),
        ({"owner": "draft", "capture": print, "release": 3}, "OwnerGraphs.release must be"),
    ],
)
def test_owner_graphs_refuses_what_it_cannot_run_when_made(kwargs, message):
    from vllm_specgraph.profile import OwnerGraphs

    with pytest.raises(TypeError, match=message):
        OwnerGraphs(**kwargs)


def test_owner_graphs_refuses_an_empty_owner_name():
    with pytest.raises(ValueError, match=r"OwnerGraphs\.owner must be a non-empty str, got ''"):
        OwnerGraphs("", print)


_TARGET = OwnerGraphs("target", print)


def _bad_profile_arguments():
    lone_pool = ChannelPool("tp", lambda cid, owner: None)
    return [
        ({"owners": None}, "owners must be an iterable of OwnerGraphs, got None"),
        ({"owners": _TARGET}, r"owners must be an iterable of OwnerGraphs, got OwnerGraphs\("),
        ({"owners": [1]}, r"owners\[0\] must be a OwnerGraphs, got 1"),
        ({"channel_pools": None}, "channel_pools must be an iterable of ChannelPool, got None"),
        ({"channel_pools": lone_pool}, "channel_pools must be an iterable of ChannelPool, got <"),
        ({"channel_pools": ["tp"]}, r"channel_pools\[0\] must be a ChannelPool, got 'tp'"),
        ({"workspace": "ws"}, "workspace must be a LaneWorkspace, got 'ws'"),
        ({"redirect_pools": 3}, "redirect_pools must be callable, got 3"),
    ]


@pytest.mark.parametrize(("kwargs", "match"), _bad_profile_arguments())
def test_profile_graph_memory_bad_argument_types_named_before_any_cuda_call(kwargs, match):
    # No CUDA fake: an argument refused after the first CUDA call would say "needs CUDA".
    with pytest.raises(TypeError, match=match):
        profile_graph_memory(**{"owners": [_TARGET]} | kwargs)


@pytest.mark.parametrize(("kwargs", "match"), _bad_profile_arguments()[3:])
def test_disposable_graph_pass_bad_argument_types_named_before_any_cuda_call(kwargs, match):
    from vllm_specgraph.profile import disposable_graph_pass

    with pytest.raises(TypeError, match=match), disposable_graph_pass(**kwargs):
        pass


def test_profile_graph_memory_reads_owners_given_as_an_iterator_once(cuda):
    events, _ = cuda
    report = profile_graph_memory(iter([_owner("target", events, 1)]))
    assert [o.owner for o in report.owners] == ["target"]


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((None, (0, 1), [], []), "owners must be an iterable of OwnerGraphs, got None"),
        (([1], (0, 1), [], []), r"owners\[0\] must be a OwnerGraphs, got 1"),
        (([_TARGET], None, [], []), "pool must be a pool handle, a pair of ints, got None"),
        (([_TARGET], (0, "1"), [], []), r"pool\[1\] must be an int, got '1'"),
        (([_TARGET], (0, 1), None, []), "channel_pools must be an iterable of ChannelPool"),
        (([_TARGET], (0, 1), [], None), "recorders must be a list, got None"),
        (([_TARGET], (0, 1), [], ()), r"recorders must be a list, got \(\)"),
    ],
)
def test_measure_captures_bad_argument_types_named_before_any_cuda_call(args, match):
    from vllm_specgraph.profile import measure_captures

    with pytest.raises(TypeError, match=match):
        measure_captures(*args)


@pytest.mark.parametrize("step", [None, 3, "sync"])
def test_disposable_pass_on_destroy_refuses_what_it_cannot_call_and_keeps_nothing(step):
    from vllm_specgraph.profile import DisposablePass

    disposable = DisposablePass((0, 1))
    with pytest.raises(TypeError, match=f"step must be callable, got {step!r}"):
        disposable.on_destroy(step)
    assert disposable._destroy_steps == []


@pytest.mark.parametrize(
    ("segment", "error"), [(None, TypeError), ([], TypeError), ({"address": 0}, ValueError)]
)
def test_segment_blocks_of_no_segment_names_it(segment, error):
    from vllm_specgraph.meter import segment_blocks

    with pytest.raises(
        error, match=f"segment must be a segment dict.*got {re.escape(repr(segment))}"
    ):
        segment_blocks(segment)


def test_profile_graph_memory_refuses_an_agree_that_is_no_function():
    from vllm_specgraph.profile import OwnerGraphs, profile_graph_memory

    with pytest.raises(TypeError, match="agree must be callable, got 'no'"):
        profile_graph_memory([OwnerGraphs("target", print)], agree="no")


def test_profile_graph_memory_reports_one_time_and_retained_bytes_with_their_signs(cuda):
    """The first capture in the process loads 6 MiB for good (kernel code, say), and
    every capture leaves 2 MiB behind: the first pass takes both, so the report
    says 8 MiB one-time and measures again; the second pass leaves its 2 MiB:
    retained."""
    from vllm_specgraph.profile import OwnerGraphs

    _, state = cuda
    first = [True]

    def capture(recorder):
        with recorder.capture():
            pass  # the recorder enters the fake capture
        state["free"] -= (6 << 20 if first[0] else 0) + (2 << 20)
        first[0] = False

    report = profile_graph_memory([OwnerGraphs("target", capture)])
    assert report.one_time_bytes == 8 << 20
    assert report.retained_bytes == 2 << 20


def _engine_pass(state, leaves: int, owners_mib: int = 10):
    """A stand-in pass: it takes ``leaves`` bytes for good and reports one owner."""
    from vllm_specgraph.meter import OwnerMemory
    from vllm_specgraph.profile import PassReading

    def run():
        state["free"] -= leaves
        return PassReading(
            (OwnerMemory("target", 1, owners_mib << 20, owners_mib << 20),), frozenset()
        )

    return run


def test_engine_measures_again_and_reports_the_last_pass(cuda, monkeypatch):
    from vllm_specgraph.profile import measure_graph_memory

    _, state = cuda
    first, second = _engine_pass(state, 4 << 20, 10), _engine_pass(state, 0, 12)
    block = {"address": 1 << 30, "size": 2 << 20, "state": "active_allocated"}
    passes = []

    def run_pass(index):
        passes.append(index)
        if index == 1:  # a block the second pass keeps: the profile's blocks are the last pass's
            state["segments"] = lambda: [{"device": 0, "total_size": 2 << 20, "blocks": [block]}]
        return (first if index == 0 else second)()

    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda: 7 << 20)
    profile = measure_graph_memory(run_pass, log=lambda line: None)
    assert passes == [0, 1] and profile.passes == 2
    report = profile.report
    assert (report.one_time_bytes, report.retained_bytes) == (4 << 20, 0)
    assert report.owners[0].driver_bytes == 12 << 20, "the second pass's owners"
    assert report.transient_peak_bytes == 7 << 20
    assert profile.blocks_after == frozenset({(1 << 30, 2 << 20)})


def test_engine_refuses_a_second_pass_that_finds_no_graph(cuda):
    from vllm_specgraph.profile import measure_graph_memory

    _, state = cuda
    first = _engine_pass(state, 4 << 20)
    with pytest.raises(RuntimeError, match="second profiling pass found no graph"):
        measure_graph_memory(lambda index: first() if index == 0 else None, log=print)


def test_engine_votes_once_also_with_nothing_to_capture(cuda):
    from vllm_specgraph.profile import measure_graph_memory

    votes = []
    assert measure_graph_memory(lambda index: None, agree=votes.append) is None
    assert votes == [False]
