"""A transfer backend for tests, the whole of it in one module: writes are copies between
host regions of this process. Named in ``disagg.fabric.registry.BACKENDS`` (one line, by
``test_registry.py``), it is built and wrapped like the real ones."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

import numpy as np
import torch

from disagg.fabric.backend import Access, BackendOptions, Memory, Offsets, RegionHandle
from disagg.fabric.descriptor import MemoryDescriptor, OutOfRange, check_writes
from disagg.fabric.expectations import Expectation, ExpectationTable
from disagg.fabric.regions import LocalRegion, Window, settle_futures

_ENGINES: dict[bytes, MemcopyEngine] = {}  # by address: where a descriptor's writes land


class MemcopyEngine:
    backend = "memcopy"
    device_memory = False
    revocable_windows = False
    provider = "memcopy"
    cheap_registration = True
    delivery_complete = True

    def __init__(self, options: BackendOptions) -> None:
        self.table = ExpectationTable(options.weight_bits)
        self.timeout = options.default_timeout
        self.address = f"memcopy-{id(self):x}".encode()
        self.regions: dict[int, LocalRegion] = {}
        self.loop: asyncio.AbstractEventLoop | None = None
        _ENGINES[self.address] = self

    @property
    def junk(self) -> int:
        return self.table.junk

    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> MemcopyEngine:
        self.loop = loop or asyncio.get_running_loop()
        return self

    async def close(self) -> None:
        _ENGINES.pop(self.address, None)

    def register(self, memory: Memory, fd: int | None = None,
                 access: Access = "both") -> LocalRegion:
        assert isinstance(memory, torch.Tensor) and not memory.is_cuda
        data = memory.numpy().view(np.uint8).reshape(-1)
        rid = len(self.regions) + 1
        desc = MemoryDescriptor(self.backend, self.provider, self.address, 0, data.nbytes, 0, rid)
        self.regions[rid] = LocalRegion(rid, 0, data.nbytes, desc, data, memory)
        return self.regions[rid]

    def window(self, regions: Sequence[RegionHandle]) -> Window:
        return Window([r.descriptor for r in regions])

    def prepare(self, descriptors: Sequence[MemoryDescriptor]) -> None:
        pass

    def submit(self, src: RegionHandle, dst: MemoryDescriptor, src_offsets: Offsets,
               dst_offsets: Offsets, lengths: Offsets, imm: int,
               timeout: float | None = None) -> asyncio.Future[None]:
        if not isinstance(src, LocalRegion) or self.regions.get(src.id) is not src:
            raise OutOfRange("source region is not registered with this engine")
        so, do, ln = check_writes(src.length, dst.length, src_offsets, dst_offsets, lengths)
        peer = _ENGINES[dst.address]
        target = peer.regions[dst.region].mr
        for a, b, n in zip(so.tolist(), do.tolist(), ln.tolist(), strict=True):
            target[b:b + n] = src.mr[a:a + n]
        events: list = []
        peer.table.arrive([imm] * len(ln), events)
        settle_futures(events)
        assert self.loop is not None
        fut: asyncio.Future[None] = self.loop.create_future()
        fut.set_result(None)
        return fut

    def expect(self, imm: int, count: int, timeout: float | None = None,
               standing: bool = False) -> Expectation:
        assert self.loop is not None
        t = self.timeout if timeout is None else timeout
        return self.table.expect(imm, count, self.loop.create_future(), time.monotonic() + t,
                                 standing)


def create(options: BackendOptions) -> MemcopyEngine:
    return MemcopyEngine(options)
