"""The peer all-reduce in vLLM 0.33.0's ``CudaCommunicator``, on the CPU.

vLLM's own ``_log_all_reduce_backend_selection`` and ``all_reduce`` run for real.
Faked, because they need GPUs and several ranks: the communicator is built with
``__new__`` and given the attributes vLLM's ``__init__`` sets (its backends are
``None`` or stand-ins with a ``disabled`` flag), its group is one gloo rank, the
peer all-reduce's channels are CPU tensors and its symmetric-memory kernels a
copy (one rank's sum is its own input).
"""

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from gloo_group import init_gloo_group

import vllm_specgraph.allreduce as allreduce_module
from vllm_specgraph.allreduce import PeerAllReduce
from vllm_specgraph.device_channel import device_channel_factory

pytestmark = pytest.mark.vllm

BF16 = torch.bfloat16


class _LineRecorder:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def info_once(self, message, *args, **kwargs) -> None:
        self.lines.append(message % args)


@pytest.fixture
def env(install_patch, monkeypatch):
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    module = install_patch("vllm.distributed.device_communicators.cuda_communicator")
    from vllm_specgraph.patches.distributed.device_communicators import cuda_communicator

    made: list[PeerAllReduce] = []

    def peer_on_cpu(group, device):
        assert device.type == "cuda", "vLLM's communicator device is handed on"
        made.append(
            PeerAllReduce(group, "cpu", create_channel=device_channel_factory(1 << 20, "cpu"))
        )
        return made[-1]

    monkeypatch.setattr(cuda_communicator, "PeerAllReduce", peer_on_cpu)
    kernel_calls: list[int] = []

    def copy_kernel(algorithm, staged, group_name, out):
        kernel_calls.append(staged.data_ptr())
        out.copy_(staged)

    monkeypatch.setattr(allreduce_module, "_run_symm_mem_op", copy_kernel)
    # Two GPUs on one node with peer access, as on the machine the GPU runs use; the
    # group's ranks sit on GPUs 0 and 1 of the four this rank sees, and GPU 3 is out
    # of this GPU's reach. GPUs are named by UUID across processes.
    topology = SimpleNamespace(
        same_node=True, peer_access=True, group_devices=[0, 1], reachable={0, 1, 2}
    )
    import vllm.distributed.parallel_state as parallel_state

    from vllm_specgraph.patches.distributed.device_communicators import cuda_communicator as patch

    monkeypatch.setattr(
        patch, "_group_gpus", lambda group, mine: [f"GPU-{d}" for d in topology.group_devices]
    )
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda index: SimpleNamespace(uuid=f"GPU-{index}")
    )
    monkeypatch.setattr(parallel_state, "_ENABLE_CUSTOM_ALL_REDUCE", True)

    monkeypatch.setattr(
        parallel_state, "in_the_same_node_as", lambda pg, source_rank=0: [topology.same_node]
    )
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(
        torch.cuda,
        "can_device_access_peer",
        lambda a, b: topology.peer_access and b in topology.reachable,
    )
    recorder = _LineRecorder()
    monkeypatch.setattr(module, "logger", recorder)
    monkeypatch.delenv("VLLM_SPECGRAPH_ALLREDUCE", raising=False)
    yield SimpleNamespace(
        module=module,
        made=made,
        kernel_calls=kernel_calls,
        lines=recorder.lines,
        topology=topology,
    )
    dist.destroy_process_group()


def _communicator(module, unique_name="tp:0", **backends):
    communicator = module.CudaCommunicator.__new__(module.CudaCommunicator)
    for name in (
        "fi_pcie_ipc_ar_comm",
        "fi_ar_comm",
        "qr_comm",
        "aiter_ar_comm",
        "ca_comm",
        "symm_mem_comm",
        "pynccl_comm",
    ):
        setattr(communicator, name, backends.get(name))
    communicator.use_aiter_allreduce = False
    communicator.world_size = 2  # as vLLM sees the group; the test's gloo group has one rank
    communicator.unique_name = unique_name
    communicator.device = torch.device("cuda", 0)
    communicator.device_group = communicator.cpu_group = dist.group.WORLD
    communicator._log_all_reduce_backend_selection()
    return communicator


