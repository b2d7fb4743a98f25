"""Scheduler actor of a prefill node.

Receives: ``PrefillJob`` / ``CancelJob`` / ``ReleaseJob`` / ``MessengerStats`` from the
messenger (``inproc://``). Sends: ``StepAnnounce`` BEFORE each step (SEED.md 12) and
``StepDone`` (+ the context rows as a second frame) after it.
Owns: the page pool and the prefill-only sequences; a job's pages are held after it is computed
until the messenger says every write reading them has completed.
"""

from __future__ import annotations

import logging

import msgspec
import zmq.asyncio

from disagg.actors.scheduler import SchedulerActor, SchedulerSetup
from disagg.engine.scheduling import Batch, Sequence, Status
from disagg.protocol import SamplingParams
from disagg.protocol.executor import StepPlan, StepResult
from disagg.protocol.inproc import (
    CancelJob,
    ChunkInfo,
    PrefillJob,
    ReleaseJob,
    StatsQuery,
    StatsReply,
    StepAnnounce,
    StepDone,
    ToScheduler,
)

log = logging.getLogger(__name__)


class PrefillScheduler(SchedulerActor):
    def __init__(self, setup: SchedulerSetup, mbox: zmq.asyncio.Socket):
        super().__init__("prefill", setup, None, mbox)
        self.jobs: dict[int, Sequence] = {}  # job id -> its prefill-only sequence
        self.job_of: dict[int, int] = {}  # slot -> job id
        self.held: dict[int, list[int]] = {}  # cancelled jobs' pages, freed on ReleaseJob
        self._menc = msgspec.msgpack.Encoder()

    async def handle_messenger(self, msg: ToScheduler) -> None:
        match msg:
            case PrefillJob(job=job, prompt_ids=ids):
                slot = next(self._slots)
                seq = Sequence(slot, f"job-{job}", list(ids), SamplingParams(max_tokens=1), 0,
                               arrival=slot, prefill_only=True)
                self.jobs[job] = seq
                self.job_of[slot] = job
                self.counters.started += 1
                self.sched.add(seq)
            case CancelJob(job=job):
                cancelled = self.jobs.get(job)
                if cancelled is not None and cancelled.status is not Status.FINISHED:
                    self.held[job] = self.sched.detach(cancelled)
                    self.counters.aborted += 1
            case ReleaseJob(job=job, outcome=outcome):
                done = self.jobs.pop(job, None)
                pages = self.held.pop(job, None)
                if done is not None:
                    self.job_of.pop(done.slot, None)
                    if done.status is Status.HELD:  # computed; its writes done or failed
                        pages = self.sched.detach(done)
                        if outcome == "finished":
                            self.counters.finished += 1
                        elif outcome == "aborted":
                            self.counters.aborted += 1
                        else:
                            self.counters.errored += 1
                if pages:
                    self.sched.free_pages(pages)
            case StatsQuery(peer=peer):
                await self._to_messenger([self._menc.encode(StatsReply(peer, self.stats()))])
            case _:
                await super().handle_messenger(msg)

    async def before_step(self, plan: StepPlan, batch: Batch) -> None:
        chunks = [ChunkInfo(self.job_of[c.seq.slot], c.start, c.count, c.seq.num_tokens,
                            list(c.seq.block_table))
                  for c in batch.chunks if c.seq.slot in self.job_of]
        await self._to_messenger([self._menc.encode(
            StepAnnounce(plan.step_id, plan.counter_base, chunks))])

    async def after_step(self, plan: StepPlan, batch: Batch, result: StepResult,
                         hidden: bytes | None) -> None:
        jobs = [self.job_of[w.slot] for w in plan.chunks if w.want_hidden and w.slot in self.job_of]
        done = StepDone(plan.step_id, result.error is None, jobs, result.error)
        frames = [self._menc.encode(done)]
        if hidden is not None and result.error is None:
            frames.append(hidden)
        await self._to_messenger(frames)

    async def step_failed(self, seq: Sequence, error: str) -> None:
        log.error("prefill step failed for %s: %s", seq.request_id, error)
        # the messenger cancels the job (StepDone.ok is False) and then releases its pages

    async def _to_messenger(self, frames: list[bytes]) -> None:
        assert self.mbox is not None
        await self.mbox.send_multipart(frames)
