"""What the prefill messenger (``disagg.actors.prefill_messenger``) holds per job and per
step: the request and where its writes go, and which layers of a step went out."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from disagg.protocol.inproc import StepAnnounce
from disagg.protocol.peer import PrefillRequest
from disagg.remote.transfer_plan import ChunkPlan


@dataclass
class Job:
    """What this messenger holds for one job: the request and where its writes go. Its
    lifecycle (state, deadlines, quota) is ``self.life`` (``disagg.remote.prefill``)."""

    id: int
    peer: bytes  # decoder's ROUTER identity
    req: PrefillRequest
    dst_kv: list[Any]  # decoded MemoryDescriptor per decoder rank
    dst_ctx: Any
    futures: list[asyncio.Future[None]] = field(default_factory=list)
    first_post_at: float | None = None
    cached_tokens: int = 0  # prompt tokens this node's prefix cache held (not computed)
    writes: int = 0  # posted so far
    bytes: int = 0


@dataclass
class Step:
    announce: StepAnnounce
    next_layer: int = 0  # layers [0, next_layer) handed to the engine
    plans: dict[int, ChunkPlan | None] = field(default_factory=dict)  # by chunk index, lazily