def test_auto_without_a_vllm_fast_path_puts_the_peer_all_reduce_first_in_vllms_line(env):
    communicator = _communicator(env.module)
    assert communicator.specgraph_all_reduce is env.made[0]
    [line] = env.lines
    assert "Using ['SPECGRAPH_P2P'] all-reduce backends" in line
    assert "potential backends: ['SPECGRAPH_P2P', 'FLASHINFER_PCIE_IPC'" in line
    assert env.module.logger.__class__ is _LineRecorder, "vLLM's logger is back"


@pytest.mark.parametrize("fast_path", ["ca_comm", "fi_ar_comm", "symm_mem_comm", "qr_comm"])
def test_auto_leaves_a_group_with_a_vllm_fast_path_as_vllm_made_it(env, fast_path):
    communicator = _communicator(env.module, **{fast_path: SimpleNamespace(disabled=False)})
    assert communicator.specgraph_all_reduce is None and env.made == []
    assert "SPECGRAPH_P2P" not in env.lines[0]


def test_auto_counts_a_disabled_vllm_backend_as_absent(env):
    communicator = _communicator(env.module, ca_comm=SimpleNamespace(disabled=True))
    assert communicator.specgraph_all_reduce is not None


def test_mode_1_puts_it_ahead_of_vllms_fast_paths(env, monkeypatch):
    monkeypatch.setenv("VLLM_SPECGRAPH_ALLREDUCE", "1")
    communicator = _communicator(env.module, ca_comm=SimpleNamespace(disabled=False))
    assert communicator.specgraph_all_reduce is not None
    assert "Using ['SPECGRAPH_P2P', 'CUSTOM'] all-reduce backends" in env.lines[0]


def test_mode_0_and_groups_other_than_tp_never_get_it(env, monkeypatch):
    assert _communicator(env.module, unique_name="pp:0").specgraph_all_reduce is None
    monkeypatch.setenv("VLLM_SPECGRAPH_ALLREDUCE", "0")
    assert _communicator(env.module).specgraph_all_reduce is None
    assert env.made == []


@pytest.mark.parametrize("missing", ["same_node", "peer_access"])
def test_auto_keeps_vllms_all_reduce_where_peers_are_out_of_reach(env, missing, caplog):
    setattr(env.topology, missing, False)
    with caplog.at_level("INFO", logger="vllm.specgraph"):
        communicator = _communicator(env.module)
    assert communicator.specgraph_all_reduce is None and env.made == []
    assert "SPECGRAPH_P2P" not in env.lines[0]
    assert any("keeps vLLM's all-reduce" in r.message for r in caplog.records)


def test_mode_1_where_peers_are_out_of_reach_names_the_fix(env, monkeypatch):
    monkeypatch.setenv("VLLM_SPECGRAPH_ALLREDUCE", "1")
    env.topology.peer_access = False
    with pytest.raises(RuntimeError, match="set VLLM_SPECGRAPH_ALLREDUCE=auto"):
        _communicator(env.module)
    assert env.made == []


def test_bad_mode_names_the_variable_the_value_and_the_choices(env, monkeypatch):
    monkeypatch.setenv("VLLM_SPECGRAPH_ALLREDUCE", "yes")
    with pytest.raises(ValueError, match=r"VLLM_SPECGRAPH_ALLREDUCE='yes'.*'auto'.*'on'"):
        _communicator(env.module)
    assert env.made == []


def test_captures_send_what_the_peer_all_reduce_takes_to_it_the_rest_to_vllm(env, monkeypatch):
    communicator = _communicator(env.module)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    capturing = [False]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    x = torch.randn(8, 16, dtype=BF16)
    ints = torch.arange(6)
    big = torch.randn(1 << 20, dtype=BF16)  # 2 MiB, above the test's 1 MiB channel
    with communicator.specgraph_all_reduce.channel_pool.capture(owner="target"):
        capturing[0] = True
        assert torch.equal(communicator.all_reduce(x), x)
        assert len(env.kernel_calls) == 1, "bf16 within the channel: the peer kernels"
        assert torch.equal(communicator.all_reduce(ints), ints)  # vLLM's chain
        assert torch.equal(communicator.all_reduce(big), big)
        capturing[0] = False
    assert len(env.kernel_calls) == 1


