"""The prefill node's side of the scheduler (``disagg.actors.scheduler.sides``).

Receives (through the scheduler): ``PrefillJob`` / ``CancelJob`` / ``ReleaseJob`` /
``StatsQuery`` from the messenger. Sends: ``StepAnnounce`` BEFORE each step and ``StepDone``
(+ the context rows as a second frame) after it, ``StatsReply``; with a host KV tier,
``JobHostPages`` as a job starts reloading pages from it (sent before its next announce);
``JobRefused`` for a job whose ids are not token ids of the model (decoded here, once).
Owns: the prefill-only sequences of the jobs; a job's pages are held after it is computed (or
cancelled) until the messenger says no write reads them any more (``ReleaseJob``).
"""

from __future__ import annotations

import logging
import time

import msgspec

from disagg import trace
from disagg.actors.scheduler.sides import SchedulerPort, SchedulerSide
from disagg.engine.prefix_tiers import PrefixTiers, TieredScheduler
from disagg.engine.scheduling import Batch, Sequence, Status
from disagg.protocol import SamplingParams
from disagg.protocol.executor import StepPlan, StepResult
from disagg.protocol.inproc import (
    CancelJob,
    ChunkInfo,
    JobHostPages,
    JobRefused,
    PrefillJob,
    ReleaseJob,
    StatsQuery,
    StatsReply,
    StepAnnounce,
    StepDone,
    ToScheduler,
)
from disagg.remote.requests import PromptIds

log = logging.getLogger(__name__)


class PrefillSide(SchedulerSide):
    def __init__(self, port: SchedulerPort):
        super().__init__(port)
        self.jobs: dict[int, Sequence] = {}  # job id -> its prefill-only sequence
        self.job_of: dict[int, int] = {}  # slot -> job id
        self.held: dict[int, list[int]] = {}  # cancelled jobs' pages, freed on ReleaseJob
        self._menc = msgspec.msgpack.Encoder()
        self._ids = PromptIds(port.arch.vocab_size)  # a job's ids: decoded once, checked as they are
        self._host_pages: list[JobHostPages] = []  # to the messenger before the next announce
        if isinstance(port.sched, TieredScheduler):
            self.tiers: PrefixTiers | None = port.sched.tiers
            self.tiers.on_host_pages = self._host_hit
        else:
            self.tiers = None

    def _host_hit(self, seq: Sequence, pages: list[tuple[int, int]]) -> None:
        job = self.job_of.get(seq.slot)
        if job is not None:
            self._host_pages.append(JobHostPages(job, pages))

    async def _flush_host_pages(self) -> None:
        while self._host_pages:
            await self.port.to_messenger([self._menc.encode(self._host_pages.pop(0))])

    async def pages_changed(self) -> None:
        await self._flush_host_pages()  # a loading job: its host pages may go out now

    async def handle_messenger(self, msg: ToScheduler) -> None:
        match msg:
            case PrefillJob(job=job, prompt=prompt, cache_salt=salt):
                ids = self._ids.decode(prompt)  # the only decode of a remote prompt's ids
                if isinstance(ids, str):
                    await self.port.to_messenger([self._menc.encode(JobRefused(job, ids))])
                    return
                slot = self.port.next_slot()
                seq = Sequence(slot, f"job-{job}", ids, SamplingParams(max_tokens=1), 0,
                               arrival=slot, prefill_only=True, cache_salt=salt)
                self.jobs[job] = seq
                self.job_of[slot] = job
                self.port.counters.started += 1
                self.port.sched.add(seq)
            case CancelJob(job=job):
                cancelled = self.jobs.get(job)
                if cancelled is not None and cancelled.status is not Status.FINISHED:
                    self.held[job] = self.port.sched.detach(cancelled)
                    self.port.counters.aborted += 1
            case ReleaseJob(job=job, outcome=outcome):
                done = self.jobs.pop(job, None)
                pages = self.held.pop(job, None)
                if done is not None:
                    self.job_of.pop(done.slot, None)
                    if done.status is Status.HELD:  # computed; its writes done or failed
                        pages = self.port.sched.detach(done)
                        if outcome == "finished":
                            self.port.counters.finished += 1
                        elif outcome == "aborted":
                            self.port.counters.aborted += 1
                        else:
                            self.port.counters.errored += 1
                if pages:
                    self.port.sched.free_pages(pages)
                if self.tiers is not None and done is not None:
                    self.tiers.unhold(done)  # host slots its writes read
            case StatsQuery(peer=peer):
                await self.port.to_messenger([self._menc.encode(StatsReply(peer,
                                                                           self.port.stats()))])

    async def before_step(self, plan: StepPlan, batch: Batch) -> None:
        await self._flush_host_pages()
        chunks = [ChunkInfo(self.job_of[c.seq.slot], c.start, c.count, c.seq.num_tokens,
                            list(c.seq.block_table))
                  for c in batch.chunks if c.seq.slot in self.job_of]
        await self.port.to_messenger([self._menc.encode(
            StepAnnounce(plan.step_id, plan.counter_base, chunks, time.monotonic()))])

    async def after_step(self, plan: StepPlan, batch: Batch, result: StepResult,
                         hidden: bytes | None) -> None:
        jobs = [self.job_of[w.slot] for w in plan.chunks if w.want_hidden and w.slot in self.job_of]
        done = StepDone(plan.step_id, result.error is None, jobs, result.error)
        trace.mark("ps.result_in", "s", plan.step_id)
        frames = [self._menc.encode(done)]
        if hidden is not None and result.error is None:
            frames.append(hidden)
        await self.port.to_messenger(frames)

    async def step_failed(self, seq: Sequence, error: str) -> bool:
        log.error("prefill step failed for %s: %s", seq.request_id, error)
        return True  # the messenger cancels the job (StepDone.ok is False), then releases it
