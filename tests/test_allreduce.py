"""CPU tests for vllm_specgraph.allreduce (no GPU).

What needs a GPU is faked, and each test says so: the symmetric-memory kernels
(``_run_symm_mem_op``), torch's symmetric-memory allocation and rendezvous, and a capturing
stream. Process groups are real (gloo, one rank in this process); two ranks run in
test_allreduce_multiprocess.py.
"""

from __future__ import annotations

import gc
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from vllm_specgraph import allreduce as allreduce_module
from vllm_specgraph.allreduce import (
    CHANNEL_BYTES,
    ONE_SHOT_MAX_BYTES,
    Algorithm,
    AllReduceConfig,
    PeerAllReduce,
    select_algorithm,
)
from vllm_specgraph.channels import checkpoint_channel_pools, rollback_channel_pools
from vllm_specgraph.device_channel import DeviceChannel, device_channel_factory
from vllm_specgraph.symm_mem_channel import symm_mem_channel_factory

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()),
    reason="torch.distributed with the gloo backend is not available in this torch build",
)

BF16, FP32 = torch.bfloat16, torch.float32
_CONFIG = AllReduceConfig(channel_bytes=4096, one_shot_max_bytes=1024)


def test_allreduce_imports_torch_only_never_vllm():
    code = (
        "import sys, vllm_specgraph.allreduce, vllm_specgraph.symm_mem_channel; "
        "print(sorted(m for m in sys.modules if m == 'vllm' or m.startswith('vllm.')))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]", done.stdout


# --- select_algorithm: pure --------------------------------------------------------------


@pytest.mark.parametrize(
    ("nbytes", "expected"),
    [
        (4, Algorithm.ONE_SHOT),
        (1024, Algorithm.ONE_SHOT),  # at the one-shot limit
        (1028, Algorithm.TWO_SHOT),
        (4096, Algorithm.TWO_SHOT),  # fills the channel
        (4100, Algorithm.NCCL),  # the channel cannot hold it
    ],
)
def test_select_algorithm_by_size_one_shot_then_two_shot_then_nccl(nbytes, expected):
    for dtype in (BF16, FP32):
        assert select_algorithm(nbytes, dtype, 2, _CONFIG) is expected, dtype


@pytest.mark.parametrize("dtype", [torch.float16, torch.int32, torch.float64, torch.uint8])
def test_select_algorithm_dtype_the_kernels_lack_goes_nccl(dtype):
    assert select_algorithm(64, dtype, 2, _CONFIG) is Algorithm.NCCL
    assert select_algorithm(2048, dtype, 2, _CONFIG) is Algorithm.NCCL


def test_select_algorithm_size_no_multiple_of_4_bytes_goes_nccl():
    assert select_algorithm(6, BF16, 2, _CONFIG) is Algorithm.NCCL  # 3 bf16 elements
    assert select_algorithm(1030, BF16, 2, _CONFIG) is Algorithm.NCCL


@pytest.mark.parametrize("world_size", [3, 5, 6, 16])
def test_select_algorithm_world_size_without_two_shot_kernel_goes_nccl_above_one_shot(world_size):
    assert select_algorithm(1024, BF16, world_size, _CONFIG) is Algorithm.ONE_SHOT
    assert select_algorithm(2048, BF16, world_size, _CONFIG) is Algorithm.NCCL


@pytest.mark.parametrize("world_size", [2, 4, 8])
def test_select_algorithm_two_shot_world_sizes(world_size):
    assert select_algorithm(2048, BF16, world_size, _CONFIG) is Algorithm.TWO_SHOT


def test_select_algorithm_config_overrides():
    never_one_shot = AllReduceConfig(channel_bytes=4096, one_shot_max_bytes=0)
    assert select_algorithm(4, BF16, 2, never_one_shot) is Algorithm.TWO_SHOT
    never_two_shot = AllReduceConfig(4096, one_shot_max_bytes=1024, two_shot_max_bytes=0)
    assert select_algorithm(2048, BF16, 2, never_two_shot) is Algorithm.NCCL
    two_shot_to_2k = AllReduceConfig(4096, one_shot_max_bytes=1024, two_shot_max_bytes=2048)
    assert select_algorithm(2048, BF16, 2, two_shot_to_2k) is Algorithm.TWO_SHOT
    assert select_algorithm(2052, BF16, 2, two_shot_to_2k) is Algorithm.NCCL
    one_shot_beyond_channel = AllReduceConfig(channel_bytes=1024, one_shot_max_bytes=1 << 30)
    assert select_algorithm(1024, BF16, 2, one_shot_beyond_channel) is Algorithm.ONE_SHOT
    assert select_algorithm(1028, BF16, 2, one_shot_beyond_channel) is Algorithm.NCCL


def test_default_config_uses_the_named_constants():
    config = AllReduceConfig()
    assert (config.channel_bytes, config.one_shot_max_bytes) == (CHANNEL_BYTES, ONE_SHOT_MAX_BYTES)
    assert select_algorithm(ONE_SHOT_MAX_BYTES, BF16, 2, config) is Algorithm.ONE_SHOT
    assert select_algorithm(ONE_SHOT_MAX_BYTES + 4, BF16, 2, config) is Algorithm.TWO_SHOT
    assert select_algorithm(CHANNEL_BYTES + 4, BF16, 2, config) is Algorithm.NCCL


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"channel_bytes": 0}, ValueError, "channel_bytes must be >= 1, got 0"),
        ({"channel_bytes": 1.5}, TypeError, "channel_bytes must be an int"),
        ({"one_shot_max_bytes": -1}, ValueError, "one_shot_max_bytes must be >= 0, got -1"),
        ({"one_shot_max_bytes": True}, TypeError, "one_shot_max_bytes must be an int"),
        ({"two_shot_max_bytes": -4}, ValueError, "two_shot_max_bytes must be >= 0, got -4"),
        ({"two_shot_max_bytes": "1M"}, TypeError, "two_shot_max_bytes must be an int"),
        ({"channel_bytes": None}, TypeError, "channel_bytes must be an int, got None"),
        ({"one_shot_max_bytes": None}, TypeError, "one_shot_max_bytes must be an int, got None"),
    ],
)
def test_config_bad_field_raises_naming_field_and_value(kwargs, error, match):
    with pytest.raises(error, match=match):
        AllReduceConfig(**kwargs)


