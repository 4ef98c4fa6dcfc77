"""PeerAllReduce on two GPUs: sums equal NCCL's bit for bit, captures get their own channels,
and rolled-back channels give their memory back to the driver.

Each test spawns two ranks (NCCL backend, one GPU each) with NVLink multicast off
(NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1), as on the machines it runs on.

Why bit-exact: with two ranks every output element is one addition a + b, and IEEE addition
is commutative and correctly rounded, so NCCL and the symmetric-memory kernels must agree on
every bit, in fp32 and in bf16 (bf16 sums computed in fp32 and rounded once, or natively,
give the same bf16). Inputs are standard normal, so no sum is subnormal.
"""

from __future__ import annotations

import datetime
import gc
import os
import time
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from vllm_specgraph.allreduce import (
    SYMM_MEM_DTYPES,
    Algorithm,
    AllReduceConfig,
    PeerAllReduce,
)
from vllm_specgraph.spans import overlapping_pairs, tensor_span

_WORLD_SIZE = 2
_MIB = 1 << 20
_TIMEOUT_S = 45  # per test: a hang in a collective fails instead of blocking the run


def _two_gpus_with_peer_access() -> bool:
    return (
        torch.cuda.is_available()
        and torch.cuda.device_count() >= _WORLD_SIZE
        and torch.cuda.can_device_access_peer(0, 1)
    )


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.multigpu,
    pytest.mark.skipif(
        torch.cuda.device_count() >= _WORLD_SIZE and not _two_gpus_with_peer_access(),
        reason="GPUs 0 and 1 have no peer-to-peer access, which symmetric memory needs",
    ),
]


def _spawn(worker: Callable[..., None], tmp_path) -> None:
    """Runs ``worker(rank, store_path)`` on two ranks; fails on a rank's error or a hang."""
    context = mp.start_processes(
        worker, args=(str(tmp_path / "store"),), nprocs=_WORLD_SIZE, join=False
    )
    deadline = time.monotonic() + _TIMEOUT_S
    while not context.join(timeout=1.0):  # raises with the rank's traceback if one failed
        if time.monotonic() > deadline:
            for process in context.processes:
                if process.is_alive():
                    process.terminate()
            pytest.fail(f"the ranks did not finish within {_TIMEOUT_S} s (a hung collective?)")


def _init_rank(rank: int, store_path: str) -> torch.device:
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl",
        init_method=f"file://{store_path}",
        rank=rank,
        world_size=_WORLD_SIZE,
        device_id=device,
        timeout=datetime.timedelta(seconds=_TIMEOUT_S),
    )
    return device


def _nccl_sum(x: torch.Tensor) -> torch.Tensor:
    ref = x.clone()
    dist.all_reduce(ref)
    return ref


def _randn(shape, dtype, device, gen) -> torch.Tensor:
    return torch.randn(shape, device=device, generator=gen).to(dtype)


