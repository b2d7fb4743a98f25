"""CUDA KV memory through the cuMem virtual memory API, shareable by POSIX file descriptor.

The executor creates the physical allocation with an exportable handle and maps it; the node's
main process imports the fd with ``cuMemImportFromShareableHandle`` and maps the same memory
into its own address space (SEED.md 19), so one transfer engine can reach every executor's KV.
Needs ``cuda-bindings`` (``from cuda.bindings import driver``); imported only on CUDA paths.
"""

from __future__ import annotations

from typing import Any

import torch


def _driver() -> Any:
    from cuda.bindings import driver

    return driver


def _check(result: Any) -> Any:
    cu = _driver()
    err, *rest = result if isinstance(result, tuple) else (result,)
    if err != cu.CUresult.CUDA_SUCCESS:
        _, name = cu.cuGetErrorName(err)
        raise RuntimeError(f"CUDA driver call failed: {name.decode() if name else err}")
    if not rest:
        return None
    return rest[0] if len(rest) == 1 else tuple(rest)


class _ArrayInterface:
    """Exposes a raw device pointer to ``torch.as_tensor`` as bytes."""

    def __init__(self, ptr: int, nbytes: int):
        self.__cuda_array_interface__ = {
            "shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 3,
        }


class CuMemAllocation:
    def __init__(self, handle: Any, ptr: int, size: int, device: torch.device):
        self.handle = handle
        self.ptr = ptr
        self.size = size  # rounded up to the allocation granularity
        self.device = device

    @staticmethod
    def _prop(device: torch.device) -> Any:
        cu = _driver()
        prop = cu.CUmemAllocationProp()
        prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = device.index if device.index is not None else torch.cuda.current_device()
        prop.requestedHandleTypes = (
            cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        )
        return prop

    @classmethod
    def _rounded(cls, nbytes: int, prop: Any) -> int:
        cu = _driver()
        gran = _check(cu.cuMemGetAllocationGranularity(
            prop, cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED))
        return (nbytes + gran - 1) // gran * gran

    @classmethod
    def _map(cls, handle: Any, size: int, prop: Any, device: torch.device) -> CuMemAllocation:
        cu = _driver()
        ptr = _check(cu.cuMemAddressReserve(size, 0, 0, 0))
        _check(cu.cuMemMap(ptr, size, 0, handle, 0))
        access = cu.CUmemAccessDesc()
        access.location = prop.location
        access.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        _check(cu.cuMemSetAccess(ptr, size, [access], 1))
        return cls(handle, int(ptr), size, device)

    @classmethod
    def create(cls, nbytes: int, device: torch.device) -> CuMemAllocation:
        torch.zeros(1, device=device)  # make torch's primary context current on this thread
        prop = cls._prop(device)
        size = cls._rounded(nbytes, prop)
        handle = _check(_driver().cuMemCreate(size, prop, 0))
        alloc = cls._map(handle, size, prop, device)
        alloc.as_tensor(torch.uint8, (size,)).zero_()
        return alloc

    @classmethod
    def import_fd(cls, fd: int, nbytes: int, device: torch.device) -> CuMemAllocation:
        cu = _driver()
        torch.zeros(1, device=device)
        prop = cls._prop(device)
        size = cls._rounded(nbytes, prop)
        handle = _check(cu.cuMemImportFromShareableHandle(
            fd, cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR))
        return cls._map(handle, size, prop, device)

    def export_fd(self) -> int:
        cu = _driver()
        fd = _check(cu.cuMemExportToShareableHandle(
            self.handle, cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0))
        return int(fd)

    def as_tensor(self, dtype: torch.dtype, shape: tuple[int, ...] | list[int]) -> torch.Tensor:
        n = 1
        for s in shape:
            n *= s
        nbytes = n * torch.empty((), dtype=dtype).element_size()
        raw = torch.as_tensor(_ArrayInterface(self.ptr, nbytes), device=self.device)
        return raw.view(dtype).view(tuple(shape))

    def close(self) -> None:
        cu = _driver()
        _check(cu.cuMemUnmap(self.ptr, self.size))
        _check(cu.cuMemAddressFree(self.ptr, self.size))
        _check(cu.cuMemRelease(self.handle))


