"""The gpu_worker patch on vLLM 0.33.0's own Worker (no GPU: the engine is faked)."""

from types import SimpleNamespace

import pytest

from vllm_specgraph.lanes import current_owner

pytestmark = pytest.mark.vllm


def _config(method: str | None) -> SimpleNamespace:
    spec = None
    if method is not None:
        spec = SimpleNamespace(method=method, use_dspark=lambda: method == "dspark")
    return SimpleNamespace(speculative_config=spec)


@pytest.mark.parametrize("method", ["eagle", "eagle3", "mtp", "draft_model", "ngram", "dflash"])
def test_num_workspace_lanes_two_for_every_speculative_method_on_mrv2(install_patch, method):
    gpu_worker = install_patch("vllm.v1.worker.gpu_worker")
    assert gpu_worker._num_workspace_lanes(_config(method), True) == 2
    assert gpu_worker._num_workspace_lanes(_config(method), False) == 1
    assert gpu_worker._num_workspace_lanes(_config(None), True) == 1


class _Engine:
    supports_draft_weight_update = True

    def __init__(self) -> None:
        self.lanes: list[tuple[str, object]] = []

    def start_weight_update(self) -> None:
        self.lanes.append(("start", current_owner()))

    def update_weights(self, info) -> None:
        self.lanes.append(("update", current_owner()))

    def finish_weight_update(self) -> None:
        self.lanes.append(("finish", current_owner()))

    def reset_weight_update_target(self) -> None:
        pass


def _bare_worker(gpu_worker):
    worker = gpu_worker.Worker.__new__(gpu_worker.Worker)
    worker.weight_transfer_engine = _Engine()
    worker._weight_update_active = False
    worker._weight_update_is_draft = False
    worker.vllm_config = None
    worker.get_draft_model = lambda: None
    worker._set_draft_weight_update_target = lambda: None
    worker.model_runner = SimpleNamespace(reset_lora_state=lambda: None)
    return worker


@pytest.mark.parametrize(("is_draft", "lane"), [(True, 1), (False, "target")])
def test_weight_update_session_runs_in_the_lane_of_its_model(
    install_patch, monkeypatch, is_draft, lane
):
    import contextlib

    gpu_worker = install_patch("vllm.v1.worker.gpu_worker")
    monkeypatch.setattr(gpu_worker, "set_current_vllm_config", lambda c: contextlib.nullcontext())
    worker = _bare_worker(gpu_worker)
    worker._start_weight_update(is_draft=is_draft)
    worker.update_weights({"chunk": 0})
    worker.finish_weight_update()
    assert worker.weight_transfer_engine.lanes == [
        ("start", lane),
        ("update", lane),
        ("finish", lane),
    ]
