"""A channel per capture through vLLM 0.33.0's ``GroupCoordinator.graph_capture``, on the CPU.

vLLM's ``graph_capture`` runs for real. Faked, because they need a GPU and
several ranks: the coordinator and its ``CudaCommunicator`` are built with
``__new__`` (no process groups), the CUDA streams are stand-ins, the peer
all-reduce is one gloo rank with CPU channels, and the communicator's custom
all-reduce is a recorder of its ``capture()`` context.
"""

from contextlib import contextmanager, nullcontext
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from vllm_specgraph.allreduce import PeerAllReduce
from vllm_specgraph.device_channel import device_channel_factory
from vllm_specgraph.lanes import use_lane

pytestmark = pytest.mark.vllm


class _Stream:
    def wait_stream(self, other) -> None:
        pass


@pytest.fixture
def env(install_patch, monkeypatch):
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    parallel_state = install_patch("vllm.distributed.parallel_state")
    from vllm.distributed.device_communicators.cuda_communicator import CudaCommunicator

    events: list = []
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: _Stream())
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: nullcontext())

    def create_channel(channel_id, owner):
        events.append(("channel", owner))
        return device_channel_factory(1 << 10, "cpu")(channel_id, owner)

    @contextmanager
    def custom_all_reduce_capture():
        events.append(("custom_all_reduce_capture",))
        yield

    communicator = CudaCommunicator.__new__(CudaCommunicator)
    communicator.ca_comm = SimpleNamespace(capture=custom_all_reduce_capture)
    communicator.fi_pcie_ipc_ar_comm = communicator.aiter_ar_comm = None
    communicator.specgraph_all_reduce = PeerAllReduce(
        dist.group.WORLD, "cpu", create_channel=create_channel
    )
    group = parallel_state.GroupCoordinator.__new__(parallel_state.GroupCoordinator)
    group.device_communicator = communicator
    context = parallel_state.GraphCaptureContext(_Stream())
    yield SimpleNamespace(
        group=group,
        context=context,
        events=events,
        channel_pool=communicator.specgraph_all_reduce.channel_pool,
    )
    dist.destroy_process_group()


def test_each_capture_binds_its_own_channel_owned_by_its_lane(env):
    seen = []
    with env.group.graph_capture(env.context) as context:
        assert context is env.context
        seen.append(env.channel_pool.current())
    with use_lane(1), env.group.graph_capture(env.context):
        seen.append(env.channel_pool.current())
    assert [c.owner for c in seen] == ["target", "draft"]
    assert seen[0] is not seen[1]
    assert not env.channel_pool.in_capture()


def test_the_channel_is_made_before_vllms_capture_contexts_are_entered(env):
    with env.group.graph_capture(env.context):
        pass
    assert env.events == [("channel", "target"), ("custom_all_reduce_capture",)]


def test_an_error_in_the_capture_unbinds_the_channel(env):
    with pytest.raises(KeyError), env.group.graph_capture(env.context):
        raise KeyError("capture failed")
    assert not env.channel_pool.in_capture()
    env.channel_pool.checkpoint()  # refuses while a capture is still counted


def test_a_group_without_the_peer_all_reduce_captures_as_vllm_does(env):
    env.group.device_communicator.specgraph_all_reduce = None
    with env.group.graph_capture(env.context) as context:
        assert context is env.context
    assert env.events == [("custom_all_reduce_capture",)]