# --- PeerAllReduce on one gloo rank -------------------------------------------------------


@pytest.fixture
def group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


class _Factory:
    """CPU channels (DeviceChannel stands in for symmetric memory); counts what it made."""

    def __init__(self, nbytes: int = _CONFIG.channel_bytes) -> None:
        self._create = device_channel_factory(nbytes, "cpu")
        self.channels: list[DeviceChannel] = []

    def __call__(self, channel_id: int, owner: str) -> DeviceChannel:
        channel = self._create(channel_id, owner)
        self.channels.append(channel)
        return channel


@pytest.fixture
def symm_calls(monkeypatch):
    """Fakes the symmetric-memory kernels: one rank's sum is its own input; records calls."""
    calls: list[tuple[Algorithm, int, str]] = []

    def fake_op(algorithm, staged, group_name, out):
        calls.append((algorithm, staged.data_ptr(), group_name))
        out.copy_(staged)

    monkeypatch.setattr(allreduce_module, "_run_symm_mem_op", fake_op)
    return calls


def _make(group, factory=None, config=_CONFIG) -> tuple[PeerAllReduce, _Factory]:
    factory = _Factory(config.channel_bytes) if factory is None else factory
    return PeerAllReduce(group, "cpu", config, create_channel=factory), factory


def _in_buffer(data_ptr: int, channel: DeviceChannel) -> bool:
    start = channel.buffer.data_ptr()
    return start <= data_ptr < start + channel.buffer.numel()


def test_all_reduce_symm_mem_path_stages_in_eager_channel_and_returns_sum(group, symm_calls):
    all_reduce, factory = _make(group)
    x = torch.randn(16, 8, dtype=BF16)
    y = all_reduce.all_reduce(x)
    assert torch.equal(y, x) and y is not x and y.shape == x.shape
    ((algorithm, data_ptr, group_name),) = symm_calls
    assert algorithm is Algorithm.ONE_SHOT and group_name == group.group_name
    (eager,) = factory.channels
    assert data_ptr == eager.buffer.data_ptr() and all_reduce.channel_pool.current() is eager


