"""Several endpoints ("lanes") as one transfer engine: writes striped over NICs/endpoints.

A node with several NICs (or a provider that gains from several endpoints on one) opens one
:class:`FabricEngine` per lane, each with its own fabric, domain, endpoint, CQ and progress
thread. Memory is registered with every lane; the region's descriptor is lane 0's, with the
other lanes' ``(address, base, key)`` in its ``handle`` (``b"S"`` + msgpack), so a peer with a
single lane still reads it as a plain descriptor (``disagg.fabric.lanes``, pure). A batch
is bounds-checked whole, then its writes are spread over ``min(local lanes, remote lanes)``
lanes, least-loaded by bytes
(``topology.stripe``), from a first lane drawn per batch (``topology.first_lane``: a batch of
one write leaves on any lane, not always lane 0); lane ``i`` writes to the peer's lane ``i``. Every write still carries
the batch's immediate, and the lanes share one :class:`ExpectationTable`, so a receiver counts
arrivals on any lane towards the same expectation: striping changes nothing in what the peers
count. Lanes pick interfaces nearest first (``lane_domains``; the node passes the NIC names
``topology.pair_gpus`` found nearest its GPU).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np

from disagg.fabric import lib as fl
from disagg.fabric.backend import Access, BackendOptions, Memory, Offsets, RegionHandle
from disagg.fabric.descriptor import MemoryDescriptor, OutOfRange, check_writes
from disagg.fabric.engine import FabricEngine
from disagg.fabric.expectations import Expectation, ExpectationTable
from disagg.fabric.lanes import Lane, lanes_handle, lanes_of
from disagg.fabric.regions import LocalRegion, Window, buffer_address
from disagg.fabric.topology import MAX_LANES, first_lane, lane_domains, stripe


def create(options: BackendOptions) -> FabricEngine | StripedEngine:
    """The ``fabric`` backend: one endpoint on ``options.address`` (empty: loopback, the
    provider's choice), or a ``StripedEngine`` over ``options.lanes``, on the interfaces
    nearest this process's GPU first."""
    node, source = options.address or "127.0.0.1", bool(options.address)
    if options.lanes > 1:
        return StripedEngine(discover_lanes(options.provider, options.lanes,
                                            tuple(options.nearest()), node=node, source=source),
                             weight_bits=options.weight_bits,
                             default_timeout=options.default_timeout,
                             max_inflight=options.max_inflight)
    return FabricEngine(fl.discover(options.provider, node=node, source=source),
                        weight_bits=options.weight_bits, default_timeout=options.default_timeout,
                        max_inflight=options.max_inflight)


def discover_lanes(provider: str | None, lanes: int, nearest: Sequence[str] = (),
                   node: str | None = "127.0.0.1", source: bool = False) -> list[fl.FabricInfo]:
    infos = [i for i in fl.getinfo(provider, node, source=source) if i.cq_data_size >= 4]
    if not infos:
        raise fl.FabricError(f"fi_getinfo(provider={provider!r})", -fl.lib.FI_ENODATA)
    return [infos[i] for i in lane_domains([i.domain for i in infos], lanes, nearest)]


@dataclass(eq=False)
class StripedRegion:
    """A buffer registered with every lane; ``descriptor`` advertises them all."""

    id: int
    addr: int
    length: int
    descriptor: MemoryDescriptor
    lanes: list[LocalRegion]
    owner: Any = None


class StripedEngine:
    """``FabricEngine``'s interface over several lanes."""

    backend = "fabric"
    device_memory = False
    revocable_windows = True

    def __init__(self, infos: Sequence[fl.FabricInfo], weight_bits: int = 0,
                 **kw: Any) -> None:
        if not 1 <= len(infos) <= MAX_LANES:
            raise ValueError(f"a striped engine takes 1..{MAX_LANES} lanes, got {len(infos)}")
        self.expectations = ExpectationTable(weight_bits)
        self.lanes: list[FabricEngine] = []
        try:
            for info in infos:
                self.lanes.append(FabricEngine(info, weight_bits=weight_bits,
                                               expectations=self.expectations, **kw))
        except BaseException:
            for lane in self.lanes:
                lane.close_sync()
            raise
        self._ids = 0

    @property
    def provider(self) -> str:
        return self.lanes[0].provider

    @property
    def cheap_registration(self) -> bool:
        return self.lanes[0].cheap_registration

    @property
    def delivery_complete(self) -> bool:
        return all(lane.delivery_complete for lane in self.lanes)

    @property
    def junk(self) -> int:
        return self.expectations.junk

    @property
    def stats(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for lane in self.lanes:
            for k, v in lane.stats.items():
                out[k] = out.get(k, 0) + v
        return out

    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> StripedEngine:
        loop = loop or asyncio.get_running_loop()
        for lane in self.lanes:
            lane.start(loop)
        return self

    async def close(self) -> None:
        for lane in self.lanes:
            await lane.close()

    def close_sync(self) -> None:
        for lane in self.lanes:
            lane.close_sync()

    # ---- memory ----------------------------------------------------------------------------

    def register(self, buffer: Memory, fd: int | None = None,
                 access: Access = "both") -> StripedRegion:
        addr, length = buffer_address(buffer)
        return self.register_address(addr, length, owner=buffer, access=access)

    def register_address(self, addr: int, length: int, owner: object = None,
                         access: Access = "both") -> StripedRegion:
        regions = [lane.register_address(addr, length, owner, access=access)
                   for lane in self.lanes]
        return self._striped(addr, length, owner, regions)

    def _striped(self, addr: int, length: int, owner: object,
                 regions: list[LocalRegion]) -> StripedRegion:
        first = regions[0].descriptor
        extra = [Lane(r.descriptor.address, r.descriptor.base, r.descriptor.key)
                 for r in regions[1:]]
        desc = (msgspec.structs.replace(first, handle=lanes_handle(extra))
                if extra else first)
        self._ids += 1
        return StripedRegion(self._ids, addr, length, desc, regions, owner)

    def deregister(self, region: StripedRegion) -> None:
        for lane, r in zip(self.lanes, region.lanes, strict=True):
            lane.deregister(r)

    def own(self, region: RegionHandle) -> StripedRegion:
        """``region`` as this engine registered it; ``OutOfRange`` for any other."""
        if not isinstance(region, StripedRegion):
            raise OutOfRange("source region is not registered with this engine")
        return region

    def prepare(self, descriptors: Sequence[MemoryDescriptor]) -> None:
        """Nothing to map ahead (as ``FabricEngine.prepare``)."""

    def window(self, regions: Sequence[RegionHandle]) -> Window:
        """``FabricEngine.window`` on every lane; each descriptor advertises all lanes."""
        own = [self.own(r) for r in regions]
        wins = [lane.window([r.lanes[i] for r in own]) for i, lane in enumerate(self.lanes)]
        descs = []
        for k, r in enumerate(own):
            fresh = [LocalRegion(0, r.addr, r.length, w.descriptors[k], None) for w in wins]
            descs.append(self._striped(r.addr, r.length, r.owner, fresh).descriptor)

        def revoke() -> None:
            for w in wins:
                w.close()

        return Window(descs, revoke)

    # ---- sending ---------------------------------------------------------------------------

    def submit(self, src: RegionHandle, dst: MemoryDescriptor, src_offsets: Offsets,
               dst_offsets: Offsets, lengths: Offsets, imm: int,
               timeout: float | None = None) -> asyncio.Future[Any]:
        """As ``FabricEngine.submit``; the writes are spread over the lanes both sides have."""
        src = self.own(src)
        so, do, ln = check_writes(src.length, dst.length, src_offsets, dst_offsets, lengths)
        remote = lanes_of(dst)
        n = min(len(self.lanes), len(remote))
        first = first_lane(imm, int(do[0]), n) if so.shape[0] else 0
        if n == 1 or so.shape[0] <= 1:
            return self.lanes[first].submit(src.lanes[first], remote[first], so, do, ln, imm,
                                            timeout)
        lane_of = np.asarray(stripe(ln.tolist(), n, first))
        futs = []
        for i in range(n):
            m = lane_of == i
            if m.any():
                futs.append(self.lanes[i].submit(src.lanes[i], remote[i], so[m], do[m], ln[m],
                                                 imm, timeout))
        # done when every lane's batch is; fails with the first failure (gather still
        # retrieves the others' results, so nothing is left unobserved)
        return asyncio.gather(*futs)

    # ---- receiving -------------------------------------------------------------------------

    def expect(self, imm: int, count: int, timeout: float | None = None,
               standing: bool = False) -> Expectation:
        """Resolve when ``count`` units carrying ``imm`` landed, on any lane."""
        return self.lanes[0].expect(imm, count, timeout, standing)

    def pending_expectations(self) -> int:
        return len(self.expectations)

