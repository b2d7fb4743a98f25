"""The write side's bookkeeping of a fabric engine, owned by its progress thread: one
completion context per write in flight, and batched completion-queue reads.

``WriteSlots``: the provider owns each write's ``fi_context2`` while the write flies; slot
``i``'s context is at ``ctx + i * size``; ``batch[i]`` is the batch its write belongs to.
``CQReader``: reads up to ``n`` completions per call into numpy views, so a drain costs no
Python per entry (``dg_cq_drain`` in the cffi binding splits them into local slots and
remote immediates).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import numpy as np

from disagg.fabric import lib as fl


@dataclass(eq=False)
class Batch:
    """Writes of one ``submit`` call: addresses and lengths as arrays, one immediate."""

    src: np.ndarray  # absolute source addresses, uint64
    dst: np.ndarray  # remote addresses, uint64
    lens: np.ndarray  # bytes, uint64
    desc: Any  # local MR descriptor (fi_mr_desc)
    peer: bytes  # destination endpoint name
    key: int
    imm: int
    future: asyncio.Future[None]
    deadline: float
    posted: int = 0
    remaining: int = 0
    finished: bool = False


class WriteSlots:
    def __init__(self, capacity: int):
        self.capacity = capacity
        self.size = int(fl.lib.dg_context_size())
        self.ctx = fl.ffi.new("char[]", capacity * self.size)
        self.ctx_int = int(fl.ffi.cast("uintptr_t", self.ctx))
        self.free = list(range(capacity - 1, -1, -1))
        self.batch: list[Batch | None] = [None] * capacity

    def take(self, k: int) -> np.ndarray:
        """The next ``k`` free slots (not yet reserved: ``posted`` reserves those used)."""
        return np.array(self.free[-k:][::-1], dtype=np.uint32)

    def posted(self, slots: np.ndarray, n: int, b: Batch) -> None:
        """The first ``n`` of ``slots`` carry writes of ``b`` now."""
        del self.free[len(self.free) - n:]
        for s in slots[:n].tolist():
            self.batch[s] = b

    def release(self, s: int) -> Batch | None:
        """Slot ``s``'s write completed: the slot is free again; its batch, if any."""
        b, self.batch[s] = self.batch[s], None
        self.free.append(s)
        return b

    def slot_of(self, ctx: int) -> int | None:
        """The slot whose context is at address ``ctx`` (None: not one of ours)."""
        off = ctx - self.ctx_int
        return off // self.size if 0 <= off < self.capacity * self.size else None


class CQReader:
    def __init__(self, n: int = 256):
        self.n = n
        self.entries = fl.ffi.new("struct fi_cq_data_entry[]", n)
        self.slot_out = fl.ffi.new("int64_t[]", n)
        self.flags_out = fl.ffi.new("uint64_t[]", n)
        self.data_out = fl.ffi.new("uint64_t[]", n)
        self.slots = np.frombuffer(fl.ffi.buffer(self.slot_out), dtype=np.int64)
        self.data = np.frombuffer(fl.ffi.buffer(self.data_out), dtype=np.uint64)
        self.flags = np.frombuffer(fl.ffi.buffer(self.flags_out), dtype=np.uint64)

    def read(self, cq: Any, slots: WriteSlots) -> int:
        """Up to ``n`` completions (their count; ``-FI_EAVAIL``: an error entry is next)."""
        return int(fl.lib.dg_cq_drain(cq.ptr, self.entries, self.n, slots.ctx, slots.capacity,
                                      self.slot_out, self.flags_out, self.data_out))

    def local(self, n: int) -> list[int]:
        """Slots of this side's writes that completed, among the last ``n`` read."""
        s = self.slots[:n]
        return s[s >= 0].tolist()  # type: ignore[no-any-return]

    def immediates(self, n: int) -> list[int]:
        """Immediate data of peers' writes that landed here, among the last ``n`` read."""
        remote = (self.flags[:n] & np.uint64(int(fl.lib.FI_REMOTE_CQ_DATA))) != 0
        return self.data[:n][remote].tolist()  # type: ignore[no-any-return]
