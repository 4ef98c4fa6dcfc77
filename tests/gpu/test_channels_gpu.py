"""GPU tests for vllm_specgraph.channels: per-graph channels and memory returned on rollback."""

from __future__ import annotations

import gc
from collections.abc import Callable

import pytest
import torch

from vllm_specgraph.channels import Channel, ChannelPool, device_channel_factory
from vllm_specgraph.spans import overlapping_pairs, tensor_span

pytestmark = pytest.mark.gpu

_N = 4096  # float32 elements each step stages in its channel buffer
_CHANNEL_BYTES = _N * 4
_MIB = 1 << 20
# Large enough that a channel left behind by rollback could not hide inside the tolerance.
_THROWAWAY_CHANNEL_BYTES = 64 * _MIB
_TOLERANCE_BYTES = 2 * _MIB

Step = Callable[[torch.Tensor, Channel], torch.Tensor]


def _staged(channel: Channel) -> torch.Tensor:
    return channel.buffer.view(torch.float32)[:_N]


def _target_step(x: torch.Tensor, channel: Channel) -> torch.Tensor:
    torch.mul(x, 2.0, out=_staged(channel))
    channel.signal[:1].add_(1)
    return _staged(channel) + 1.0


def _draft_step(x: torch.Tensor, channel: Channel) -> torch.Tensor:
    torch.add(x, 3.0, out=_staged(channel))
    channel.signal[:1].add_(1)
    return _staged(channel) * _staged(channel)


def _capture(
    channel_pool: ChannelPool, owner: str, step: Step, x: torch.Tensor
) -> tuple[torch.cuda.CUDAGraph, Channel, torch.Tensor]:
    # The channel pool is entered before torch.cuda.graph: channel creation must not be captured.
    with channel_pool.capture(owner=owner) as channel:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            assert channel_pool.current() is channel, "capture must see its own channel"
            out = step(x, channel_pool.current())
    return graph, channel, out


def _free_driver_bytes() -> int:
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info()[0]


def test_capture_target_and_draft_get_distinct_channels_replays_match_eager():
    device = torch.device("cuda")
    channel_pool = ChannelPool(
        "tp", device_channel_factory(_CHANNEL_BYTES, device, num_signal_slots=8)
    )
    x = torch.zeros(_N, device=device)
    eager = channel_pool.current()
    _target_step(x, eager)  # warm up kernels outside capture
    _draft_step(x, eager)
    torch.cuda.synchronize()

    target_graph, target, target_out = _capture(channel_pool, "target", _target_step, x)
    draft_graph, draft, draft_out = _capture(channel_pool, "draft", _draft_step, x)

    assert len({id(eager), id(target), id(draft)}) == 3
    assert channel_pool.num_channels == 3 and channel_pool.current() is eager
    channels = (eager, target, draft)
    spans = [tensor_span(ch.buffer) for ch in channels] + [
        tensor_span(ch.signal) for ch in channels
    ]
    assert overlapping_pairs(spans) == [], f"channel memory overlaps: {spans}"

    gen = torch.Generator(device=device).manual_seed(0)
    num_target, num_draft = 0, 0
    # Interleave in both orders and replay target twice in a row, as speculative decoding does.
    for order in ("td", "dt", "ttd", "dtd"):
        x.copy_(torch.randn(_N, device=device, generator=gen))
        for name in order:
            (target_graph if name == "t" else draft_graph).replay()
        num_target += order.count("t")
        num_draft += order.count("d")
        # Each graph's staged data survives the other's replay: the channels are not shared.
        torch.testing.assert_close(_staged(target), x * 2.0)
        torch.testing.assert_close(_staged(draft), x + 3.0)
        torch.testing.assert_close(target_out, _target_step(x, channel_pool.current()))
        torch.testing.assert_close(draft_out, _draft_step(x, channel_pool.current()))
    assert int(target.signal[0]) == num_target
    assert int(draft.signal[0]) == num_draft

    torch.cuda.synchronize()
    target_graph.reset()
    draft_graph.reset()
    channel_pool.close()


def test_rollback_after_throwaway_capture_returns_driver_memory():
    device = torch.device("cuda")
    channel_pool = ChannelPool("tp", device_channel_factory(_THROWAWAY_CHANNEL_BYTES, device))
    x = torch.ones(_N, device=device)
    channel_pool.current()  # the eager channel predates the checkpoint and must survive rollback

    def throwaway_capture() -> tuple[int, Channel]:
        cp = channel_pool.checkpoint()
        graph, channel, out = _capture(channel_pool, "profile", _target_step, x)
        graph.replay()
        torch.cuda.synchronize()
        free_during = torch.cuda.mem_get_info()[0]
        del out  # the graph's private pool lives until its outputs are gone too
        graph.reset()
        del graph
        channel_pool.rollback(cp)
        return free_during, channel

    # First round pays one-time costs (lazy kernel loads, graph runtime state) that stay
    # with the process, not with the graph; measure the second round only.
    throwaway_capture()
    num_channels = channel_pool.num_channels
    free_before = _free_driver_bytes()
    free_during, channel = throwaway_capture()
    free_after = _free_driver_bytes()

    assert free_before - free_during >= _THROWAWAY_CHANNEL_BYTES, "channel took no memory?"
    assert abs(free_after - free_before) <= _TOLERANCE_BYTES, (
        f"driver free memory before {free_before / _MIB:.1f} MiB, after {free_after / _MIB:.1f} MiB"
    )
    assert channel_pool.num_channels == num_channels
    with pytest.raises(RuntimeError, match="closed"):
        _ = channel.buffer
    channel_pool.close()


def test_capture_entered_inside_graph_capture_raises_naming_fix():
    # Runs last: it exercises the refusal on a really capturing stream.
    device = torch.device("cuda")
    channel_pool = ChannelPool("tp", device_channel_factory(_CHANNEL_BYTES, device))
    x = torch.zeros(_N, device=device)
    _ = x + 1.0  # warm up outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = x + 1.0  # keep the graph non-empty
        fix = r"enter channel_pool\.capture\(\) before torch\.cuda\.graph"
        with pytest.raises(RuntimeError, match=fix), channel_pool.capture(owner="late"):
            pass
        with pytest.raises(RuntimeError, match="capturing"):
            channel_pool.current()
    assert channel_pool.num_channels == 0
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(y, x + 1.0)
    graph.reset()
