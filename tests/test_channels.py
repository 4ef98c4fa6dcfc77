"""CPU tests for vllm_specgraph.channels (no GPU, no vLLM)."""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
import time
import weakref
from collections.abc import Callable

import numpy as np
import pytest
import torch

from vllm_specgraph.channels import (
    Channel,
    ChannelCloseError,
    ChannelPool,
    DeviceChannel,
    checkpoint_channel_pools,
    device_channel_factory,
    rollback_channel_pools,
)


class _FakeChannel:
    """Records its close calls, labelled by its channel pool's name, in a list shared with it."""

    def __init__(
        self, channel_id: int, owner: str, channel_pool_name: str, events: list[tuple]
    ) -> None:
        self.channel_id = channel_id
        self.owner = owner
        self._pool_name = channel_pool_name
        self._events = events

    def close_imports(self) -> None:
        self._events.append(("close_imports", self._pool_name, self.channel_id))

    def free_exports(self) -> None:
        self._events.append(("free_exports", self._pool_name, self.channel_id))


def _make_channel_pool(
    name: str = "tp",
    events: list[tuple] | None = None,
    make_channel: Callable[[int, str, str, list], Channel] | None = None,
) -> tuple[ChannelPool, list]:
    """A channel pool of fake channels recording into ``events`` (``make_channel`` builds them)."""
    events = [] if events is None else events

    def create_channel(channel_id: int, owner: str) -> Channel:
        if make_channel is not None:
            return make_channel(channel_id, owner, name, events)
        events.append(("create", name, channel_id))
        return _FakeChannel(channel_id, owner, name, events)

    channel_pool = ChannelPool(
        name,
        create_channel,
        barrier=lambda: events.append(("barrier", name)),
        synchronize=lambda: events.append(("sync", name)),
    )
    return channel_pool, events


def _state(channel_pool: ChannelPool) -> tuple:
    return channel_pool.num_channels, channel_pool.channels


def _expected_close(name: str, newest_first: list[int]) -> list[tuple]:
    return [
        ("sync", name),
        ("barrier", name),
        *[("close_imports", name, i) for i in newest_first],
        ("barrier", name),
        *[("free_exports", name, i) for i in newest_first],
        ("barrier", name),
    ]


def test_capture_each_entry_creates_fresh_channel():
    channel_pool, _ = _make_channel_pool()
    with channel_pool.capture(owner="target") as target:
        assert channel_pool.current() is target
    with channel_pool.capture(owner="draft") as draft:
        assert channel_pool.current() is draft
    assert target is not draft
    assert target.channel_id != draft.channel_id
    assert channel_pool.channels == (target, draft)


def test_capture_nested_reuses_enclosing_channel():
    channel_pool, _ = _make_channel_pool()
    with channel_pool.capture(owner="target") as outer:
        with channel_pool.capture() as inner:
            assert inner is outer
            assert channel_pool.current() is outer
        assert channel_pool.current() is outer
    assert channel_pool.num_channels == 1


def test_in_capture_true_only_inside_a_capture_block_of_this_pool():
    channel_pool, _ = _make_channel_pool()
    other, _ = _make_channel_pool("other")
    assert not channel_pool.in_capture()
    with channel_pool.capture(owner="target"):
        assert channel_pool.in_capture()
        assert not other.in_capture()
    assert not channel_pool.in_capture()


def test_current_outside_capture_creates_eager_channel_lazily():
    channel_pool, events = _make_channel_pool()
    assert channel_pool.num_channels == 0 and events == []
    eager = channel_pool.current()
    assert channel_pool.current() is eager
    with channel_pool.capture(owner="target") as target:
        assert target is not eager
    assert channel_pool.current() is eager
    assert channel_pool.num_channels == 2


def test_capture_after_eager_use_never_returns_eager_channel():
    channel_pool, _ = _make_channel_pool()
    eager = channel_pool.current()
    seen = []
    for owner in ("target", "draft"):
        with channel_pool.capture(owner=owner) as channel:
            seen.append(channel)
    assert eager not in seen and seen[0] is not seen[1]


def test_capture_exception_restores_outer_state():
    channel_pool, _ = _make_channel_pool()
    eager = channel_pool.current()
    with channel_pool.capture(owner="target") as outer:
        with pytest.raises(ValueError, match="boom"), channel_pool.capture():
            raise ValueError("boom")
        assert channel_pool.current() is outer
    with pytest.raises(KeyError), channel_pool.capture(owner="draft"):
        raise KeyError("x")
    assert channel_pool.current() is eager
    channel_pool.checkpoint()  # would raise if a capture were still counted as active


