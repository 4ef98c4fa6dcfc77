"""The CustomAllreduce patch on vLLM 0.33.0's own communicator class, on the CPU.

vLLM's ``CustomAllreduce`` code runs for real: ``capture()``, ``custom_all_reduce``,
``all_reduce``, ``register_graph_buffers`` with its broadcast. Faked, because they
need GPUs and several ranks:

* ``_CompiledCustomAr`` stands in for the compiled ``_C_custom_ar`` ops this CPU
  build lacks, with the behaviour of the 0.33.0 binary: a launch on a capturing
  stream appends the address it reads to a pending list and takes the next
  ``rank_data`` slot; registration exports the pending addresses, opens each
  peer's, fills that many slots and clears the list. It records every registration.
* ``_PeerRank`` stands in for rank 1 of a two-rank gloo group: it answers the
  broadcast with as many buffers as this rank registers (it captured the same
  graph) and the capture-kind check with its own kind.
* The capturing stream is a flag (``torch.cuda.is_current_stream_capturing``).

The collective check itself runs on two real gloo processes at the end.
"""

import datetime
from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from vllm_specgraph.lanes import use_lane, use_owner

pytestmark = pytest.mark.vllm

_WORLD_SIZE = 2


class _CompiledCustomAr:
    def __init__(self) -> None:
        self.rank = 0
        self.slots_used = 0
        self.buffers: dict[int, int] = {}
        self.pending: list[int] = []
        self.opened_peer_handles = 0
        self.registrations: list[tuple[object, int]] = []
        self.launches = 0

    def init_custom_ar(self, ipc_tensors, rank_data, rank, fully_connected) -> int:
        self.rank = rank
        return 1

    def register_buffer(self, fa, ipc_ptrs) -> None:
        self.buffers[ipc_ptrs[self.rank]] = self.slots_used
        self.slots_used += 1

    def all_reduce(self, fa, inp, out, reg_buffer, reg_buffer_sz_bytes) -> None:
        self.launches += 1
        address = reg_buffer or inp.data_ptr()
        if torch.cuda.is_current_stream_capturing():
            self.pending.append(address)
        elif address not in self.buffers:
            raise RuntimeError(f"buffer address {address} is not registered!")
        out.copy_(inp)

    def get_graph_buffer_ipc_meta(self, fa) -> tuple[list[int], list[int]]:
        return list(self.pending), [0] * len(self.pending)

    def register_graph_buffers(self, fa, handles, offsets) -> None:
        from vllm_specgraph.lanes import current_owner

        if any(len(rank_handles) != len(self.pending) for rank_handles in handles):
            raise IndexError("ranks registered different numbers of buffers")
        self.registrations.append((current_owner(), len(self.pending)))
        self.slots_used += len(self.pending)
        self.opened_peer_handles += len(self.pending) * (len(handles) - 1)
        self.pending.clear()

    def dispose(self, fa) -> None:
        pass

    def free_shared_buffer(self, ptr) -> None:
        pass

    def state(self) -> tuple:
        return (self.slots_used, tuple(self.pending), self.opened_peer_handles)


class _PeerRank:
    def __init__(self, compiled: _CompiledCustomAr) -> None:
        self.compiled = compiled
        self.disposable: bool | None = None  # None: the peer's capture is of this rank's kind

    def broadcast_object_list(self, objects, src, group=None, device=None) -> None:
        if src != 0:
            objects[:] = [[7] * len(self.compiled.pending), [0] * len(self.compiled.pending)]

    def all_reduce(self, tensor, op=None, group=None) -> None:
        if self.disposable is not None:
            peer = torch.tensor([int(self.disposable), -int(self.disposable)])
            tensor.copy_(torch.maximum(tensor, peer))


@pytest.fixture
def env(install_patch, monkeypatch):
    module = install_patch("vllm.distributed.device_communicators.custom_all_reduce")
    compiled = _CompiledCustomAr()
    peer = _PeerRank(compiled)
    monkeypatch.setattr(module, "ops", compiled)
    for name, fn in {
        "get_world_size": lambda group=None: _WORLD_SIZE,
        "get_process_group_ranks": lambda group: list(range(_WORLD_SIZE)),
        "broadcast_object_list": peer.broadcast_object_list,
        "all_reduce": peer.all_reduce,
    }.items():
        monkeypatch.setattr(dist, name, fn)
    capturing = {"on": False}
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing["on"])
    # vLLM's __init__ stops before its compiled set-up on a build without the
    # library (custom_ar False); the lines below finish it as vLLM does.
    comm = module.CustomAllreduce(group="gloo-tp", device="cpu")
    staging = torch.empty(8 << 20, dtype=torch.uint8)  # stands for the IPC buffer
    comm.group, comm.rank, comm.world_size = "gloo-tp", 0, _WORLD_SIZE
    comm.device, comm.fully_connected, comm.max_size = torch.device("cpu"), True, 8 << 20
    comm.meta_ptrs, comm.buffer_ptrs = [0, 0], [staging.data_ptr(), 1 << 40]
    comm._ptr = compiled.init_custom_ar(comm.meta_ptrs, torch.empty(0), 0, True)
    compiled.register_buffer(comm._ptr, comm.buffer_ptrs)
    comm.disabled = False

    @contextmanager
    def captured_graph():
        """What CudaGraphManager.capture does around one graph, as seen by the communicator."""
        torch.empty_like(comm.custom_all_reduce(torch.ones(64)))  # eager warm-up
        capturing["on"] = True
        try:
            yield
        finally:
            capturing["on"] = False

    yield SimpleNamespace(comm=comm, compiled=compiled, peer=peer, captured_graph=captured_graph)
    comm.disabled = True  # vLLM's __del__ would dispose through the real (absent) ops


