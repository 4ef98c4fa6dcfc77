"""The V1 runner's graph-memory profile leaves no peer all-reduce channel behind.

vLLM 0.33.0's ``gpu_model_runner`` module and its patch run for real; vLLM's own
``profile_cudagraph_memory`` is a stand-in that captures inside
``GroupCoordinator.graph_capture`` as vLLM's does (it needs a GPU and a model),
and the TP group's peer all-reduce is one gloo rank with CPU channels.
"""

from types import SimpleNamespace

import pytest
import torch.distributed as dist

from vllm_specgraph.allreduce import PeerAllReduce
from vllm_specgraph.device_channel import device_channel_factory

pytestmark = pytest.mark.vllm


@pytest.fixture
def v1_runner(install_patch, monkeypatch):
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    import vllm.distributed.parallel_state as parallel_state
    import vllm.v1.worker.gpu_model_runner as gpu_model_runner

    peer = PeerAllReduce(
        dist.group.WORLD, "cpu", create_channel=device_channel_factory(1 << 10, "cpu")
    )
    tp = SimpleNamespace(device_communicator=SimpleNamespace(specgraph_all_reduce=peer))
    monkeypatch.setattr(parallel_state, "_TP", tp)
    outcome = {"fail": False, "channels_during": None}

    def vllm_profile(self):
        with peer.channel_pool.capture(owner="target"):  # what graph_capture binds
            outcome["channels_during"] = peer.channel_pool.num_channels
        if outcome["fail"]:
            raise RuntimeError("profiling capture failed")
        return 7

    monkeypatch.setattr(gpu_model_runner.GPUModelRunner, "profile_cudagraph_memory", vllm_profile)
    install_patch("vllm.v1.worker.gpu_model_runner")
    runner = gpu_model_runner.GPUModelRunner.__new__(gpu_model_runner.GPUModelRunner)
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
