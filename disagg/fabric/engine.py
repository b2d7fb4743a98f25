"""The fabric transfer engine: register memory, submit page writes, count immediates.

Shaped like pplx-garden's fabric-lib::

    info = discover("tcp")                       # fi_getinfo
    engine = FabricEngine(info); engine.start()  # fabric, domain, AV, CQ, RDM endpoint, thread
    region = engine.register(buffer)             # local handle; region.descriptor goes to peers
    win = engine.window([region])                # receiver: fresh keys for one transfer;
    win.descriptors[0] -> peer ... win.close()   # closed: the provider refuses its writes
    fut = engine.submit(region, desc, src_offsets, dst_offsets, lengths, imm)  # await fut
    exp = engine.expect(imm, count)              # receiver: await exp; exp.cancel()

One progress thread per engine owns every libfabric call after ``start()`` (its loop:
``disagg.fabric.progress``): it posts queued writes, drains the completion queue, counts
immediate data and checks deadlines. Native events enter asyncio in exactly one place,
``ProgressThread._emit`` (``call_soon_threadsafe``).
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from disagg.fabric import lib as fl
from disagg.fabric.descriptor import MemoryDescriptor, OutOfRange, check_writes
from disagg.fabric.expectations import Expectation, ExpectationTable, TransferTimeout
from disagg.fabric.lib import discover
from disagg.fabric.progress import ProgressThread
from disagg.fabric.regions import (
    EngineClosed,
    LocalRegion,
    Window,
    buffer_address,
)
from disagg.fabric.slots import Batch, CQReader, WriteSlots

__all__ = ["EngineClosed", "Expectation", "FabricEngine", "LocalRegion", "TransferTimeout",
           "Window", "discover"]  # discover: from disagg.fabric.lib

log = logging.getLogger("disagg.fabric")

U64_MAX = (1 << 64) - 1


class FabricEngine(ProgressThread):
    """One libfabric RDM endpoint with its CQ, AV and progress thread."""

    backend = "fabric"

    def __init__(
        self,
        info: fl.FabricInfo,
        max_inflight: int = 1024,
        default_timeout: float = 60.0,
        idle_sleep_max: float = 0.002,
        weight_bits: int = 0,
        expectations: ExpectationTable | None = None,
    ) -> None:
        """``expectations``: a table shared with other engines (the lanes of a
        ``StripedEngine`` count arrivals on any of them towards one expectation)."""
        self.info = info
        self.fabric = fl.Fabric(info)
        self.domain = fl.Domain(self.fabric)
        self.cq = fl.CompletionQueue(self.domain, size=max(4 * max_inflight, 1024))
        self.av = fl.AddressVector(self.domain)
        self.ep = fl.Endpoint(self.domain, self.cq, self.av)
        self.address = self.ep.name()
        self.default_timeout = default_timeout
        self.idle_sleep_max = idle_sleep_max
        self.capacity = max(1, min(max_inflight, info.tx_size or max_inflight))
        self.imm_max = U64_MAX if info.cq_data_size >= 8 else (1 << (8 * info.cq_data_size)) - 1
        self._slots = WriteSlots(self.capacity)
        self._cqr = CQReader()

        self._regions: dict[int, LocalRegion] = {}
        self._region_ids = itertools.count(1)
        self._expectations = (expectations if expectations is not None
                              else ExpectationTable(weight_bits))
        self._inbox: collections.deque[Any] = collections.deque()
        self._sending: collections.deque[Batch] = collections.deque()
        self._active: set[Batch] = set()
        self._wake_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._running = False
        self._closed = False
        self.stats = collections.Counter[str]()
        # a write's completion means its data was placed at the target (else: only sent)
        self.delivery_complete = info.delivery_complete

    # ---- lifecycle -------------------------------------------------------------------------

    @property
    def provider(self) -> str:
        return self.info.provider

    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> FabricEngine:
        """Start the progress thread; futures resolve on ``loop`` (default: the running one)."""
        if self._thread is not None:
            return self
        self._loop = loop or asyncio.get_running_loop()
        self._running = True
        self._thread = threading.Thread(target=self._run, name="fabric-progress", daemon=True)
        self._thread.start()
        return self

    async def close(self) -> None:
        """Stop the thread, fail every pending future with EngineClosed, release resources."""
        if not self._closed:
            await asyncio.get_running_loop().run_in_executor(None, self.close_sync)

    def close_sync(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._thread is not None:
            self._running = False
            self._wake()
            self._thread.join()
        self._release()

    def _release(self) -> None:
        self.ep.close()
        for r in self._regions.values():
            if isinstance(r.mr, fl.MemoryRegion):
                r.mr.close()
        self._regions.clear()
        self.cq.close()
        self.av.close()
        self.domain.close()
        self.fabric.close()
        os.close(self._wake_fd)

    # ---- memory ----------------------------------------------------------------------------

    def register(self, buffer: Any) -> LocalRegion:
        """Register a host buffer (buffer protocol, or an object with ``data_ptr()``/``nbytes``)."""
        addr, length = buffer_address(buffer)
        return self.register_address(addr, length, owner=buffer)

    def register_address(
        self, addr: int, length: int, owner: Any = None, iface: int = 0, device: int = 0,
        access: str = "both",
    ) -> LocalRegion:
        """Register raw memory [addr, addr + length); ``owner`` keeps it alive. ``access``:
        ``source`` (only written from here: no remote access), ``target`` (peers write into
        it) or ``both`` (``lib.ACCESS``); a random key unless the provider picks it."""
        if length <= 0:
            raise ValueError("cannot register an empty region")

        def do() -> LocalRegion:
            mr = fl.MemoryRegion(self.domain, addr, length, self.ep, iface=iface, device=device,
                                 access=access)
            rid = next(self._region_ids)
            desc = MemoryDescriptor(
                backend="fabric", provider=self.provider, address=self.address,
                base=mr.remote_base, length=length, key=mr.key, region=rid,
            )
            region = LocalRegion(rid, addr, length, desc, mr, owner)
            self._regions[rid] = region
            return region

        return self._call(do)

    def deregister(self, region: LocalRegion) -> None:
        def do() -> None:
            if self._regions.pop(region.id, None) is not None:
                region.mr.close()

        if not self._closed:
            self._call(do)

    def window(self, regions: list[LocalRegion]) -> Window:
        """Fresh remote-write registrations of ``regions``' memory, revoked by ``close()``
        (each in one round trip to the progress thread, which runs libfabric calls)."""
        fresh = self._call(lambda: [self.register_address(r.addr, r.length, r.owner,
                                                          access="target") for r in regions])

        def revoke() -> None:
            if not self._closed:
                self._call(lambda: list(map(self.deregister, fresh)))

        self.stats["windows"] += 1
        return Window([r.descriptor for r in fresh], revoke)

    @property
    def junk(self) -> int:
        """Immediates that arrived for no pending expectation, or past its count."""
        return self._expectations.junk

    def _call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on the progress thread (libfabric objects are used from one thread)."""
        if self._thread is None or threading.current_thread() is self._thread:
            return fn()
        done = threading.Event()
        box: list[Any] = []

        def job() -> None:
            try:
                box.append((True, fn()))
            except BaseException as e:  # noqa: BLE001 - handed back to the caller
                box.append((False, e))
            done.set()

        self._inbox.append(job)
        self._wake()
        done.wait()
        ok, val = box[0]
        if not ok:
            raise val
        return val

    # ---- sending ---------------------------------------------------------------------------

    def submit(
        self,
        src: LocalRegion,
        dst: MemoryDescriptor,
        src_offsets: Any,
        dst_offsets: Any,
        lengths: Any,
        imm: int,
        timeout: float | None = None,
    ) -> asyncio.Future[None]:
        """Write ``lengths[i]`` bytes from ``src + src_offsets[i]`` to ``dst + dst_offsets[i]``.

        Every write carries ``imm`` as remote CQ data. The future resolves when all writes of
        the batch completed at the source, and fails with OutOfRange (raised here, nothing
        posted), FabricError (a completion error) or TransferTimeout.
        """
        if self._thread is None or self._loop is None:
            raise RuntimeError("engine not started")
        if dst.backend != "fabric" or dst.provider != self.provider:
            raise OutOfRange(
                f"descriptor is for {dst.backend}/{dst.provider}, engine is fabric/{self.provider}"
            )
        if not 0 <= imm <= self.imm_max:
            raise OutOfRange(f"immediate {imm:#x} does not fit {self.info.cq_data_size} bytes")
        if src.id not in self._regions:
            raise OutOfRange("source region is not registered with this engine")
        so, do, ln = check_writes(src.length, dst.length, src_offsets, dst_offsets, lengths)
        fut: asyncio.Future[None] = self._loop.create_future()
        n = so.shape[0]
        if n == 0:
            fut.set_result(None)
            return fut
        t = self.default_timeout if timeout is None else timeout
        batch = Batch(
            src=(so + src.addr).astype(np.uint64), dst=(do + dst.base).astype(np.uint64),
            lens=ln.astype(np.uint64), desc=src.mr.desc, peer=dst.address, key=dst.key,
            imm=imm, future=fut, deadline=time.monotonic() + t, remaining=n,
        )
        self._inbox.append(batch)
        self._wake()
        return fut

    # ---- receiving -------------------------------------------------------------------------

    def expect(self, imm: int, count: int, timeout: float | None = None) -> Expectation:
        """Resolve when ``count`` writes carrying ``imm`` have landed here (any order)."""
        if self._loop is None:
            raise RuntimeError("engine not started")
        t = self.default_timeout if timeout is None else timeout
        e = self._expectations.expect(imm, count, self._loop.create_future(),
                                      time.monotonic() + t)
        self._wake()  # the deadline may be earlier than the thread's current wait
        return e

    def pending_expectations(self) -> int:
        return len(self._expectations)

    def batches_in_flight(self) -> int:
        """Write batches the progress thread holds (posting, queued or awaiting completion)."""
        return len(self._active)
