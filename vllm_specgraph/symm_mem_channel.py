"""Symmetric-memory channels for :class:`vllm_specgraph.channels.ChannelPool`.

A channel here is one buffer that torch's symmetric-memory allocator gives every rank of a
process group, rendezvoused over that group: each rank maps its peers' buffers, and the
signal pad torch allocates with every buffer, so kernels load and store peer memory
directly. Creating a channel allocates, synchronizes the device and exchanges handles
between ranks (a collective), so it is illegal during capture; the channel pool creates it
before the capture begins, and every rank must create channels in the same order.

Depends on torch only and never imports vLLM.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch
import torch.distributed as dist

from vllm_specgraph._checks import check_device, check_instance, check_int, check_str

__all__ = ["SymmMemChannel", "symm_mem_channel_factory"]

_T = TypeVar("_T")


def _allocate(nbytes: int, device: torch.device) -> torch.Tensor:
    # torch's public ``_symmetric_memory.empty`` takes its memory from one process-wide pool
    # (on by default, TORCH_SYMMMEM_IMPLICIT_POOL) that keeps freed blocks cached, and
    # torch.cuda.empty_cache() releases no pool that is still alive: a rolled-back channel
    # would keep its memory for good. The allocator entry point that ``empty`` calls gives
    # each channel its own allocation, unmapped and returned to the driver when freed.
    from torch._C._distributed_c10d import _SymmetricMemory

    return _SymmetricMemory.empty_strided_p2p((nbytes,), (1,), torch.uint8, device)


def _rendezvous(buffer: torch.Tensor, group_name: str) -> object:
    from torch.distributed import _symmetric_memory

    return _symmetric_memory.rendezvous(buffer, group_name)


class SymmMemChannel:
    """One rendezvoused symmetric-memory buffer (``uint8``) and its rendezvous handle.

    Owns: the buffer, this rank's export, until :meth:`free_exports`; and the handle, this
    rank's reference to the peers' buffers it mapped, until :meth:`close_imports`. Kernels
    captured with the channel borrow both. Using the channel after either call raises
    RuntimeError.

    .. note:: torch keeps the peers' mappings with this rank's allocation rather than with
       the handle, so they are unmapped when :meth:`free_exports` frees the buffer (torch
       synchronizes the device first). A peer's memory returns to its driver once every rank
       has dropped its mapping: ChannelPool's last barrier orders that before anyone measures.
    """

    def __init__(self, channel_id: int, owner: str, buffer: torch.Tensor, handle: object) -> None:
        channel_id = check_int("channel_id", channel_id, 0, "pass the id the channel pool assigned")
        check_str("owner", owner, "name the channel's owner, e.g. 'target'")
        check_instance("buffer", buffer, torch.Tensor, "pass the symmetric-memory tensor")
        if handle is None:
            # None is how a closed channel says its handle is gone.
            raise TypeError(
                "handle must be the rendezvous handle of buffer, got None; pass what "
                "torch.distributed._symmetric_memory.rendezvous(buffer, group_name) returned"
            )
        if buffer.dtype != torch.uint8 or buffer.dim() != 1:
            raise ValueError(
                f"buffer must be a 1-D uint8 tensor, got {buffer.dtype} of shape "
                f"{tuple(buffer.shape)}; allocate it as bytes"
            )
        self.channel_id = channel_id
        self.owner = owner
        self._buffer: torch.Tensor | None = buffer
        self._handle: object | None = handle
        self._closed = False

    @property
    def buffer(self) -> torch.Tensor:
        return self._live(self._buffer, "buffer")

    @property
    def handle(self) -> object:
        return self._live(self._handle, "handle")

    def close_imports(self) -> None:
        self._closed = True
        self._handle = None

    def free_exports(self) -> None:
        self._closed = True
        self._handle = None
        self._buffer = None

    def _live(self, value: _T | None, what: str) -> _T:
        if self._closed or value is None:
            raise RuntimeError(
                f"symmetric-memory channel {self.channel_id} ({self.owner!r}) is closed; its "
                f"{what} is gone. Use channel_pool.current() or a new channel_pool.capture() "
                f"for a live channel"
            )
        return value


def symm_mem_channel_factory(
    group: dist.ProcessGroup, nbytes: int, device: torch.device | str | int
) -> Callable[[int, str], SymmMemChannel]:
    """Return a ``create_channel`` for ``ChannelPool`` that makes :class:`SymmMemChannel`.

    Each channel holds ``nbytes`` bytes on ``device`` (a CUDA device), rendezvoused over
    ``group``. The driver maps symmetric memory in granules (2 MiB on current GPUs), and
    torch adds a signal pad of a few KiB to every buffer, so a channel takes ``nbytes`` plus
    the pad, rounded up to the granule.

    A ``create_channel`` that raises (allocation or rendezvous failed) leaves nothing
    allocated on this rank; the channel pool then records no channel.
    """
    check_instance("group", group, dist.ProcessGroup, "pass the torch.distributed group")
    nbytes = check_int("nbytes", nbytes, 1, "pass the channel buffer's size in bytes, e.g. 1 << 20")
    device = check_device("device", device, "pass the rank's GPU, e.g. torch.device('cuda', 0)")
    if device.type != "cuda":
        raise ValueError(
            f"symmetric memory needs a CUDA device, got {device}; pass the rank's GPU, "
            f"e.g. torch.device('cuda', local_rank)"
        )
    group_name = group.group_name

    def create_channel(channel_id: int, owner: str) -> SymmMemChannel:
        buffer = _allocate(nbytes, device)
        handle = _rendezvous(buffer, group_name)
        return SymmMemChannel(channel_id, owner, buffer, handle)

    return create_channel