def test_eager_all_reduces_take_vllms_chain_quietly_and_make_no_channel(env, caplog):
    communicator = _communicator(env.module)
    x = torch.randn(8, 16, dtype=BF16)
    with caplog.at_level("WARNING", logger="vllm.specgraph"):
        assert torch.equal(communicator.all_reduce(x), x)
    assert caplog.records == []
    assert env.kernel_calls == []
    assert communicator.specgraph_all_reduce.channel_pool.num_channels == 0


def test_a_graph_captured_outside_graph_capture_uses_vllms_all_reduce(env, monkeypatch, caplog):
    communicator = _communicator(env.module)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    capturing = [True]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    x = torch.randn(4, 4, dtype=BF16)
    with caplog.at_level("WARNING", logger="vllm.specgraph"):
        communicator.all_reduce(x)
        communicator.all_reduce(x)
    assert env.kernel_calls == []
    assert communicator.specgraph_all_reduce.channel_pool.num_channels == 0
    assert [r.message.count("outside GroupCoordinator.graph_capture") for r in caplog.records] == [
        1
    ]
    capturing[0] = False  # the channel is bound before the capture begins
    with communicator.specgraph_all_reduce.channel_pool.capture(owner="target") as channel:
        capturing[0] = True
        communicator.all_reduce(x)
    start = channel.buffer.data_ptr()
    assert start <= env.kernel_calls[0] < start + channel.buffer.numel()


def test_communicator_without_the_patchs_attribute_keeps_vllms_all_reduce(env):
    # A communicator of a group with one rank never runs the selection step.
    module = env.module
    communicator = module.CudaCommunicator.__new__(module.CudaCommunicator)
    for name in ("fi_ar_comm", "qr_comm", "fi_pcie_ipc_ar_comm", "aiter_ar_comm", "ca_comm"):
        setattr(communicator, name, None)
    communicator.symm_mem_comm = communicator.pynccl_comm = None
    communicator.use_aiter_allreduce = False
    communicator.device_group = dist.group.WORLD
    x = torch.randn(3, dtype=BF16)
    assert torch.equal(communicator.all_reduce(x), x)
    assert env.kernel_calls == []


def _vote_worker(rank: int, store_path: str, result_dir: str) -> None:
    from pathlib import Path

    import vllm.distributed.parallel_state as parallel_state

    from vllm_specgraph.patches.distributed.device_communicators.cuda_communicator import (
        _peers_reachable,
    )

    # Two GPUs on one node; rank 1's GPU sees no peer access (faked: no GPU here).
    parallel_state.in_the_same_node_as = lambda pg, source_rank=0: [True, True]
    torch.cuda.current_device = lambda: rank
    torch.cuda.device_count = lambda: 2
    torch.cuda.can_device_access_peer = lambda this, other: rank == 0
    torch.cuda.get_device_properties = lambda index: SimpleNamespace(uuid=f"GPU-{index}")
    init_gloo_group(rank, store_path, 2)
    try:
        (Path(result_dir) / f"rank{rank}").write_text(str(_peers_reachable(dist.group.WORLD)))
    finally:
        dist.destroy_process_group()


def test_reachability_is_a_vote_one_rank_without_peer_access_turns_it_off_on_both(tmp_path):
    """Two real gloo ranks: their GPUs are gathered by UUID and the verdicts voted."""
    import torch.multiprocessing as mp

    mp.spawn(_vote_worker, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=2, join=True)
    assert [(tmp_path / f"rank{r}").read_text() for r in range(2)] == ["False", "False"]