def test_capture_in_threads_is_isolated():
    channel_pool, _ = _make_channel_pool()
    eager = channel_pool.current()
    both_inside = threading.Barrier(3)
    results: dict[str, tuple] = {}

    def worker(owner: str) -> None:
        with channel_pool.capture(owner=owner) as channel:
            both_inside.wait(timeout=5)
            results[owner] = (channel, channel_pool.current())
            both_inside.wait(timeout=5)

    threads = [threading.Thread(target=worker, args=(o,)) for o in ("target", "draft")]
    for t in threads:
        t.start()
    both_inside.wait(timeout=5)
    # Other threads' captures are invisible to current() here but still block checkpoint().
    assert channel_pool.current() is eager
    with pytest.raises(RuntimeError, match="capture"):
        channel_pool.checkpoint()
    both_inside.wait(timeout=5)
    for t in threads:
        t.join(timeout=5)
    (t_ch, t_cur), (d_ch, d_cur) = results["target"], results["draft"]
    assert t_ch is t_cur and d_ch is d_cur and t_ch is not d_ch
    assert eager not in (t_ch, d_ch)


def test_capture_in_asyncio_tasks_is_isolated():
    channel_pool, _ = _make_channel_pool()

    async def task(owner: str, entered: asyncio.Event, other: asyncio.Event) -> tuple:
        with channel_pool.capture(owner=owner) as channel:
            entered.set()
            await other.wait()  # both tasks are inside their captures now
            return channel, channel_pool.current()

    async def main() -> list[tuple]:
        a, b = asyncio.Event(), asyncio.Event()
        return await asyncio.gather(task("target", a, b), task("draft", b, a))

    (t_ch, t_cur), (d_ch, d_cur) = asyncio.run(main())
    assert t_ch is t_cur and d_ch is d_cur and t_ch is not d_ch


def test_channels_view_is_read_only_snapshot():
    channel_pool, _ = _make_channel_pool()
    view = channel_pool.channels
    assert isinstance(view, tuple)
    channel_pool.current()
    assert view == () and len(channel_pool.channels) == 1


def test_rollback_newer_channels_closes_newest_first_in_coordinated_order():
    channel_pool, events = _make_channel_pool()
    with channel_pool.capture(owner="warm"):
        pass
    cp = channel_pool.checkpoint()
    for owner in ("target", "draft", "encoder"):
        with channel_pool.capture(owner=owner):
            pass
    kept = channel_pool.channels[:1]
    events.clear()
    channel_pool.rollback(cp)
    assert events == _expected_close("tp", [3, 2, 1])
    assert channel_pool.channels == kept


def test_rollback_nothing_newer_emits_no_events():
    channel_pool, events = _make_channel_pool()
    channel_pool.current()
    cp = channel_pool.checkpoint()
    events.clear()
    channel_pool.rollback(cp)
    assert events == [] and channel_pool.num_channels == 1


def test_rollback_eager_created_after_checkpoint_drops_it():
    channel_pool, events = _make_channel_pool()
    cp = channel_pool.checkpoint()
    old_eager = channel_pool.current()
    channel_pool.rollback(cp)
    assert channel_pool.num_channels == 0
    assert ("free_exports", "tp", old_eager.channel_id) in events
    new_eager = channel_pool.current()
    assert new_eager is not old_eager
    assert new_eager.channel_id != old_eager.channel_id  # ids are never reused


def test_rollback_eager_created_before_checkpoint_keeps_it():
    channel_pool, _ = _make_channel_pool()
    eager = channel_pool.current()
    cp = channel_pool.checkpoint()
    with channel_pool.capture(owner="target"):
        pass
    channel_pool.rollback(cp)
    assert channel_pool.current() is eager and channel_pool.channels == (eager,)


def test_checkpoint_during_capture_raises_and_changes_nothing():
    channel_pool, events = _make_channel_pool()
    with channel_pool.capture(owner="target"):
        before, num_events = _state(channel_pool), len(events)
        with pytest.raises(RuntimeError, match=r"channel_pool\.capture\(\)"):
            channel_pool.checkpoint()
        assert _state(channel_pool) == before and len(events) == num_events


