"""Peer-to-peer all-reduce on symmetric memory, with one channel per CUDA-graph capture.

Every rank copies its input into its own channel buffer; then one torch kernel per rank
loads the peers' buffers through peer-to-peer access (NVLink or PCIe) and sums:

* **one-shot** (``torch.ops.symm_mem.one_shot_all_reduce_out``): each rank reads every
  peer's whole input and sums it itself. One barrier round; each rank reads (W-1)·n bytes.
* **two-shot** (``torch.ops.symm_mem.two_shot_all_reduce_out``): each rank sums 1/W of the
  input over all peers (reduce-scatter), then reads the others' sums (all-gather). Two
  barrier rounds; each rank reads 2(W-1)/W·n bytes.
* **NCCL** (``torch.distributed.all_reduce`` on the group) for what the kernels cannot take
  (other dtypes, sizes that are no multiple of 4 bytes) or the channel cannot hold.

Only peer loads and stores are used, never NVLink multicast (no ``multimem_*`` op), so it
runs where multicast is off or absent: PCIe machines, NCCL_NVLS_ENABLE=0,
TORCH_SYMM_MEM_DISABLE_MULTICAST=1.

Channels come from the all-reduce's :class:`~vllm_specgraph.channels.ChannelPool`. A graph
captured inside ``channel_pool.capture()`` bakes in a channel of its own, so the target's and
the draft's replays never share a buffer or a signal pad; eager calls share one persistent
eager channel. Enter the channel pool before the graph (creating a channel allocates and is
collective)::

    all_reduce = PeerAllReduce(group, device)
    with all_reduce.channel_pool.capture(owner="target"):
        with torch.cuda.graph(graph):
            y = all_reduce.all_reduce(x)

``GraphRecorder(pool, owner, channel_pools=[all_reduce.channel_pool])`` does the same, and
checkpoint/rollback of the channel pool (the disposable profile's) closes the channels of
throwaway graphs on every rank.

Depends on torch only and never imports vLLM.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable

import torch
import torch.distributed as dist

from vllm_specgraph._checks import check_callable, check_device, check_instance, check_int
from vllm_specgraph.channels import Channel, ChannelPool, stream_is_capturing
from vllm_specgraph.symm_mem_channel import symm_mem_channel_factory

__all__ = [
    "CHANNEL_BYTES",
    "ONE_SHOT_MAX_BYTES",
    "SYMM_MEM_DTYPES",
    "TWO_SHOT_WORLD_SIZES",
    "Algorithm",
    "AllReduceConfig",
    "PeerAllReduce",
    "select_algorithm",
]

ONE_SHOT_MAX_BYTES = 512 * 1024
"""Largest input the default config sends one-shot. Small inputs are bound by barrier
latency, where one-shot's single round wins; large ones by link bandwidth, where two-shot
reads less. On two H200s, graph-replayed, one-shot is ahead up to 512 KiB and two-shot from
2 MiB (``bench/allreduce.py`` measures both on the machine at hand)."""

CHANNEL_BYTES = 8 << 20
"""Default channel buffer; larger inputs go to NCCL. 8 MiB, as vLLM's own custom all-reduce:
two-shot still beats NCCL there on two H200s, and a channel belongs to one capture context
(in vLLM, one owner's whole capture: every graph size of it shares the channel, since they
replay one at a time on one stream), so a server holds a few channels, not one per graph."""

SYMM_MEM_DTYPES = (torch.float32, torch.bfloat16)
"""Dtypes torch's one-shot and two-shot kernels are compiled for; others go to NCCL."""

TWO_SHOT_WORLD_SIZES = (2, 4, 8)
"""World sizes torch's two-shot kernel with a separate output is compiled for."""

# The kernels load and store vectors of up to 16 bytes, never less than 4: the input size must
# be a multiple of 4 bytes, and ``out`` 16-byte aligned (torch checks the input's alignment,
# not the output's; a misaligned store would fault the device).
_SIZE_MULTIPLE_BYTES = 4
_OUT_ALIGNMENT_BYTES = 16