def test_auto_respects_a_user_who_disabled_custom_all_reduce(env, monkeypatch, caplog):
    import vllm.distributed.parallel_state as parallel_state

    monkeypatch.setattr(parallel_state, "_ENABLE_CUSTOM_ALL_REDUCE", False)
    with caplog.at_level("INFO", logger="vllm.specgraph"):
        assert _communicator(env.module).specgraph_all_reduce is None
    assert any("custom all-reduce is disabled" in r.message for r in caplog.records)
    monkeypatch.setenv("VLLM_SPECGRAPH_ALLREDUCE", "1")  # asked for by name: taken
    assert _communicator(env.module).specgraph_all_reduce is not None


def test_auto_counts_vllms_nccl_symmetric_memory_as_a_fast_path(env, monkeypatch):
    from vllm.distributed.device_communicators import pynccl_allocator

    monkeypatch.setattr(pynccl_allocator, "is_symmetric_memory_enabled", lambda: True)
    monkeypatch.setattr(env.module, "is_symmetric_memory_enabled", lambda: True, raising=False)
    communicator = env.module.CudaCommunicator.__new__(env.module.CudaCommunicator)
    for name in ("fi_pcie_ipc_ar_comm", "fi_ar_comm", "qr_comm", "aiter_ar_comm", "ca_comm"):
        setattr(communicator, name, None)
    communicator.symm_mem_comm = None
    communicator.pynccl_comm = SimpleNamespace(disabled=False)
    communicator.use_aiter_allreduce = False
    communicator.world_size = 4
    communicator.unique_name = "tp:0"
    communicator.device = torch.device("cuda", 0)
    communicator.device_group = communicator.cpu_group = dist.group.WORLD
    communicator._log_all_reduce_backend_selection()
    assert "'NCCL_SYMM_MEM'" in env.lines[0]
    assert communicator.specgraph_all_reduce is None and env.made == []


def test_batch_invariant_keeps_vllms_all_reduce_in_every_mode(env, monkeypatch):
    from vllm import envs

    monkeypatch.setattr(envs, "VLLM_BATCH_INVARIANT", True, raising=False)
    for mode in ("auto", "1"):
        monkeypatch.setenv("VLLM_SPECGRAPH_ALLREDUCE", mode)
        assert _communicator(env.module).specgraph_all_reduce is None
    assert env.made == []


def test_elastic_ep_keeps_vllms_all_reduce_and_mode_1_names_the_fix(env, monkeypatch, caplog):
    """Elastic EP re-captures after releasing graphs, and vLLM's release leaves some
    alive: the channels of the dropped ones could not be told apart, so none is made.
    The current config is a stand-in (a VllmConfig needs a GPU platform to build);
    vLLM's own ParallelConfig field is read."""
    import vllm.config
    from vllm.config import ParallelConfig

    parallel = ParallelConfig()
    assert parallel.enable_elastic_ep is False, "vLLM's default"
    config = SimpleNamespace(parallel_config=parallel)
    monkeypatch.setattr(vllm.config, "get_current_vllm_config_or_none", lambda: config)
    assert _communicator(env.module).specgraph_all_reduce is not None
    parallel.enable_elastic_ep = True
    with caplog.at_level("INFO", logger="vllm.specgraph"):
        assert _communicator(env.module).specgraph_all_reduce is None
    assert any("elastic EP re-captures graphs" in r.message for r in caplog.records)
    monkeypatch.setenv("VLLM_SPECGRAPH_ALLREDUCE", "1")
    with pytest.raises(RuntimeError, match=r"with elastic EP .* set VLLM_SPECGRAPH_ALLREDUCE="):
        _communicator(env.module)
    assert len(env.made) == 1, "only the run without elastic EP made one"


def test_peer_access_is_checked_to_the_groups_own_gpus(env):
    env.topology.group_devices = [0, 1]  # GPU 3, out of reach, is not the group's
    assert _communicator(env.module).specgraph_all_reduce is not None
    env.topology.group_devices = [0, 3]
    assert _communicator(env.module).specgraph_all_reduce is None
    env.topology.group_devices = [0, 7]  # a GPU this process does not see at all
    assert _communicator(env.module).specgraph_all_reduce is None
