"""Two gloo ranks whose own readings disagree take one decision."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch.distributed as dist
import torch.multiprocessing as mp
from gloo_group import init_gloo_group

from vllm_specgraph.ranks import on_any_rank

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()),
    reason="torch.distributed with the gloo backend is not available in this torch build",
)


def _worker(rank: int, store_path: str, out_dir: str) -> None:
    init_gloo_group(rank, store_path, 2)
    try:
        group = dist.new_group(backend="gloo")
        decisions = [
            on_any_rank(rank == 1, group),  # only rank 1 needs it
            on_any_rank(False, group),
            on_any_rank(True, group),
        ]
        (Path(out_dir) / f"rank{rank}.txt").write_text(repr(decisions))
    finally:
        dist.destroy_process_group()


def test_on_any_rank_gives_every_rank_the_same_decision(tmp_path):
    mp.spawn(_worker, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=2, join=True)
    decisions = [(tmp_path / f"rank{r}.txt").read_text() for r in (0, 1)]
    assert decisions == ["[True, False, True]"] * 2


def _profile_worker(rank: int, store_path: str, out_dir: str) -> None:
    """The profile engine on a rank whose own readings differ from the other's:
    rank 1's first pass leaves 8 MiB taken (state it loads once), rank 0's nothing.
    CUDA's memory readings are faked (no GPU here); the vote is real gloo."""
    import functools

    import torch

    import vllm_specgraph.profile as profile
    from vllm_specgraph.meter import OwnerMemory

    free = [1 << 30]
    for name, fn in {
        "synchronize": lambda *device: None,
        "empty_cache": lambda: None,
        "mem_get_info": lambda *device: (free[0], 2 << 30),
        "memory_reserved": lambda *device: 0,
        "max_memory_reserved": lambda *device: 0,
        "reset_peak_memory_stats": lambda *device: None,
    }.items():
        setattr(torch.cuda, name, fn)
    profile.live_blocks = frozenset
    passes = []

    def run_pass(index: int) -> profile.PassReading:
        passes.append(index)
        if rank == 1 and index == 0:
            free[0] -= 8 << 20
        return profile.PassReading((OwnerMemory("target", 1, 2 << 20, 2 << 20),), frozenset())

    init_gloo_group(rank, store_path, 2)
    try:
        group = dist.new_group(backend="gloo")
        agree = functools.partial(on_any_rank, group=group)
        result = profile.measure_graph_memory(run_pass, agree=agree, log=lambda line: None)
        (Path(out_dir) / f"rank{rank}.txt").write_text(repr((passes, result.passes)))
    finally:
        dist.destroy_process_group()


def test_ranks_whose_readings_disagree_take_the_same_passes(tmp_path):
    """Rank 0 alone would stop after one pass while rank 1 runs a second, whose
    collectives would then wait for rank 0 for good: both take two."""
    mp.spawn(_profile_worker, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=2, join=True)
    outcomes = [(tmp_path / f"rank{r}.txt").read_text() for r in (0, 1)]
    assert outcomes == ["([0, 1], 2)"] * 2


def test_on_any_rank_alone_asks_nobody():
    assert on_any_rank(True, None) is True and on_any_rank(False, None) is False
    assert on_any_rank(np.bool_(True), None) is True


@pytest.mark.parametrize(
    ("flag", "match"),
    [
        (0, r"flag must be a bool, got 0 \(int\)"),
        ("no", "flag must be a bool, got 'no'"),
        (np.int64(1), r"flag must be a bool, got .*\(int64\)"),
    ],
)
def test_on_any_rank_refuses_what_is_no_flag(flag, match):
    with pytest.raises(TypeError, match=match):
        on_any_rank(flag, None)
