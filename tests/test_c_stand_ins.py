"""The pure-torch stand-in for vLLM's compiled ``_C_stable_libtorch``
(scripts/vllm_e2e/_C_stable_libtorch.py): its tensor-parallel embedding lookup checked
on the CPU against ``F.embedding``, and its placeholder ops.

Loading the stand-in registers ``torch.ops._C`` ops process-wide, which would change
what other tests see (vLLM probes some of these names), so the checks run in one
child interpreter (this file run as a script) that loads it as vLLM imports it and
reports per check; each test asserts one check's outcome.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Callable
from types import ModuleType

import pytest
import torch
import torch.nn.functional as F

SHIM = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    "scripts",
    "vllm_e2e",
    "_C_stable_libtorch.py",
)


def _lookup(shim: ModuleType, full: torch.Tensor, ids: torch.Tensor, shard: tuple, tail: int = 0):
    """One rank's lookup through the stand-in, and what it should give: the full
    embedding of every id the rank owns, zero rows for the rest. ``shard`` is
    (org_start, org_end, padding, added_start, added_end); the rank's table holds its
    base ids, the padding rows (NaN, so that a lookup that reads one shows), its added
    ids and ``tail`` more padding rows, as the layer lays it out."""
    org_start, org_end, pad, added_start, added_end = shard
    nan = torch.full((max(pad, tail), full.shape[1]), float("nan"), dtype=full.dtype)
    table = torch.cat([full[org_start:org_end], nan[:pad], full[added_start:added_end], nan[:tail]])
    out = torch.full((ids.numel(), full.shape[1]), 7.0, dtype=full.dtype)
    torch.ops._C.vocab_parallel_embedding(out, ids, table, *shard)
    owned = [org_start <= int(t) < org_end or added_start <= int(t) < added_end for t in ids]
    safe = torch.tensor([int(t) if o else 0 for t, o in zip(ids, owned, strict=True)]).long()
    want = F.embedding(safe, full.float()) * torch.tensor(owned, dtype=torch.float32)[:, None]
    torch.testing.assert_close(out.float(), want, rtol=0, atol=0)
    assert not out.isnan().any(), "a padding row leaked into the output"
    return out


def _sum_of_ranks(shim: ModuleType, full: torch.Tensor, ids: torch.Tensor, shards: list) -> None:
    """The ranks' lookups add up to the full lookup; an id nobody owns gives zeros."""
    total = sum(_lookup(shim, full, ids, shard[:5], *shard[5:]) for shard in shards)
    inside = (ids >= 0) & (ids < full.shape[0])
    torch.testing.assert_close(total[inside], F.embedding(ids[inside], full), rtol=0, atol=0)
    assert (total[~inside] == 0).all()


def check_two_ranks(shim: ModuleType) -> None:
    """Vocab 100 padded to 128 over two ranks: rank 1 holds 36 ids and 28 padding rows."""
    torch.manual_seed(0)
    _sum_of_ranks(
        shim,
        torch.randn(100, 8),
        torch.arange(-1, 102),
        [(0, 64, 0, 100, 100), (64, 100, 28, 100, 100)],
    )


def check_added_vocab(shim: ModuleType) -> None:
    """Base vocab 10 padded to 16, plus 4 added ids, over two ranks (int32 ids)."""
    torch.manual_seed(1)
    ids = torch.tensor([0, 7, 8, 9, 10, 11, 12, 13, 14, -1, 3], dtype=torch.int32)
    for shard in ((0, 8, 0, 10, 12), (8, 10, 6, 12, 14)):
        _lookup(shim, torch.randn(14, 4), ids, shard)


def check_dtypes_and_no_tokens(shim: ModuleType) -> None:
    full = torch.randn(32, 6).to(torch.bfloat16)
    for dtype in (torch.int32, torch.int64):
        ids = torch.tensor([31, 16, 15, 0, 40], dtype=dtype)
        assert _lookup(shim, full, ids, (16, 32, 0, 32, 32)).dtype == torch.bfloat16
    none = torch.empty(0, dtype=torch.int64)
    assert _lookup(shim, full, none, (0, 16, 0, 32, 32)).shape == (0, 6)


SHARD_FIELDS = (  # vLLM's ShardIndices, in the op's argument order, then the tail padding
    "org_vocab_start_index",
    "org_vocab_end_index",
    "num_org_vocab_padding",
    "added_vocab_start_index",
    "added_vocab_end_index",
    "num_added_vocab_padding",
)


def check_with_vllm_shard_indices(shim: ModuleType) -> None:
    """The arguments as vLLM computes them (``VocabParallelEmbedding._get_indices``) for
    the layer docstring's example (1010 base ids padded to 1024, 16 added, TP=2) and
    the tiny config's vocabulary (512, TP=2)."""
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
        shards = []
        for rank in range(2):
            si = VocabParallelEmbedding._get_indices(
                total_padded, base_padded, base + added, base, rank, 2
            )
            shards.append(tuple(getattr(si, field) for field in SHARD_FIELDS))
        _sum_of_ranks(
            shim, torch.randn(base + added, 8), torch.arange(-2, base + added + 3), shards
        )


# The list the device script writes beside the stand-in: one name it implements.
LISTED = ("_C::rms_norm", "_C::vocab_parallel_embedding")


def check_listed_names_raise_unless_implemented(shim: ModuleType) -> None:
    """A listed name becomes an op that raises, naming itself; a listed name the
    stand-in implements keeps its implementation and its schema."""
    assert shim.PLACEHOLDERS == ["_C::rms_norm"], shim.PLACEHOLDERS
    try:
        torch.ops._C.rms_norm()
    except NotImplementedError as e:
        assert "_C::rms_norm" in str(e), e
    else:
        raise AssertionError("a placeholder op ran")
    op = torch.ops._C.vocab_parallel_embedding.default
    names = [a.name for a in op._schema.arguments]
    assert names == ["out", "input_ids", "weight", *SHARD_FIELDS[:5]], names
    assert op._schema.arguments[0].alias_info.is_write


class _Skip(Exception):
    """A check that cannot run here (reported as ``skip: reason``)."""


CHECKS: dict[str, Callable[[ModuleType], None]] = {
    name[len("check_") :]: fn for name, fn in dict(globals()).items() if name.startswith("check_")
}


@pytest.fixture(scope="module")
def child_report() -> dict[str, str]:
    proc = subprocess.run(
        [sys.executable, os.path.abspath(__file__)], capture_output=True, text=True, timeout=300
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
    tree = tempfile.mkdtemp()
    shutil.copy(SHIM, tree)
    with open(os.path.join(tree, "_C_stable_libtorch_placeholders.txt"), "w") as f:
        f.write("\n".join(LISTED) + "\n")
    path = os.path.join(tree, os.path.basename(SHIM))
    spec = importlib.util.spec_from_file_location("vllm._C_stable_libtorch", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    report: dict[str, str] = {}
    for check_name, check in CHECKS.items():
        try:
            check(module)
            report[check_name] = "ok"
        except _Skip as e:
            report[check_name] = f"skip: {e}"
        except Exception:
            report[check_name] = traceback.format_exc()
    print(json.dumps(report))
