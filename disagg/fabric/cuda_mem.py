"""CUDA driver access for the ``cuda-ipc`` backend: the driver entry points it calls through
cffi (legacy IPC handles, async copies), ``cuda.bindings`` result checking, cuMem allocations
with a POSIX-fd exportable handle (:class:`CuMemAllocation`: the node's KV cache, and the
only cuMem wrapper), and the fd hand-over between processes of one user (:func:`fetch_fd`; the
receiver's side is :func:`serve_fds`)."""

from __future__ import annotations

import collections
import logging
import os
import socket
import struct
from dataclasses import dataclass
from typing import Any

from disagg.fabric.descriptor import MemoryDescriptor, OutOfRange

log = logging.getLogger("disagg.fabric")

CUMEM_HANDLE = struct.Struct("<QQQ")  # region id, mapping size, offset of byte 0 of the region

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



class _ArrayInterface:
    """Exposes a raw device pointer to ``torch.as_tensor`` as bytes."""

    def __init__(self, ptr: int, nbytes: int):
        self.__cuda_array_interface__ = {
            "shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 3,
        }


class CuMemAllocation:
    """Device memory from the cuMem virtual memory API with a POSIX-fd exportable handle: the
    node's KV cache (an executor creates it, the node's main process imports the fd and maps
    the same memory; cuda-ipc peers import it too)."""

    def __init__(self, handle: Any, ptr: int, size: int, device: Any):
        self.handle = handle
        self.ptr = ptr
        self.size = size  # rounded up to the allocation granularity
        self.device = device

    @staticmethod
    def _prop(device: Any) -> Any:
        import torch
        from cuda.bindings import driver as cu

        prop = cu.CUmemAllocationProp()
        prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = device.index if device.index is not None else torch.cuda.current_device()
        prop.requestedHandleTypes = (
            cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)
        return prop

    @staticmethod
    def _rounded(nbytes: int, prop: Any) -> int:
        from cuda.bindings import driver as cu

        gran = cu_result(cu.cuMemGetAllocationGranularity(
            prop, cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED))
        return int(-(-nbytes // gran) * gran)

    @classmethod
    def _map(cls, handle: Any, size: int, prop: Any, device: Any) -> CuMemAllocation:
        from cuda.bindings import driver as cu

        ptr = cu_result(cu.cuMemAddressReserve(size, 0, 0, 0))
        cu_result(cu.cuMemMap(ptr, size, 0, handle, 0))
        access = cu.CUmemAccessDesc()
        access.location = prop.location
        access.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        cu_result(cu.cuMemSetAccess(ptr, size, [access], 1))
        return cls(handle, int(ptr), size, device)

    @classmethod
    def create(cls, nbytes: int, device: Any) -> CuMemAllocation:
        """A zeroed allocation of at least ``nbytes`` on ``device`` (a torch.device)."""
        import torch
        from cuda.bindings import driver as cu

        torch.zeros(1, device=device)  # make torch's primary context current on this thread
        prop = cls._prop(device)
        size = cls._rounded(nbytes, prop)
        alloc = cls._map(cu_result(cu.cuMemCreate(size, prop, 0)), size, prop, device)
        alloc.as_tensor(torch.uint8, (size,)).zero_()
        return alloc

    @classmethod
    def import_fd(cls, fd: int, nbytes: int, device: Any) -> CuMemAllocation:
        """Map the allocation another process exported as ``fd``."""
        import torch
        from cuda.bindings import driver as cu

        torch.zeros(1, device=device)
        prop = cls._prop(device)
        size = cls._rounded(nbytes, prop)
        handle = cu_result(cu.cuMemImportFromShareableHandle(
            fd, cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR))
        return cls._map(handle, size, prop, device)

    def export_fd(self) -> int:
        """A new POSIX fd of the allocation (the caller closes it)."""
        from cuda.bindings import driver as cu

        return int(cu_result(cu.cuMemExportToShareableHandle(
            self.handle, cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0)))

    def as_tensor(self, dtype: Any, shape: tuple[int, ...] | list[int]) -> Any:
        import torch

        n = 1
        for d in shape:
            n *= d
        nbytes = n * torch.empty((), dtype=dtype).element_size()
        raw = torch.as_tensor(_ArrayInterface(self.ptr, nbytes), device=self.device)
        return raw.view(dtype).view(tuple(shape))

    def close(self) -> None:
        from cuda.bindings import driver as cu

        cu_result(cu.cuMemUnmap(self.ptr, self.size))
        cu_result(cu.cuMemAddressFree(self.ptr, self.size))
        cu_result(cu.cuMemRelease(self.handle))


@dataclass(eq=False)
class _Mapping:
    ptr: int  # where the peer region's byte 0 is in this process
    base: int  # what to release
    size: int
    kind: str  # "M" (cuMem) or "L" (legacy IPC)
    handle: Any = None  # cuMem generic allocation handle


class PeerMappings:
    """A sender's mappings of peers' registered memory into this process, made once per
    (address, handle) and released together: cuMem memory by its fd (``fetch_fd``), or a
    legacy CUDA IPC handle."""

    def __init__(self, device: int, stats: collections.Counter[str]):
        self.device = device
        self.stats = stats
        self.opened: dict[tuple[bytes, bytes], _Mapping] = {}

    def open(self, address: bytes, handle: bytes) -> int:
        """This process's address of byte 0 of the peer region (mapped once)."""
        key = (address, handle)
        m = self.opened.get(key)
        if m is None:
            m = self._map_cumem(address, handle) if handle[:1] == b"M" else self._map_legacy(handle)
            self.opened[key] = m
        return m.ptr

    def open_ahead(self, pending: collections.deque[tuple[bytes, bytes]]) -> None:
        """Map every (address, handle) ``pending`` lists, ahead of its first write; a failure
        is logged only (that write meets it again and fails with it)."""
        while pending:
            address, handle = pending.popleft()
            try:
                self.open(address, handle)
            except Exception as e:  # noqa: BLE001
                log.warning("cuda-ipc: mapping a peer region ahead failed: %s", e)

    def _map_legacy(self, handle: bytes) -> _Mapping:
        ffi, drv = driver()
        h = ffi.new("CUipcMemHandle *")
        ffi.memmove(h, handle[1:65], 64)
        out = ffi.new("CUdeviceptr *")
        check_rc("cuIpcOpenMemHandle", drv.cuIpcOpenMemHandle_v2(out, h[0], 1))
        base = int(out[0])
        return _Mapping(base + struct.unpack("<Q", handle[65:73])[0], base, 0, "L")

    def _map_cumem(self, address: bytes, handle: bytes) -> _Mapping:
        from cuda.bindings import driver as cu

        rid, size, off = CUMEM_HANDLE.unpack(handle[1:])
        fd = fetch_fd(address, rid)
        try:
            h = cu_result(cu.cuMemImportFromShareableHandle(
                fd, cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR))
        finally:
            os.close(fd)
        ptr = cu_result(cu.cuMemAddressReserve(size, 0, 0, 0))
        cu_result(cu.cuMemMap(ptr, size, 0, h, 0))
        access = cu.CUmemAccessDesc()
        access.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        access.location.id = self.device
        access.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        cu_result(cu.cuMemSetAccess(ptr, size, [access], 1))
        self.stats["cumem_imports"] += 1
        return _Mapping(int(ptr) + off, int(ptr), size, "M", h)

    def release(self) -> None:
        for m in self.opened.values():
            try:
                if m.kind == "L":
                    _ffi_, drv = driver()
                    drv.cuIpcCloseMemHandle(m.base)
                else:
                    from cuda.bindings import driver as cu

                    cu_result(cu.cuMemUnmap(m.base, m.size))
                    cu_result(cu.cuMemAddressFree(m.base, m.size))
                    cu_result(cu.cuMemRelease(m.handle))
            except Exception as e:  # noqa: BLE001 - best effort at shutdown
                log.debug("cuda-ipc: releasing a peer mapping failed: %s", e)
        self.opened.clear()


def check_target(dst: MemoryDescriptor, prefix: bytes) -> bytes:
    """``dst``'s handle if it is a writable cuda-ipc region of a peer engine (notification
    address under ``prefix``), else ``OutOfRange``."""
    h = dst.handle
    if dst.backend != "cuda-ipc" or not (
            (h[:1] == b"L" and len(h) == 73) or (h[:1] == b"M" and len(h) == 1 + CUMEM_HANDLE.size)):
        raise OutOfRange("descriptor is not a writable cuda-ipc region")
    if not dst.address.startswith(prefix) or len(dst.address) > 100:
        raise OutOfRange("cuda-ipc notification address is not ours")
    if h[:1] == b"M":
        _, size, off = CUMEM_HANDLE.unpack(h[1:])
        if off + dst.length > size:
            raise OutOfRange("cuda-ipc region lies outside its advertised mapping")
    return h


def serve_fds(srv: socket.socket, exports: dict[int, int],
              stats: collections.Counter[str]) -> None:
    """Hand a registered cuMem fd to a same-user peer that asks for it (SCM_RIGHTS)."""
    while True:
        try:
            conn, _ = srv.accept()
        except (BlockingIOError, OSError):
            return
        with conn:
            try:
                conn.settimeout(2.0)
                creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                        struct.calcsize("3i"))
                _pid, uid, _gid = struct.unpack("3i", creds)
                data = conn.recv(8)
                fd = exports.get(struct.unpack("<Q", data)[0]) if len(data) == 8 else None
                if uid != os.getuid() or fd is None:
                    stats["fd_refused"] += 1
                    conn.sendall(b"no")
                    continue
                socket.send_fds(conn, [b"ok"], [fd])
                stats["fd_served"] += 1
            except OSError as e:
                log.debug("cuda-ipc: fd request failed: %s", e)