class Algorithm(enum.Enum):
    """How :meth:`PeerAllReduce.all_reduce` sums an input."""

    ONE_SHOT = "one_shot"
    TWO_SHOT = "two_shot"
    NCCL = "nccl"  # torch.distributed.all_reduce on the group (its backend: NCCL on GPUs)


@dataclasses.dataclass(frozen=True, slots=True)
class AllReduceConfig:
    """Channel size and thresholds; every rank must pass the same (checked at construction).

    Fields:
        channel_bytes: each channel's buffer; larger inputs go to NCCL.
        one_shot_max_bytes: inputs up to this size go one-shot; 0 turns one-shot off.
        two_shot_max_bytes: larger inputs up to this size go two-shot; None means up to
            ``channel_bytes``; 0 turns two-shot off.
    """

    channel_bytes: int = CHANNEL_BYTES
    one_shot_max_bytes: int = ONE_SHOT_MAX_BYTES
    two_shot_max_bytes: int | None = None

    def __post_init__(self) -> None:
        # Plain ints from here on (numpy integers are accepted): torch's
        # symmetric-memory calls take nothing else.
        checks = {
            "channel_bytes": (1, "pass the buffer size, e.g. 8 << 20"),
            "one_shot_max_bytes": (0, "pass bytes, 0 for never"),
            "two_shot_max_bytes": (0, "pass bytes, 0 for never, or None for up to channel_bytes"),
        }
        for name, (minimum, fix) in checks.items():
            value = getattr(self, name)
            if value is None and name == "two_shot_max_bytes":  # the one field that may be None
                continue
            object.__setattr__(self, name, check_int(name, value, minimum, fix))


def _refusal(
    algorithm: Algorithm, nbytes: int, dtype: torch.dtype, world_size: int, channel_bytes: int
) -> str | None:
    """Why ``algorithm`` cannot sum such an input, or None if it can."""
    if algorithm is Algorithm.NCCL:
        return None
    if dtype not in SYMM_MEM_DTYPES:
        return f"dtype {dtype} is not one its kernels take {SYMM_MEM_DTYPES}"
    if nbytes % _SIZE_MULTIPLE_BYTES:
        return f"the input's {nbytes} bytes are no multiple of {_SIZE_MULTIPLE_BYTES}"
    if nbytes > channel_bytes:
        return f"the input's {nbytes} bytes exceed the channel's {channel_bytes}"
    if algorithm is Algorithm.TWO_SHOT and world_size not in TWO_SHOT_WORLD_SIZES:
        return f"world size {world_size} is not one its kernel takes {TWO_SHOT_WORLD_SIZES}"
    return None


def select_algorithm(
    nbytes: int, dtype: torch.dtype, world_size: int, config: AllReduceConfig
) -> Algorithm:
    """The algorithm for an input of ``nbytes`` bytes of ``dtype``: pure, communicates nothing.

    One-shot up to ``config.one_shot_max_bytes``, then two-shot up to
    ``config.two_shot_max_bytes``, else NCCL; either kernel only where it can take the input.
    """
    check_int("nbytes", nbytes, 0, "pass the input's size in bytes")
    check_instance("dtype", dtype, torch.dtype, "pass the input's torch dtype")
    check_int("world_size", world_size, 1, "pass the group's number of ranks")
    check_instance("config", config, AllReduceConfig, "pass an AllReduceConfig")
    two_shot_max = config.two_shot_max_bytes
    limits = (
        (Algorithm.ONE_SHOT, config.one_shot_max_bytes),
        (Algorithm.TWO_SHOT, config.channel_bytes if two_shot_max is None else two_shot_max),
    )
    for algorithm, max_bytes in limits:
        refused = _refusal(algorithm, nbytes, dtype, world_size, config.channel_bytes)
        if nbytes <= max_bytes and refused is None:
            return algorithm
    return Algorithm.NCCL


