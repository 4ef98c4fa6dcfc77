"""The capture meter on the CPU: driver readings and allocator segments faked."""

import pytest
import torch

from vllm_specgraph.meter import CaptureFootprint, CaptureMeter, current_meter, metering

MIB = 1 << 20


@pytest.fixture
def readings(monkeypatch):
    """Free bytes, reserved bytes and graph-pool segment bytes a test moves by hand."""
    state = {"free": 1000 * MIB, "reserved": 0, "graph_pool": 0, "graphs": 0}
    fakes = {
        "synchronize": lambda device=None: None,
        "empty_cache": lambda: None,
        "mem_get_info": lambda device=None: (state["free"], 2000 * MIB),
        "memory_reserved": lambda: state["reserved"],
        "current_device": lambda: 0,
        "memory_snapshot": lambda: [
            {"device": 0, "segment_pool_id": (0, 9), "total_size": state["graph_pool"]}
        ],
    }
    for name, fn in fakes.items():
        monkeypatch.setattr(torch.cuda, name, fn)
    return state


def _capture(state, nbytes: int, graphs: int = 1, outside: int = 0) -> None:
    """``graphs`` graphs captured into a graph pool, plus bytes outside the allocator."""
    state["free"] -= nbytes + outside
    state["reserved"] += nbytes
    state["graph_pool"] += nbytes
    state["graphs"] += graphs


def test_a_nested_owner_is_measured_and_the_rest_owner_gets_what_is_left(readings):
    meter = CaptureMeter(lambda: readings["graphs"])
    with metering(meter), meter.whole_call():
        _capture(readings, 30 * MIB, graphs=3, outside=2 * MIB)
        with current_meter().measure("draft"):
            _capture(readings, 10 * MIB, graphs=2)
    target, draft = meter.owners()
    assert (target.owner, target.num_graphs, target.driver_bytes, target.allocator_bytes) == (
        "target",
        3,
        32 * MIB,
        30 * MIB,
    )
    assert (draft.owner, draft.num_graphs, draft.driver_bytes) == ("draft", 2, 10 * MIB)
    assert meter.footprint == CaptureFootprint(40 * MIB, 0, 2 * MIB)
    assert current_meter() is None, "the meter is active only inside its block"


def test_the_call_s_own_total_replaces_the_meter_s_reading(readings):
    meter = CaptureMeter(lambda: readings["graphs"], rest_owner="encoder")
    with meter.whole_call():
        _capture(readings, 8 * MIB)
    (rest,) = meter.owners(total_bytes=9 * MIB)
    assert (rest.owner, rest.driver_bytes) == ("encoder", 9 * MIB)


def test_an_owner_measured_twice_adds_up(readings):
    meter = CaptureMeter(lambda: readings["graphs"])
    with meter.whole_call():
        for _ in range(2):
            with meter.measure("draft"):
                _capture(readings, 4 * MIB)
    target, draft = meter.owners()
    assert (draft.driver_bytes, draft.num_graphs) == (8 * MIB, 2)
    assert (target.driver_bytes, target.num_graphs) == (0, 0)


def test_owners_before_a_whole_call_is_refused(readings):
    meter = CaptureMeter(lambda: 0)
    with pytest.raises(RuntimeError, match="needs a call measured with whole_call"):
        meter.owners()


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"graphs_captured": 3}, TypeError, "graphs_captured must be callable, got 3"),
        ({"graphs_captured": int, "rest_owner": ""}, ValueError, "rest_owner must be a non-empty"),
    ],
)
def test_bad_meter_arguments_are_named(kwargs, error, match):
    with pytest.raises(error, match=match):
        CaptureMeter(**kwargs)
