"""A stand-in for NVIDIA's ``cuda.bindings.driver``: the virtual memory calls a reserved
range makes, on the CPU. It hands out handles for physical allocations while a budget
lasts and records what is mapped where; the GPU tests check real pages."""

from types import SimpleNamespace

MIB = 1 << 20
OK, OUT_OF_MEMORY, INVALID = 0, 2, 1


class FakeDriver:
    CUresult = SimpleNamespace(CUDA_SUCCESS=OK)
    CUmemAllocationGranularity_flags = SimpleNamespace(CU_MEM_ALLOC_GRANULARITY_MINIMUM=0)
    CUmemAllocationType = SimpleNamespace(CU_MEM_ALLOCATION_TYPE_PINNED=1)
    CUmemLocationType = SimpleNamespace(CU_MEM_LOCATION_TYPE_DEVICE=1)
    CUmemAccess_flags = SimpleNamespace(CU_MEM_ACCESS_FLAGS_PROT_READWRITE=3)

    class CUmemAllocationProp:
        def __init__(self):
            self.location = SimpleNamespace()

    class CUmemAccessDesc:
        def __init__(self):
            self.location = SimpleNamespace()

    def __init__(self, physical_bytes: int = 64 * MIB) -> None:
        self.physical_free = physical_bytes
        self.handles: dict[int, int] = {}  # handle -> bytes
        self.mapped: dict[int, tuple[int, int]] = {}  # address -> (bytes, handle)
        self.reserved: dict[int, int] = {}
        self.fail_map = self.fail_access = False
        self.fail_unmap_after: int | None = None  # unmaps that succeed before one fails
        self.access_devices: list[int] = []
        self._next = 0

    def cuMemGetAllocationGranularity(self, prop, flag):
        return OK, 2 * MIB

    def cuMemAddressReserve(self, size, alignment, address, flags):
        base = (1 << 40) + len(self.reserved) * (1 << 36)
        self.reserved[base] = size
        return OK, base

    def cuMemAddressFree(self, address, size):
        assert self.reserved.pop(address) == size
        return (OK,)

    def cuMemCreate(self, size, prop, flags):
        if size > self.physical_free:
            return OUT_OF_MEMORY, None
        self._next += 1
        self.handles[self._next], self.physical_free = size, self.physical_free - size
        return OK, self._next

    def cuMemRelease(self, handle):
        self.physical_free += self.handles.pop(handle)
        return (OK,)

    def cuMemMap(self, address, size, offset, handle, flags):
        if self.fail_map:
            return (INVALID,)
        self.mapped[address] = (size, handle)
        return (OK,)

    def cuMemSetAccess(self, address, size, descs, count):
        self.access_devices.append(descs[0].location.id)
        if self.fail_access == "raise":
            raise TypeError("the bindings refused an argument")
        return (INVALID,) if self.fail_access else (OK,)

    def cuMemUnmap(self, address, size):
        if self.fail_unmap_after is not None:
            if self.fail_unmap_after == 0:
                self.fail_unmap_after = None
                return (INVALID,)
            self.fail_unmap_after -= 1
        assert self.mapped.pop(address)[0] == size
        return (OK,)

    def cuGetErrorName(self, result):
        return OK, {OUT_OF_MEMORY: b"CUDA_ERROR_OUT_OF_MEMORY", INVALID: b"CUDA_ERROR_INVALID"}[
            result
        ]
