"""What the prefill messenger (``disagg.actors.prefill_messenger``) holds per job and per
step: the request and where its writes go, and which layers of a step went out; and how it
posts a job's writes (``JobWrites``)."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from disagg.protocol.inproc import StepAnnounce
from disagg.protocol.peer import KVLayoutDesc, PrefillFailCode, PrefillRequest
from disagg.remote.prefill import PrefillJobs
from disagg.remote.transfer_plan import ChunkPlan, Runs, context_write

log = logging.getLogger("disagg.actors.prefill_messenger")


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
    context_posted: bool = False  # its context write (the decoder counts one) went out


@dataclass
class Step:
    announce: StepAnnounce
    next_layer: int = 0  # layers [0, next_layer) handed to the engine
    plans: dict[int, ChunkPlan | None] = field(default_factory=dict)  # by chunk index, lazily


class JobWrites:
    """The prefill messenger's posting of a job's writes (mixed into it)."""

    layout: KVLayoutDesc
    life: PrefillJobs
    transfer: Any  # disagg.actors.transfer.TransferEngine
    ctx_region: Any
    zero_slot: int  # a context row never written: the source of context markers

    def _fail(self, job: Job, code: PrefillFailCode, message: str) -> None:
        raise NotImplementedError

    def _post_context(self, job: Job, slot: int | None = None) -> None:
        """The job's context write, once: its hidden row at ``slot`` (MTP reads it), else a
        zero-row marker, posted with the last layer's KV so the decoder's count ends there."""
        if job.context_posted or (slot is None and self.layout.spec_method == "mtp") or \
                not self.life.may_write(job.id, time.monotonic()):
            return
        job.context_posted, n = True, self.layout.context_bytes
        self._post(job, self.ctx_region, job.dst_ctx, Runs.of([context_write(
            (self.zero_slot if slot is None else slot) * n, job.req.ctx_offset, n)]))

    def _post(self, job: Job, src: Any, dst: Any, runs: Runs) -> None:
        """Hand ``runs`` to the transfer engine (the caller checked ``may_write``); no write
        may still be queued or posted past the job's absolute deadline."""
        now = time.monotonic()
        if job.first_post_at is None:
            job.first_post_at = now
        job.writes += len(runs)
        job.bytes += int(runs.length.sum())
        left = self.life.time_left(job.id, now)
        try:
            job.futures.extend(self.transfer.write(src, dst, runs, job.req.key,
                                                   timeout=min(left, self.transfer.timeout_s)))
        except Exception as e:  # out of range: refuse, never write outside
            log.error("job %d: refused writes: %s", job.id, e)
            self._fail(job, "transfer_failed", str(e))
