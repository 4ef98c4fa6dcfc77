"""A GPU address range reserved up front and backed by physical pages on demand.

Capture-once needs a tensor whose addresses exist before its memory does: CUDA
graphs are captured against it while only the pages warm-up and capture touch
are backed, their cost is measured, and only then are pages mapped up to the
budget. A captured kernel bakes in virtual addresses, so it reads and writes
pages mapped after the capture, and keeps reading the pages mapped before it.

The CUDA driver's virtual memory management does this (``cuMemAddressReserve``,
``cuMemCreate``, ``cuMemMap``, ``cuMemSetAccess``), called through NVIDIA's
``cuda-bindings`` package (``cuda.bindings.driver``), which is imported only when
a range is made. Torch only besides: this module never imports vLLM.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch

from vllm_specgraph._checks import check_device, check_int

__all__ = [
    "BlockBacking",
    "PageMapError",
    "ReservedRange",
    "StridedPlacement",
    "blocks_within",
    "page_runs",
]

_MIB = 1 << 20


class PageMapError(RuntimeError):
    """Backing a range with pages failed; nothing was mapped by the failed call."""


@dataclass(frozen=True)
class _Mapping:
    offset: int
    nbytes: int
    handle: Any


class _Views:
    """Held by every tensor over the range: alive while any view is."""

    def __init__(self, address: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (address, False),
            "version": 3,
        }


def _driver() -> Any:
    try:
        from cuda.bindings import driver
    except ImportError as error:
        raise RuntimeError(
            "a reserved GPU range needs NVIDIA's cuda-bindings package (cuda.bindings.driver); "
            f"install cuda-bindings for this CUDA driver ({error})"
        ) from None
    return driver


class ReservedRange:
    """``nbytes`` of virtual addresses on one GPU, backed by pages only where mapped.

    Arguments:
        nbytes: the range's size; rounded up to the driver's granularity (2 MiB on
            current GPUs).
        device: the GPU (a torch.device, ``"cuda:N"`` or an index).
        driver: the CUDA driver API (``cuda.bindings.driver``); given only by tests.

    *Owns*: the address range and every page mapped into it, until :meth:`release`
    (a range dropped without it keeps both for the life of the process: nothing
    but the caller knows when no graph reads it any more).
    *Lends*: :meth:`tensor` views; touching an unmapped byte through one is an
    illegal address, on the GPU and in any graph that replays it.
    """

    def __init__(self, nbytes: int, device: torch.device | str | int, *, driver: Any = None):
        check_int("nbytes", nbytes, 1, "pass the largest size the range must ever hold")
        self.device = check_device("device", device, "pass the GPU, e.g. 'cuda:0'")
        if self.device.type != "cuda" or self.device.index is None:
            raise ValueError(
                f"device must be one CUDA GPU with its index, got {device!r}; pass e.g. 'cuda:0'"
            )
        self._cu = driver if driver is not None else _driver()
        torch.cuda.init()  # the driver calls below act on torch's (primary) context
        self._prop = self._allocation_prop()
        self.granularity = self._call(
            "cuMemGetAllocationGranularity",
            self._prop,
            self._cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM,
        )
        self.reserved_bytes = -(-int(nbytes) // self.granularity) * self.granularity
        self.address = int(
            self._call("cuMemAddressReserve", self.reserved_bytes, self.granularity, 0, 0)
        )
        self._mappings: list[_Mapping] = []
        self._views: weakref.ref[_Views] | None = None

    @property
    def mapped_bytes(self) -> int:
        return sum(m.nbytes for m in self._mappings)

    def tensor(self, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
        """A tensor over the whole range, ``reserved_bytes`` long in bytes.

        Every view keeps one holder alive, so :meth:`release` can tell whether any is left.
        *Requires*: the first page is mapped (torch asks the driver which GPU the
        address is on).
        """
        if self.address == 0:
            raise RuntimeError("this reserved range was released; make a new one")
        if not self._mappings or self._mappings[0].offset != 0:
            raise RuntimeError(
                "the range's first page is not mapped, so torch cannot place a tensor on it; "
                "map(0, ...) first"
            )
        views = self._views() if self._views is not None else None
        if views is None:
            views = _Views(self.address, self.reserved_bytes)
            self._views = weakref.ref(views)
        with torch.cuda.device(self.device):
            raw = torch.as_tensor(views, device=self.device)
        return raw.view(dtype)

    def map(self, offset: int, nbytes: int) -> int:
        """Back ``[offset, offset + nbytes)`` with pages (widened to the granularity).

        Pages already mapped stay as they are, with their contents; one new
        physical allocation backs each unmapped run. Returns the bytes newly mapped.

        Raises :class:`PageMapError` naming the bytes asked for and the GPU's
        free bytes when the driver refuses; what the failed call had mapped is
        unmapped and released again, so the range is as it was.
        """
        check_int("offset", offset, 0, "pass a byte offset into the range")
        check_int("nbytes", nbytes, 1, "pass how many bytes to back")
        return self.map_runs([(offset, offset + nbytes)])

    def map_runs(self, runs: list[tuple[int, int]]) -> int:
        """Back every ``(start, end)`` byte run, as :meth:`map` backs one, all or none:
        a failure in any run leaves the range as it was. Returns the bytes newly mapped."""
        if self.address == 0:
            raise RuntimeError("this reserved range was released; make a new one")
        pages = page_runs(runs, self.granularity)
        if pages and pages[-1][1] > self.reserved_bytes:
            raise ValueError(
                f"the runs reach byte {max(end for _, end in runs)}, beyond the "
                f"{self.reserved_bytes} reserved; reserve a larger range"
            )
        added: list[_Mapping] = []
        try:
            for start, end in pages:
                for run_start, run_end in self._unmapped_runs(start, end):
                    added.append(self._map_run(run_start, run_end - run_start))
        except BaseException:
            # Any failure, the driver's or an interrupt: what this call mapped goes back.
            for mapping in reversed(added):
                self._unmap(mapping)
            raise
        self._mappings = sorted([*self._mappings, *added], key=lambda m: m.offset)
        return sum(m.nbytes for m in added)

    def release(self) -> None:
        """Unmap every page, give the physical memory back, free the address range.

        *Requires*: no tensor view is left and no graph that read the range is
        alive (a graph's addresses would point at nothing). Refuses while a view
        is. Calling it again does nothing.
        """
        if self.address == 0:
            return
        if self._views is not None and self._views() is not None:
            raise RuntimeError(
                "a tensor over this reserved range is still alive; drop every view (and "
                "every graph that reads it) before releasing the range"
            )
        torch.cuda.synchronize(self.device)
        while self._mappings:  # one at a time, so a failure midway can be retried
            self._unmap(self._mappings[-1])
            self._mappings.pop()
        self._call("cuMemAddressFree", self.address, self.reserved_bytes)
        self.address = 0

    def release_when_unviewed(self) -> bool:
        """:meth:`release` now if no view is left (True); else once the last one dies.

        For an error path that cannot drop the views it lent (another object holds
        them): the range goes back when that holder lets them go, and with the
        process otherwise.
        """
        views = self._views() if self._views is not None else None
        if views is None:
            self.release()
            return True
        weakref.finalize(views, self.release).atexit = False
        return False

    def _unmapped_runs(self, start: int, end: int) -> list[tuple[int, int]]:
        runs, cursor = [], start
        for m in self._mappings:
            if m.offset + m.nbytes <= cursor or m.offset >= end:
                continue
            if m.offset > cursor:
                runs.append((cursor, m.offset))
            cursor = max(cursor, m.offset + m.nbytes)
        if cursor < end:
            runs.append((cursor, end))
        return runs

    def _map_run(self, offset: int, nbytes: int) -> _Mapping:
        cu = self._cu
        result, handle = cu.cuMemCreate(nbytes, self._prop, 0)
        if result != cu.CUresult.CUDA_SUCCESS:
            free, _ = torch.cuda.mem_get_info(self.device)
            raise PageMapError(
                f"could not back {nbytes / _MIB:.1f} MiB of the reserved range on "
                f"{self.device} ({self._error(result)}); the GPU has {free / _MIB:.1f} MiB "
                "free; ask for less (a lower gpu_memory_utilization) or free memory first"
            )
        address, mapped = self.address + offset, False
        try:
            (result,) = cu.cuMemMap(address, nbytes, 0, handle, 0)
            mapped = result == cu.CUresult.CUDA_SUCCESS
            if mapped:
                access = cu.CUmemAccessDesc()
                access.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
                access.location.id = self.device.index
                access.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
                (result,) = cu.cuMemSetAccess(address, nbytes, [access], 1)
                if result == cu.CUresult.CUDA_SUCCESS:
                    return _Mapping(offset, nbytes, handle)
        except BaseException:
            result = None
            raise
        finally:
            if result != cu.CUresult.CUDA_SUCCESS:  # the pages go back on any failure
                if mapped:
                    cu.cuMemUnmap(address, nbytes)
                cu.cuMemRelease(handle)
        raise PageMapError(
            f"could not map {nbytes / _MIB:.1f} MiB at offset {offset} of the reserved range "
            f"on {self.device} ({self._error(result)}); nothing of this call stays mapped"
        )

    def _unmap(self, mapping: _Mapping) -> None:
        self._call("cuMemUnmap", self.address + mapping.offset, mapping.nbytes)
        self._call("cuMemRelease", mapping.handle)

    def _allocation_prop(self) -> Any:
        cu = self._cu
        prop = cu.CUmemAllocationProp()
        prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = self.device.index
        return prop

    def _call(self, name: str, *args: Any) -> Any:
        result, *values = getattr(self._cu, name)(*args)
        if result != self._cu.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"{name} failed on {self.device}: {self._error(result)}")
        return values[0] if values else None

    def _error(self, result: Any) -> str:
        _, name = self._cu.cuGetErrorName(result)
        return name.decode() if isinstance(name, bytes) else str(name)


def page_runs(runs: list[tuple[int, int]], granularity: int) -> list[tuple[int, int]]:
    """``(start, end)`` byte runs widened to whole pages, merged where they meet, sorted."""
    pages: list[tuple[int, int]] = []
    for start, end in sorted(runs):
        if start < 0 or end <= start:
            raise ValueError(
                f"a byte run must have 0 <= start < end, got ({start}, {end}); pass "
                "(offset, offset + nbytes)"
            )
        first, last = start // granularity * granularity, -(-end // granularity) * granularity
        if pages and first <= pages[-1][1]:
            pages[-1] = (pages[-1][0], max(pages[-1][1], last))
        else:
            pages.append((first, last))
    return pages


@dataclass(frozen=True)
class StridedPlacement:
    """Where same-shaped layers keep their blocks in one allocation.

    Layer ``l``'s page of block ``b`` (``page_bytes`` long) starts at
    ``offset + l * layer_stride + b * block_stride``: one run per layer where each
    layer has a region of its own, one run for all where blocks are outermost.
    """

    offset: int
    layer_stride: int
    block_stride: int
    num_layers: int
    page_bytes: int

    def runs(self, num_blocks: int) -> list[tuple[int, int]]:
        """The byte runs that hold blocks ``0 .. num_blocks - 1`` of every layer."""
        if num_blocks <= 0:
            return []
        span = (num_blocks - 1) * self.block_stride + self.page_bytes
        starts = (self.offset + layer * self.layer_stride for layer in range(self.num_layers))
        return [(start, start + span) for start in starts]


def _pages_bytes(placements: list[StridedPlacement], num_blocks: int, granularity: int) -> int:
    runs = [run for p in placements for run in p.runs(num_blocks)]
    return sum(end - start for start, end in page_runs(runs, granularity))


def blocks_within(
    placements: list[StridedPlacement], budget_bytes: int, granularity: int, max_blocks: int
) -> int:
    """The most blocks (at most ``max_blocks``) whose pages, over every placement, fit
    in ``budget_bytes`` once widened to ``granularity``."""

    low, high = 0, max_blocks
    while low < high:  # the largest count that fits: pages grow with the count
        middle = (low + high + 1) // 2
        if _pages_bytes(placements, middle, granularity) <= budget_bytes:
            low = middle
        else:
            high = middle - 1
    return low


class BlockBacking:
    """A KV cache's backing allocation over a reserved range, backed a block prefix at a time.

    Arguments:
        reserved: the range, as large as the allocation with ``max_blocks`` blocks.
        placements: where every layer keeps its blocks in it.
        max_blocks: the blocks the allocation holds.

    *Owns*: ``reserved``, until :meth:`release`. *Guarantees*: blocks
    ``0 .. num_blocks - 1`` of every layer are backed and were zeroed when they
    were backed (as the allocation vLLM would have made is); the blocks above are
    unbacked, and touching one is an illegal address. Blocks are only ever added,
    so a graph captured against the range keeps every page it read.
    """

    def __init__(
        self, reserved: ReservedRange, placements: list[StridedPlacement], max_blocks: int
    ) -> None:
        check_int("max_blocks", max_blocks, 1, "pass the blocks the KV cache was sized for")
        if not placements:
            raise ValueError("a block backing needs at least one placement; pass the KV tensors'")
        self.reserved = reserved
        self.placements = list(placements)
        self.max_blocks = int(max_blocks)
        self.num_blocks = 0
        # torch needs the first page backed to place a tensor on the range.
        reserved.map(0, 1)
        self._raw = reserved.tensor(torch.int8)
        self._raw[: reserved.granularity].zero_()

    def tensor(self) -> torch.Tensor:
        """The whole range as int8 bytes: what ``torch.zeros(nbytes, dtype=torch.int8)`` is."""
        return self._raw

    def pages_bytes(self, num_blocks: int) -> int:
        """The bytes of whole pages that back blocks ``0 .. num_blocks - 1``."""
        return _pages_bytes(self.placements, num_blocks, self.reserved.granularity)

    def most_blocks_within(self, budget_bytes: int) -> int:
        """The most blocks whose pages fit in ``budget_bytes``; never fewer than are backed."""
        check_int("budget_bytes", budget_bytes, 0, "pass the bytes the KV cache may take")
        fit = blocks_within(
            self.placements, budget_bytes, self.reserved.granularity, self.max_blocks
        )
        return max(fit, self.num_blocks)

    def back(self, num_blocks: int) -> int:
        """Back and zero blocks up to ``num_blocks`` (all or none); returns the bytes mapped.

        Blocks already backed keep their contents. Raises :class:`PageMapError`
        (nothing of the call mapped) when the driver refuses.
        """
        check_int("num_blocks", num_blocks, 0, "pass how many blocks to back")
        if num_blocks > self.max_blocks:
            raise ValueError(
                f"num_blocks={num_blocks} is beyond the {self.max_blocks} blocks the range "
                "was reserved for; pass at most that"
            )
        if num_blocks <= self.num_blocks:
            return 0
        runs = [run for p in self.placements for run in p.runs(num_blocks)]
        mapped = self.reserved.map_runs(runs)
        for start, end in page_runs(self._new_block_runs(num_blocks), 1):
            self._raw[start:end].zero_()
        self.num_blocks = num_blocks
        return mapped

    def release(self) -> bool:
        """Drop this object's view and release the range, now if no other view is left
        (True), else once the last one dies (:meth:`ReservedRange.release_when_unviewed`)."""
        self._raw = None
        return self.reserved.release_when_unviewed()

    def _new_block_runs(self, num_blocks: int) -> list[tuple[int, int]]:
        first = self.num_blocks
        runs = []
        for p in self.placements:
            for layer in range(p.num_layers):
                start = p.offset + layer * p.layer_stride + first * p.block_stride
                runs.append(
                    (start, start + (num_blocks - 1 - first) * p.block_stride + p.page_bytes)
                )
        return runs