def test_all_reduce_each_capture_stages_in_its_own_channel(group, symm_calls):
    all_reduce, factory = _make(group)
    x = torch.randn(32, dtype=FP32)
    all_reduce.all_reduce(x)  # eager channel first
    for owner in ("target", "draft"):
        with all_reduce.channel_pool.capture(owner=owner) as channel:
            assert torch.equal(all_reduce.all_reduce(x), x)
            assert _in_buffer(symm_calls[-1][1], channel), owner
    eager, target, draft = factory.channels
    assert (target.owner, draft.owner) == ("target", "draft")
    assert [_in_buffer(call[1], eager) for call in symm_calls] == [True, False, False]


def test_all_reduce_non_contiguous_input_gives_contiguous_sum(group, symm_calls):
    all_reduce, _ = _make(group)
    x = torch.randn(16, 8, dtype=BF16).t()
    y = all_reduce.all_reduce(x)
    assert symm_calls[-1][0] is Algorithm.ONE_SHOT
    assert torch.equal(y, x) and y.is_contiguous()


def test_all_reduce_in_place_with_out_x(group, symm_calls):
    all_reduce, _ = _make(group)
    for dtype in (FP32, torch.float16):  # one-shot, then NCCL
        x = torch.randn(8, dtype=dtype)
        expected = x.clone()
        assert all_reduce.all_reduce(x, out=x) is x
        assert torch.equal(x, expected)
    assert len(symm_calls) == 1


