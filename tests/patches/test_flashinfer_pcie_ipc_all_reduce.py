"""The FlashInfer PCIe IPC patch on vLLM 0.33.0's own communicator and warm-up, on the CPU.

vLLM's ``FlashInferPcieIpcAllReduce`` (constructor and ``setup``) and its
``warmup_flashinfer_pcie_ipc_allreduce`` run for real. Faked, because they need
GPUs, several ranks or a FlashInfer JIT build: FlashInfer's workspace class and
its size query (``_Workspace``, a layout of the same shape as FlashInfer
0.7.2.post1's), the four-rank TP group, the CUDA device, its free memory and
synchronise, and the autotune file location.
"""

import logging
import sys
from types import ModuleType, SimpleNamespace
from typing import ClassVar

import pytest
import torch
import torch.distributed as dist

pytestmark = pytest.mark.vllm

MIB = 1 << 20
_STAND_IN = "specgraph_tests_flashinfer_pcie_ipc_ar"


def _slab_bytes(world_size: int, max_numel: int, elem_size: int, max_blocks: int) -> int:
    payload = max_numel * elem_size
    return 4 * world_size * payload + 2 * payload + 64 * max_blocks


class _Workspace:
    """Stands in for flashinfer.comm.PcieIpcAllReduceWorkspace."""

    made: ClassVar[list] = []  # set per test by the fixture
    memory: ClassVar[dict] = {}

    def __init__(
        self, group, max_numel, dtype=torch.bfloat16, max_blocks=128, profile=None,
        tune_batches=None, tune_cache=None,
    ):  # fmt: skip
        elem_size = torch.empty((), dtype=dtype).element_size()
        self.args = (dist.get_world_size(group), max_numel, elem_size, max_blocks)
        self.memory["free"] -= _slab_bytes(*self.args)  # cudaMalloc, outside torch's allocator
        self.made.append(self)

    def rebind_stream(self):
        pass

    def tune(self, hiddens, dtype, tune_group):
        self.memory["free"] -= 4 * MIB  # probe tensors the caching allocator keeps
        self.memory["reserved"] += 4 * MIB

    def prepare(self, shapes, dtype):
        pass


_Workspace.__module__ = _STAND_IN


@pytest.fixture
def env(install_patch, monkeypatch, tmp_path):
    import vllm.distributed.parallel_state as parallel_state
    import vllm.model_executor.warmup.flashinfer_autotune_cache as autotune_cache
    import vllm.v1.worker.gpu.cudagraph_utils  # noqa: F401 (before the platform reads as CUDA)
    from vllm.distributed.device_communicators.cuda_communicator import CudaCommunicator
    from vllm.platforms import current_platform

    module = install_patch("vllm.distributed.device_communicators.flashinfer_pcie_ipc_all_reduce")
    stand_in = ModuleType(_STAND_IN)
    stand_in.get_pcie_ipc_comm_module = lambda: SimpleNamespace(workspace_size=_slab_bytes)
    monkeypatch.setitem(sys.modules, _STAND_IN, stand_in)
    monkeypatch.setattr(
        module, "flashinfer_comm", SimpleNamespace(PcieIpcAllReduceWorkspace=_Workspace)
    )
    monkeypatch.setattr(module, "_pcie_ipc_available", True)
    monkeypatch.setattr(module, "in_the_same_node_as", lambda group, source_rank: [True] * 4)
    monkeypatch.setattr(type(current_platform), "is_cuda", lambda self: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 4)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    memory = {"free": 1000 * MIB, "reserved": 0}
    monkeypatch.setattr(_Workspace, "made", [])
    monkeypatch.setattr(_Workspace, "memory", memory)
    for namespace, name, fn in [
        (torch.accelerator, "synchronize", lambda *args: None),
        (torch.cuda, "synchronize", lambda *args: None),
        (torch.cuda, "mem_get_info", lambda *args: (memory["free"], 2000 * MIB)),
        (torch.cuda, "memory_reserved", lambda *args: memory["reserved"]),
    ]:
        monkeypatch.setattr(namespace, name, fn)
    monkeypatch.setenv("VLLM_ALLREDUCE_USE_FLASHINFER_PCIE_IPC", "1")

    pcie = module.FlashInferPcieIpcAllReduce(group="nccl-tp", tune_group="gloo-tp", device="cpu")
    # A CudaCommunicator holding only the PCIe communicator: a full one needs a GPU group.
    communicator = CudaCommunicator.__new__(CudaCommunicator)
    communicator.fi_pcie_ipc_ar_comm = pcie
    tp_group = SimpleNamespace(device_communicator=communicator, ranks=[0, 1, 2, 3])
    monkeypatch.setattr(parallel_state, "get_tp_group", lambda: tp_group)
    monkeypatch.setattr(
        autotune_cache, "resolve_flashinfer_autotune_file", lambda runner: tmp_path / "tune.json"
    )
    vllm_config = SimpleNamespace(
        compilation_config=SimpleNamespace(cudagraph_capture_sizes=[1, 2, 4, 8, 512, 256]),
        model_config=SimpleNamespace(dtype=torch.bfloat16, get_hidden_size=lambda: 5120),
        parallel_config=SimpleNamespace(use_ubatching=False),
    )
    runner = SimpleNamespace(vllm_config=vllm_config)
    worker = SimpleNamespace(
        vllm_config=vllm_config, model_runner=runner, model_config=vllm_config.model_config
    )
    patch = sys.modules[
        "vllm_specgraph.patches.distributed.device_communicators.flashinfer_pcie_ipc_all_reduce"
    ]
    yield SimpleNamespace(
        module=module, patch=patch, pcie=pcie, tp_group=tp_group, runner=runner, worker=worker
    )


