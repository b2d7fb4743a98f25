"""``cuda-ipc`` backend: page writes between GPUs of one host, same API as FabricEngine.

Receiver: ``register(tensor)`` exports the tensor's allocation with a CUDA IPC handle (64
bytes, serialisable, carried in ``MemoryDescriptor.handle`` with the tensor's offset in it)
and binds a Unix datagram socket (abstract name, in ``MemoryDescriptor.address``) on which
senders report immediates. Sender: ``submit`` maps the peer allocation once
(``cuIpcOpenMemHandle``, peer access enabled lazily), issues one ``cuMemcpyAsync`` per page
run on a dedicated stream, records an event, and when the event has completed sends
``(imm, count)`` to the receiver -- the same semantics as fabric immediate data: the receiver's
counter only moves once the bytes are there.

One progress thread per engine, as in the fabric engine; futures resolve through
``call_soon_threadsafe`` only. The driver calls go through cffi in ABI mode on
``libcuda.so.1``; torch provides the device, stream and events.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import os
import select
import socket
import struct
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from disagg.fabric.counter import ImmCounter
from disagg.fabric.descriptor import MemoryDescriptor, OutOfRange, check_writes
from disagg.fabric.engine import EngineClosed, Expectation, LocalRegion, TransferTimeout, _settle

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
_IMM = struct.Struct("<QQ")  # (imm, count) per notification datagram
_drv: Any = None
_ffi: Any = None


def _driver() -> tuple[Any, Any]:
    global _drv, _ffi
    if _drv is None:
        import cffi

        _ffi = cffi.FFI()
        _ffi.cdef(_CDEF)
        _drv = _ffi.dlopen("libcuda.so.1")
    return _ffi, _drv


def _check(what: str, rc: int) -> None:
    if rc != 0:
        ffi, drv = _driver()
        s = ffi.new("const char **")
        drv.cuGetErrorString(rc, s)
        text = ffi.string(s[0]).decode() if s[0] != ffi.NULL else "?"
        raise RuntimeError(f"{what}: CUDA error {rc}: {text}")


@dataclass(eq=False)
class _Job:
    src: np.ndarray
    dst_handle: bytes
    dst: np.ndarray
    lens: np.ndarray
    address: bytes
    imm: int
    future: asyncio.Future[None]
    deadline: float
    event: Any = None


class CudaIpcEngine:
    backend = "cuda-ipc"

    def __init__(self, device: int = 0, default_timeout: float = 60.0, weight_bits: int = 0) -> None:
        import torch

        self.torch = torch
        self.device = device
        self.default_timeout = default_timeout
        self.provider = "cuda-ipc"
        self._name = f"\0disagg-cuda-ipc-{os.getpid()}-{id(self):x}".encode()
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.bind(self._name)
        self._sock.setblocking(False)
        self._out = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._wake_r, self._wake_w = os.pipe()
        self._counter = ImmCounter(weight_bits=weight_bits)
        self._expectations: dict[int, Expectation] = {}
        self._lock = threading.Lock()
        self._inbox: collections.deque[_Job] = collections.deque()
        self._pending: collections.deque[_Job] = collections.deque()
        self._opened: dict[bytes, int] = {}
        self._regions: dict[int, LocalRegion] = {}
        self._ids = itertools.count(1)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._running = False
        self.stats = collections.Counter[str]()

    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> CudaIpcEngine:
        if self._thread is None:
            self._loop = loop or asyncio.get_running_loop()
            self._running = True
            self._thread = threading.Thread(target=self._run, name="cuda-ipc-progress",
                                            daemon=True)
            self._thread.start()
        return self

    async def close(self) -> None:
        if self._thread is not None:
            self._running = False
            os.write(self._wake_w, b"x")
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join)
            self._thread = None
        ffi, drv = _driver()
        for ptr in self._opened.values():
            drv.cuIpcCloseMemHandle(ptr)
        self._opened.clear()
        self._sock.close()
        self._out.close()
        os.close(self._wake_r)
        os.close(self._wake_w)

    def register(self, tensor: Any) -> LocalRegion:
        """Export a contiguous CUDA tensor; its descriptor lets peers on this host write to it."""
        if not getattr(tensor, "is_cuda", False) or not tensor.is_contiguous():
            raise ValueError("cuda-ipc registers contiguous CUDA tensors")
        ffi, drv = _driver()
        ptr = int(tensor.data_ptr())
        length = int(tensor.numel() * tensor.element_size())
        base = ffi.new("CUdeviceptr *")
        size = ffi.new("size_t *")
        _check("cuMemGetAddressRange", drv.cuMemGetAddressRange_v2(base, size, ptr))
        h = ffi.new("CUipcMemHandle *")
        _check("cuIpcGetMemHandle", drv.cuIpcGetMemHandle(h, base[0]))
        handle = bytes(ffi.buffer(h)) + struct.pack("<Q", ptr - int(base[0]))
        rid = next(self._ids)
        desc = MemoryDescriptor(backend="cuda-ipc", provider="cuda-ipc", address=self._name,
                                base=0, length=length, key=0, region=rid, handle=handle)
        region = LocalRegion(rid, ptr, length, desc, None, tensor)
        self._regions[rid] = region
        return region

    def submit(self, src: LocalRegion, dst: MemoryDescriptor, src_offsets: Any,
               dst_offsets: Any, lengths: Any, imm: int,
               timeout: float | None = None) -> asyncio.Future[None]:
        if self._loop is None:
            raise RuntimeError("engine not started")
        if dst.backend != "cuda-ipc" or len(dst.handle) != 72:
            raise OutOfRange("descriptor is not a cuda-ipc region")
        if not dst.address.startswith(b"\0disagg-cuda-ipc-"):
            raise OutOfRange("cuda-ipc notification address is not ours")
        if not 0 <= imm < 1 << 64:
            raise OutOfRange("immediate does not fit 64 bits")
        so, do, ln = check_writes(src.length, dst.length, src_offsets, dst_offsets, lengths)
        fut: asyncio.Future[None] = self._loop.create_future()
        t = self.default_timeout if timeout is None else timeout
        self._inbox.append(_Job(
            (so + src.addr).astype(np.uint64), dst.handle, do.astype(np.uint64),
            ln.astype(np.uint64), dst.address, imm, fut, time.monotonic() + t))
        os.write(self._wake_w, b"x")
        return fut

    def expect(self, imm: int, count: int, timeout: float | None = None) -> Expectation:
        if self._loop is None:
            raise RuntimeError("engine not started")
        fut: asyncio.Future[None] = self._loop.create_future()
        t = self.default_timeout if timeout is None else timeout
        e = Expectation(imm, count, fut, self, time.monotonic() + t)
        with self._lock:
            if self._counter.expect(imm, count):
                fut.set_result(None)
                return e
            self._expectations[imm] = e
        return e

    def _cancel_expectation(self, e: Expectation) -> bool:
        with self._lock:
            if self._expectations.get(e.imm) is not e:
                return False
            del self._expectations[e.imm]
            self._counter.cancel(e.imm)
        e.future.cancel()
        return True

    def _emit(self, events: list[Any]) -> None:
        """The one door into asyncio."""
        if events and self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(_settle, events)

    def _open(self, handle: bytes) -> int:
        ptr = self._opened.get(handle[:64])
        if ptr is None:
            ffi, drv = _driver()
            h = ffi.new("CUipcMemHandle *")
            ffi.memmove(h, handle[:64], 64)
            out = ffi.new("CUdeviceptr *")
            _check("cuIpcOpenMemHandle", drv.cuIpcOpenMemHandle_v2(out, h[0], 1))
            ptr = int(out[0])
            self._opened[handle[:64]] = ptr
        return ptr + struct.unpack("<Q", handle[64:72])[0]

    def _run(self) -> None:
        """Loop: issue queued copies, retire finished ones (notify), read notifications, wait."""
        torch = self.torch
        torch.cuda.set_device(self.device)
        stream = torch.cuda.Stream(self.device)
        ffi, drv = _driver()
        events: list[Any] = []
        try:
            while self._running:
                work = False
                while self._inbox:
                    job = self._inbox.popleft()
                    work = True
                    try:
                        base = self._open(job.dst_handle)
                        for s, d, n in zip(job.src.tolist(), job.dst.tolist(),
                                           job.lens.tolist(), strict=True):
                            _check("cuMemcpyAsync", drv.cuMemcpyAsync(
                                base + d, s, n, ffi.cast("void *", stream.cuda_stream)))
                        job.event = torch.cuda.Event()
                        job.event.record(stream)
                        self._pending.append(job)
                    except Exception as e:
                        events.append((job.future, e))
                while self._pending and self._pending[0].event.query():
                    job = self._pending.popleft()
                    work = True
                    try:
                        self._out.sendto(_IMM.pack(job.imm, job.dst.shape[0]), job.address)
                        events.append((job.future, None))
                    except OSError as e:
                        events.append((job.future, ConnectionError(f"peer gone: {e}")))
                    self.stats["completed"] += job.dst.shape[0]
                work |= self._read_notes(events)
                self._expire(events)
                if events:
                    self._emit(events)
                    events = []
                if not work:
                    t = 0.0001 if self._pending else 0.05
                    r, _, _ = select.select([self._sock.fileno(), self._wake_r], [], [], t)
                    if self._wake_r in r:
                        os.read(self._wake_r, 4096)
        finally:
            err = EngineClosed("cuda-ipc engine closed")
            events += [(j.future, err) for j in list(self._pending) + list(self._inbox)]
            with self._lock:
                events += [(e.future, err) for e in self._expectations.values()]
                self._expectations.clear()
            self._emit(events)

    def _read_notes(self, events: list[Any]) -> bool:
        got = False
        while True:
            try:
                data = self._sock.recv(64)
            except BlockingIOError:
                return got
            got = True
            if len(data) != _IMM.size:
                self.stats["bad_notes"] += 1
                continue
            imm, n = _IMM.unpack(data)
            self.stats["arrived"] += n
            with self._lock:
                key, units = self._counter.split(imm, n)
                if self._counter.arrive(key, units):
                    e = self._expectations.pop(key, None)
                    if e is not None:
                        events.append((e.future, None))

    def _expire(self, events: list[Any]) -> None:
        now = time.monotonic()
        for job in [j for j in self._pending if j.deadline <= now and not j.future.done()]:
            events.append((job.future, TransferTimeout("cuda-ipc batch passed its deadline")))
        with self._lock:
            for e in [e for e in self._expectations.values() if e.deadline <= now]:
                del self._expectations[e.imm]
                self._counter.cancel(e.imm)
                events.append((e.future, TransferTimeout(
                    f"expectation imm {e.imm:#x} passed its deadline")))