def _capture_two_all_reduces(env) -> list[torch.Tensor]:
    outputs = []
    with env.comm.capture():
        for _ in range(2):
            with env.captured_graph():
                outputs.append(env.comm.custom_all_reduce(torch.full((64,), 3.0)))
    return outputs


def test_production_target_and_draft_captures_each_register_their_own_buffers(env):
    with use_owner("target"):
        _capture_two_all_reduces(env)
    with use_lane(1):
        _capture_two_all_reduces(env)
    assert env.compiled.registrations == [("target", 2), (1, 2)]
    assert env.compiled.launches == 4
    assert env.compiled.state() == (1 + 4, (), 4), "init buffer + 4 graph slots, 1 peer each"


def test_profile_capture_registers_nothing_and_leaves_no_state(env, disposable_pass):
    before = env.compiled.state()
    with disposable_pass(), use_owner("target"):
        outputs = _capture_two_all_reduces(env)
        with use_lane(1):
            _capture_two_all_reduces(env)
    assert env.compiled.launches == 0, "no compiled all-reduce entered a profiling graph"
    assert all(count == 0 for _, count in env.compiled.registrations)
    assert env.compiled.state() == before, "no slot taken, nothing pending, no peer handle opened"
    assert [(o.shape, o.dtype) for o in outputs] == [((64,), torch.float32)] * 2
    assert not env.comm._specgraph_disposable_capture, "the next capture is production again"


def test_production_capture_after_profile_registers_only_its_own_buffers(env, disposable_pass):
    with disposable_pass():
        _capture_two_all_reduces(env)
    _capture_two_all_reduces(env)
    # Had the profile's launches stayed pending, this registration would export them too.
    assert env.compiled.registrations[-1] == ("target", 2)
    assert env.compiled.state() == (1 + 2, (), 2)


def test_exception_inside_profile_capture_leaves_registration_state_as_it_was(env, disposable_pass):
    before = env.compiled.state()
    with (
        pytest.raises(KeyError, match="draft capture failed"),
        disposable_pass(),
        env.comm.capture(),
        env.captured_graph(),
    ):
        env.comm.custom_all_reduce(torch.ones(64))
        raise KeyError("draft capture failed")
    assert env.compiled.state() == before
    assert env.compiled.launches == 0
    assert not env.comm._IS_CAPTURING
    assert not getattr(env.comm, "_specgraph_disposable_capture", False)


def test_ranks_disagreeing_on_capture_kind_refused_before_anything_is_captured(
    env, disposable_pass
):
    before = env.compiled.state()
    env.peer.disposable = False  # rank 1 is already in its production capture
    with (
        disposable_pass(),
        pytest.raises(RuntimeError, match="disposable profiling capture, another rank"),
        env.comm.capture(),
    ):
        pytest.fail("the capture block must not run")
    env.peer.disposable = True
    with (
        pytest.raises(RuntimeError, match="a production capture, another rank"),
        env.comm.capture(),
    ):
        pytest.fail("the capture block must not run")
    assert env.compiled.state() == before and env.compiled.registrations == []
    assert not env.comm._IS_CAPTURING
    assert not getattr(env.comm, "_specgraph_disposable_capture", False)


def test_eager_all_reduce_during_profile_still_runs_the_compiled_op(env, disposable_pass):
    with disposable_pass():
        out = env.comm.custom_all_reduce(torch.full((64,), 2.0))
    assert env.compiled.launches == 1 and torch.equal(out, torch.full((64,), 2.0))


def _gloo_worker(rank: int, store_path: str, result_dir: str) -> None:
    from pathlib import Path

    from vllm_specgraph.patches.distributed.device_communicators.custom_all_reduce import (
        check_same_capture_kind,
    )

    dist.init_process_group(
        "gloo",
        init_method=f"file://{store_path}",
        rank=rank,
        world_size=_WORLD_SIZE,
        timeout=datetime.timedelta(seconds=30),
    )
    outcomes = []
    try:
        for kinds in ((True, True), (False, False), (True, False)):
            try:
                check_same_capture_kind(dist.group.WORLD, kinds[rank])
                outcomes.append("ok")
            except RuntimeError:
                outcomes.append("refused")
    finally:
        dist.destroy_process_group()
    (Path(result_dir) / f"rank{rank}").write_text(" ".join(outcomes))


@pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()),
    reason="torch.distributed with the gloo backend is not available in this torch build",
)
def test_check_same_capture_kind_two_gloo_ranks_agree_or_both_refuse(tmp_path):
    mp.spawn(
        _gloo_worker,
        args=(str(tmp_path / "store"), str(tmp_path)),
        nprocs=_WORLD_SIZE,
        join=True,
    )
    for rank in range(_WORLD_SIZE):
        assert (tmp_path / f"rank{rank}").read_text() == "ok ok refused"
