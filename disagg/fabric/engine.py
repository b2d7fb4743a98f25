"""The fabric transfer engine: register memory, submit page writes, count immediates.

Shaped like pplx-garden's fabric-lib::

    info = discover("tcp")                       # fi_getinfo
    engine = FabricEngine(info); engine.start()  # fabric, domain, AV, CQ, RDM endpoint, thread
    region = engine.register(buffer)             # local handle; region.descriptor goes to peers
    win = engine.window([region])                # receiver: fresh keys for one transfer;
    win.descriptors[0] -> peer ... win.close()   # closed: the provider refuses its writes
    fut = engine.submit(region, desc, src_offsets, dst_offsets, lengths, imm)  # await fut
    exp = engine.expect(imm, count)              # receiver: await exp; exp.cancel()

One progress thread per engine (a ``ProgressThread`` it owns, ``disagg.fabric.progress``)
runs every libfabric call after ``start()``: it posts queued writes, drains the completion
queue, counts immediate data and checks deadlines. Native events enter asyncio in exactly one
place, ``ProgressThread._emit`` (``call_soon_threadsafe``).
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import time
from collections.abc import Sequence

import numpy as np

from disagg.fabric import lib as fl
from disagg.fabric.backend import Access, Memory, Offsets, RegionHandle
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
from disagg.fabric.slots import Batch

__all__ = ["EngineClosed", "Expectation", "FabricEngine", "LocalRegion", "TransferTimeout",
           "Window", "discover"]  # discover: from disagg.fabric.lib

log = logging.getLogger("disagg.fabric")

U64_MAX = (1 << 64) - 1
# providers whose registrations pin nothing (measured on tcp: ~5 us a registration + close,
# whatever the size): per-attempt windows by default
CHEAP_REGISTRATION = ("tcp", "shm", "net", "udp", "sockets")


def cheap_registration(provider: str) -> bool:
    """Whether registering memory with ``provider`` pins nothing."""
    return provider.split(";")[0] in CHEAP_REGISTRATION


class FabricEngine:
    """One libfabric RDM endpoint with its CQ, AV and progress thread."""

    backend = "fabric"
    device_memory = False  # no FI_HMEM here: GPU memory goes through host staging
    revocable_windows = True

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
        self.capacity = max(1, min(max_inflight, info.tx_size or max_inflight))
        self.imm_max = U64_MAX if info.cq_data_size >= 8 else (1 << (8 * info.cq_data_size)) - 1
        self._regions: dict[int, LocalRegion] = {}
        self._region_ids = itertools.count(1)
        self._expectations = (expectations if expectations is not None
                              else ExpectationTable(weight_bits))
        self._closed = False
        self.stats = collections.Counter[str]()
        self._progress = ProgressThread(self.fabric, self.cq, self.av, self.ep,
                                        self._expectations, self.capacity, idle_sleep_max,
                                        self.stats, info.provider)
        # a write's completion means its data was placed at the target (else: only sent)
        self.delivery_complete = info.delivery_complete

    # ---- lifecycle -------------------------------------------------------------------------

    @property
    def provider(self) -> str:
        return self.info.provider

    @property
    def cheap_registration(self) -> bool:
        return cheap_registration(self.provider)

    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> FabricEngine:
        """Start the progress thread; futures resolve on ``loop`` (default: the running one)."""
        if self._progress.loop is None:
            self._progress.start(loop or asyncio.get_running_loop())
        return self

    async def close(self) -> None:
        """Stop the thread, fail every pending future with EngineClosed, release resources."""
        if not self._closed:
            await asyncio.get_running_loop().run_in_executor(None, self.close_sync)

    def close_sync(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._progress.stop()
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
        self._progress.close()

    # ---- memory ----------------------------------------------------------------------------

    def register(self, buffer: Memory, fd: int | None = None,
                 access: Access = "both") -> LocalRegion:
        """Register a host buffer (buffer protocol, or a host tensor); ``fd`` is ignored."""
        addr, length = buffer_address(buffer)
        return self.register_address(addr, length, owner=buffer, access=access)

    def register_address(
        self, addr: int, length: int, owner: object = None, iface: int = 0, device: int = 0,
        access: Access = "both",
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

        return self._progress.call(do)

    def own(self, region: RegionHandle) -> LocalRegion:
        """``region`` as this engine registered it; ``OutOfRange`` for any other."""
        if not isinstance(region, LocalRegion) or self._regions.get(region.id) is not region:
            raise OutOfRange("source region is not registered with this engine")
        return region

    def deregister(self, region: LocalRegion) -> None:
        def do() -> None:
            if self._regions.pop(region.id, None) is not None:
                region.mr.close()

        if not self._closed:
            self._progress.call(do)

    def window(self, regions: Sequence[RegionHandle]) -> Window:
        """Fresh remote-write registrations of ``regions``' memory, revoked by ``close()``
        (each in one round trip to the progress thread, which runs libfabric calls)."""
        own = [self.own(r) for r in regions]
        fresh = self._progress.call(lambda: [self.register_address(r.addr, r.length, r.owner,
                                                                   access="target")
                                             for r in own])

        def revoke() -> None:
            if not self._closed:
                self._progress.call(lambda: list(map(self.deregister, fresh)))

        self.stats["windows"] += 1
        return Window([r.descriptor for r in fresh], revoke)

    @property
    def junk(self) -> int:
        """Immediates that arrived for no pending expectation, or past its count."""
        return self._expectations.junk

    def prepare(self, descriptors: Sequence[MemoryDescriptor]) -> None:
        """Nothing to map ahead: a peer's address enters the AV at its first write."""

    # ---- sending ---------------------------------------------------------------------------

    def submit(
        self,
        src: RegionHandle,
        dst: MemoryDescriptor,
        src_offsets: Offsets,
        dst_offsets: Offsets,
        lengths: Offsets,
        imm: int,
        timeout: float | None = None,
    ) -> asyncio.Future[None]:
        """Write ``lengths[i]`` bytes from ``src + src_offsets[i]`` to ``dst + dst_offsets[i]``.

        Every write carries ``imm`` as remote CQ data. The future resolves when all writes of
        the batch completed at the source, and fails with OutOfRange (raised here, nothing
        posted), FabricError (a completion error) or TransferTimeout.
        """
        loop = self._progress.loop
        if loop is None:
            raise RuntimeError("engine not started")
        if dst.backend != "fabric" or dst.provider != self.provider:
            raise OutOfRange(
                f"descriptor is for {dst.backend}/{dst.provider}, engine is fabric/{self.provider}"
            )
        if not 0 <= imm <= self.imm_max:
            raise OutOfRange(f"immediate {imm:#x} does not fit {self.info.cq_data_size} bytes")
        src = self.own(src)
        so, do, ln = check_writes(src.length, dst.length, src_offsets, dst_offsets, lengths)
        fut: asyncio.Future[None] = loop.create_future()
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
        self._progress.post(batch)
        return fut

    # ---- receiving -------------------------------------------------------------------------

    def expect(self, imm: int, count: int, timeout: float | None = None,
               standing: bool = False) -> Expectation:
        """Resolve when ``count`` writes carrying ``imm`` have landed here (any order);
        ``standing``: armed ahead of need, so the progress thread need not poll fast for it."""
        loop = self._progress.loop
        if loop is None:
            raise RuntimeError("engine not started")
        t = self.default_timeout if timeout is None else timeout
        e = self._expectations.expect(imm, count, loop.create_future(), time.monotonic() + t,
                                     standing)
        self._progress.wake()  # the deadline may be earlier than the thread's current wait
        return e

    def pending_expectations(self) -> int:
        return len(self._expectations)

    def batches_in_flight(self) -> int:
        """Write batches the progress thread holds (posting, queued or awaiting completion)."""
        return self._progress.in_flight()
