"""The lane self-check's verdict and its CPU behaviour (the check itself runs in tests/gpu)."""

import dataclasses

import pytest
import torch

from vllm_specgraph import selfcheck
from vllm_specgraph.selfcheck import LaneSelfcheckReport

_PASSING = LaneSelfcheckReport(
    iterations=100,
    owner_lane_mismatches=0,
    owner_lane_max_abs_diff=0.0,
    draft_retired_bytes=16896,
    shared_lane_mismatches=67,
    shared_lane_input_reused=True,
)


def test_lane_selfcheck_report_ok_only_when_owner_exact_and_control_fails():
    assert _PASSING.ok
    for field, value in [
        ("owner_lane_mismatches", 1),  # owner lanes gave a wrong result
        ("shared_lane_mismatches", 0),  # the negative control could not fail
        ("draft_retired_bytes", 0),  # the lane never grew after a capture
    ]:
        assert not dataclasses.replace(_PASSING, **{field: value}).ok, field


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without a GPU")
def test_main_without_cuda_says_what_it_needs_and_exits_2(capsys):
    assert selfcheck.main() == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
