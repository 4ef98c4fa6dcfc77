"""The DCP workspace patch on vLLM 0.33.0's own factories and workspace classes, on the CPU.

vLLM's factories and ``DirectDCPA2AWorkspace`` / ``DirectDCPQGatherWorkspace`` /
``DirectDCPKVGatherWorkspace`` constructors run for real. Faked, because they
need GPUs and several ranks: the symmetric-memory allocation and rendezvous
(``symm_mem.empty`` gives a CPU tensor, the rendezvous handle maps "peers" to
CPU tensors and reports multicast), the multicast capability probe, the device
synchronise, and the DCP group (two ranks, this one rank 0).
"""

import gc
import weakref
from types import SimpleNamespace

import pytest
import torch

from vllm_specgraph.lanes import use_lane, use_owner

pytestmark = pytest.mark.vllm

_MULTICAST_BASE = 1 << 40


class _ProcessGroup:
    group_name = "dcp"

    def size(self) -> int:
        return 2

    def rank(self) -> int:
        return 0


class _GroupCoordinator:
    """Hashable by identity, as vLLM's GroupCoordinator is (the factories key on it)."""

    def __init__(self) -> None:
        self.device_group, self.world_size = _ProcessGroup(), 2


class _Handle:
    def __init__(self, storage: torch.Tensor) -> None:
        self.storage, self.multicast_ptr = storage, _MULTICAST_BASE

    def barrier(self) -> None:
        pass

    def get_buffer(self, peer, shape, dtype, storage_offset):
        return self.storage if peer == 0 else torch.empty(shape, dtype=dtype)


@pytest.fixture
def dcp(install_patch, monkeypatch):
    import vllm.v1.attention.ops.cp_common as cp_common
    from torch._C._distributed_c10d import _SymmetricMemory

    allocations = []

    def empty(shape, device=None, dtype=None):
        allocations.append(shape)
        return torch.empty(shape, dtype=dtype)

    fake_symm_mem = SimpleNamespace(empty=empty, rendezvous=lambda storage, name: _Handle(storage))
    monkeypatch.setattr(cp_common, "symm_mem", fake_symm_mem)
    monkeypatch.setattr(_SymmetricMemory, "has_multicast_support", lambda *args: True)
    monkeypatch.setattr(torch.accelerator, "synchronize", lambda *args: None)
    monkeypatch.setattr(torch.accelerator, "current_device_index", lambda: 0)
    for name in ("A2A", "Q_GATHER", "KV_GATHER"):
        monkeypatch.setenv(f"VLLM_USE_DIRECT_DCP_{name}", "1")
    module = install_patch("vllm.v1.attention.ops.dcp")
    yield SimpleNamespace(module=module, group=_GroupCoordinator(), allocations=allocations)


_CALLS = {
    "get_direct_dcp_a2a_workspace": (8, 2, 16, torch.bfloat16, 1),
    "get_direct_dcp_q_gather_workspace": (8, 2, 16, torch.bfloat16, 1),
    "get_direct_dcp_kv_gather_workspace": (8, 16, torch.bfloat16, 1),
}


def _ask(dcp, factory: str):
    return getattr(dcp.module, factory)(dcp.group, torch.device("cpu"), *_CALLS[factory])


@pytest.mark.parametrize("factory", list(_CALLS))
def test_factory_one_workspace_per_lane_the_same_within_a_lane(dcp, factory):
    with use_owner("target"):
        target = _ask(dcp, factory)
        assert _ask(dcp, factory) is target
    with use_lane(1):
        draft = _ask(dcp, factory)
        assert _ask(dcp, factory) is draft
    assert draft is not target and draft.epoch.data_ptr() != target.epoch.data_ptr()
    assert type(draft).__name__.startswith("DirectDCP")
    assert _ask(dcp, factory) is target, "lane 0 is the default owner's"


@pytest.mark.parametrize("factory", list(_CALLS))
def test_factory_workspaces_made_in_disposable_pass_are_let_go_with_it(
    dcp, factory, disposable_pass
):
    kept = _ask(dcp, factory)  # made before the profile, as layers make theirs
    with disposable_pass():
        assert _ask(dcp, factory) is kept
        with use_lane(1):
            profiling = weakref.ref(_ask(dcp, factory))
        assert getattr(dcp.module, factory).num_workspaces == 2
    gc.collect()
    assert profiling() is None, "nothing holds the profile's workspace after the pass"
    assert getattr(dcp.module, factory).num_workspaces == 1
    assert _ask(dcp, factory) is kept
    with use_lane(1):
        assert _ask(dcp, factory) is not None, "production makes the draft's own again"


def test_factory_making_a_workspace_during_capture_refused(dcp, monkeypatch):
    target = _ask(dcp, "get_direct_dcp_a2a_workspace")
    made = len(dcp.allocations)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert _ask(dcp, "get_direct_dcp_a2a_workspace") is target, "an existing one is fine"
    with use_lane(1), pytest.raises(RuntimeError, match="lane 1 does not have yet"):
        _ask(dcp, "get_direct_dcp_a2a_workspace")
    assert len(dcp.allocations) == made
    assert dcp.module.get_direct_dcp_a2a_workspace.num_workspaces == 1


def test_factory_failing_construction_leaves_nothing_held(dcp):
    factory = dcp.module.get_direct_dcp_a2a_workspace
    with pytest.raises(ValueError, match=r"does not support torch\.float32"):
        factory(dcp.group, torch.device("cpu"), 8, 2, 16, torch.float32, 1)
    assert factory.num_workspaces == 0


def test_factory_owner_without_a_lane_refused_naming_the_fix(dcp):
    with use_owner("encoder"), pytest.raises(RuntimeError, match="'encoder' has no lane"):
        _ask(dcp, "get_direct_dcp_a2a_workspace")


@pytest.mark.parametrize("factory", list(_CALLS))
def test_factory_cache_clear_forgets_every_lane_as_functools_cache_does(dcp, factory):
    """vLLM's factories are ``functools.cache``'d, and its own tests reset them with
    ``cache_clear()``: the lane-owned factory keeps that interface."""
    with use_owner("target"):
        target = _ask(dcp, factory)
    with use_lane(1):
        draft = _ask(dcp, factory)
    getattr(dcp.module, factory).cache_clear()
    assert getattr(dcp.module, factory).num_workspaces == 0
    with use_owner("target"):
        assert _ask(dcp, factory) is not target
    with use_lane(1):
        assert _ask(dcp, factory) is not draft
