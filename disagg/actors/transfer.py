"""Transfer engine actor: the node's one link to the fabric.

Owns: the backend engine (libfabric endpoint, CQ, AV and progress thread, or cuda-ipc), the
registrations of every executor's KV memory (mapped into this process) and of the context
buffer. Turns planned writes into batches with immediate data and counts what lands here.
Callers only ``await``; the engine's progress thread enters asyncio in one place.
"""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict
from typing import Any

import torch

from disagg.fabric import decode_descriptor, make_backend
from disagg.fabric.descriptor import MemoryDescriptor
from disagg.transfer_plan import UNIT_BITS, Write, make_imm

log = logging.getLogger(__name__)


class TransferEngine:
    def __init__(self, backend: str = "fabric", provider: str = "tcp", timeout_s: float = 30.0,
                 device: torch.device | None = None):
        kw: dict[str, Any] = {"weight_bits": UNIT_BITS, "default_timeout": timeout_s}
        if backend == "cuda-ipc":
            kw["device"] = (device.index or 0) if device is not None else 0
            self.engine = make_backend(backend, **kw)
        else:
            self.engine = make_backend(backend, provider=provider, **kw)
        self.backend = backend
        self.timeout_s = timeout_s
        self.writes_sent = 0
        self.bytes_sent = 0
        self.units_received = 0

    def start(self) -> TransferEngine:
        self.engine.start(asyncio.get_running_loop())
        return self

    async def close(self) -> None:
        await self.engine.close()

    def register(self, tensor: torch.Tensor) -> Any:
        """Register a tensor's memory once; returns the local region (``.descriptor`` for peers)."""
        if self.backend == "cuda-ipc":
            return self.engine.register(tensor)
        return self.engine.register_address(int(tensor.data_ptr()),
                                            tensor.numel() * tensor.element_size(), owner=tensor)

    @staticmethod
    def decode_descriptor(data: bytes) -> MemoryDescriptor:
        return decode_descriptor(data)

    def write(self, src: Any, dst: MemoryDescriptor, writes: list[Write], key: int,
              timeout: float | None = None) -> list[asyncio.Future[None]]:
        """Post ``writes`` (one batch per distinct unit count: the immediate carries it).
        Raises ``OutOfRange`` before posting anything that falls outside ``dst``."""
        by_units: dict[int, list[Write]] = defaultdict(list)
        for w in writes:
            by_units[w.units].append(w)
        futures = []
        for units, ws in by_units.items():
            futures.append(self.engine.submit(
                src, dst, [w.src_offset for w in ws], [w.dst_offset for w in ws],
                [w.length for w in ws], make_imm(key, units), timeout=timeout))
            self.writes_sent += len(ws)
            self.bytes_sent += sum(w.length for w in ws)
        return futures

    def expect(self, key: int, units: int, timeout: float) -> Any:
        """An awaitable that resolves when ``units`` units carrying ``key`` have landed."""
        return self.engine.expect(key, units, timeout=timeout)
