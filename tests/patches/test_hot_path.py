"""The plugin's share of a decode step, counted in Python calls.

A decode step with a speculator passes through the plugin where vLLM selects
the draft lane (``use_workspace_lane``), calls a speculator method (each one
wrapped to run in the draft lane), asks the workspace for scratch memory, and
all-reduces over the TP group. These tests count the Python calls the plugin
makes there, with vLLM 0.33.0's own modules and speculator classes; the model
itself is left out (the plugin wraps nothing inside it), and the tensor-parallel
communicator is a stand-in, since it needs several GPUs. A count that grows
means per-step work crept back into the hot path: move it to load or capture
time instead.
"""

import os
import sys
from collections.abc import Callable

import pytest
import torch

import vllm_specgraph

pytestmark = pytest.mark.vllm

PACKAGE_DIR = os.path.dirname(vllm_specgraph.__file__) + os.sep


def python_calls(fn: Callable[[], object], where: Callable[[str], bool]) -> list[str]:
    """The Python functions ``fn`` calls (itself not included) whose file ``where`` accepts."""
    calls: list[str] = []

    def record(frame, event, arg):
        if event == "call" and where(frame.f_code.co_filename):
            calls.append(frame.f_code.co_name)

    sys.setprofile(record)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return calls


def in_plugin(filename: str) -> bool:
    return filename.startswith(PACKAGE_DIR)


LANE_SCOPE_CALLS = 4
"""Entering and leaving the draft lane: ``use_lane``, the scope's ``__init__``,
``__enter__`` and ``__exit__``."""


@pytest.fixture
def draft_model_step(install_patch, monkeypatch):
    """One decode step of vLLM's draft-model speculator, as ``sample_tokens`` runs it.

    The speculator is vLLM's ``StandaloneARSpeculator``, built through the patched
    ``init_speculator``; the methods a step calls are overridden so that no model
    runs: ``propose`` samples one draft token per speculative step, through the
    public ``sample_draft``, as vLLM's does. Returns ``step(num_tokens)``.
    """
    import vllm.v1.worker.gpu.model_runner as model_runner
    from vllm.v1.worker.gpu.spec_decode.standalone_ar.speculator import (
        StandaloneARSpeculator,
    )

    class DraftModel(StandaloneARSpeculator):
        def observe_verification(self, *args):
            pass

        def propose(self, *args, num_speculative_tokens, **kwargs):
            for _ in range(num_speculative_tokens):
                self.sample_draft()

        def sample_draft(self, *args, **kwargs):
            pass

    def init_speculator(vllm_config, device, req_states):
        return DraftModel.__new__(DraftModel)

    monkeypatch.setattr(model_runner, "init_speculator", init_speculator)
    install_patch("vllm.v1.worker.workspace")
    install_patch("vllm.v1.worker.gpu.cudagraph_utils")
    install_patch("vllm.v1.worker.gpu.model_runner")
    speculator = model_runner.init_speculator(None, "cpu", None)

    def step(num_tokens: int) -> None:
        speculator.observe_verification(None, None, None)
        with model_runner.use_workspace_lane(1):
            speculator.propose(num_speculative_tokens=num_tokens)

    return step


@pytest.mark.parametrize("num_tokens", [1, 3, 7])
def test_decode_step_with_a_draft_model_enters_the_draft_lane_twice(draft_model_step, num_tokens):
    """The lane is entered by the first speculator call and by vLLM's own
    ``use_workspace_lane``; a speculator method that runs in it costs one call."""
    calls = python_calls(lambda: draft_model_step(num_tokens), in_plugin)
    speculator_calls = 2 + num_tokens  # observe_verification, propose, sample_draft each
    assert len(calls) == 2 * LANE_SCOPE_CALLS + speculator_calls, calls
    assert calls.count("in_draft_lane") == speculator_calls, calls


def test_workspace_request_makes_no_more_python_calls_than_vllms_own(install_patch, monkeypatch):
    from vllm.v1.worker import workspace

    monkeypatch.setattr(torch.accelerator, "empty_cache", lambda: None)  # no accelerator here
    request = (((64, 128), torch.bfloat16), ((64,), torch.float32))
    original = workspace.WorkspaceManager(torch.device("cpu"), 1, 2), workspace.use_workspace_lane
    install_patch("vllm.v1.worker.workspace")
    ours = workspace.WorkspaceManager(torch.device("cpu"), 1, 2), workspace.use_workspace_lane
    counts = {}
    for name, (manager, use_workspace_lane) in (("vllm", original), ("plugin", ours)):
        with use_workspace_lane(1):
            manager.get_simultaneous(*request)  # grows once, then serves from the buffer
            counts[name] = python_calls(lambda m=manager: m.get_simultaneous(*request), bool)
    assert len(counts["plugin"]) <= len(counts["vllm"]), counts
    # The request and its slot (the ubatch from vLLM's micro-batch context, the lane
    # from the owner): nothing else but comprehensions, which Python 3.12 inlines.
    named = [name for name in counts["plugin"] if not name.startswith("<")]
    assert named == ["get_simultaneous", "_slot", "dbo_current_ubatch_id"], counts


@pytest.mark.parametrize("peer", [None, "peer all-reduce"])
def test_all_reduce_outside_capture_costs_the_wrapper_alone(monkeypatch, peer):
    """Eager all-reduces (a draft model without graphs, at TP >= 2) go to vLLM's own
    all-reduce after one check. The communicator is a stand-in: a real one needs
    several GPUs."""
    from types import SimpleNamespace

    from vllm_specgraph.patches.distributed.device_communicators import cuda_communicator

    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    reduced = []
    all_reduce = cuda_communicator._wrap_all_reduce(lambda self, x: reduced.append(x) or x)
    communicator = SimpleNamespace(specgraph_all_reduce=peer)
    tensor = torch.ones(4)
    calls = python_calls(lambda: all_reduce(communicator, tensor), in_plugin)
    assert calls == ["all_reduce_peer_first"] + ["stream_is_capturing"] * (peer is not None)
    assert reduced == [tensor]