def test_rollback_during_capture_raises_and_changes_nothing():
    channel_pool, events = _make_channel_pool()
    cp = channel_pool.checkpoint()
    with channel_pool.capture(owner="target"):
        before, num_events = _state(channel_pool), len(events)
        with pytest.raises(RuntimeError, match="refused"):
            channel_pool.rollback(cp)
        assert _state(channel_pool) == before and len(events) == num_events
    channel_pool.rollback(cp)  # the refused call did not consume the checkpoint
    assert channel_pool.num_channels == 0


def test_rollback_foreign_checkpoint_raises_value_error_naming_both_pools():
    tp, tp_events = _make_channel_pool("tp")
    dcp, _ = _make_channel_pool("dcp")
    cp = dcp.checkpoint()
    tp.current()
    before, num_events = _state(tp), len(tp_events)
    with pytest.raises(ValueError, match="dcp") as info:
        tp.rollback(cp)
    assert "tp" in str(info.value)
    assert _state(tp) == before and len(tp_events) == num_events


def test_rollback_same_name_other_pool_raises_value_error():
    first, _ = _make_channel_pool("tp")
    second, _ = _make_channel_pool("tp")
    with pytest.raises(ValueError, match="serial"):
        second.rollback(first.checkpoint())


def test_rollback_used_checkpoint_raises_and_changes_nothing():
    channel_pool, events = _make_channel_pool()
    cp = channel_pool.checkpoint()
    channel_pool.current()
    channel_pool.rollback(cp)
    channel_pool.current()
    before, num_events = _state(channel_pool), len(events)
    with pytest.raises(RuntimeError, match="already used"):
        channel_pool.rollback(cp)
    assert _state(channel_pool) == before and len(events) == num_events


def test_rollback_to_earlier_checkpoint_invalidates_later_ones():
    channel_pool, _ = _make_channel_pool()
    early = channel_pool.checkpoint()
    with channel_pool.capture(owner="target"):
        pass
    late = channel_pool.checkpoint()
    channel_pool.rollback(early)
    with channel_pool.capture(owner="draft"), channel_pool.capture():
        pass
    with pytest.raises(RuntimeError, match="invalidated"):
        channel_pool.rollback(late)
    assert channel_pool.num_channels == 1


def test_checkpoint_channel_pools_shared_pool_checkpointed_once_in_first_seen_order():
    tp, _ = _make_channel_pool("tp")
    pp, _ = _make_channel_pool("pp")
    cp = checkpoint_channel_pools([tp, tp, pp, tp])  # TP and DCP groups share one communicator
    assert cp.channel_pools == (tp, pp)
    assert [c.channel_pool_name for c in cp.checkpoints] == ["tp", "pp"]


def test_rollback_channel_pools_rolls_back_in_reverse_order():
    events: list[tuple] = []
    channel_pools = [_make_channel_pool(name, events)[0] for name in ("tp", "dcp", "pp")]
    cp = checkpoint_channel_pools(
        [channel_pools[0], channel_pools[1], channel_pools[0], channel_pools[2]]
    )
    for channel_pool in channel_pools:
        with channel_pool.capture(owner="target"):
            pass
    events.clear()
    rollback_channel_pools(cp)
    assert events == [e for name in ("pp", "dcp", "tp") for e in _expected_close(name, [0])]


def test_rollback_channel_pools_one_pool_capturing_changes_nothing():
    events: list[tuple] = []
    tp, _ = _make_channel_pool("tp", events)
    pp, _ = _make_channel_pool("pp", events)
    cp = checkpoint_channel_pools([tp, pp])
    tp.current()
    with pp.capture(owner="target"):
        num_events = len(events)
        with pytest.raises(RuntimeError, match="pp"):
            rollback_channel_pools(cp)
        assert len(events) == num_events and tp.num_channels == 1
    rollback_channel_pools(cp)
    assert tp.num_channels == 0 and pp.num_channels == 0


def _fake_capturing_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    # Fakes what needs a GPU: a CUDA device whose current stream is capturing a graph.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)


def test_capture_while_stream_capturing_raises_naming_fix(monkeypatch):
    channel_pool, events = _make_channel_pool()
    _fake_capturing_stream(monkeypatch)
    fix = r"enter channel_pool\.capture\(\) before torch\.cuda\.graph"
    with pytest.raises(RuntimeError, match=fix), channel_pool.capture(owner="target"):
        pass
    assert channel_pool.num_channels == 0 and events == []
    monkeypatch.undo()
    channel_pool.checkpoint()  # the refused entry left no capture counted as active


