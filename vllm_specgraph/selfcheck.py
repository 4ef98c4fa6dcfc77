"""GPU self-check for owner lanes: ``python -m vllm_specgraph.selfcheck``.

Captures a target graph and two draft graphs that take workspace views, makes
the draft need more workspace after the target (and a first draft graph) were
captured, then replays everything interleaved with fresh random inputs and
compares each output bit for bit with eager execution. A negative control runs
the same capture with target and draft sharing one lane and reports, from the
address ranges of the views each graph retained, whether the graphs overlap.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass

import torch

from vllm_specgraph.lanes import DEFAULT_OWNER_LANES, LaneWorkspace, use_owner
from vllm_specgraph.spans import spans_overlap

__all__ = ["LaneSelfcheckReport", "main", "run_lane_selfcheck"]

_HIDDEN = 512


@dataclass(frozen=True)
class LaneSelfcheckReport:
    iterations: int
    mismatches: int
    max_abs_diff: float
    draft_retired_bytes: int  # outgrown draft-lane buffers kept for the graphs that view them
    lanes_overlap: bool
    shared_lane_overlap: bool

    @property
    def ok(self) -> bool:
        return self.mismatches == 0 and not self.lanes_overlap and self.shared_lane_overlap


class _Mlp:
    """Two matmuls whose intermediate lives in workspace scratch, as a model layer's would."""

    def __init__(self, scale: int, generator: torch.Generator, device: torch.device) -> None:
        def weight(rows: int, cols: int) -> torch.Tensor:
            w = torch.randn(rows, cols, generator=generator, device=device) / rows**0.5
            return w.to(torch.bfloat16)

        self.up = weight(_HIDDEN, _HIDDEN * scale)
        self.down = weight(_HIDDEN * scale, _HIDDEN)

    def __call__(self, x: torch.Tensor, workspace: LaneWorkspace) -> tuple[torch.Tensor, int]:
        (scratch,) = workspace.get_simultaneous(((x.shape[0], self.up.shape[1]), torch.bfloat16))
        torch.matmul(x, self.up, out=scratch)
        scratch.relu_()
        return scratch @ self.down, scratch.data_ptr()


@dataclass
class _Captured:
    """One captured graph, its static input and output, and the scratch span it baked in."""

    graph: torch.cuda.CUDAGraph
    model: _Mlp
    x: torch.Tensor
    out: torch.Tensor
    scratch_span: tuple[int, int]


def _capture(
    model: _Mlp, x: torch.Tensor, workspace: LaneWorkspace, pool: tuple[int, int]
) -> _Captured:
    """Warm up on a side stream (which may grow the lane), then capture."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        model(x, workspace)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out, scratch_ptr = model(x, workspace)
    scratch_bytes = x.shape[0] * model.up.shape[1] * x.element_size()
    return _Captured(graph, model, x, out, (scratch_ptr, scratch_ptr + scratch_bytes))


def _capture_all(
    owner_lanes: dict[str, int], device: torch.device, seed: int
) -> tuple[dict[str, _Captured], LaneWorkspace]:
    generator = torch.Generator(device=device).manual_seed(seed)
    target, draft = _Mlp(4, generator, device), _Mlp(2, generator, device)
    workspace = LaneWorkspace(device, owner_lanes=owner_lanes)
    pool = torch.cuda.graph_pool_handle()
    # The second draft graph needs more scratch than the first one, so the draft
    # lane grows after two graphs already hold views of it.
    plan = [
        ("target", target, "target", 32),
        ("draft-small", draft, "draft", 8),
        ("draft-large", draft, "draft", 64),
    ]
    captured = {}
    for name, model, owner, batch in plan:
        x = torch.zeros(batch, _HIDDEN, dtype=torch.bfloat16, device=device)
        with use_owner(owner):
            captured[name] = _capture(model, x, workspace, pool)
    return captured, workspace


def _replay_interleaved(
    graphs: dict[str, _Captured], iterations: int, seed: int, device: torch.device
) -> tuple[int, float]:
    """Fresh random inputs each step, replay order rotated; compare with eager bit for bit."""
    reference_ws = LaneWorkspace(device)
    generator = torch.Generator(device=device).manual_seed(seed)
    order = list(graphs)
    mismatches, max_diff = 0, 0.0
    for step in range(iterations):
        expected = {}
        for name, g in graphs.items():
            g.x.copy_(torch.randn(g.x.shape, generator=generator, device=device))
            expected[name] = g.model(g.x, reference_ws)[0]
        for name in order[step % 3 :] + order[: step % 3]:
            graphs[name].graph.replay()
        for name, g in graphs.items():
            if not torch.equal(g.out, expected[name]):
                mismatches += 1
                diff = (g.out.float() - expected[name].float()).abs().max().item()
                max_diff = max(max_diff, diff)
    torch.cuda.synchronize()
    return mismatches, max_diff


def run_lane_selfcheck(iterations: int = 100, seed: int = 0) -> LaneSelfcheckReport:
    """Run the check on the current CUDA device; see the module docstring."""
    device = torch.device("cuda", torch.cuda.current_device())
    graphs, workspace = _capture_all(dict(DEFAULT_OWNER_LANES), device, seed)
    retired = workspace.usage()["draft"].retired_bytes
    target_span = graphs["target"].scratch_span
    lanes_overlap = any(
        spans_overlap(target_span, graphs[n].scratch_span) for n in ("draft-small", "draft-large")
    )
    mismatches, max_diff = _replay_interleaved(graphs, iterations, seed + 1, device)

    shared, _ = _capture_all({"target": 0, "draft": 0}, device, seed)
    shared_overlap = spans_overlap(
        shared["target"].scratch_span, shared["draft-small"].scratch_span
    )
    for g in (*graphs.values(), *shared.values()):
        g.graph.reset()
    return LaneSelfcheckReport(
        iterations=iterations,
        mismatches=mismatches,
        max_abs_diff=max_diff,
        draft_retired_bytes=retired,
        lanes_overlap=lanes_overlap,
        shared_lane_overlap=shared_overlap,
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
    print(
        f"owner lanes: {report.iterations} interleaved replays, {report.mismatches} mismatches; "
        f"target/draft overlap with lanes: {report.lanes_overlap}, "
        f"with one shared lane: {report.shared_lane_overlap} -> {'OK' if report.ok else 'FAIL'}"
    )
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
