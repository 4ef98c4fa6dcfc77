"""Two gloo ranks: ChannelPool's barriers order close_imports before any free_exports."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp
from gloo_group import init_gloo_group

from vllm_specgraph.channels import ChannelPool

_WORLD_SIZE = 2
_SLOW_RANK = 1
_SLOW_CLOSE_S = 0.2
_OWNERS_AFTER_CHECKPOINT = ("target", "draft", "encoder")

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()),
    reason="torch.distributed with the gloo backend is not available in this torch build",
)


class _LoggedChannel:
    """Appends (monotonic_ns, rank, event, channel_id) lines to this rank's log file."""

    def __init__(self, channel_id: int, rank: int, log_path: Path) -> None:
        self.channel_id = channel_id
        self._rank = rank
        self._log_path = log_path

    def close_imports(self) -> None:
        if self._rank == _SLOW_RANK:
            # Without the barrier after close_imports, the fast rank's frees would land
            # while this rank still "maps" their memory, and the ordering assertion fails.
            time.sleep(_SLOW_CLOSE_S)
        self._log("close_imports")

    def free_exports(self) -> None:
        self._log("free_exports")

    def _log(self, event: str) -> None:
        with self._log_path.open("a") as f:
            f.write(f"{time.monotonic_ns()} {self._rank} {event} {self.channel_id}\n")


def _worker(rank: int, store_path: str, log_dir: str) -> None:
    init_gloo_group(rank, store_path, _WORLD_SIZE)
    try:
        log_path = Path(log_dir) / f"rank{rank}.log"
        channel_pool = ChannelPool(
            "tp",
            lambda channel_id, owner: _LoggedChannel(channel_id, rank, log_path),
            barrier=dist.barrier,
            synchronize=lambda: None,  # CPU only: nothing to synchronize
        )
        channel_pool.current()  # eager channel 0 stays alive across the rollback
        cp = channel_pool.checkpoint()
        for owner in _OWNERS_AFTER_CHECKPOINT:
            with channel_pool.capture(owner=owner):
                pass
        channel_pool.rollback(cp)
        channel_pool.close()
    finally:
        dist.destroy_process_group()


def _read_events(log_dir: Path) -> list[tuple[int, int, str, int]]:
    events = []
    for rank in range(_WORLD_SIZE):
        for line in (log_dir / f"rank{rank}.log").read_text().splitlines():
            ns, r, event, channel_id = line.split()
            events.append((int(ns), int(r), event, int(channel_id)))
    return sorted(events)


def _assert_closes_before_frees(events: list[tuple[int, int, str, int]]) -> None:
    last_close = max(ns for ns, _, event, _ in events if event == "close_imports")
    first_free = min(ns for ns, _, event, _ in events if event == "free_exports")
    assert last_close < first_free, events


def test_rollback_two_gloo_ranks_closes_all_imports_before_any_free(tmp_path):
    log_dir = tmp_path / "logs"
    log_dir.mkdir()
    mp.spawn(
        _worker,
        args=(str(tmp_path / "store"), str(log_dir)),
        nprocs=_WORLD_SIZE,
        join=True,
    )
    events = _read_events(log_dir)
    newer = {1, 2, 3}
    rollback_events = [e for e in events if e[3] in newer]
    close_events = [e for e in events if e[3] not in newer]
    assert len(rollback_events) == 2 * _WORLD_SIZE * len(newer)
    assert len(close_events) == 2 * _WORLD_SIZE
    _assert_closes_before_frees(rollback_events)
    _assert_closes_before_frees(close_events)
    # The trailing barrier of rollback keeps close() from starting on any rank early.
    assert max(e[0] for e in rollback_events) < min(e[0] for e in close_events)
    for rank in range(_WORLD_SIZE):
        for event in ("close_imports", "free_exports"):
            ids = [e[3] for e in rollback_events if e[1] == rank and e[2] == event]
            assert ids == [3, 2, 1], (rank, event, ids)