def test_current_eager_creation_while_stream_capturing_raises(monkeypatch):
    channel_pool, _ = _make_channel_pool()
    _fake_capturing_stream(monkeypatch)
    with pytest.raises(RuntimeError, match="capturing"):
        channel_pool.current()
    assert channel_pool.num_channels == 0


def test_current_existing_eager_channel_refused_to_capturing_stream(monkeypatch):
    channel_pool, _ = _make_channel_pool()
    eager = channel_pool.current()
    _fake_capturing_stream(monkeypatch)  # a graph captured without entering channel_pool.capture()
    fix = r"enter channel_pool\.capture\(\) before torch\.cuda\.graph"
    with pytest.raises(RuntimeError, match=fix):
        channel_pool.current()
    monkeypatch.undo()
    assert channel_pool.current() is eager and channel_pool.num_channels == 1


def test_capture_nested_while_stream_capturing_reuses_without_creating(monkeypatch):
    channel_pool, _ = _make_channel_pool()
    with channel_pool.capture(owner="target") as outer:
        _fake_capturing_stream(monkeypatch)  # torch.cuda.graph(...) entered after the channel pool
        with channel_pool.capture() as inner:
            assert inner is outer and channel_pool.current() is outer


def test_close_all_channels_closes_newest_first_and_refuses_reuse():
    channel_pool, events = _make_channel_pool()
    channel_pool.current()
    with channel_pool.capture(owner="target"):
        pass
    events.clear()
    channel_pool.close()
    assert events == _expected_close("tp", [1, 0])
    assert channel_pool.num_channels == 0
    num_events = len(events)
    channel_pool.close()  # idempotent
    assert len(events) == num_events
    with pytest.raises(RuntimeError, match="closed"):
        channel_pool.current()
    with pytest.raises(RuntimeError, match="closed"):
        channel_pool.checkpoint()


def test_close_during_capture_raises_and_changes_nothing():
    channel_pool, events = _make_channel_pool()
    with channel_pool.capture(owner="target"), pytest.raises(RuntimeError, match="close"):
        channel_pool.close()
    assert channel_pool.num_channels == 1 and len(events) == 1
    channel_pool.current()


def test_pool_default_barrier_and_synchronize_work_on_cpu():
    channel_pool = ChannelPool("solo", device_channel_factory(64, "cpu"))
    cp = channel_pool.checkpoint()
    with channel_pool.capture(owner="target") as channel:
        pass
    channel_pool.rollback(cp)
    with pytest.raises(RuntimeError, match="closed"):
        _ = channel.buffer


def test_device_channel_owns_buffer_and_signal_until_freed():
    channel = DeviceChannel(7, "target", 128, "cpu", num_signal_slots=4)
    assert isinstance(channel, Channel)
    assert channel.buffer.dtype == torch.uint8 and channel.buffer.numel() == 128
    assert channel.signal.dtype == torch.int32 and channel.signal.numel() == 4
    channel.close_imports()
    with pytest.raises(RuntimeError, match="closed"):
        _ = channel.buffer
    channel.free_exports()
    with pytest.raises(RuntimeError, match="closed"):
        _ = channel.signal


@pytest.mark.parametrize(("nbytes", "slots"), [(0, 4), (16, 0), (-1, 4)])
def test_device_channel_factory_bad_sizes_raises_value_error(nbytes, slots):
    with pytest.raises(ValueError, match="must be >= 1"):
        device_channel_factory(nbytes, "cpu", num_signal_slots=slots)
    with pytest.raises(ValueError, match="must be >= 1"):
        DeviceChannel(0, "x", nbytes, "cpu", num_signal_slots=slots)


def test_device_channel_factory_creates_channels_with_given_id_and_owner():
    create = device_channel_factory(32, "cpu", num_signal_slots=2)
    channel = create(3, "draft")
    assert channel.channel_id == 3 and channel.owner == "draft"
    assert channel.buffer.numel() == 32 and channel.signal.numel() == 2


@pytest.mark.parametrize(
    ("nbytes", "slots", "message"),
    [
        ("16", 4, r"nbytes must be an int, got '16' \(str\)"),
        (16.0, 4, r"nbytes must be an int, got 16.0 \(float\)"),
        (True, 4, r"nbytes must be an int, got True \(bool\)"),
        (16, None, r"num_signal_slots must be an int, got None \(NoneType\)"),
    ],
)
def test_device_channel_factory_wrong_types_raise_type_error_naming_argument(
    nbytes, slots, message
):
    with pytest.raises(TypeError, match=message):
        device_channel_factory(nbytes, "cpu", num_signal_slots=slots)
    with pytest.raises(TypeError, match=message):
        DeviceChannel(0, "x", nbytes, "cpu", num_signal_slots=slots)


