"""CUDA driver access for the ``cuda-ipc`` backend: the driver entry points it calls through
cffi (legacy IPC handles, async copies), ``cuda.bindings`` result checking, cuMem allocations
with a POSIX-fd exportable handle (:class:`CuMemBuffer`, the same kind of memory as the node's
KV cache), and the fd hand-over between processes of one user (:func:`fetch_fd`; the
receiver's side is ``CudaIpcEngine._serve_fds``)."""

from __future__ import annotations

import os
import socket
import struct
from typing import Any

_CDEF = """
typedef int CUresult;
typedef unsigned long long CUdeviceptr;
typedef struct { char reserved[64]; } CUipcMemHandle;
CUresult cuIpcGetMemHandle(CUipcMemHandle *pHandle, CUdeviceptr dptr);
CUresult cuIpcOpenMemHandle_v2(CUdeviceptr *pdptr, CUipcMemHandle handle, unsigned int flags);
CUresult cuIpcCloseMemHandle(CUdeviceptr dptr);
CUresult cuMemGetAddressRange_v2(CUdeviceptr *pbase, size_t *psize, CUdeviceptr dptr);
CUresult cuMemcpyAsync(CUdeviceptr dst, CUdeviceptr src, size_t n, void *stream);
CUresult cuGetErrorString(CUresult error, const char **pStr);
"""
_drv: Any = None
_ffi: Any = None


def driver() -> tuple[Any, Any]:
    global _drv, _ffi
    if _drv is None:
        import cffi

        _ffi = cffi.FFI()
        _ffi.cdef(_CDEF)
        _drv = _ffi.dlopen("libcuda.so.1")
    return _ffi, _drv


def check_rc(what: str, rc: int) -> None:
    if rc != 0:
        ffi, drv = driver()
        s = ffi.new("const char **")
        drv.cuGetErrorString(rc, s)
        text = ffi.string(s[0]).decode() if s[0] != ffi.NULL else "?"
        raise RuntimeError(f"{what}: CUDA error {rc}: {text}")


def cu_result(result: Any) -> Any:
    """Unwrap a ``cuda.bindings.driver`` result tuple, raising on an error."""
    from cuda.bindings import driver as cu

    err, *rest = result if isinstance(result, tuple) else (result,)
    if err != cu.CUresult.CUDA_SUCCESS:
        _, name = cu.cuGetErrorName(err)
        raise RuntimeError(f"CUDA driver call failed: {name.decode() if name else err}")
    return rest[0] if len(rest) == 1 else (tuple(rest) if rest else None)



def fetch_fd(address: bytes, rid: int, timeout: float = 10.0) -> int:
    """Ask the receiver at ``address`` (its notification socket) for region ``rid``'s fd."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(address + b".fd")
        s.sendall(struct.pack("<Q", rid))
        msg, fds, _flags, _addr = socket.recv_fds(s, 16, 1)
    if msg != b"ok" or not fds:
        for fd in fds:
            os.close(fd)
        raise ConnectionError(f"cuda-ipc peer refused region {rid}: {msg!r}")
    return fds[0]



class CuMemBuffer:
    """A cuMem allocation with a POSIX-fd exportable handle, mapped here (tests and bench: the
    same kind of memory as the node's KV cache). ``tensor`` is uint8; ``fd`` is exportable."""

    def __init__(self, nbytes: int, device: int) -> None:
        import torch
        from cuda.bindings import driver as cu

        torch.zeros(1, device=f"cuda:{device}")  # the primary context, current here
        prop = cu.CUmemAllocationProp()
        prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = device
        prop.requestedHandleTypes = (
            cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)
        gran = cu_result(cu.cuMemGetAllocationGranularity(
            prop, cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED))
        self.size = -(-nbytes // gran) * gran
        self.handle = cu_result(cu.cuMemCreate(self.size, prop, 0))
        self.ptr = int(cu_result(cu.cuMemAddressReserve(self.size, 0, 0, 0)))
        cu_result(cu.cuMemMap(self.ptr, self.size, 0, self.handle, 0))
        access = cu.CUmemAccessDesc()
        access.location = prop.location
        access.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        cu_result(cu.cuMemSetAccess(self.ptr, self.size, [access], 1))
        self.fd = int(cu_result(cu.cuMemExportToShareableHandle(
            self.handle, cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0)))

        class _Iface:
            __cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1",
                                        "data": (self.ptr, False), "version": 3}

        self.tensor = torch.as_tensor(_Iface(), device=f"cuda:{device}")

    def close(self) -> None:
        from cuda.bindings import driver as cu

        del self.tensor
        os.close(self.fd)
        cu_result(cu.cuMemUnmap(self.ptr, self.size))
        cu_result(cu.cuMemAddressFree(self.ptr, self.size))
        cu_result(cu.cuMemRelease(self.handle))
