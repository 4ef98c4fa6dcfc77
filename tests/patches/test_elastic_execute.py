"""Elastic EP's graph release frees the workspace's retired buffers where no graph
survives it (real vLLM class; its release and the graphs are stand-ins: they need a GPU)."""

import pytest
import torch

pytestmark = pytest.mark.vllm


@pytest.mark.parametrize("a_graph_survives", [False, True])
def test_release_cuda_graphs_then_frees_retired_buffers_no_graph_can_read(
    monkeypatch, install_patch, a_graph_survives
):
    # monkeypatch first, so it is undone last: vLLM's method is back after the test.
    import vllm.distributed.elastic_ep.elastic_execute as elastic_execute

    workspace_module = install_patch("vllm.v1.worker.workspace")
    executor = elastic_execute.ElasticEPScalingExecutor
    calls = []

    def release_cuda_graphs(self):  # stands for vLLM's, which needs a GPU and a model
        calls.append(("graphs released", manager.usage()["target"].retired_bytes > 0))

    monkeypatch.setattr(executor, "_release_cuda_graphs", release_cuda_graphs)
    install_patch("vllm.distributed.elastic_ep.elastic_execute")
    monkeypatch.setattr(workspace_module, "_manager", None)
    workspace_module.init_workspace_manager(torch.device("cpu"), 1, 1)
    manager = workspace_module.current_workspace_manager()
    manager.get_simultaneous(((64,), torch.float32))
    # A graph viewed the buffer (a stand-in for a capture, which needs a GPU).
    monkeypatch.setattr(manager, "_is_capturing", lambda: True)
    manager.get_simultaneous(((64,), torch.float32))
    monkeypatch.setattr(manager, "_is_capturing", bool)
    manager.get_simultaneous(((4096,), torch.float32))  # the outgrown buffer is retired

    class Graph:  # stands for torch.cuda.CUDAGraph, which a CPU build cannot make
        pass

    monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
    survivor = Graph() if a_graph_survives else None  # e.g. a V1 drafter's graph
    executor._release_cuda_graphs(executor.__new__(executor))
    assert calls == [("graphs released", True)], "vLLM's release runs first"
    retired = manager.usage()["target"].retired_bytes
    assert (retired > 0) is a_graph_survives, "kept only while a graph may read it"
    assert manager.usage()["target"].live_bytes >= 4096 * 4
    del survivor