@pytest.mark.parametrize(
    ("device", "error", "match"),
    [
        (None, TypeError, "device must be a torch.device, .*got None"),
        (True, TypeError, "device must be a torch.device, .*got True"),
        (1.0, TypeError, "device must be a torch.device, .*got 1.0"),
        ("gpu", ValueError, "device 'gpu' is not a device torch can use"),
    ],
)
def test_device_channel_bad_device_raises_naming_it_when_the_factory_is_made(device, error, match):
    with pytest.raises(error, match=match):
        device_channel_factory(16, device)
    with pytest.raises(error, match=match):
        DeviceChannel(0, "x", 16, device)


def test_device_channel_numpy_integers_count_as_ints():
    channel = device_channel_factory(np.int64(16), "cpu", num_signal_slots=np.int64(2))(
        np.int64(3), "draft"
    )
    assert type(channel.channel_id) is int and channel.channel_id == 3
    assert channel.buffer.numel() == 16 and channel.signal.numel() == 2


@pytest.mark.parametrize(
    ("channel_id", "owner", "named"),
    [(-1, "x", "channel_id"), ("0", "x", "channel_id"), (True, "x", "channel_id"), (0, 5, "owner")],
)
def test_device_channel_bad_id_or_owner_raises_naming_argument(channel_id, owner, named):
    with pytest.raises((TypeError, ValueError), match=named):
        DeviceChannel(channel_id, owner, 16, "cpu")


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"name": None}, "name must be a non-empty str, got None"),
        ({"name": 3}, "name must be a non-empty str, got 3"),
        ({"create_channel": 3}, "create_channel must be callable, got 3"),
        ({"barrier": "dist.barrier"}, "barrier must be callable, got 'dist.barrier'"),
        ({"synchronize": 0}, "synchronize must be callable, got 0"),
    ],
)
def test_init_wrong_types_raise_type_error_naming_argument(kwargs, named):
    args = {"name": "tp", "create_channel": lambda cid, owner: None} | kwargs
    with pytest.raises(TypeError, match=named):
        ChannelPool(**args)


def test_init_empty_name_raises_value_error():
    with pytest.raises(ValueError, match="name must be a non-empty str, got ''"):
        ChannelPool("", lambda cid, owner: None)


@pytest.mark.parametrize(
    ("owner", "error"), [(None, TypeError), (3, TypeError), (True, TypeError), ("", ValueError)]
)
def test_capture_bad_owner_raises_and_changes_nothing(owner, error):
    channel_pool, events = _make_channel_pool()
    with (
        pytest.raises(error, match=f"owner must be a non-empty str, got {owner!r}"),
        channel_pool.capture(owner),
    ):
        pass
    assert channel_pool.num_channels == 0 and events == []
    channel_pool.checkpoint()  # no capture was left counted as active


def test_create_channel_returning_non_channel_raises_type_error_and_keeps_nothing():
    channel_pool = ChannelPool("tp", lambda cid, owner: object(), synchronize=lambda: None)
    message = r"create_channel\(0, 'target'\) returned .*not a Channel"
    with pytest.raises(TypeError, match=message), channel_pool.capture("target"):
        pass
    assert channel_pool.num_channels == 0
    channel_pool.checkpoint()


def test_rollback_wrong_checkpoint_type_raises_type_error_and_changes_nothing():
    channel_pool, events = _make_channel_pool()
    cp = channel_pool.checkpoint()
    channel_pool.current()
    before, num_events = _state(channel_pool), len(events)
    with pytest.raises(TypeError, match="cp must be a ChannelCheckpoint, got None"):
        channel_pool.rollback(None)
    with pytest.raises(
        TypeError, match="cp must be a ChannelCheckpoint, got ChannelPoolsCheckpoint"
    ):
        channel_pool.rollback(checkpoint_channel_pools([channel_pool]))
    with pytest.raises(TypeError, match="cp must be a ChannelPoolsCheckpoint"):
        rollback_channel_pools(cp)
    assert _state(channel_pool) == before and len(events) == num_events


