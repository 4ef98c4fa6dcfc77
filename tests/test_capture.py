"""GraphRecorder.capture on the CPU, with torch.cuda.CUDAGraph and torch.cuda.graph faked.

The fakes record what happens to each graph, and the fake ``torch.cuda.graph``
can fail when capture ends, as a real capture does when the block did
something illegal while capturing.
"""

from contextlib import contextmanager

import pytest

import vllm_specgraph.capture as capture_module
from vllm_specgraph.capture import GraphRecorder
from vllm_specgraph.channels import ChannelPool
from vllm_specgraph.lanes import current_owner


class _RecordingGraph:
    def __init__(self) -> None:
        self.events: list[tuple] = []

    def reset(self) -> None:
        self.events.append(("reset",))


@pytest.fixture
def graphs(monkeypatch):
    """Every fake graph created, in order; ``fail_end`` makes the next capture end fail."""
    made: list[_RecordingGraph] = []
    fail_end = {"next": False}

    def make_graph() -> _RecordingGraph:
        made.append(_RecordingGraph())
        return made[-1]

    @contextmanager
    def graph(g, pool=None, stream=None):
        g.events.append(("capture_begin", pool, current_owner()))
        yield
        if fail_end["next"]:
            fail_end["next"] = False
            raise RuntimeError("capture_end: operation not permitted when stream is capturing")
        g.events.append(("capture_end",))

    monkeypatch.setattr(capture_module.torch.cuda, "CUDAGraph", make_graph)
    monkeypatch.setattr(capture_module.torch.cuda, "graph", graph)
    return made, fail_end


def _channel_pool() -> ChannelPool:
    class _Channel:
        def __init__(self, channel_id: int, owner: str) -> None:
            self.channel_id, self.owner = channel_id, owner

        def close_imports(self) -> None:
            pass

        def free_exports(self) -> None:
            pass

    return ChannelPool("tp", _Channel, synchronize=lambda: None)


def test_capture_success_keeps_graph_captured_as_owner_into_pool(graphs):
    made, _ = graphs
    recorder = GraphRecorder((0, 7), "draft", [_channel_pool()])
    with recorder.capture() as graph:
        pass
    assert recorder.graphs == (graph,) and made == [graph]
    assert graph.events == [("capture_begin", (0, 7), "draft"), ("capture_end",)]


def test_capture_block_raises_resets_graph_and_keeps_nothing(graphs):
    made, _ = graphs
    channel_pool = _channel_pool()
    recorder = GraphRecorder((0, 7), "draft", [channel_pool])
    with recorder.capture():
        pass
    with pytest.raises(KeyError, match="model failed"), recorder.capture():
        raise KeyError("model failed")
    assert recorder.num_graphs == 1 and recorder.graphs == (made[0],)
    assert made[1].events[-1] == ("reset",)
    assert made[0].events[-1] == ("capture_end",)  # the kept graph was not touched
    assert current_owner() == "target"
    channel_pool.checkpoint()  # no capture is left counted as active


def test_capture_end_raises_resets_graph_and_keeps_nothing(graphs):
    made, fail_end = graphs
    recorder = GraphRecorder((0, 7), "target", [_channel_pool()])
    fail_end["next"] = True
    with pytest.raises(RuntimeError, match="capture_end"), recorder.capture():
        pass
    assert recorder.num_graphs == 0
    assert made[0].events == [("capture_begin", (0, 7), "target"), ("reset",)]


def test_capture_channel_refused_resets_graph_and_keeps_nothing(graphs):
    made, _ = graphs
    channel_pool = _channel_pool()
    channel_pool.close()  # entering its capture raises before torch.cuda.graph begins
    recorder = GraphRecorder((0, 7), "draft", [channel_pool])
    with pytest.raises(RuntimeError, match="closed"), recorder.capture():
        pass
    assert recorder.num_graphs == 0
    assert made[0].events == [("reset",)]


def test_reset_destroys_every_kept_graph(graphs):
    made, _ = graphs
    recorder = GraphRecorder((0, 7), "target")
    for _ in range(2):
        with recorder.capture():
            pass
    recorder.reset()
    assert recorder.num_graphs == 0
    assert [g.events[-1] for g in made] == [("reset",), ("reset",)]


@pytest.mark.parametrize(
    ("args", "error", "match"),
    [
        (((0, 7), None), TypeError, "owner must be a non-empty str, got None"),
        (((0, 7), 1), TypeError, "owner must be a non-empty str, got 1"),
        (((0, 7), ""), ValueError, "owner must be a non-empty str, got ''"),
        ((None, "draft"), TypeError, "pool must be a pool handle, a pair of ints, got None"),
        ((7, "draft"), TypeError, "pool must be a pool handle, a pair of ints, got 7"),
        (((7,), "draft"), TypeError, r"pool must be a pool handle, a pair of ints, got \(7,\)"),
        (((0, -1), "draft"), ValueError, r"pool\[1\] must be >= 0, got -1"),
        (((0, 7), "draft", None), TypeError, "channel_pools must be an iterable of ChannelPool"),
        (((0, 7), "draft", [1]), TypeError, r"channel_pools\[0\] must be a ChannelPool, got 1"),
    ],
)
def test_recorder_bad_arguments_raise_naming_them_when_made(args, error, match):
    with pytest.raises(error, match=match):
        GraphRecorder(*args)


def test_recorder_single_channel_pool_is_refused_naming_the_fix():
    with pytest.raises(TypeError, match=r"channel_pools must be an iterable.*pass a list of"):
        GraphRecorder((0, 7), "draft", _channel_pool())


def test_recorder_takes_numpy_pool_ids_as_plain_ints():
    import numpy as np

    recorder = GraphRecorder((np.int64(0), np.int64(7)), "draft")
    assert recorder.pool == (0, 7) and all(type(i) is int for i in recorder.pool)


@pytest.mark.parametrize("stream", [3, "side"])
def test_capture_bad_stream_raises_before_a_graph_is_made(graphs, stream):
    made, _ = graphs
    recorder = GraphRecorder((0, 7), "draft", [_channel_pool()])
    match = rf"stream must be a torch\.cuda\.Stream or None, got {stream!r}"
    with pytest.raises(TypeError, match=match), recorder.capture(stream):
        pass
    assert made == [] and recorder.num_graphs == 0
    assert recorder.channel_pools[0].num_channels == 0
