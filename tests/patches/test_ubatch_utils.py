"""Micro-batch threads of vLLM 0.33.0's ubatch runner keep their starter's lane."""

import threading

import pytest

from vllm_specgraph.lanes import LaneThread, current_owner, use_owner

pytestmark = pytest.mark.vllm


def test_ubatch_threads_start_in_the_lane_of_their_starter(install_patch):
    ubatch_utils = install_patch("vllm.v1.worker.gpu.ubatch_utils")
    assert ubatch_utils.threading.Thread is LaneThread
    assert ubatch_utils.threading.Barrier is threading.Barrier
    assert threading.Thread is not LaneThread, "only vLLM's ubatch module sees LaneThread"
    seen = []
    with use_owner("draft"):
        thread = ubatch_utils.threading.Thread(target=lambda: seen.append(current_owner()))
    thread.start()
    thread.join()
    assert seen == ["draft"]
