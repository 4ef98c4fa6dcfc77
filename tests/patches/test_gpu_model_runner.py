"""The V1 runner's graph-memory profile leaves no peer all-reduce channel behind.

vLLM 0.33.0's ``gpu_model_runner`` module and its patch run for real; vLLM's own
``profile_cudagraph_memory`` is a stand-in that captures inside
``GroupCoordinator.graph_capture`` as vLLM's does (it needs a GPU and a model),
and the TP group's peer all-reduce is one gloo rank with CPU channels.
"""

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from vllm_specgraph.allreduce import PeerAllReduce
from vllm_specgraph.device_channel import device_channel_factory

pytestmark = pytest.mark.vllm


@pytest.fixture
def v1_runner(install_patch, monkeypatch):
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    import vllm.distributed.parallel_state as parallel_state
    import vllm.v1.worker.gpu_model_runner as gpu_model_runner
    from vllm.config import ParallelConfig

    peer = PeerAllReduce(
        dist.group.WORLD, "cpu", create_channel=device_channel_factory(1 << 10, "cpu")
    )
    tp = SimpleNamespace(device_communicator=SimpleNamespace(specgraph_all_reduce=peer))
    monkeypatch.setattr(parallel_state, "_TP", tp)
    outcome = {"fail": False, "channels_during": None, "in_capture": lambda: None}

    def vllm_profile(self):
        with peer.channel_pool.capture(owner="target"):  # what graph_capture binds
            outcome["channels_during"] = peer.channel_pool.num_channels
            outcome["in_capture"]()
        if outcome["fail"]:
            raise RuntimeError("profiling capture failed")
        return 7

    monkeypatch.setattr(gpu_model_runner.GPUModelRunner, "profile_cudagraph_memory", vllm_profile)
    install_patch("vllm.v1.worker.gpu_model_runner")
    runner = gpu_model_runner.GPUModelRunner.__new__(gpu_model_runner.GPUModelRunner)
    runner.parallel_config = ParallelConfig()
    yield SimpleNamespace(runner=runner, pool=peer.channel_pool, outcome=outcome, tp=tp)
    dist.destroy_process_group()


def test_v1_profile_rolls_back_the_channel_its_capture_made(v1_runner):
    assert v1_runner.runner.profile_cudagraph_memory() == 7
    assert v1_runner.outcome["channels_during"] == 1
    assert v1_runner.pool.num_channels == 0, "the throwaway capture's channel is closed"


def test_v1_profile_rolls_back_also_when_it_fails(v1_runner):
    v1_runner.outcome["fail"] = True
    with pytest.raises(RuntimeError, match="profiling capture failed"):
        v1_runner.runner.profile_cudagraph_memory()
    assert v1_runner.pool.num_channels == 0


def test_v1_profile_without_the_peer_all_reduce_is_vllms_alone(v1_runner, monkeypatch):
    channel_pool = v1_runner.pool
    monkeypatch.setattr(v1_runner.tp.device_communicator, "specgraph_all_reduce", None)
    assert v1_runner.runner.profile_cudagraph_memory() == 7
    assert channel_pool.num_channels == 1, "nothing rolled back: the plugin stays out"


@pytest.mark.parametrize("dbo", [False, True])
def test_v1_profile_leaves_no_buffer_kept_for_its_graphs(
    v1_runner, install_patch, monkeypatch, dbo
):
    """A buffer a profiling capture viewed is kept when outgrown while that graph
    lives; vLLM's profile clears its graphs, so after it the buffer is freed on
    growth as vLLM frees it, and what was retired goes; not with micro-batching,
    whose graphs outlive the profile, nor after a profile that failed."""
    workspace = install_patch("vllm.v1.worker.workspace")
    saved = workspace._manager
    workspace.init_workspace_manager(torch.device("cpu"), None, 1)
    manager = workspace.current_workspace_manager()
    capturing = [False]
    monkeypatch.setattr(manager, "_is_capturing", lambda: capturing[0])
    manager.get_simultaneous(((1024,), torch.uint8))  # warm-up sizes it

    def capture():
        capturing[0] = True
        manager.get_simultaneous(((1024,), torch.uint8))  # the graph views it
        capturing[0] = False

    v1_runner.outcome["in_capture"] = capture
    v1_runner.runner.parallel_config.enable_dbo = dbo
    slot = manager._slots[(0, 0)]
    try:
        slot.retired.append(torch.empty(1))  # an earlier graph's, gone with the profile
        v1_runner.runner.profile_cudagraph_memory()
        manager.get_simultaneous(((8192,), torch.uint8))  # warm-up after the profile
        assert len(slot.retired) == (2 if dbo else 0)
        v1_runner.outcome["fail"] = True
        with pytest.raises(RuntimeError, match="profiling capture failed"):
            v1_runner.runner.profile_cudagraph_memory()
        manager.get_simultaneous(((16384,), torch.uint8))
        assert slot.retired, "a failed profile forgets no graph"
    finally:
        workspace._manager = saved
