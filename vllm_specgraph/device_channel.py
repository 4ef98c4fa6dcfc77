"""A single-process channel for :class:`vllm_specgraph.channels.ChannelPool`.

Also importable from :mod:`vllm_specgraph.channels`. Depends on torch only.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from vllm_specgraph._checks import check_device, check_int, check_str

__all__ = ["DeviceChannel", "device_channel_factory"]


def _checked(
    nbytes: int, device: torch.device | str | int, num_signal_slots: int
) -> tuple[int, torch.device, int]:
    """The sizes as plain ints and the device as a torch.device, else raise naming the argument."""
    return (
        check_int("nbytes", nbytes, 1, "pass the channel buffer's size in bytes, e.g. 1 << 20"),
        check_device("device", device, "pass the channel's device, e.g. 'cuda:0'"),
        check_int(
            "num_signal_slots", num_signal_slots, 1, "pass the number of int32 slots, e.g. 64"
        ),
    )


class DeviceChannel:
    """Single-process channel: a ``uint8`` buffer and ``int32`` signal slots on one device.

    Owns: both tensors, until :meth:`free_exports`. Kernels captured with them borrow them.
    Using the channel after :meth:`close_imports` or :meth:`free_exports` raises
    RuntimeError. Creating one allocates, so it is not legal during capture.
    """

    def __init__(
        self,
        channel_id: int,
        owner: str,
        nbytes: int,
        device: torch.device | str | int,
        num_signal_slots: int = 64,
    ) -> None:
        channel_id = check_int("channel_id", channel_id, 0, "pass the id the channel pool assigned")
        check_str("owner", owner, "name the channel's owner, e.g. 'target'")
        nbytes, device, num_signal_slots = _checked(nbytes, device, num_signal_slots)
        self.channel_id = channel_id
        self.owner = owner
        self._buffer: torch.Tensor | None = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        self._signal: torch.Tensor | None = torch.zeros(
            num_signal_slots, dtype=torch.int32, device=device
        )
        self._closed = False

    @property
    def buffer(self) -> torch.Tensor:
        return self._live(self._buffer, "buffer")

    @property
    def signal(self) -> torch.Tensor:
        return self._live(self._signal, "signal")

    def close_imports(self) -> None:
        # One process imports nothing; only mark the channel unusable.
        self._closed = True

    def free_exports(self) -> None:
        self._closed = True
        self._buffer = None
        self._signal = None

    def _live(self, tensor: torch.Tensor | None, what: str) -> torch.Tensor:
        if self._closed or tensor is None:
            raise RuntimeError(
                f"channel {self.channel_id} ({self.owner!r}) is closed; {what} is gone. "
                f"Use channel_pool.current() or a new channel_pool.capture() for a live channel"
            )
        return tensor


def device_channel_factory(
    nbytes: int, device: torch.device | str | int, num_signal_slots: int = 64
) -> Callable[[int, str], DeviceChannel]:
    """Return a ``create_channel`` for ``ChannelPool`` that makes :class:`DeviceChannel`."""
    nbytes, device, num_signal_slots = _checked(nbytes, device, num_signal_slots)

    def create_channel(channel_id: int, owner: str) -> DeviceChannel:
        return DeviceChannel(channel_id, owner, nbytes, device, num_signal_slots)

    return create_channel