@pytest.mark.parametrize(
    ("x", "why"),
    [
        (torch.randn(8, dtype=torch.float16), "dtype"),
        (torch.arange(8, dtype=torch.int64), "dtype"),
        (torch.randn(3, dtype=BF16), "size"),
        (torch.randn(_CONFIG.channel_bytes // 4 + 1, dtype=FP32), "channel"),
    ],
)
def test_all_reduce_nccl_fallback_creates_no_channel(group, symm_calls, x, why):
    all_reduce, factory = _make(group)
    assert all_reduce.select(x) is Algorithm.NCCL, why
    assert torch.equal(all_reduce.all_reduce(x), x)
    assert symm_calls == [] and factory.channels == []


def test_all_reduce_records_no_autograd_history_in_channel(group, symm_calls):
    all_reduce, factory = _make(group)
    x = torch.randn(8, dtype=FP32, requires_grad=True)
    y = all_reduce.all_reduce(x)
    assert not y.requires_grad and y.grad_fn is None
    (eager,) = factory.channels
    assert eager.buffer.grad_fn is None, "the channel would keep x's autograd graph alive"


def test_all_reduce_empty_input_sends_nothing(group, symm_calls):
    all_reduce, factory = _make(group)
    y = all_reduce.all_reduce(torch.empty(0, 4, dtype=BF16))
    assert y.shape == (0, 4) and symm_calls == [] and factory.channels == []


def test_all_reduce_forced_algorithm_is_used(group, symm_calls):
    all_reduce, factory = _make(group, config=AllReduceConfig(channel_bytes=4096))
    x = torch.randn(16, dtype=FP32)  # one-shot by size
    assert torch.equal(all_reduce.all_reduce(x, algorithm=Algorithm.NCCL), x)
    assert symm_calls == [] and factory.channels == []
    all_reduce.all_reduce(torch.randn(1000, dtype=FP32), algorithm=Algorithm.ONE_SHOT)
    assert symm_calls[-1][0] is Algorithm.ONE_SHOT


def _misaligned_out(n: int) -> torch.Tensor:
    out = torch.empty(n + 1, dtype=FP32)[1:]  # 4 bytes past a 16-byte boundary
    assert out.data_ptr() % 16 == 4
    return out


def test_all_reduce_misaligned_out_goes_nccl(group, symm_calls):
    all_reduce, factory = _make(group)
    x, out = torch.randn(8, dtype=FP32), _misaligned_out(8)
    assert all_reduce.select(x, out) is Algorithm.NCCL
    assert all_reduce.all_reduce(x, out=out) is out and torch.equal(out, x)
    assert symm_calls == [] and factory.channels == []


def _bad_calls():
    x = torch.randn(8, dtype=FP32)
    return [
        ({"x": x.numpy()}, TypeError, "x must be a Tensor"),
        ({"x": torch.empty(8, device="meta")}, ValueError, "x is on meta.*runs on cpu"),
        ({"x": x, "out": [0.0] * 8}, TypeError, "out must be a Tensor"),
        ({"x": x, "out": torch.empty(4)}, ValueError, r"out has shape.*\(4,\).*x has.*\(8,\)"),
        ({"x": x, "out": torch.empty(8, dtype=BF16)}, ValueError, "bfloat16.*float32"),
        ({"x": x, "out": torch.empty(8, 2)[:, 0]}, ValueError, "out is not contiguous"),
        ({"x": x, "algorithm": "one_shot"}, TypeError, "algorithm must be a Algorithm"),
        (
            {"x": torch.randn(8, dtype=torch.float16), "algorithm": Algorithm.ONE_SHOT},
            ValueError,
            r"one_shot cannot sum x.*dtype torch\.float16",
        ),
        (
            {"x": torch.randn(2000, dtype=FP32), "algorithm": Algorithm.ONE_SHOT},
            ValueError,
            "8000 bytes exceed the channel's 4096",
        ),
        (
            {"x": x, "algorithm": Algorithm.TWO_SHOT},
            ValueError,
            r"two_shot cannot sum x.*world size 1",
        ),
        (
            {"x": x, "out": _misaligned_out(8), "algorithm": Algorithm.ONE_SHOT},
            ValueError,
            "out is not 16-byte aligned",
        ),
    ]


@pytest.mark.parametrize(("kwargs", "error", "match"), _bad_calls())
def test_all_reduce_bad_arguments_raise_and_change_nothing(group, symm_calls, kwargs, error, match):
    all_reduce, factory = _make(group)
    kwargs = dict(kwargs)
    with pytest.raises(error, match=match):
        all_reduce.all_reduce(kwargs.pop("x"), **kwargs)
    assert symm_calls == [] and factory.channels == []
    assert all_reduce.channel_pool.num_channels == 0


def _fake_capturing_stream(patch: pytest.MonkeyPatch) -> None:
    # Fakes what needs a GPU: a current stream that captures a CUDA graph.
    patch.setattr(torch.cuda, "is_available", lambda: True)
    patch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)


def test_all_reduce_refuses_capturing_stream_outside_capture_block(group, symm_calls, monkeypatch):
    all_reduce, factory = _make(group)
    all_reduce.all_reduce(torch.randn(8, dtype=FP32))  # the eager channel exists
    fix = r"enter channel_pool\.capture\(\) before torch\.cuda\.graph"
    with monkeypatch.context() as patch:
        _fake_capturing_stream(patch)
        for x in (torch.randn(8, dtype=FP32), torch.randn(8, dtype=torch.float16)):  # symm, NCCL
            with pytest.raises(RuntimeError, match=fix):
                all_reduce.all_reduce(x)
    assert len(symm_calls) == 1 and len(factory.channels) == 1
    with all_reduce.channel_pool.capture(owner="target") as target, monkeypatch.context() as patch:
        _fake_capturing_stream(patch)
        x = torch.randn(8, dtype=torch.float16)
        assert torch.equal(all_reduce.all_reduce(x), x)  # NCCL inside a capture block
        all_reduce.all_reduce(torch.randn(8, dtype=FP32))
        assert _in_buffer(symm_calls[-1][1], target)


def test_constructor_bad_arguments(group):
    with pytest.raises(TypeError, match="group must be a ProcessGroup"):
        PeerAllReduce("tp", "cpu", create_channel=_Factory())
    with pytest.raises(TypeError, match="config must be a AllReduceConfig"):
        PeerAllReduce(group, "cpu", {"channel_bytes": 1024}, create_channel=_Factory())
    with pytest.raises(ValueError, match="symmetric memory needs a CUDA device, got cpu"):
        PeerAllReduce(group, "cpu")
    with pytest.raises(TypeError, match="create_channel must be callable"):
        PeerAllReduce(group, "cpu", create_channel=42)


@pytest.mark.parametrize(
    ("device", "error", "match"),
    [
        (None, TypeError, "device must be a torch.device, .*got None"),
        (True, TypeError, "device must be a torch.device, .*got True"),
        (1.5, TypeError, "device must be a torch.device, .*got 1.5"),
        ("gpu", ValueError, "device 'gpu' is not a device torch can use"),
    ],
)
def test_constructor_bad_device_raises_naming_it_before_any_collective(group, device, error, match):
    factory = _Factory()
    with pytest.raises(error, match=match):
        PeerAllReduce(group, device, create_channel=factory)
    assert factory.channels == []


def test_close_closes_every_channel(group, symm_calls):
    all_reduce, factory = _make(group)
    all_reduce.all_reduce(torch.randn(8, dtype=FP32))
    with all_reduce.channel_pool.capture(owner="target"):
        pass
    all_reduce.close()
    assert all_reduce.channel_pool.num_channels == 0
    for channel in factory.channels:
        with pytest.raises(RuntimeError, match="closed"):
            _ = channel.buffer
    with pytest.raises(RuntimeError, match="closed"):
        all_reduce.all_reduce(torch.randn(8, dtype=FP32))


# --- symmetric-memory channels, torch's allocation and rendezvous faked (conftest) ------


def test_symm_mem_rollback_frees_throwaway_channels_keeps_production(
    group, fake_symm_mem, symm_calls
):
    create = symm_mem_channel_factory(group, _CONFIG.channel_bytes, torch.device("cuda", 0))
    all_reduce = PeerAllReduce(group, "cpu", _CONFIG, create_channel=create)
    x = torch.randn(8, dtype=FP32)
    all_reduce.all_reduce(x)
    with all_reduce.channel_pool.capture(owner="target") as target:
        all_reduce.all_reduce(x)
    cp = checkpoint_channel_pools([all_reduce.channel_pool])
    for owner in ("profile-target", "profile-draft"):
        with all_reduce.channel_pool.capture(owner=owner):
            all_reduce.all_reduce(x)
    assert all_reduce.channel_pool.num_channels == 4
    rollback_channel_pools(cp)
    gc.collect()
    alive = [ref() is not None for ref in fake_symm_mem.buffers]
    assert alive == [True, True, False, False]
    assert [ref() is not None for ref in fake_symm_mem.handles] == alive
    assert target.buffer.numel() == _CONFIG.channel_bytes  # production channels stay live
    assert torch.equal(all_reduce.all_reduce(x), x)
    with all_reduce.channel_pool.capture(owner="target") as again:
        assert again is not target and again.channel_id == 4  # ids are never reused
        assert torch.equal(all_reduce.all_reduce(x), x)


def test_symm_mem_failed_rendezvous_leaves_pool_and_memory_as_before(group, fake_symm_mem):
    create = symm_mem_channel_factory(group, 64, torch.device("cuda", 0))
    all_reduce = PeerAllReduce(group, "cpu", AllReduceConfig(64), create_channel=create)
    fake_symm_mem.fail_rendezvous = True
    with pytest.raises(RuntimeError, match="on purpose"), all_reduce.channel_pool.capture("t"):
        pass
    gc.collect()
    assert all_reduce.channel_pool.num_channels == 0
    assert [ref() for ref in fake_symm_mem.buffers] == [None]


@pytest.mark.parametrize(
    ("args", "error", "message"),
    [
        ((-4, torch.bfloat16, 2), ValueError, "nbytes must be >= 0, got -4"),
        ((1024, "bfloat16", 2), TypeError, "dtype must be a dtype, got 'bfloat16'"),
        ((1024, torch.bfloat16, 0), ValueError, "world_size must be >= 1, got 0"),
        ((1024.0, torch.bfloat16, 2), TypeError, "nbytes must be an int, got 1024.0"),
    ],
)
def test_select_algorithm_refuses_bad_arguments_naming_them(args, error, message):
    from vllm_specgraph.allreduce import AllReduceConfig, select_algorithm

    with pytest.raises(error, match=message):
        select_algorithm(*args, AllReduceConfig())


def test_select_algorithm_takes_numpy_integers_as_ints():
    import numpy as np

    from vllm_specgraph.allreduce import AllReduceConfig, select_algorithm

    config = AllReduceConfig()
    assert select_algorithm(np.int64(1024), torch.bfloat16, np.int32(2), config) is (
        select_algorithm(1024, torch.bfloat16, 2, config)
    )


def test_all_reduce_config_stores_numpy_integers_as_plain_ints():
    import numpy as np

    from vllm_specgraph.allreduce import AllReduceConfig

    config = AllReduceConfig(channel_bytes=np.int64(1 << 20), one_shot_max_bytes=np.int32(4096))
    assert type(config.channel_bytes) is int and type(config.one_shot_max_bytes) is int
