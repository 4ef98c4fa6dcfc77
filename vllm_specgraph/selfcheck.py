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

__all__ = ["LaneSelfcheckReport", "main", "run_lane_selfcheck"]

_HIDDEN = 512


@dataclass(frozen=True)
class LaneSelfcheckReport:
    iterations: int
    mismatches: int
    max_abs_diff: float
    retired_bytes_during_capture: int
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


def _capture(fn, x: torch.Tensor, workspace: LaneWorkspace, pool) -> tuple:
    """Warm up on a side stream (which may grow the lane), then capture."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn(x, workspace)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out, scratch_ptr = fn(x, workspace)
    scratch_bytes = x.shape[0] * fn.up.shape[1] * 2
    return graph, out, (scratch_ptr, scratch_ptr + scratch_bytes)


def _capture_all(owner_lanes, device: torch.device, seed: int):
    generator = torch.Generator(device=device).manual_seed(seed)
    target, draft = _Mlp(4, generator, device), _Mlp(2, generator, device)
    workspace = LaneWorkspace(device, owner_lanes=owner_lanes)
    pool = torch.cuda.graph_pool_handle()
    # (name, model, owner, batch): the second draft graph needs more scratch than
    # the first one, so the draft lane grows after two graphs already hold views.
    plan = [("target", target, "target", 32), ("draft-small", draft, "draft", 8)]
    plan.append(("draft-large", draft, "draft", 64))
    graphs = {}
    for name, model, owner, batch in plan:
        x = torch.zeros(batch, _HIDDEN, dtype=torch.bfloat16, device=device)
        with use_owner(owner):
            graph, out, span = _capture(model, x, workspace, pool)
        graphs[name] = (graph, model, owner, x, out, span)
    return graphs, workspace


def _spans_overlap(spans: list[tuple[int, int]]) -> bool:
    return any(a[0] < b[1] and b[0] < a[1] for i, a in enumerate(spans) for b in spans[i + 1 :])


def run_lane_selfcheck(iterations: int = 100, seed: int = 0) -> LaneSelfcheckReport:
    """Run the check on the current CUDA device; see the module docstring."""
    device = torch.device("cuda", torch.cuda.current_device())
    graphs, workspace = _capture_all(DEFAULT_OWNER_LANES, device, seed)
    retired = workspace.usage()["draft"].retired_bytes
    target_span = graphs["target"][5]
    draft_spans = [graphs[n][5] for n in ("draft-small", "draft-large")]
    lanes_overlap = any(_spans_overlap([target_span, s]) for s in draft_spans)

    reference_ws = LaneWorkspace(device)
    generator = torch.Generator(device=device).manual_seed(seed + 1)
    order = ["target", "draft-small", "draft-large"]
    mismatches, max_diff = 0, 0.0
    for step in range(iterations):
        expected = {}
        for name in order:
            _, model, _, x, _, _ = graphs[name]
            x.copy_(torch.randn(x.shape, generator=generator, device=device))
            expected[name] = model(x, reference_ws)[0]
        for name in order[step % 3 :] + order[: step % 3]:  # rotate the replay order
            graphs[name][0].replay()
        for name in order:
            out = graphs[name][4]
            if not torch.equal(out, expected[name]):
                mismatches += 1
                max_diff = max(max_diff, (out.float() - expected[name].float()).abs().max().item())
    torch.cuda.synchronize()

    shared, _ = _capture_all({"target": 0, "draft": 0}, device, seed)
    shared_spans = [shared[n][5] for n in order]
    shared_overlap = _spans_overlap(shared_spans[:2])
    for g in (*graphs.values(), *shared.values()):
        g[0].reset()
    return LaneSelfcheckReport(
        iterations=iterations,
        mismatches=mismatches,
        max_abs_diff=max_diff,
        retired_bytes_during_capture=retired,
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
