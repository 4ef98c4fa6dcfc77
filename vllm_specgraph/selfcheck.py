"""GPU self-check for owner lanes: ``python -m vllm_specgraph.selfcheck``.

Captures a target graph and two draft graphs whose scratch comes from the
workspace; the second draft graph needs more scratch than the lane holds, so
the workspace grows after the target and the first draft graph were captured.
Then it replays the three graphs interleaved (the order rotates every step)
on fresh random inputs and compares each output bit for bit with eager
execution. It runs twice:

* **Owner lanes** (this library): target in lane 0, draft in lane 1; growth
  retires the outgrown buffer and keeps it. Expected: 0 mismatches.
* **Negative control, one shared lane** as in vLLM 0.33.0's
  ``WorkspaceManager``: target and draft share the buffer, and growth frees
  the outgrown one at once. The draft's growth frees the buffer the target
  graph (and the first draft graph) baked in, and the next allocation, the
  second draft graph's static input, is given that memory. Every replay of
  those graphs then writes scratch over that input, and the second draft
  graph, when it replays after them, computes on their scratch instead of its
  input. Expected: mismatches > 0; none would mean the check cannot fail.

Static inputs are persistent workspace tensors, and all workspace memory comes
from one private memory pool (``alloc_context``, the way vLLM's sleep mode
allocates its workspace), so which block the freed buffer goes to next does
not depend on unrelated allocations: both runs are deterministic.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping
from dataclasses import asdict, dataclass

import torch

from vllm_specgraph.lanes import DEFAULT_OWNER_LANES, LaneWorkspace, use_owner
from vllm_specgraph.spans import Span, spans_overlap, tensor_span

__all__ = ["LaneSelfcheckReport", "main", "run_lane_selfcheck"]

_HIDDEN = 512
_SHARED_LANE: Mapping[str, int] = {"target": 0, "draft": 0}
# (graph, owner, batch), in capture order. draft-large's scratch (64 x 1024 bf16) outgrows
# what target (16 x 2048) and draft-small (8 x 1024) left in the lane, and its static input
# (64 x 512 bf16) fits in the target's outgrown buffer.
_PLAN = (("target", "target", 16), ("draft-small", "draft", 8), ("draft-large", "draft", 64))


@dataclass(frozen=True)
class LaneSelfcheckReport:
    iterations: int  # steps; each step replays every graph once
    owner_lane_mismatches: int  # graph outputs that differ from eager, with owner lanes
    owner_lane_max_abs_diff: float
    draft_retired_bytes: int  # outgrown draft-lane buffers kept for the graphs that view them
    shared_lane_mismatches: int  # the same with one shared lane freeing on growth
    shared_lane_input_reused: bool  # the control's freed buffer went to draft-large's input

    @property
    def ok(self) -> bool:
        return (
            self.owner_lane_mismatches == 0
            and self.draft_retired_bytes > 0
            and self.shared_lane_mismatches > 0
        )


class _Mlp:
    """Two matmuls whose intermediate lives in workspace scratch, as a model layer's would."""

    def __init__(self, scale: int, generator: torch.Generator, device: torch.device) -> None:
        def weight(rows: int, cols: int) -> torch.Tensor:
            w = torch.randn(rows, cols, generator=generator, device=device) / rows**0.5
            return w.to(torch.bfloat16)

        self.up = weight(_HIDDEN, _HIDDEN * scale)
        self.down = weight(_HIDDEN * scale, _HIDDEN)

    def __call__(self, x: torch.Tensor, workspace: LaneWorkspace) -> tuple[torch.Tensor, Span]:
        (scratch,) = workspace.get_simultaneous(((x.shape[0], self.up.shape[1]), torch.bfloat16))
        torch.matmul(x, self.up, out=scratch)
        scratch.relu_()
        # Only the span leaves: a reference would keep the buffer alive after growth.
        return scratch @ self.down, tensor_span(scratch)


@dataclass
class _Captured:
    """One captured graph, its static input and output, and the scratch span it baked in."""

    graph: torch.cuda.CUDAGraph
    model: _Mlp
    x: torch.Tensor
    out: torch.Tensor
    scratch_span: Span


@dataclass(frozen=True)
class _RunResult:
    mismatches: int
    max_abs_diff: float
    draft_retired_bytes: int
    draft_large_input_reused: bool  # its input overlaps memory the target graph writes


