"""Two gloo ranks: PeerAllReduce's selection, channels and fallback across real processes.

What needs GPUs is faked, and said so where it is: the symmetric-memory kernels are emulated
by a gloo all-gather of every rank's staged channel bytes (so each rank must really have
staged its input in the channel the kernel is given), and channels are CPU DeviceChannels.
The NCCL path is the real torch.distributed.all_reduce, on gloo.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from gloo_group import init_gloo_group

from vllm_specgraph import allreduce as allreduce_module
from vllm_specgraph.allreduce import Algorithm, AllReduceConfig, PeerAllReduce
from vllm_specgraph.channels import checkpoint_channel_pools, rollback_channel_pools
from vllm_specgraph.device_channel import device_channel_factory

_WORLD_SIZE = 2
_CONFIG = AllReduceConfig(channel_bytes=4096, one_shot_max_bytes=1024)
# (numel, dtype, algorithm the selection must pick at world size 2)
_CASES = (
    (64, torch.bfloat16, Algorithm.ONE_SHOT),
    (256, torch.float32, Algorithm.ONE_SHOT),
    (1024, torch.bfloat16, Algorithm.TWO_SHOT),
    (1024, torch.float32, Algorithm.TWO_SHOT),
    (2048, torch.float32, Algorithm.NCCL),  # larger than the channel
    (64, torch.float16, Algorithm.NCCL),  # a dtype the kernels lack
    (33, torch.bfloat16, Algorithm.NCCL),  # 66 bytes: no multiple of 4
)

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()),
    reason="torch.distributed with the gloo backend is not available in this torch build",
)


def _emulated_symm_mem_op(calls: list[tuple[str, int]]):
    """Stands in for the GPU kernels: sums every rank's staged bytes, gathered over gloo."""

    def run(algorithm, staged, group_name, out):
        group = dist.group.WORLD
        assert group_name == group.group_name, group_name
        parts = [torch.empty_like(staged) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, staged, group=group)
        out.copy_(torch.stack(parts).float().sum(0).to(out.dtype))
        calls.append((algorithm.value, staged.data_ptr()))

    return run


def _rank_input(rank: int, numel: int, dtype: torch.dtype, step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * step + 10 * rank + numel)
    # Small integers: every dtype here sums them exactly, in any order.
    return torch.randint(-8, 8, (numel,), generator=gen).to(dtype)


def _expected(numel: int, dtype: torch.dtype, step: int) -> torch.Tensor:
    parts = [_rank_input(r, numel, dtype, step) for r in range(_WORLD_SIZE)]
    return torch.stack(parts).float().sum(0).to(dtype)


def _run_cases(all_reduce: PeerAllReduce, rank: int, step: int, calls: list) -> list[str]:
    """All-reduces every case; returns the algorithm each used (from the emulated kernel)."""
    used = []
    for numel, dtype, algorithm in _CASES:
        assert all_reduce.select(torch.empty(numel, dtype=dtype)) is algorithm, (numel, dtype)
        num_calls = len(calls)
        y = all_reduce.all_reduce(_rank_input(rank, numel, dtype, step))
        assert torch.equal(y, _expected(numel, dtype, step)), (numel, dtype, step)
        used.append(calls[-1][0] if len(calls) > num_calls else "nccl")
    return used


def _staged_in(calls: list, channel) -> bool:
    start = channel.buffer.data_ptr()
    return all(start <= ptr < start + channel.buffer.numel() for _, ptr in calls)


def _worker(rank: int, store_path: str, result_dir: str) -> None:
    init_gloo_group(rank, store_path, _WORLD_SIZE, timeout_s=60)
    calls: list[tuple[str, int]] = []
    allreduce_module._run_symm_mem_op = _emulated_symm_mem_op(calls)
    result: dict[str, object] = {}
    try:
        group = dist.group.WORLD
        # Every rank must pass the same config: a differing rank is named on every rank.
        mismatched = AllReduceConfig(4096, one_shot_max_bytes=1024 if rank == 0 else 2048)
        try:
            PeerAllReduce(
                group, "cpu", mismatched, create_channel=device_channel_factory(64, "cpu")
            )
        except ValueError as exc:
            result["mismatch_error"] = str(exc)

        factory = device_channel_factory(_CONFIG.channel_bytes, "cpu")
        all_reduce = PeerAllReduce(group, "cpu", _CONFIG, create_channel=factory)
        result["eager"] = _run_cases(all_reduce, rank, 0, calls)
        eager = all_reduce.channel_pool.current()
        result["eager_staged_in_eager_channel"] = _staged_in(calls, eager)
        for step, owner in enumerate(("target", "draft"), start=1):
            calls.clear()
            with all_reduce.channel_pool.capture(owner=owner) as channel:
                result[owner] = _run_cases(all_reduce, rank, step, calls)
            result[f"{owner}_staged_in_own_channel"] = _staged_in(calls, channel)
        cp = checkpoint_channel_pools([all_reduce.channel_pool])
        with all_reduce.channel_pool.capture(owner="profile"):
            _run_cases(all_reduce, rank, 3, calls)
        rollback_channel_pools(cp)  # collective: the pool's barrier is the group's
        result["num_channels_after_rollback"] = all_reduce.channel_pool.num_channels
        result["after_rollback"] = _run_cases(all_reduce, rank, 4, calls)
        all_reduce.close()
    finally:
        (Path(result_dir) / f"rank{rank}.json").write_text(json.dumps(result))
        dist.destroy_process_group()


def test_two_ranks_select_stage_and_sum_on_every_path(tmp_path):
    mp.spawn(_worker, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=_WORLD_SIZE)
    expected = [algorithm.value for _, _, algorithm in _CASES]
    for rank in range(_WORLD_SIZE):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert "ranks [1]" in result["mismatch_error"], result
        for phase in ("eager", "target", "draft", "after_rollback"):
            assert result[phase] == expected, (rank, phase)
        assert result["eager_staged_in_eager_channel"], rank
        assert result["target_staged_in_own_channel"], rank
        assert result["draft_staged_in_own_channel"], rank
        assert result["num_channels_after_rollback"] == 3, rank  # eager, target, draft