def test_checkpoint_channel_pools_single_pool_or_other_objects_raise_type_error():
    channel_pool, _ = _make_channel_pool()
    with pytest.raises(TypeError, match=r"single ChannelPool 'tp'; pass \[channel_pool\]"):
        checkpoint_channel_pools(channel_pool)
    with pytest.raises(TypeError, match=r"channel_pools\[1\] must be a ChannelPool, got 'tp'"):
        checkpoint_channel_pools([channel_pool, "tp"])


@pytest.mark.parametrize("channel_pools", [None, 3, "tp"])
def test_checkpoint_channel_pools_of_no_iterable_names_it_and_checkpoints_nothing(channel_pools):
    channel_pool, _ = _make_channel_pool()
    match = rf"channel_pools must be an iterable of ChannelPool, got {channel_pools!r}"
    with pytest.raises(TypeError, match=match):
        checkpoint_channel_pools(channel_pools)
    assert not channel_pool._live_tokens


def test_checkpoint_channel_pools_reads_an_iterator_once():
    channel_pool, _ = _make_channel_pool()
    cp = checkpoint_channel_pools(iter([channel_pool, channel_pool]))
    assert cp.channel_pools == (channel_pool,) and len(cp.checkpoints) == 1


def test_capture_and_rollback_in_threads_never_hand_out_a_closed_channel():
    """Two threads capture while a third checkpoints and rolls back, as fast as they can."""
    closed_ids: list[int] = []

    class _ClosableChannel:
        def __init__(self, channel_id: int, owner: str) -> None:
            self.channel_id, self.owner, self.closed = channel_id, owner, False

        def close_imports(self) -> None:
            self.closed = True

        def free_exports(self) -> None:
            closed_ids.append(self.channel_id)

    channel_pool = ChannelPool("tp", _ClosableChannel, synchronize=lambda: None)
    stop = threading.Event()
    bad: list[str] = []

    def capture_loop() -> None:
        try:
            while not stop.is_set():
                with channel_pool.capture("target") as channel:
                    if channel.closed or channel not in channel_pool.channels:
                        bad.append(f"capture got channel {channel.channel_id}, rolled back")
                time.sleep(0)  # leave the rollback thread moments when no capture is active
        except Exception as exc:
            bad.append(repr(exc))

    def rollback_loop() -> None:
        while not stop.is_set():
            try:
                channel_pool.rollback(channel_pool.checkpoint())
            except RuntimeError as exc:
                if "refused" not in str(exc):  # refusals are expected while captures run
                    bad.append(repr(exc))

    # Switching threads every microsecond opens any unguarded window within milliseconds.
    switch_interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    threads = [threading.Thread(target=capture_loop) for _ in range(2)]
    threads.append(threading.Thread(target=rollback_loop))
    try:
        for thread in threads:
            thread.start()
        stop.wait(0.5)
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=5)
        sys.setswitchinterval(switch_interval)
    assert bad == []
    assert closed_ids, "no rollback closed a channel: the test exercised nothing"


class _FailingChannel(_FakeChannel):
    """A fake channel whose ``fail`` step raises OSError the first ``times`` times."""

    def __init__(self, *args, fail: str, times: int = 1) -> None:
        super().__init__(*args)
        self._fail, self._times = fail, times

    def close_imports(self) -> None:
        self._maybe_fail("close_imports")
        super().close_imports()

    def free_exports(self) -> None:
        self._maybe_fail("free_exports")
        super().free_exports()

    def _maybe_fail(self, step: str) -> None:
        if step == self._fail and self._times > 0:
            self._times -= 1
            self._events.append((f"{step} failed", self._pool_name, self.channel_id))
            raise OSError(f"{step} of channel {self.channel_id} failed")


def _make_failing_channel_pool(fail: str, failing_id: int, name: str = "tp", events=None):
    """A channel pool like _make_channel_pool's whose channel ``failing_id`` fails ``fail`` once."""

    def make_channel(channel_id: int, owner: str, pool_name: str, events: list) -> Channel:
        if channel_id == failing_id:
            return _FailingChannel(channel_id, owner, pool_name, events, fail=fail)
        return _FakeChannel(channel_id, owner, pool_name, events)

    return _make_channel_pool(name, events, make_channel)


def _capture_three(channel_pool: ChannelPool) -> None:
    for owner in ("target", "draft", "encoder"):
        with channel_pool.capture(owner=owner):
            pass