def _capture(
    name: str,
    owner: str,
    batch: int,
    model: _Mlp,
    workspace: LaneWorkspace,
    graph_pool: tuple[int, int],
    free_outgrown: bool,
) -> _Captured:
    """Warm up (which sizes the lane), take the static input, then capture."""
    with use_owner(owner):
        warmup_input = torch.zeros(batch, _HIDDEN, dtype=torch.bfloat16, device=workspace.device)
        model(warmup_input, workspace)
        if free_outgrown:
            # What vLLM 0.33.0's manager does on growth, although graphs captured
            # earlier still point into the outgrown buffer.
            workspace.release_retired()
        x = workspace.get_persistent(("input", name), (batch, _HIDDEN), torch.bfloat16)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=graph_pool):
            out, scratch_span = model(x, workspace)
    return _Captured(graph, model, x, out, scratch_span)


def _replay_interleaved(
    graphs: Mapping[str, _Captured], iterations: int, seed: int, device: torch.device
) -> tuple[int, float]:
    """Fresh random inputs each step, replay order rotated; compare with eager bit for bit."""
    reference_workspace = LaneWorkspace(device)
    generator = torch.Generator(device=device).manual_seed(seed)
    order = list(graphs)
    mismatches, max_diff = 0, 0.0
    for step in range(iterations):
        expected = {}
        for name, g in graphs.items():
            g.x.copy_(torch.randn(g.x.shape, generator=generator, device=device))
            expected[name] = g.model(g.x, reference_workspace)[0]
        shift = step % len(order)
        for name in order[shift:] + order[:shift]:
            graphs[name].graph.replay()
        for name, g in graphs.items():
            if not torch.equal(g.out, expected[name]):
                mismatches += 1
                diff = (g.out.float() - expected[name].float()).abs().max().item()
                max_diff = max(max_diff, diff)
    return mismatches, max_diff


def _run(
    owner_lanes: Mapping[str, int],
    free_outgrown: bool,
    models: Mapping[str, _Mlp],
    iterations: int,
    seed: int,
    device: torch.device,
) -> _RunResult:
    memory_pool = torch.cuda.MemPool()
    workspace = LaneWorkspace(
        device,
        owner_lanes=owner_lanes,
        alloc_context=lambda: torch.cuda.use_mem_pool(memory_pool, device),
    )
    graph_pool = torch.cuda.graph_pool_handle()
    graphs = {
        name: _capture(name, owner, batch, models[owner], workspace, graph_pool, free_outgrown)
        for name, owner, batch in _PLAN
    }
    retired = workspace.usage()["draft"].retired_bytes
    reused = spans_overlap(graphs["target"].scratch_span, tensor_span(graphs["draft-large"].x))
    mismatches, max_diff = _replay_interleaved(graphs, iterations, seed, device)
    torch.cuda.synchronize()
    for g in graphs.values():
        g.graph.reset()
    # Tensors from memory_pool go before the pool itself (it outlives this line).
    del graphs, workspace
    return _RunResult(mismatches, max_diff, retired, reused)


def run_lane_selfcheck(iterations: int = 100, seed: int = 0) -> LaneSelfcheckReport:
    """Run the check on the current CUDA device; see the module docstring."""
    device = torch.device("cuda", torch.cuda.current_device())
    generator = torch.Generator(device=device).manual_seed(seed)
    models = {"target": _Mlp(4, generator, device), "draft": _Mlp(2, generator, device)}
    owner = _run(DEFAULT_OWNER_LANES, False, models, iterations, seed + 1, device)
    shared = _run(_SHARED_LANE, True, models, iterations, seed + 1, device)
    return LaneSelfcheckReport(
        iterations=iterations,
        owner_lane_mismatches=owner.mismatches,
        owner_lane_max_abs_diff=owner.max_abs_diff,
        draft_retired_bytes=owner.draft_retired_bytes,
        shared_lane_mismatches=shared.mismatches,
        shared_lane_input_reused=shared.draft_large_input_reused,
    )


def main() -> int:
    if not torch.cuda.is_available():
        print(
            f"vllm-specgraph self-check needs a CUDA GPU; torch {torch.__version__} sees none. "
            "Run `make demo` on a machine with an NVIDIA GPU and torch.",
            file=sys.stderr,
        )
        return 2
    report = run_lane_selfcheck()
    print(json.dumps(asdict(report) | {"ok": report.ok}, indent=2))
    num_replays = report.iterations * len(_PLAN)
    print(
        f"{num_replays} interleaved replays against eager, bit for bit: owner lanes "
        f"{report.owner_lane_mismatches} mismatches; one shared lane that frees on growth "
        f"(vLLM 0.33.0's manager) {report.shared_lane_mismatches} mismatches "
        f"-> {'OK' if report.ok else 'FAIL'}"
    )
    if not report.shared_lane_input_reused:
        print(
            "negative control: the freed buffer did not go to the next allocation, so the "
            "shared-lane hazard was not set up; check PYTORCH_CUDA_ALLOC_CONF",
            file=sys.stderr,
        )
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
