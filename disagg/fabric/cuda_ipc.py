"""``cuda-ipc`` backend: page writes between GPUs of one host, same API as FabricEngine.

Receiver: ``register(tensor, fd=None)`` makes the tensor's memory mappable by a peer process
and puts what the peer needs in ``MemoryDescriptor.handle``; ``MemoryDescriptor.address`` is an
abstract Unix datagram socket on which senders report immediates. Two kinds of memory:

- cuMem memory (``fd`` given: the POSIX fd of its ``cuMemCreate`` allocation, e.g. the node's
  KV cache, ``ExecutorGroup.kv_fds``). Legacy IPC handles do not work on it. The handle is
  ``b"M" + (region id, mapping size, offset of the tensor)``; the sender fetches the fd from
  the receiver over an abstract Unix stream socket (``address + b".fd"``, SCM_RIGHTS; the
  receiver answers only peers of its own uid, checked with SO_PEERCRED), then
  ``cuMemImportFromShareableHandle`` + ``cuMemAddressReserve`` + ``cuMemMap`` +
  ``cuMemSetAccess`` for its own device. Chosen over ``pidfd_getfd``, which needs ptrace
  rights on the receiver (Yama, container seccomp profiles refuse it without
  CAP_SYS_PTRACE); a Unix socket works between any two processes of one user on one host.
- plain ``cudaMalloc`` memory (no fd; torch's caching allocator): a legacy CUDA IPC handle,
  ``b"L" + 64-byte cuIpcMemHandle + offset``, opened with ``cuIpcOpenMemHandle``.

Memory that can be neither (cuMem without its fd) registers as a source only (empty handle).

Sender: ``submit`` maps the peer memory once per descriptor (``prepare``: ahead, on the progress
thread), then issues the batch on a dedicated stream without synchronizing, as a copy kernel or
on the copy engines (``disagg.fabric.cuda_copy``: ``copy`` mode ``auto`` by default, or
``DISAGG_CUDA_IPC_COPY``). It records an event; once the event has completed the progress
thread sends ``(imm, count)`` to the receiver -- the same semantics as fabric immediate data:
the receiver's counter only moves once the bytes are there.

One progress thread per engine; futures resolve through ``call_soon_threadsafe`` only.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import os
import select
import socket
import struct
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from disagg.fabric.backend import (
    Access,
    BackendOptions,
    Memory,
    Offsets,
    RegionHandle,
    TraceHook,
    no_trace,
)
from disagg.fabric.cuda_copy import CopyIssuer
from disagg.fabric.cuda_mem import CUMEM_HANDLE, PeerMappings, check_target, driver, serve_fds
from disagg.fabric.descriptor import MemoryDescriptor, OutOfRange, check_writes
from disagg.fabric.expectations import Expectation, ExpectationTable, NotPosted, TransferTimeout
from disagg.fabric.regions import EngineClosed, LocalRegion, Window, settle_futures

log = logging.getLogger("disagg.fabric")

_IMM = struct.Struct("<QQ")  # (imm, count) per notification datagram
_PREFIX = b"\0disagg-cuda-ipc-"
_GRANULE = 2 << 20
MAX_NOTE_COUNT = 1 << 32  # writes one notification may report (a batch's run count)


def create(options: BackendOptions) -> CudaIpcEngine:
    """The ``cuda-ipc`` backend on CUDA device ``options.device``."""
    return CudaIpcEngine(device=options.device, default_timeout=options.default_timeout,
                         weight_bits=options.weight_bits, trace=options.trace)


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
    span: tuple[int, int] | None = None  # ring entries the kernel's tile table uses


class CudaIpcEngine:
    backend = "cuda-ipc"
    device_memory = True  # registers CUDA memory itself; context buffers live on the device
    revocable_windows = False  # CUDA IPC mappings cannot be revoked per transfer
    cheap_registration = False
    delivery_complete = False  # a batch completes at the source when its copies finished

    def __init__(self, device: int = 0, default_timeout: float = 60.0, weight_bits: int = 0,
                 copy: str | None = None, ctas: int | None = None,
                 trace: TraceHook = no_trace) -> None:
        """``trace``: where the progress thread marks a batch issued and its notes sent and
        received (``disagg.trace.mark`` in a node)."""
        import torch

        self.torch = torch
        self.device = device
        self.default_timeout = default_timeout
        self.provider = "cuda-ipc"
        self._trace = trace
        self.stats = collections.Counter[str]()
        self.copier = CopyIssuer(torch, device, copy, ctas, self.stats)
        self._name = f"\0disagg-cuda-ipc-{os.getpid()}-{id(self):x}".encode()
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.bind(self._name)
        self._sock.setblocking(False)
        self._fd_srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._fd_srv.bind(self._name + b".fd")
        self._fd_srv.listen(64)
        self._fd_srv.setblocking(False)
        self._exports: dict[int, int] = {}  # region id -> our dup of its cuMem fd
        self._out = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._wake_r, self._wake_w = os.pipe()
        self._expectations = ExpectationTable(weight_bits)
        self._inbox: collections.deque[_Job] = collections.deque()
        self._pending: collections.deque[_Job] = collections.deque()
        self._maps: collections.deque[tuple[bytes, bytes]] = collections.deque()  # to map ahead
        self._peers = PeerMappings(device, self.stats)
        self._regions: dict[int, LocalRegion] = {}
        self._ids = itertools.count(1)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._running = False

    @property
    def copy(self) -> str:
        """The copy mode (``disagg.fabric.cuda_copy``); set between batches by benchmarks."""
        return self.copier.copy

    @copy.setter
    def copy(self, mode: str) -> None:
        self.copier.copy = mode

    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> CudaIpcEngine:
        if self._thread is None:
            self.copier.warm()
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
        self._release()

    def _release(self) -> None:
        self._peers.release()
        for fd in self._exports.values():
            os.close(fd)
        self._exports.clear()
        for s in (self._sock, self._out, self._fd_srv):
            s.close()
        os.close(self._wake_r)
        os.close(self._wake_w)

    # ---- memory ----------------------------------------------------------------------------

    def register(self, tensor: Memory, fd: int | None = None,
                 access: Access = "both") -> LocalRegion:
        """Make a contiguous CUDA tensor writable by same-host peers (its descriptor).

        ``fd``: the POSIX fd of the cuMem allocation the tensor lies in (it is dup'ed; the
        caller keeps its own). Without it the tensor must be plain cudaMalloc memory, or it is
        registered as a write source only. ``access`` is not enforced: a same-host peer that
        maps the memory may write all of it."""
        if (not isinstance(tensor, self.torch.Tensor) or not tensor.is_cuda
                or not tensor.is_contiguous()):
            raise ValueError("cuda-ipc registers contiguous CUDA tensors")
        with self.torch.cuda.device(tensor.device):  # its primary context current here
            return self._register(tensor, fd)

    def _register(self, tensor: Any, fd: int | None) -> LocalRegion:
        ffi, drv = driver()
        ptr = int(tensor.data_ptr())
        length = int(tensor.numel() * tensor.element_size())
        rid = next(self._ids)
        base_p = ffi.new("CUdeviceptr *")
        size_p = ffi.new("size_t *")
        ranged = drv.cuMemGetAddressRange_v2(base_p, size_p, ptr) == 0
        base, size = (int(base_p[0]), int(size_p[0])) if ranged else (ptr, 0)
        handle = b""
        if fd is not None:
            off = ptr - base
            size = max(size, -(-(off + length) // _GRANULE) * _GRANULE)
            self._exports[rid] = os.dup(fd)
            handle = b"M" + CUMEM_HANDLE.pack(rid, size, off)
        elif ranged:
            h = ffi.new("CUipcMemHandle *")
            rc = drv.cuIpcGetMemHandle(h, base)
            if rc == 0:
                handle = b"L" + bytes(ffi.buffer(h)) + struct.pack("<Q", ptr - base)
            else:
                log.info("cuda-ipc: region %d has no IPC handle (CUDA error %d; cuMem memory "
                         "needs its fd): registered as a write source only", rid, rc)
        desc = MemoryDescriptor(backend="cuda-ipc", provider="cuda-ipc", address=self._name,
                                base=0, length=length, key=0, region=rid, handle=handle)
        region = LocalRegion(rid, ptr, length, desc, None, tensor)
        self._regions[rid] = region
        return region

    # ---- sending ---------------------------------------------------------------------------

    def submit(self, src: RegionHandle, dst: MemoryDescriptor, src_offsets: Offsets,
               dst_offsets: Offsets, lengths: Offsets, imm: int,
               timeout: float | None = None) -> asyncio.Future[None]:
        if self._loop is None:
            raise RuntimeError("engine not started")
        if not isinstance(src, LocalRegion) or self._regions.get(src.id) is not src:
            raise OutOfRange("source region is not registered with this engine")
        h = check_target(dst, _PREFIX)
        if not 0 <= imm < 1 << 64:
            raise OutOfRange("immediate does not fit 64 bits")
        so, do, ln = check_writes(src.length, dst.length, src_offsets, dst_offsets, lengths)
        fut: asyncio.Future[None] = self._loop.create_future()
        if so.shape[0] == 0:
            fut.set_result(None)
            return fut
        t = self.default_timeout if timeout is None else timeout
        self._inbox.append(_Job(
            (so + src.addr).astype(np.uint64), h, do.astype(np.uint64),
            ln.astype(np.uint64), dst.address, imm, fut, time.monotonic() + t))
        os.write(self._wake_w, b"x")
        return fut

    def prepare(self, dsts: Sequence[MemoryDescriptor]) -> None:
        """Map these peer regions now (on the progress thread), not at their first write."""
        self._maps.extend((d.address, check_target(d, _PREFIX)) for d in dsts)
        os.write(self._wake_w, b"x")

    # ---- receiving -------------------------------------------------------------------------

    def expect(self, imm: int, count: int, timeout: float | None = None,
               standing: bool = False) -> Expectation:
        if self._loop is None:
            raise RuntimeError("engine not started")
        t = self.default_timeout if timeout is None else timeout
        return self._expectations.expect(imm, count, self._loop.create_future(),
                                         time.monotonic() + t, standing)

    def pending_expectations(self) -> int:
        return len(self._expectations)

    @property
    def junk(self) -> int:
        """Notifications counted for no pending expectation, past its count, or malformed."""
        return self._expectations.junk + self.stats["bad_notes"]

    def window(self, regions: Sequence[RegionHandle]) -> Window:
        """The regions' own descriptors: CUDA IPC mappings cannot be revoked per transfer."""
        return Window([r.descriptor for r in regions])

    def _emit(self, events: list[Any]) -> None:
        """The one door into asyncio."""
        if events and self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(settle_futures, events)

    # ---- the progress thread -----------------------------------------------------------------

    def _issue(self, job: _Job, stream: Any, events: list[Any]) -> None:
        dst = job.dst + np.uint64(self._peers.open(job.address, job.dst_handle))

        def wait_oldest() -> None:
            self._pending[0].event.synchronize()
            self._retire(events)

        job.span = self.copier.issue(job.src, dst, job.lens, stream, self._spans, wait_oldest)

    def _spans(self) -> list[tuple[int, int]]:
        return [j.span for j in self._pending if j.span is not None]

    def _retire(self, events: list[Any]) -> bool:
        work = False
        while self._pending and self._pending[0].event.query():
            job = self._pending.popleft()
            work = True
            try:
                self._out.sendto(_IMM.pack(job.imm, job.dst.shape[0]), job.address)
                self._trace("c.note_out", "k", job.imm)
                events.append((job.future, None))
            except OSError as e:
                events.append((job.future, ConnectionError(f"peer gone: {e}")))
            self.stats["completed"] += job.dst.shape[0]
        return work

    def _run(self) -> None:
        """Loop: issue queued copies, retire finished ones (notify), read notifications, serve
        fd requests, wait."""
        torch = self.torch
        events: list[Any] = []
        try:
            stream = self.copier.setup()
            while self._running:
                work = False
                self._peers.open_ahead(self._maps)
                while self._inbox:
                    job = self._inbox.popleft()
                    work = True
                    if job.deadline <= time.monotonic():  # never issue a copy past it
                        events.append((job.future, NotPosted(
                            "cuda-ipc batch still queued at its deadline, not issued")))
                        continue
                    try:
                        self._issue(job, stream, events)
                        job.event = torch.cuda.Event()
                        job.event.record(stream)
                        self._pending.append(job)
                        self._trace("c.issued", "k", job.imm)
                    except Exception as e:
                        log.warning("cuda-ipc: batch failed: %s", e)
                        events.append((job.future, e))
                work |= self._retire(events)
                work |= self._read_notes(events)
                serve_fds(self._fd_srv, self._exports, self.stats)
                self._expire(events)
                if events:
                    self._emit(events)
                    events = []
                if not work:
                    fds = [self._sock.fileno(), self._fd_srv.fileno(), self._wake_r]
                    r, _, _ = select.select(fds, [], [], 0.0001 if self._pending else 0.05)
                    if self._wake_r in r:
                        os.read(self._wake_r, 4096)
        except BaseException as e:  # pragma: no cover - a bug; fail everything loudly
            log.exception("cuda-ipc progress thread died")
            events += [(j.future, e) for j in list(self._pending) + list(self._inbox)]
            self._pending.clear()
            self._inbox.clear()
        finally:
            err = EngineClosed("cuda-ipc engine closed")
            events += [(j.future, err) for j in list(self._pending) + list(self._inbox)]
            events += self._expectations.fail_all(err)
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
            if not 0 < n <= MAX_NOTE_COUNT:
                self.stats["bad_notes"] += 1
                continue
            self.stats["arrived"] += n
            self._trace("c.note_in", "k", imm)
            self._expectations.arrive({imm: n}, events)
            report = self._expectations.junk_report(time.monotonic())
            if report:
                log.warning("cuda-ipc: %s", report)

    def _expire(self, events: list[Any]) -> None:
        now = time.monotonic()
        for job in [j for j in self._pending if j.deadline <= now and not j.future.done()]:
            events.append((job.future, TransferTimeout("cuda-ipc batch passed its deadline")))
        self._expectations.expire(now, events)