def test_rollback_close_imports_fails_keeps_channels_owned_and_retry_close_finishes():
    channel_pool, events = _make_failing_channel_pool("close_imports", failing_id=2)
    eager = channel_pool.current()
    cp = channel_pool.checkpoint()
    _capture_three(channel_pool)  # channels 1, 2, 3
    doomed = channel_pool.channels[1:]
    events.clear()
    with pytest.raises(
        ChannelCloseError, match=r"channel\(s\) \[3, 2, 1\].*retry_close\(\)"
    ) as info:
        channel_pool.rollback(cp)
    assert "close_imports failed for channel 2: OSError" in str(info.value)
    assert info.value.channel_ids == (3, 2, 1) and info.value.channel_pool_name == "tp"
    # The other channels' imports were still closed; nothing was freed past the failure.
    assert events == [
        ("sync", "tp"),
        ("barrier", "tp"),
        ("close_imports", "tp", 3),
        ("close_imports failed", "tp", 2),
        ("close_imports", "tp", 1),
    ]
    assert channel_pool.channels == (eager,)
    assert channel_pool.unclosed_channels == doomed[::-1]
    events.clear()
    channel_pool.retry_close()
    assert events == [
        ("sync", "tp"),
        ("barrier", "tp"),
        ("close_imports", "tp", 2),  # only the one that failed
        ("barrier", "tp"),
        *[("free_exports", "tp", i) for i in (3, 2, 1)],
        ("barrier", "tp"),
    ]
    assert channel_pool.unclosed_channels == ()


def test_rollback_free_exports_fails_keeps_only_that_channel_owned():
    channel_pool, events = _make_failing_channel_pool("free_exports", failing_id=1)
    cp = channel_pool.checkpoint()
    _capture_three(channel_pool)  # channels 0, 1, 2
    with pytest.raises(ChannelCloseError, match=r"free_exports .*channel\(s\) \[1\]"):
        channel_pool.rollback(cp)
    assert [e[2] for e in events if e[0] == "free_exports"] == [2, 0]
    assert [ch.channel_id for ch in channel_pool.unclosed_channels] == [1]
    assert channel_pool.channels == ()
    events.clear()
    channel_pool.retry_close()
    assert [e for e in events if e[0] in ("close_imports", "free_exports")] == [
        ("free_exports", "tp", 1)
    ]
    assert channel_pool.unclosed_channels == ()


def test_rollback_barrier_fails_keeps_every_channel_owned_and_retry_close_finishes():
    events: list[tuple] = []
    num_barriers = [0]

    def barrier() -> None:
        num_barriers[0] += 1
        if num_barriers[0] == 2:  # the one between close_imports and free_exports
            raise TimeoutError("peer rank did not arrive")

    channel_pool = ChannelPool(
        "tp", lambda cid, owner: _FakeChannel(cid, owner, "tp", events), barrier=barrier
    )
    cp = channel_pool.checkpoint()
    _capture_three(channel_pool)
    doomed = channel_pool.channels
    with pytest.raises(ChannelCloseError, match=r"second barrier \(TimeoutError\(.*\[2, 1, 0\]"):
        channel_pool.rollback(cp)
    assert channel_pool.unclosed_channels == doomed[::-1]
    assert not [e for e in events if e[0] == "free_exports"]
    channel_pool.retry_close()
    assert [e[2] for e in events if e[0] == "free_exports"] == [2, 1, 0]
    assert [e[2] for e in events if e[0] == "close_imports"] == [2, 1, 0]  # not twice
    assert channel_pool.unclosed_channels == ()


def test_close_fails_then_retry_close_on_closed_pool_frees_the_rest():
    channel_pool, events = _make_failing_channel_pool("close_imports", failing_id=0)
    channel_pool.current()
    with pytest.raises(ChannelCloseError, match=r"close\(\) failed"):
        channel_pool.close()
    assert [ch.channel_id for ch in channel_pool.unclosed_channels] == [0]
    channel_pool.retry_close()
    assert channel_pool.unclosed_channels == ()
    assert ("free_exports", "tp", 0) in events


def test_rollback_channel_pools_one_pool_fails_to_close_the_others_still_roll_back():
    events: list[tuple] = []
    tp, _ = _make_failing_channel_pool("close_imports", failing_id=0, name="tp", events=events)
    pp, _ = _make_channel_pool("pp", events)
    cp = checkpoint_channel_pools([tp, pp])
    for channel_pool in (tp, pp):
        with channel_pool.capture(owner="target"):
            pass
    with pytest.raises(ChannelCloseError, match="'tp'"):
        rollback_channel_pools(cp)  # pp first (reverse order), then tp fails
    assert pp.num_channels == 0 and pp.unclosed_channels == ()
    assert ("free_exports", "pp", 0) in events
    assert [ch.channel_id for ch in tp.unclosed_channels] == [0]


