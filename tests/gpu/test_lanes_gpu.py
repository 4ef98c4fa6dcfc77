"""Owner lanes under real CUDA graph capture and replay (GPU only)."""

import pytest

from vllm_specgraph.selfcheck import run_lane_selfcheck

pytestmark = pytest.mark.gpu


def test_run_lane_selfcheck_interleaved_replays_equal_eager():
    report = run_lane_selfcheck(iterations=100)
    assert report.mismatches == 0, report
    assert report.draft_retired_bytes > 0, "the draft lane never grew"


def test_run_lane_selfcheck_shared_lane_overlaps_owner_lanes_do_not():
    report = run_lane_selfcheck(iterations=1)
    assert report.shared_lane_overlap, "negative control: one shared lane must alias"
    assert not report.lanes_overlap, "target and draft graphs hold overlapping views"