def _assert_equal(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    num_diff = int((got != want).sum())
    assert num_diff == 0, f"{what}: {num_diff} of {want.numel()} elements differ from NCCL"


# --- (a) every algorithm, eager and in a graph ---------------------------------------------

# (shape, dtype, what the default config picks). Default: one-shot up to 512 KiB, two-shot
# up to the 8 MiB channel, NCCL above; 60-byte inputs take the kernels' 4-byte vector path.
_EAGER_CASES = (
    ((2,), torch.bfloat16, Algorithm.ONE_SHOT),
    ((1,), torch.float32, Algorithm.ONE_SHOT),
    ((3, 5), torch.float32, Algorithm.ONE_SHOT),
    ((5, 6), torch.bfloat16, Algorithm.ONE_SHOT),
    ((4, 1024), torch.bfloat16, Algorithm.ONE_SHOT),
    ((128, 1024), torch.float32, Algorithm.ONE_SHOT),  # 512 KiB: the one-shot limit
    ((300, 1000), torch.bfloat16, Algorithm.TWO_SHOT),
    ((2048, 1024), torch.float32, Algorithm.TWO_SHOT),  # 8 MiB: fills the channel
    ((2048 * 1024 + 1,), torch.float32, Algorithm.NCCL),  # exceeds the channel
    ((3,), torch.bfloat16, Algorithm.NCCL),  # 6 bytes: no multiple of 4
    ((64, 64), torch.float16, Algorithm.NCCL),  # a dtype the kernels lack
)
_GRAPH_SHAPE = (96, 1024)  # 192 KiB in bf16: every algorithm can take it


def _fits_kernels(x: torch.Tensor, channel_bytes: int) -> bool:
    return x.dtype in SYMM_MEM_DTYPES and x.nbytes % 4 == 0 and x.nbytes <= channel_bytes


def _every_algorithm_worker(rank: int, store_path: str) -> None:
    device = _init_rank(rank, store_path)
    try:
        all_reduce = PeerAllReduce(dist.group.WORLD, device)
        gen = torch.Generator(device=device).manual_seed(1 + rank)
        for shape, dtype, expected in _EAGER_CASES:
            x = _randn(shape, dtype, device, gen)
            assert all_reduce.select(x) is expected, (shape, dtype, all_reduce.select(x))
            ref = _nccl_sum(x)
            _assert_equal(all_reduce.all_reduce(x), ref, f"{shape} {dtype} picked")
            for algorithm in Algorithm:
                if algorithm is Algorithm.NCCL or _fits_kernels(x, all_reduce.config.channel_bytes):
                    y = all_reduce.all_reduce(x, algorithm=algorithm)
                    _assert_equal(y, ref, f"{shape} {dtype} {algorithm.value}")
            y = x.clone()
            _assert_equal(all_reduce.all_reduce(y, out=y), ref, f"{shape} {dtype} in place")

        # One graph per algorithm, each on its own channel, replayed with fresh inputs.
        static_in = torch.zeros(_GRAPH_SHAPE, dtype=torch.bfloat16, device=device)
        for algorithm in Algorithm:
            all_reduce.all_reduce(static_in, algorithm=algorithm)  # warm up outside capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with all_reduce.channel_pool.capture(owner=algorithm.value), torch.cuda.graph(graph):
                static_out = all_reduce.all_reduce(static_in, algorithm=algorithm)
            for step in range(3):
                static_in.copy_(_randn(_GRAPH_SHAPE, torch.bfloat16, device, gen))
                graph.replay()
                _assert_equal(static_out, _nccl_sum(static_in), f"{algorithm.value} replay {step}")
            torch.cuda.synchronize()
            del static_out
            graph.reset()
        all_reduce.close()
    finally:
        dist.destroy_process_group()


def test_eager_and_graph_sums_equal_nccl_for_every_algorithm(tmp_path):
    _spawn(_every_algorithm_worker, tmp_path)


# --- (b) target and draft graphs, interleaved ---------------------------------------------

_TARGET_SHAPE = (512, 1024)  # 1 MiB bf16: two-shot
_TARGET_SMALL_SHAPE = (8, 1024)  # 32 KiB fp32: one-shot
_DRAFT_SHAPE = (16, 1024)  # 32 KiB bf16: one-shot
_NUM_STEPS = 1000
_ORDERS = ("td", "dt", "ttd", "dtd")  # speculative decoding replays the target back to back


def _staged(channel, x: torch.Tensor) -> torch.Tensor:
    return channel.buffer[: x.nbytes].view(x.dtype).view(x.shape)


def _target_and_draft_worker(rank: int, store_path: str) -> None:
    device = _init_rank(rank, store_path)
    try:
        all_reduce = PeerAllReduce(dist.group.WORLD, device)
        pool = all_reduce.channel_pool
        gen = torch.Generator(device=device).manual_seed(100 + rank)
        t_in = torch.zeros(_TARGET_SHAPE, dtype=torch.bfloat16, device=device)
        t_small_in = torch.zeros(_TARGET_SMALL_SHAPE, dtype=torch.float32, device=device)
        d_in = torch.zeros(_DRAFT_SHAPE, dtype=torch.bfloat16, device=device)
        assert all_reduce.select(t_in) is Algorithm.TWO_SHOT
        assert all_reduce.select(t_small_in) is Algorithm.ONE_SHOT
        assert all_reduce.select(d_in) is Algorithm.ONE_SHOT
        for x in (t_in, t_small_in, d_in):
            all_reduce.all_reduce(x)  # warm up outside capture; creates the eager channel
        torch.cuda.synchronize()

        target_graph, draft_graph = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        with pool.capture(owner="target") as target, torch.cuda.graph(target_graph):
            t_out = all_reduce.all_reduce(t_in)
            t_small_out = all_reduce.all_reduce(t_small_in)
        with pool.capture(owner="draft") as draft, torch.cuda.graph(draft_graph):
            d_out = all_reduce.all_reduce(d_in)

        eager = pool.current()
        assert len({id(eager), id(target), id(draft)}) == 3 and pool.num_channels == 3
        spans = [tensor_span(channel.buffer) for channel in (eager, target, draft)]
        assert overlapping_pairs(spans) == [], f"channel buffers overlap: {spans}"
        eager_bytes = eager.buffer.clone()  # no replay may touch the eager channel

        mismatches = torch.zeros((), dtype=torch.int64, device=device)
        # A one-shot call leaves this rank's input staged in the channel it ran on: the
        # target's last call is t_small, the draft's only call d_in.
        misplaced = torch.zeros((), dtype=torch.int64, device=device)
        num_replays = {"t": 0, "d": 0}
        for step in range(_NUM_STEPS):
            t_in.copy_(_randn(_TARGET_SHAPE, torch.bfloat16, device, gen))
            t_small_in.copy_(_randn(_TARGET_SMALL_SHAPE, torch.float32, device, gen))
            d_in.copy_(_randn(_DRAFT_SHAPE, torch.bfloat16, device, gen))
            for name in _ORDERS[step % len(_ORDERS)]:
                (target_graph if name == "t" else draft_graph).replay()
                num_replays[name] += 1
            for got, x in ((t_out, t_in), (t_small_out, t_small_in), (d_out, d_in)):
                mismatches += (got != _nccl_sum(x)).sum()
            for channel, x in ((target, t_small_in), (draft, d_in)):
                misplaced += (_staged(channel, x) != x).sum()
        assert int(mismatches) == 0, f"{int(mismatches)} elements differ from NCCL"
        assert int(misplaced) == 0, f"{int(misplaced)} staged elements not in their own channel"
        assert torch.equal(eager.buffer, eager_bytes), "a graph replay wrote the eager channel"
        assert num_replays["t"] > _NUM_STEPS and num_replays["d"] > _NUM_STEPS, num_replays

        torch.cuda.synchronize()
        del t_out, t_small_out, d_out
        target_graph.reset()
        draft_graph.reset()
        all_reduce.close()
    finally:
        dist.destroy_process_group()


def test_target_and_draft_graphs_on_own_channels_replayed_interleaved_equal_nccl(tmp_path):
    _spawn(_target_and_draft_worker, tmp_path)


# --- (c) rollback gives the throwaway channels' memory back -------------------------------

# Large enough that a channel left behind by rollback could not hide inside the tolerance.
_THROWAWAY_CHANNEL_BYTES = 16 * _MIB
_TOLERANCE_BYTES = 2 * _MIB
_PROFILE_OWNERS = ("profile-target", "profile-draft", "profile-draft")
_ROLLBACK_SHAPE = (512, 1024)  # 1 MiB bf16: two-shot


def _free_driver_bytes() -> int:
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info()[0]


def _throwaway_round(all_reduce: PeerAllReduce, x: torch.Tensor) -> tuple[int, list]:
    """Checkpoint, capture and replay throwaway graphs, destroy them, roll back."""
    pool = all_reduce.channel_pool
    cp = pool.checkpoint()
    graphs, outs, channels = [], [], []
    for owner in _PROFILE_OWNERS:
        graph = torch.cuda.CUDAGraph()
        with pool.capture(owner=owner) as channel, torch.cuda.graph(graph):
            outs.append(all_reduce.all_reduce(x))
        graphs.append(graph)
        channels.append(channel)
    for graph in graphs:
        graph.replay()
    ref = _nccl_sum(x)
    for out in outs:
        _assert_equal(out, ref, "throwaway graph")
    free_during = torch.cuda.mem_get_info()[0]
    torch.cuda.synchronize()
    del outs, out  # a graph's private pool lives until its outputs are gone too
    for graph in graphs:
        graph.reset()
    del graphs, graph
    pool.rollback(cp)  # collective: every rank closes its imports, then frees its exports
    return free_during, channels


def _is_open(channel) -> bool:
    try:
        _ = channel.buffer
    except RuntimeError:
        return False
    return True


def _rollback_worker(rank: int, store_path: str) -> None:
    device = _init_rank(rank, store_path)
    try:
        config = AllReduceConfig(channel_bytes=_THROWAWAY_CHANNEL_BYTES)
        all_reduce = PeerAllReduce(dist.group.WORLD, device, config)
        gen = torch.Generator(device=device).manual_seed(200 + rank)
        x = _randn(_ROLLBACK_SHAPE, torch.bfloat16, device, gen)
        assert all_reduce.select(x) is Algorithm.TWO_SHOT
        _assert_equal(all_reduce.all_reduce(x), _nccl_sum(x), "eager before")
        production = torch.cuda.CUDAGraph()
        with all_reduce.channel_pool.capture(owner="target"), torch.cuda.graph(production):
            production_out = all_reduce.all_reduce(x)
        num_channels = all_reduce.channel_pool.num_channels  # eager + production

        # The first round pays what the process keeps once (lazily loaded kernels, graph
        # runtime state); only the second round is measured.
        _throwaway_round(all_reduce, x)
        free_before = _free_driver_bytes()
        free_during, channels = _throwaway_round(all_reduce, x)
        free_after = _free_driver_bytes()

        taken = free_before - free_during
        assert taken >= len(_PROFILE_OWNERS) * _THROWAWAY_CHANNEL_BYTES, (
            f"rank {rank}: the throwaway channels took only {taken / _MIB:.1f} MiB"
        )
        assert abs(free_after - free_before) <= _TOLERANCE_BYTES, (
            f"rank {rank}: driver free memory {free_before / _MIB:.1f} MiB before the round, "
            f"{free_after / _MIB:.1f} MiB after its rollback"
        )
        assert all_reduce.channel_pool.num_channels == num_channels
        still_open = [channel.channel_id for channel in channels if _is_open(channel)]
        assert still_open == [], f"rank {rank}: rolled-back channels {still_open} are open"

        for step in range(3):  # the production graph and the eager channel still work
            x.copy_(_randn(_ROLLBACK_SHAPE, torch.bfloat16, device, gen))
            production.replay()
            ref = _nccl_sum(x)
            _assert_equal(production_out, ref, f"production replay {step}")
            _assert_equal(all_reduce.all_reduce(x), ref, f"eager after rollback {step}")
        torch.cuda.synchronize()
        del production_out
        production.reset()
        all_reduce.close()
    finally:
        dist.destroy_process_group()


def test_rollback_after_throwaway_captures_returns_driver_memory_on_every_rank(tmp_path):
    _spawn(_rollback_worker, tmp_path)
