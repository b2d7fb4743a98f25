"""What both KV messengers share: memory registrations, the scheduler link, owned tasks."""

from __future__ import annotations

import asyncio
from typing import Any, Literal

import msgspec
import torch
import zmq.asyncio

from disagg.protocol.inproc import MessengerStats
from disagg.protocol.peer import KVLayoutDesc
from disagg.serving.metrics import Metrics
from disagg.transfer import TransferEngine


class MessengerBase:
    """Registers every rank's KV cache (mapped into this process) and a context buffer of
    ``ctx_slots`` rows with the transfer engine, once; talks to the scheduler over
    ``sched_sock``; keeps a reference to every task it starts (cancelled by ``close``)."""

    # what peers may do with these registrations: a sender's are write sources only; a
    # receiver overrides (``target``, or ``source`` when each attempt gets its own window)
    register_access: Literal["source", "target", "both"] = "source"

    def __init__(self, sched_sock: zmq.asyncio.Socket, transfer: TransferEngine,
                 layout: KVLayoutDesc, kvs: list[torch.Tensor],
                 kv_fds: list[int | None] | None, ctx_slots: int, metrics: Metrics | None = None):
        self.sched = sched_sock
        self.transfer = transfer
        self.layout = layout
        fds = list(kv_fds or [None] * len(kvs))
        access = self.register_access
        self.kv_regions = [transfer.register(kv.view(torch.uint8).view(-1), fd=fd, access=access)
                           for kv, fd in zip(kvs, fds, strict=True)]  # one per rank
        self.ctx_buf = transfer.context_buffer(ctx_slots, layout.context_bytes)
        self.ctx_region = transfer.register(self.ctx_buf.view(-1), access=access)
        self.ctx_free = list(range(ctx_slots - 1, -1, -1))
        self.metrics = metrics
        self.bad_frames = 0
        self._enc = msgspec.msgpack.Encoder()
        self._tasks: set[asyncio.Task[None]] = set()

    async def _to_scheduler(self, msg: Any) -> None:
        await self.sched.send(self._enc.encode(msg))

    def stats(self) -> MessengerStats:
        raise NotImplementedError

    async def _pages_back(self, msg: Any) -> None:
        """Send a message that gives pages back to the scheduler, after this messenger's
        stats as they are now: the scheduler answers Stats from the last snapshot it got, so
        nobody may see the pages free while the snapshot still counts the transfer."""
        await self._to_scheduler(self.stats())
        await self._to_scheduler(msg)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _cancel_tasks(self) -> None:
        for t in self._tasks:
            t.cancel()