def _run_symm_mem_op(
    algorithm: Algorithm, staged: torch.Tensor, group_name: str, out: torch.Tensor
) -> None:
    # Both ops read ``staged`` on every rank through the peers' mappings and write ``out``;
    # each ends with a barrier round, so no peer still reads this rank's buffer when the next
    # call on the same channel overwrites it.
    if algorithm is Algorithm.ONE_SHOT:
        torch.ops.symm_mem.one_shot_all_reduce_out(staged, "sum", group_name, out)
    else:
        torch.ops.symm_mem.two_shot_all_reduce_out(staged, "sum", group_name, out)


class PeerAllReduce:
    """Sum over one process group: one-shot, two-shot or NCCL by input (see the module).

    Arguments:
        group: the torch.distributed process group (NCCL for GPUs).
        device: this rank's device; it must be the current CUDA device whenever the
            all-reduce is built or called, since the kernels launch on the current stream.
        config: channel size and thresholds, the same on every rank; AllReduceConfig() if
            None.
        create_channel: the channel pool's factory; symmetric-memory channels of
            ``config.channel_bytes`` on ``device`` if None. Its channels need a ``buffer``:
            1-D ``uint8`` of at least ``config.channel_bytes`` on ``device``.

    Building one is collective: the ranks exchange their configs and refuse with ValueError
    if they differ (they would pick different algorithms for one input and hang).
    Owns: :attr:`channel_pool` and every channel in it, until :meth:`close`.
    """

    def __init__(
        self,
        group: dist.ProcessGroup,
        device: torch.device | str | int,
        config: AllReduceConfig | None = None,
        *,
        create_channel: Callable[[int, str], Channel] | None = None,
    ) -> None:
        check_instance("group", group, dist.ProcessGroup, "pass the torch.distributed group")
        config = AllReduceConfig() if config is None else config
        check_instance("config", config, AllReduceConfig, "pass an AllReduceConfig or None")
        device = check_device("device", device, "pass this rank's GPU, e.g. 'cuda:0'")
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if create_channel is None:
            create_channel = symm_mem_channel_factory(group, config.channel_bytes, device)
        check_callable("create_channel", create_channel, "pass (channel_id, owner) -> Channel")
        self._group = group
        self._group_name = group.group_name
        self._device = device
        self._config = config
        self._world_size = dist.get_world_size(group)
        self._check_current_device()
        _check_same_config(group, config)
        is_nccl = device.type == "cuda" and dist.get_backend(group) == "nccl"
        barrier_kwargs = {"device_ids": [device.index]} if is_nccl else {}
        self._channel_pool = ChannelPool(
            f"allreduce:{self._group_name}",
            create_channel,
            barrier=lambda: dist.barrier(group=group, **barrier_kwargs),
            synchronize=(lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else None,
        )

    @property
    def channel_pool(self) -> ChannelPool:
        return self._channel_pool

    @property
    def config(self) -> AllReduceConfig:
        return self._config

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def world_size(self) -> int:
        return self._world_size

    def select(self, x: torch.Tensor, out: torch.Tensor | None = None) -> Algorithm:
        """The algorithm :meth:`all_reduce` picks for ``x`` (and ``out``); communicates nothing."""
        self._check_args(x, out)
        algorithm = select_algorithm(x.nbytes, x.dtype, self._world_size, self._config)
        return Algorithm.NCCL if self._refusal(algorithm, x, out) else algorithm

    def all_reduce(
        self,
        x: torch.Tensor,
        *,
        out: torch.Tensor | None = None,
        algorithm: Algorithm | None = None,
    ) -> torch.Tensor:
        """Sum ``x`` over the group's ranks into ``out`` and return ``out``.

        Collective: every rank calls it with the same shape and dtype, in the same order.
        ``out``: contiguous, with ``x``'s shape, dtype and device, or ``x`` itself (in place);
        if None, a new tensor, allocated where the caller allocates (inside a capture: in that
        graph's pool). ``algorithm`` forces one (ValueError if it cannot take ``x``); None
        picks by :meth:`select`. Not differentiable: autograd records nothing, so no graph
        of ``x`` is kept alive through the channel.

        Legal during capture only inside ``channel_pool.capture()`` (RuntimeError otherwise,
        whatever the algorithm): the graph then bakes in that capture's channel. Outside
        capture it uses the eager channel, created on the first call that needs one (a
        collective). Bad arguments raise before anything is allocated or sent.
        """
        algorithm = self._resolve(x, out, algorithm)
        with torch.no_grad():
            return self._sum(x, out, algorithm)

    def close(self) -> None:
        """Close every channel (collective; see :meth:`ChannelPool.close` for the contract)."""
        self._channel_pool.close()

    def _sum(self, x: torch.Tensor, out: torch.Tensor | None, algorithm: Algorithm) -> torch.Tensor:
        if out is None:
            out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        if x.numel() == 0:
            return out
        if algorithm is Algorithm.NCCL:
            if stream_is_capturing():
                self._channel_pool.current()  # refuses a capture outside channel_pool.capture()
            if out is not x:
                out.copy_(x)
            dist.all_reduce(out, group=self._group)
            return out
        channel = self._channel_pool.current()
        staged = channel.buffer[: x.nbytes].view(x.dtype).view(x.shape)
        staged.copy_(x)
        _run_symm_mem_op(algorithm, staged, self._group_name, out)
        return out

    def _resolve(
        self, x: torch.Tensor, out: torch.Tensor | None, algorithm: Algorithm | None
    ) -> Algorithm:
        if algorithm is None:
            return self.select(x, out)
        check_instance("algorithm", algorithm, Algorithm, "pass an Algorithm or None")
        self._check_args(x, out)
        refused = self._refusal(algorithm, x, out)
        if refused is not None:
            raise ValueError(
                f"PeerAllReduce {self._group_name!r}: {algorithm.value} cannot sum x "
                f"({x.dtype}, shape {tuple(x.shape)}): {refused}; pass algorithm=None to "
                f"pick one that can"
            )
        return algorithm

    def _refusal(
        self, algorithm: Algorithm, x: torch.Tensor, out: torch.Tensor | None
    ) -> str | None:
        refused = _refusal(
            algorithm, x.nbytes, x.dtype, self._world_size, self._config.channel_bytes
        )
        misaligned = out is not None and out.data_ptr() % _OUT_ALIGNMENT_BYTES
        if refused is None and algorithm is not Algorithm.NCCL and misaligned:
            return f"out is not {_OUT_ALIGNMENT_BYTES}-byte aligned"
        return refused

    def _check_args(self, x: torch.Tensor, out: torch.Tensor | None) -> None:
        check_instance("x", x, torch.Tensor, "pass the tensor to sum over the ranks")
        if x.device != self._device:
            raise ValueError(
                f"x is on {x.device}, but this all-reduce runs on {self._device}; move x there"
            )
        self._check_current_device()
        if out is None:
            return
        check_instance("out", out, torch.Tensor, "pass a tensor like x, or None")
        got = (tuple(out.shape), out.dtype, out.device)
        want = (tuple(x.shape), x.dtype, x.device)
        if got != want:
            raise ValueError(
                f"out has shape, dtype and device {got}, x has {want}; pass an out like x, or None"
            )
        if not out.is_contiguous():
            raise ValueError("out is not contiguous; pass a contiguous out, or None")

    def _check_current_device(self) -> None:
        if self._device.type != "cuda":
            return
        current = torch.cuda.current_device()
        if current != self._device.index:
            raise RuntimeError(
                f"the current CUDA device is cuda:{current}, but this all-reduce runs on "
                f"{self._device}; call torch.cuda.set_device({self._device.index}) first"
            )


def _check_same_config(group: dist.ProcessGroup, config: AllReduceConfig) -> None:
    """Refuse, on every rank alike, configs that differ across the group's ranks."""
    configs: list[object] = [None] * dist.get_world_size(group)
    dist.all_gather_object(configs, dataclasses.astuple(config), group=group)
    differing = [rank for rank, other in enumerate(configs) if other != configs[0]]
    if differing:
        fields = tuple(f.name for f in dataclasses.fields(AllReduceConfig))
        raise ValueError(
            f"AllReduceConfig differs across the ranks of group {group.group_name!r}: "
            f"{fields} is {configs[0]} on rank 0 but {[configs[r] for r in differing]} on "
            f"ranks {differing}; pass the same config on every rank"
        )
