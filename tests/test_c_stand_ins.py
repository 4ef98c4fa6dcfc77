"""The pure-torch stand-ins for vLLM's compiled ops (scripts/vllm_e2e/_C_stable_libtorch.py),
checked on the CPU against references computed here.

Loading the stand-in module registers ``torch.ops._C`` ops process-wide, which
would change what other tests see (vLLM probes some of these names). So the
checks run in one child interpreter (this file run as a script): it loads the
module the way vLLM imports it, calls each op through ``torch.ops`` and reports
per check. Each test below asserts one check's outcome.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import traceback
from collections.abc import Callable
from types import ModuleType

import pytest
import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
SHIM = os.path.join(os.path.dirname(HERE), "scripts", "vllm_e2e", "_C_stable_libtorch.py")


# ---- checks (run in the child) ------------------------------------------------


def _shard_reference(
    full: torch.Tensor,
    ids: torch.Tensor,
    org_start: int,
    org_end: int,
    added_start: int,
    added_end: int,
) -> torch.Tensor:
    """What a rank contributes, from the full table: the full embedding of every
    id this rank owns, zero rows for the rest."""
    owned = [
        org_start <= int(t) < org_end or added_start <= int(t) < added_end for t in ids.tolist()
    ]
    safe = torch.tensor([int(t) if o else 0 for t, o in zip(ids.tolist(), owned, strict=True)])
    rows = F.embedding(safe, full)
    return rows * torch.tensor(owned, dtype=full.dtype).unsqueeze(-1)


def _shard_table(
    full: torch.Tensor, org_start: int, org_end: int, pad: int, added_start: int, added_end: int
) -> torch.Tensor:
    """A rank's shard as the layer lays it out: its base ids, ``pad`` padding
    rows (NaN here, so a lookup that reads one shows), then its added ids."""
    dim = full.shape[1]
    parts = [full[org_start:org_end], torch.full((pad, dim), float("nan"), dtype=full.dtype)]
    parts.append(full[added_start:added_end])
    return torch.cat(parts)


def _call(shim: ModuleType, weight: torch.Tensor, ids: torch.Tensor, *indices: int) -> torch.Tensor:
    out = torch.full((ids.numel(), weight.shape[1]), 7.0, dtype=weight.dtype)
    before = shim.CALLS["_C::vocab_parallel_embedding"]
    torch.ops._C.vocab_parallel_embedding(out, ids, weight, *indices)
    assert shim.CALLS["_C::vocab_parallel_embedding"] == before + 1, "call not counted"
    return out


def check_vocab_parallel_embedding_two_ranks(shim: ModuleType) -> None:
    """vocab 100 padded to 128 over two ranks: rank 1 holds 36 ids and 28
    padding rows. Every id in [-1, 101] on both ranks; the ranks' sum equals
    F.embedding over the full table, and an id nobody owns gives zeros."""
    torch.manual_seed(0)
    vocab, dim = 100, 8
    full = torch.randn(vocab, dim)
    ids = torch.arange(-1, vocab + 2)
    shards = [(0, 64, 0, 100, 100), (64, 100, 28, 100, 100)]  # (org_start, org_end, pad, ...)
    total = torch.zeros(ids.numel(), dim)
    for org_start, org_end, pad, a_start, a_end in shards:
        table = _shard_table(full, org_start, org_end, pad, a_start, a_end)
        assert table.shape[0] == 64
        out = _call(shim, table, ids, org_start, org_end, pad, a_start, a_end)
        ref = _shard_reference(full, ids, org_start, org_end, a_start, a_end)
        torch.testing.assert_close(out, ref, rtol=0, atol=0)
        assert not out.isnan().any(), "a padding row leaked into the output"
        total += out
    inside = (ids >= 0) & (ids < vocab)
    torch.testing.assert_close(total[inside], F.embedding(ids[inside], full), rtol=0, atol=0)
    assert (total[~inside] == 0).all()


def check_vocab_parallel_embedding_added_vocab(shim: ModuleType) -> None:
    """Base vocab 10 (padded to 16) plus 4 added ids over two ranks, as in the
    layer's layout: each rank's added ids come after its base ids and padding."""
    torch.manual_seed(1)
    dim = 4
    full = torch.randn(14, dim)  # ids 0..9 base, 10..13 added
    ids = torch.tensor([0, 7, 8, 9, 10, 11, 12, 13, 14, -1, 3], dtype=torch.int32)
    # rank 0: base [0, 8), no padding, added [10, 12); rank 1: base [8, 10),
    # 6 padding rows, added [12, 14).
    for org_start, org_end, pad, a_start, a_end in ((0, 8, 0, 10, 12), (8, 10, 6, 12, 14)):
        table = _shard_table(full, org_start, org_end, pad, a_start, a_end)
        out = _call(shim, table, ids, org_start, org_end, pad, a_start, a_end)
        ref = _shard_reference(full, ids.long(), org_start, org_end, a_start, a_end)
        torch.testing.assert_close(out, ref, rtol=0, atol=0)


def check_vocab_parallel_embedding_dtypes_and_empty(shim: ModuleType) -> None:
    """int32 and int64 ids, a bf16 table, and zero tokens."""
    full = torch.randn(32, 6).to(torch.bfloat16)
    for dtype in (torch.int32, torch.int64):
        ids = torch.tensor([31, 16, 15, 0, 40], dtype=dtype)
        out = _call(shim, full[16:32], ids, 16, 32, 0, 32, 32)
        ref = _shard_reference(full.float(), ids.long(), 16, 32, 32, 32).to(torch.bfloat16)
        assert out.dtype == torch.bfloat16
        torch.testing.assert_close(out, ref, rtol=0, atol=0)
    out = _call(shim, full[:16], torch.empty(0, dtype=torch.int64), 0, 16, 0, 32, 32)
    assert out.shape == (0, 6)


def check_vocab_parallel_embedding_with_vllm_shard_indices(shim: ModuleType) -> None:
    """The arguments as vLLM computes them (``VocabParallelEmbedding._get_indices``)
    for the layer docstring's example (1010 base ids padded to 1024, 16 added ids,
    TP=2) and for the tiny config's vocabulary (512, TP=2): the ranks' sum is the
    full lookup for every id, and ids past the vocabulary give zeros."""
    try:
        from vllm.model_executor.layers.vocab_parallel_embedding import (
            VocabParallelEmbedding,
            pad_vocab_size,
        )
    except Exception as e:  # vLLM not importable in this environment
        raise _Skip(f"vLLM not importable: {e!r}") from e

    torch.manual_seed(2)
    for base, added in ((1010, 16), (512, 0)):
        base_padded = pad_vocab_size(base)
        total_padded = pad_vocab_size(base_padded + added)
        full = torch.randn(base + added, 8)
        ids = torch.arange(-2, base + added + 3)
        total = torch.zeros(ids.numel(), 8)
        for rank in range(2):
            si = VocabParallelEmbedding._get_indices(
                total_padded, base_padded, base + added, base, rank, 2
            )
            table = _shard_table(
                full,
                si.org_vocab_start_index,
                si.org_vocab_end_index,
                si.num_org_vocab_padding,
                si.added_vocab_start_index,
                si.added_vocab_end_index,
            )
            tail = si.num_added_vocab_padding
            table = torch.cat([table, torch.full((tail, 8), float("nan"))])
            assert table.shape[0] == total_padded // 2
            total += _call(
                shim,
                table,
                ids,
                si.org_vocab_start_index,
                si.org_vocab_end_index,
                si.num_org_vocab_padding,
                si.added_vocab_start_index,
                si.added_vocab_end_index,
            )
        inside = (ids >= 0) & (ids < base + added)
        torch.testing.assert_close(total[inside], F.embedding(ids[inside], full), rtol=0, atol=0)
        assert (total[~inside] == 0).all()


def check_registered_once_and_kept_by_placeholders(shim: ModuleType) -> None:
    """The op is the stand-in's own registration (with its schema), so the
    placeholder list written by apply_shims.py, which names it, skips it."""
    op = torch.ops._C.vocab_parallel_embedding.default
    args = [a.name for a in op._schema.arguments]
    assert args == [
        "out",
        "input_ids",
        "weight",
        "org_vocab_start_index",
        "org_vocab_end_index",
        "num_org_vocab_padding",
        "added_vocab_start_index",
        "added_vocab_end_index",
    ], args
    assert op._schema.arguments[0].alias_info.is_write
    assert shim._has_op("_C", "vocab_parallel_embedding")


class _Skip(Exception):
    """A check that cannot run here (reported as ``skip: reason``)."""


CHECKS: dict[str, Callable[[ModuleType], None]] = {
    name[len("check_") :]: fn for name, fn in dict(globals()).items() if name.startswith("check_")
}


def _child() -> None:
    spec = importlib.util.spec_from_file_location("vllm._C_stable_libtorch", SHIM)
    assert spec is not None and spec.loader is not None
    shim = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(shim)
    report: dict[str, str] = {}
    for name, fn in CHECKS.items():
        try:
            fn(shim)
            report[name] = "ok"
        except _Skip as e:
            report[name] = f"skip: {e}"
        except Exception:
            report[name] = traceback.format_exc()
    print(json.dumps(report))


# ---- tests (run in pytest) ----------------------------------------------------


@pytest.fixture(scope="module")
def child_report() -> dict[str, str]:
    proc = subprocess.run(
        [sys.executable, os.path.abspath(__file__)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("check", sorted(CHECKS))
def test_stand_in(child_report: dict[str, str], check: str) -> None:
    outcome = child_report.get(check, "check did not run")
    if outcome.startswith("skip: "):
        pytest.skip(outcome[len("skip: ") :])
    assert outcome == "ok", outcome


if __name__ == "__main__":
    _child()
