"""Toy decoder layers and their graph sets, shaped like a real model's graphs.

Each layer does what makes graph memory hard to predict in a real model:
bf16 matmuls (cuBLAS workspaces), attention over a static context, workspace
scratch taken from the owner's lane, and a reduction staged through the
capture's communication channel.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from vllm_specgraph.capture import GraphRecorder
from vllm_specgraph.channels import ChannelPool, device_channel_factory
from vllm_specgraph.lanes import LaneWorkspace
from vllm_specgraph.profile import OwnerGraphs

__all__ = [
    "BATCH_SIZES",
    "ToyConfig",
    "ToyDecoder",
    "ToyGraphSet",
    "ToySpeculativeSetup",
    "build_toy_setup",
]


@dataclass(frozen=True, slots=True)
class ToyConfig:
    hidden: int = 1024
    num_heads: int = 8
    num_layers: int = 2
    context: int = 256
    mlp_scale: int = 4

    def __post_init__(self) -> None:
        if self.hidden % self.num_heads:
            raise ValueError(f"hidden={self.hidden} must divide by num_heads={self.num_heads}")


class ToyDecoder:
    """Decoder layers with fixed random weights; ``forward`` is capturable."""

    def __init__(self, config: ToyConfig, seed: int, device: torch.device) -> None:
        g = torch.Generator(device=device).manual_seed(seed)
        h, d = config.hidden, config.hidden // config.num_heads

        def w(*shape: int) -> torch.Tensor:
            return (torch.randn(*shape, generator=g, device=device) / shape[0] ** 0.5).bfloat16()

        self.config = config
        self.layers = [
            {
                "qkv": w(h, 3 * h),
                "out": w(h, h),
                "up": w(h, config.mlp_scale * h),
                "down": w(config.mlp_scale * h, h),
                "k": w(1, config.num_heads, config.context, d),
                "v": w(1, config.num_heads, config.context, d),
            }
            for _ in range(config.num_layers)
        ]

    def forward(
        self, x: torch.Tensor, workspace: LaneWorkspace, channel_pool: ChannelPool
    ) -> torch.Tensor:
        batch, (h, heads) = x.shape[0], (self.config.hidden, self.config.num_heads)
        for layer in self.layers:
            qkv, up = workspace.get_simultaneous(
                ((batch, 3 * h), torch.bfloat16), ((batch, self.config.mlp_scale * h), x.dtype)
            )
            torch.matmul(x, layer["qkv"], out=qkv)
            q = qkv[:, :h].reshape(batch, heads, 1, h // heads)
            k, v = (layer[n].expand(batch, -1, -1, -1) for n in ("k", "v"))
            attn = F.scaled_dot_product_attention(q, k, v).reshape(batch, h)
            staged = channel_pool.current().buffer[: batch * h * 2].view(torch.bfloat16)
            torch.matmul(attn, layer["out"], out=staged.view(batch, h))
            x = x + staged.view(batch, h)
            torch.matmul(x, layer["up"], out=up)
            x = x + up.relu_() @ layer["down"]
        return x


class ToyGraphSet:
    """One owner's graphs over several batch sizes, nano-vllm style.

    Static input at the largest batch, graphs captured largest first into one
    pool, an eager warm-up before each capture, replay by slice copy with
    explicit zero padding up to the smallest captured batch that fits.

    *Owns*: the static input and the graphs' outputs (pool memory) until
    :meth:`release`. *Borrows*: model, workspace, channel_pool.
    """

    def __init__(
        self,
        model: ToyDecoder,
        batch_sizes: Sequence[int],
        workspace: LaneWorkspace,
        channel_pool: ChannelPool,
    ) -> None:
        if not batch_sizes or min(batch_sizes) < 1:
            raise ValueError(f"batch_sizes must be non-empty and >= 1, got {list(batch_sizes)}")
        self.model, self.workspace, self.channel_pool = model, workspace, channel_pool
        self.batch_sizes = sorted(set(batch_sizes), reverse=True)
        self._input: torch.Tensor | None = None
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def run_eager(self, x: torch.Tensor) -> torch.Tensor:
        return self.model.forward(x, self.workspace, self.channel_pool)

    def warmup(self) -> None:
        """Eager runs at every size: loads kernels and sizes the lane before capture."""
        for bs in self.batch_sizes:
            x = torch.zeros(bs, self.model.config.hidden, dtype=torch.bfloat16, device="cuda")
            self.run_eager(x)

    def capture(self, recorder: GraphRecorder) -> None:
        hidden = self.model.config.hidden
        self._input = torch.zeros(self.batch_sizes[0], hidden, dtype=torch.bfloat16, device="cuda")
        for bs in self.batch_sizes:
            self.run_eager(self._input[:bs])
            with recorder.capture() as graph:
                out = self.run_eager(self._input[:bs])
            self._graphs[bs] = (graph, out)

    def replay(self, x: torch.Tensor) -> torch.Tensor:
        bs = min((b for b in self._graphs if b >= x.shape[0]), default=None)
        if bs is None or self._input is None:
            raise RuntimeError(f"no captured graph fits batch {x.shape[0]}; capture first")
        self._input[: x.shape[0]].copy_(x)
        self._input[x.shape[0] : bs].zero_()
        graph, out = self._graphs[bs]
        graph.replay()
        return out[: x.shape[0]]

    def release(self) -> None:
        """Drop the static input and outputs; the graphs belong to their recorder."""
        self._graphs.clear()
        self._input = None


@dataclass
class ToySpeculativeSetup:
    """A target and a draft sharing one workspace and one channel pool, as in a runner."""

    workspace: LaneWorkspace
    channel_pool: ChannelPool
    target: ToyGraphSet
    draft: ToyGraphSet

    def owners(self) -> list[OwnerGraphs]:
        return [
            OwnerGraphs(name, s.capture, warmup=s.warmup, release=s.release)
            for name, s in (("target", self.target), ("draft", self.draft))
        ]


BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)
"""Decode batch sizes captured, like a runner's cudagraph_capture_sizes."""


def build_toy_setup(
    batch_sizes: Sequence[int] = BATCH_SIZES,
    target: ToyConfig = ToyConfig(hidden=2048, num_heads=16, num_layers=8),
    draft: ToyConfig = ToyConfig(hidden=2048, num_heads=16, num_layers=2),
) -> ToySpeculativeSetup:
    device = torch.device("cuda", torch.cuda.current_device())
    workspace = LaneWorkspace(device)
    max_bytes = max(batch_sizes) * max(target.hidden, draft.hidden) * 2
    channel_pool = ChannelPool("tp", device_channel_factory(max_bytes, device))
    return ToySpeculativeSetup(
        workspace,
        channel_pool,
        ToyGraphSet(ToyDecoder(target, 0, device), batch_sizes, workspace, channel_pool),
        ToyGraphSet(ToyDecoder(draft, 1, device), batch_sizes, workspace, channel_pool),
    )
