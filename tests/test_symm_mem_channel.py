"""CPU tests for vllm_specgraph.symm_mem_channel (no GPU).

torch's symmetric-memory allocation and rendezvous need GPUs and are faked by the
``fake_symm_mem`` fixture (conftest.py); the process group is real (gloo, one rank here).
"""

from __future__ import annotations

import gc

import pytest
import torch
import torch.distributed as dist

from vllm_specgraph.channels import Channel
from vllm_specgraph.symm_mem_channel import SymmMemChannel, symm_mem_channel_factory

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()),
    reason="torch.distributed with the gloo backend is not available in this torch build",
)

_CUDA0 = torch.device("cuda", 0)  # never touched: the fake allocates on the CPU


@pytest.fixture
def group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def test_factory_allocates_bytes_then_rendezvous_over_the_group(group, fake_symm_mem):
    create = symm_mem_channel_factory(group, 4096, _CUDA0)
    channel = create(3, "target")
    assert isinstance(channel, SymmMemChannel) and isinstance(channel, Channel)
    assert (channel.channel_id, channel.owner) == (3, "target")
    assert channel.buffer.dtype == torch.uint8 and channel.buffer.shape == (4096,)
    assert channel.handle.group_name == group.group_name
    assert channel.handle.buffer_ptr == channel.buffer.data_ptr()


def test_factory_channels_are_distinct_allocations(group, fake_symm_mem):
    create = symm_mem_channel_factory(group, 64, _CUDA0)
    first, second = create(0, "target"), create(1, "draft")
    assert first.buffer.data_ptr() != second.buffer.data_ptr()
    assert first.handle is not second.handle


def test_close_imports_drops_handle_free_exports_drops_buffer(group, fake_symm_mem):
    channel = symm_mem_channel_factory(group, 64, _CUDA0)(0, "draft")
    channel.close_imports()
    gc.collect()
    assert fake_symm_mem.handles[0]() is None, "close_imports kept the rendezvous handle"
    assert fake_symm_mem.buffers[0]() is not None, "close_imports freed this rank's buffer"
    for what in ("buffer", "handle"):
        with pytest.raises(RuntimeError, match=rf"channel 0 \('draft'\) is closed; its {what}"):
            getattr(channel, what)
    channel.free_exports()
    gc.collect()
    assert fake_symm_mem.buffers[0]() is None, "free_exports kept the buffer"


def test_free_exports_alone_drops_both(group, fake_symm_mem):
    # A retry after a failed close_imports on some channel still frees everything.
    channel = symm_mem_channel_factory(group, 64, _CUDA0)(0, "target")
    channel.free_exports()
    gc.collect()
    assert fake_symm_mem.handles[0]() is None and fake_symm_mem.buffers[0]() is None


def test_failed_rendezvous_frees_the_buffer(group, fake_symm_mem):
    create = symm_mem_channel_factory(group, 64, _CUDA0)
    fake_symm_mem.fail_rendezvous = True
    with pytest.raises(RuntimeError, match="on purpose"):
        create(0, "target")
    gc.collect()
    assert [ref() for ref in fake_symm_mem.buffers] == [None]


def test_factory_bad_arguments_raise_naming_the_fix(group):
    with pytest.raises(ValueError, match=r"needs a CUDA device, got cpu; pass the rank's GPU"):
        symm_mem_channel_factory(group, 64, "cpu")
    with pytest.raises(ValueError, match="nbytes must be >= 1, got 0"):
        symm_mem_channel_factory(group, 0, _CUDA0)
    with pytest.raises(TypeError, match="nbytes must be an int"):
        symm_mem_channel_factory(group, 64.0, _CUDA0)
    with pytest.raises(TypeError, match="group must be a ProcessGroup"):
        symm_mem_channel_factory("tp", 64, _CUDA0)


@pytest.mark.parametrize(
    ("device", "error", "match"),
    [
        (None, TypeError, "device must be a torch.device, .*got None"),
        (True, TypeError, "device must be a torch.device, .*got True"),
        ("gpu", ValueError, "device 'gpu' is not a device torch can use"),
    ],
)
def test_factory_bad_device_raises_naming_it(group, device, error, match):
    with pytest.raises(error, match=match):
        symm_mem_channel_factory(group, 64, device)


def test_factory_and_channel_take_numpy_integers_as_ints(group, fake_symm_mem):
    import numpy as np

    channel = symm_mem_channel_factory(group, np.int64(64), _CUDA0)(np.int64(2), "draft")
    assert type(channel.channel_id) is int and channel.channel_id == 2
    assert channel.buffer.shape == (64,)


def test_channel_bad_buffer_raises():
    with pytest.raises(ValueError, match=r"1-D uint8 tensor, got torch\.float32"):
        SymmMemChannel(0, "target", torch.zeros(4, dtype=torch.float32), object())
    with pytest.raises(ValueError, match=r"shape \(2, 2\)"):
        SymmMemChannel(0, "target", torch.zeros(2, 2, dtype=torch.uint8), object())
    with pytest.raises(TypeError, match="buffer must be a Tensor"):
        SymmMemChannel(0, "target", b"\0" * 4, object())
    with pytest.raises(TypeError, match="handle must be the rendezvous handle of buffer, got None"):
        SymmMemChannel(0, "target", torch.zeros(4, dtype=torch.uint8), None)
    with pytest.raises(ValueError, match="owner must be a non-empty str, got ''"):
        SymmMemChannel(0, "", torch.zeros(4, dtype=torch.uint8), object())
