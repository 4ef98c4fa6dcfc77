"""Elastic EP's graph release frees the workspace's retired buffers (real vLLM class)."""

import pytest
import torch

pytestmark = pytest.mark.vllm


def test_release_cuda_graphs_then_frees_retired_buffers(monkeypatch, install_patch):
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
    executor._release_cuda_graphs(executor.__new__(executor))
    assert calls == [("graphs released", True)], "vLLM's release runs first"
    assert manager.usage()["target"].retired_bytes == 0
    assert manager.usage()["target"].live_bytes >= 4096 * 4


def test_release_cuda_graphs_closes_the_captures_channels_and_keeps_the_eager_one(
    monkeypatch, install_patch
):
    """The TP group's peer all-reduce is one gloo rank with CPU channels; vLLM's
    release is a stand-in (it needs a GPU and a model)."""
    from types import SimpleNamespace

    import torch.distributed as dist
    import vllm.distributed.elastic_ep.elastic_execute as elastic_execute
    import vllm.distributed.parallel_state as parallel_state

    from vllm_specgraph.allreduce import PeerAllReduce
    from vllm_specgraph.device_channel import device_channel_factory

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        peer = PeerAllReduce(
            dist.group.WORLD, "cpu", create_channel=device_channel_factory(1 << 10, "cpu")
        )
        communicator = SimpleNamespace(specgraph_all_reduce=peer)
        # TP and DCP share the communicator: its channels are closed once.
        for name in ("_TP", "_DCP"):
            monkeypatch.setattr(
                parallel_state, name, SimpleNamespace(device_communicator=communicator)
            )
        executor = elastic_execute.ElasticEPScalingExecutor
        released = []
        monkeypatch.setattr(
            executor, "_release_cuda_graphs", lambda self: released.append(pool.num_channels)
        )
        install_patch("vllm.distributed.elastic_ep.elastic_execute")
        pool = peer.channel_pool
        with pool.capture(owner="target"):  # what graph_capture binds, per capture
            pass
        eager = pool.current()
        with pool.capture(owner="draft"):
            pass
        assert pool.num_channels == 3
        executor._release_cuda_graphs(executor.__new__(executor))
        assert released == [3], "vLLM's release runs first"
        assert pool.channels == (eager,), "the captures' channels closed, the eager one kept"
        with pool.capture(owner="target"):  # the re-capture binds a fresh channel
            pass
        executor._release_cuda_graphs(executor.__new__(executor))
        assert pool.channels == (eager,)
    finally:
        dist.destroy_process_group()