def _kernel_warmup_step(env) -> None:
    """The lines of vLLM's kernel_warmup that set the workspace up (after KV sizing)."""
    import vllm.envs as envs

    if envs.VLLM_ALLREDUCE_USE_FLASHINFER_PCIE_IPC:
        env.module.warmup_flashinfer_pcie_ipc_allreduce(env.worker)


def test_budget_is_flashinfer_size_of_the_workspace_vllm_then_makes(env):
    budget = env.patch.communicator_bytes_after_kv_cache(env.runner)
    _kernel_warmup_step(env)
    (made,) = _Workspace.made
    assert made.args == (4, 512 * 5120, 2, 128), "largest capture size x hidden, bf16"
    slab = _slab_bytes(*made.args)
    assert budget == -(-slab // (2 * MIB)) * (2 * MIB) and budget >= slab > 80 * MIB


def _backend_off(env, monkeypatch):
    monkeypatch.setenv("VLLM_ALLREDUCE_USE_FLASHINFER_PCIE_IPC", "0")


def _disabled(env, monkeypatch):
    env.pcie.disabled = True


def _already_made(env, monkeypatch):
    env.pcie.workspace = object()


def _ubatching(env, monkeypatch):
    env.runner.vllm_config.parallel_config.use_ubatching = True


def _no_capture_sizes(env, monkeypatch):
    env.runner.vllm_config.compilation_config.cudagraph_capture_sizes = []


def _float32_model(env, monkeypatch):
    env.runner.vllm_config.model_config.dtype = torch.float32


def _not_a_cuda_communicator(env, monkeypatch):
    env.tp_group.device_communicator = SimpleNamespace(fi_pcie_ipc_ar_comm=env.pcie)


@pytest.mark.parametrize(
    "case",
    [
        _backend_off,
        _disabled,
        _already_made,
        _ubatching,
        _no_capture_sizes,
        _float32_model,
        _not_a_cuda_communicator,
    ],
)
def test_budget_zero_when_vllm_makes_no_workspace_after_kv_sizing(env, monkeypatch, case):
    case(env, monkeypatch)
    assert env.patch.communicator_bytes_after_kv_cache(env.runner) == 0
    _kernel_warmup_step(env)
    assert _Workspace.made == []


def test_budget_without_flashinfer_size_function_raises_naming_the_fix(env, monkeypatch):
    monkeypatch.delattr(sys.modules[_STAND_IN], "get_pcie_ipc_comm_module")
    with pytest.raises(RuntimeError, match="VLLM_ALLREDUCE_USE_FLASHINFER_PCIE_IPC=0"):
        env.patch.communicator_bytes_after_kv_cache(env.runner)
    assert not hasattr(env.pcie, "_specgraph_budget_bytes")


def test_setup_logs_what_it_took_against_the_budget(env, caplog):
    budget = env.patch.communicator_bytes_after_kv_cache(env.runner)
    with caplog.at_level(logging.INFO, logger="vllm.specgraph"):
        _kernel_warmup_step(env)
    slab = _slab_bytes(*_Workspace.made[0].args)
    line = next(r.getMessage() for r in caplog.records if "set-up took" in r.getMessage())
    assert f"budgeted {budget / MIB:.1f} MiB" in line
    assert f"took {slab / MIB:.1f} MiB outside the caching allocator" in line
    assert "left 4.0 MiB cached" in line


def test_profile_budget_adds_the_workspace_to_the_graphs(env, install_patch, monkeypatch):
    from vllm.config.compilation import CUDAGraphMode

    from vllm_specgraph.meter import OwnerMemory
    from vllm_specgraph.profile import GraphMemoryReport

    cudagraph_utils = install_patch("vllm.v1.worker.gpu.cudagraph_utils")
    profile_patch = sys.modules["vllm_specgraph.patches.v1.worker.gpu.cudagraph_utils"]
    report = GraphMemoryReport(
        owners=(OwnerMemory("target", 4, 100 * MIB, 0),),
        one_time_bytes=6 * MIB,
        transient_peak_bytes=0,
        retained_bytes=0,
        retained_allocator_bytes=0,
        wall_seconds=1.0,
    )
    outcome = profile_patch.ProfileOutcome(
        report, {}, None, 1, True, None, kv_state_bytes=0, kv_state_kept_bytes=0
    )
    monkeypatch.setattr(profile_patch, "exact_cudagraph_memory", lambda runner: outcome)
    env.runner.compilation_config = SimpleNamespace(cudagraph_mode=CUDAGraphMode.FULL)
    workspace = env.patch.pcie_ipc_workspace_bytes(env.runner.vllm_config)
    budget = cudagraph_utils.profile_cudagraph_memory(env.runner)
    assert budget == profile_patch.budget_bytes(report) + workspace == 106 * MIB + workspace