def test_rollback_channel_pools_later_rolled_back_pool_capturing_leaves_earlier_untouched():
    events: list[tuple] = []
    tp, _ = _make_channel_pool("tp", events)
    pp, _ = _make_channel_pool("pp", events)
    cp = checkpoint_channel_pools([tp, pp])  # rolled back in reverse: pp first, then tp
    pp.current()
    with tp.capture(owner="target"):
        num_events = len(events)
        with pytest.raises(RuntimeError, match=r"'tp'.*refused"):
            rollback_channel_pools(cp)
        assert len(events) == num_events, "pp was rolled back before tp's check refused"
        assert pp.num_channels == 1 and tp.num_channels == 1
    rollback_channel_pools(cp)  # the refused call consumed neither checkpoint
    assert tp.num_channels == 0 and pp.num_channels == 0


def test_device_channel_free_exports_drops_its_tensors():
    channel = DeviceChannel(0, "target", 64, "cpu", num_signal_slots=4)
    buffer, signal = weakref.ref(channel.buffer), weakref.ref(channel.signal)
    channel.close_imports()
    assert buffer() is not None, "close_imports must leave this rank's exports alone"
    channel.free_exports()
    assert buffer() is None and signal() is None


def test_rollback_device_channel_drops_its_tensors():
    channel_pool = ChannelPool("solo", device_channel_factory(64, "cpu"), synchronize=lambda: None)
    cp = channel_pool.checkpoint()
    with channel_pool.capture(owner="target") as channel:
        buffer, signal = weakref.ref(channel.buffer), weakref.ref(channel.signal)
    channel_pool.rollback(cp)
    assert buffer() is None and signal() is None  # though the test still holds the channel


@pytest.mark.parametrize("where", ["task", "thread", "out of order"])
def test_a_capture_block_ends_wherever_and_in_whatever_order_it_exits(where, caplog):
    """A block whose exit runs in another context (another thread or task), or
    before a block nested in it, still ends: it is no longer counted, so checkpoints
    and rollbacks go on, and the context that entered it no longer sees its channel."""
    import contextvars

    channel_pool, _ = _make_channel_pool()
    outer = channel_pool.capture(owner="target")
    channel = outer.__enter__()
    inner = channel_pool.capture(owner="target")
    assert inner.__enter__() is channel, "a nested block reuses the channel"
    inner.__exit__(None, None, None)
    if where == "out of order":
        inner = channel_pool.capture(owner="target")
        inner.__enter__()
        outer.__exit__(None, None, None)
        assert channel_pool.in_capture(), "the nested block is still open"
        with pytest.raises(RuntimeError, match=r"1 capture block\(s\) are active"):
            channel_pool.checkpoint()
        inner.__exit__(None, None, None)
    elif where == "task":
        contextvars.copy_context().run(outer.__exit__, None, None, None)
    else:
        thread = threading.Thread(target=outer.__exit__, args=(None, None, None))
        with caplog.at_level(logging.WARNING, logger="vllm.specgraph"):
            thread.start()
            thread.join()
        assert "exited in another thread or task" in caplog.text
    assert not channel_pool.in_capture()
    assert channel_pool.current() is not channel, "the eager channel, not the capture's"
    checkpoint = channel_pool.checkpoint()
    channel_pool.rollback(checkpoint)


def test_channel_creation_in_threads_is_one_at_a_time_with_distinct_ids():
    """Creation is collective (a rendezvous): two threads capturing at once must not
    create channels concurrently, nor hand out one id twice."""
    import time

    inside, most = [0], [0]

    def slow_channel(channel_id, owner, name, events):
        inside[0] += 1
        most[0] = max(most[0], inside[0])
        time.sleep(0.05)  # a rendezvous takes time: room for another thread to enter
        inside[0] -= 1
        return _FakeChannel(channel_id, owner, name, events)

    channel_pool, _ = _make_channel_pool(make_channel=slow_channel)
    start = threading.Barrier(2)
    ids = []

    def capture(owner):
        start.wait()
        with channel_pool.capture(owner=owner) as channel:
            ids.append(channel.channel_id)

    threads = [threading.Thread(target=capture, args=(o,)) for o in ("target", "draft")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert most[0] == 1 and sorted(ids) == [0, 1]
