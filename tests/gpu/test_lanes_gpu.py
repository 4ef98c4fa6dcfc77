"""Owner lanes under real CUDA graph capture and replay (GPU only)."""

import pytest

from vllm_specgraph.selfcheck import run_lane_selfcheck

pytestmark = pytest.mark.gpu


def test_run_lane_selfcheck_owner_lanes_exact_shared_lane_wrong():
    report = run_lane_selfcheck(iterations=100)
    assert report.owner_lane_mismatches == 0, report
    assert report.draft_retired_bytes > 0, "the draft lane never grew"
    assert report.shared_lane_input_reused, "negative control: the freed buffer was not reused"
    # draft-large replays after a graph that writes over its input in 2 of every 3 steps.
    assert report.shared_lane_mismatches > 0, report
    assert report.ok


def test_growth_during_real_capture_refused_sized_lane_captures_and_replays():
    import torch

    from vllm_specgraph.lanes import LaneWorkspace, WorkspaceLockedError, use_owner

    workspace = LaneWorkspace("cuda")
    with use_owner("draft"):
        (warm,) = workspace.get_simultaneous(((1 << 20,), torch.float32))  # eager warm-up
    usage_before = workspace.usage()
    graph = torch.cuda.CUDAGraph()
    with (
        pytest.raises(WorkspaceLockedError, match="in a CUDA-graph capture"),
        use_owner("draft"),
        torch.cuda.graph(graph),
    ):
        workspace.get_simultaneous(((1 << 21,), torch.float32))
    assert workspace.usage() == usage_before
    graph = torch.cuda.CUDAGraph()
    with use_owner("draft"), torch.cuda.graph(graph):
        (scratch,) = workspace.get_simultaneous(((1 << 20,), torch.float32))
        scratch.fill_(3.0)
    graph.replay()
    torch.cuda.synchronize()
    assert bool((scratch == 3.0).all())
    assert scratch.data_ptr() == warm.data_ptr(), "the capture used the warm-up's buffer"
    assert workspace.usage() == usage_before
