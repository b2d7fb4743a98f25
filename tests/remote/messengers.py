"""What the in-process messenger tests share: a tiny KV layout, the codecs of the scheduler
links, a layer counter that never moves, and a deadline-bound wait."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import msgspec

from disagg.protocol.inproc import ToScheduler
from disagg.protocol.peer import KVLayoutDesc

LAYOUT = KVLayoutDesc(num_layers=2, num_pages=16, num_kv_heads=1, page_size=4, head_dim=8,
                      dtype="float32", element_size=4, hidden_size=16)
ENC = msgspec.msgpack.Encoder()
SCHED = msgspec.msgpack.Decoder(ToScheduler)


class Counter:  # the layer counter: no step ever runs here
    def read(self) -> int:
        return 0


async def until(cond: Callable[[], object], what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"{what} not reached in {timeout}s"
        await asyncio.sleep(0.02)
