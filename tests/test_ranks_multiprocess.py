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
