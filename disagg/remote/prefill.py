"""The prefill side of remote prefill: one pure state machine for every job of a prefill node.

A job is one accepted ``PrefillRequest`` (after validation and the ownership check). It goes::

    HELD_BACK --its peer's page share allows--> QUEUED --first step--> COMPUTING
        --last chunk computed, context write posted--> SETTLING --writes settled--> (ended)
    any state before ended --abort / deadline / failed step or write--> CANCELLING
        --posted writes settled--> (ended)

Ending answers the decoder exactly once (``PrefillDone`` when every write completed,
``AbortAck`` for an abort, ``PrefillFailed`` otherwise) and only then lets the scheduler free
the job's pages (``Release``): no page is reused while a write reading it may still be posted
or in flight. A job's writes may be posted only while it is QUEUED, COMPUTING (or SETTLING for
its context write), never past its deadline. Each peer connection holds at most its share of
the job slots and of the page pool (``disagg.remote.peer_quota``); past the page share its jobs wait
here, HELD_BACK, holding no page. Time is passed in (monotonic seconds).
"""

from __future__ import annotations

import collections
import enum
from dataclasses import dataclass, field
from typing import Literal

from disagg.protocol.peer import AbortAck, PrefillDone, PrefillFailCode, PrefillFailed
from disagg.remote.deadlines import ProgressDeadline
from disagg.remote.peer_quota import PeerQuota


class JobState(enum.Enum):
    HELD_BACK = "held_back"  # accepted; waits for its peer's page share (no pages yet)
    QUEUED = "queued"  # handed to the scheduler; no step has computed it yet
    COMPUTING = "computing"  # steps compute it; layers are written as they finish
    SETTLING = "settling"  # computed, context write posted; waiting for every write
    CANCELLING = "cancelling"  # no new writes; waiting for the posted ones to settle


# ---------------------------------------------------------------- commands


@dataclass(frozen=True)
class Schedule:
    """Scheduler: compute job ``job`` (``PrefillJob``)."""

    job: int


@dataclass(frozen=True)
class Unschedule:
    """Scheduler: stop computing ``job``; keep its pages until ``Release`` (``CancelJob``)."""

    job: int


@dataclass(frozen=True)
class Settle:
    """Messenger: wait for every write of ``job`` posted so far, then call ``settled``."""

    job: int


@dataclass(frozen=True)
class Reply:
    """Messenger: the decoder's one answer about ``job``: ``done`` (with the prefiller's
    queue / compute / tail seconds), ``acked`` (its abort), or ``failed`` (code, message)."""

    job: int
    kind: Literal["done", "acked", "failed"]
    code: PrefillFailCode = "internal"
    message: str = ""
    timings: tuple[float, float, float] = (0.0, 0.0, 0.0)


@dataclass(frozen=True)
class Release:
    """Scheduler: no write reads ``job``'s pages any more: free them (``ReleaseJob``)."""

    job: int
    outcome: Literal["finished", "aborted", "errored"]


Command = Schedule | Unschedule | Settle | Reply | Release


@dataclass
class Job:
    id: int
    peer: bytes  # the decoder connection's identity
    pages: int  # its prompt's pages here (the per-peer page share)
    clock: ProgressDeadline  # idle deadline pushed by progress, under the absolute cap
    accepted_at: float
    state: JobState = JobState.HELD_BACK
    progress_sent: float = 0.0  # when its decoder last heard of progress
    first_step_at: float | None = None
    computed_at: float | None = None
    # when the poller saw the last layer of its last chunk done on the device: its compute's
    # end (the tail after it is the transfer's); None when none was seen
    last_layer_at: float | None = None
    handed: bool = False  # its pages count against its peer's share
    answer: tuple[str, PrefillFailCode, str] | None = None  # CANCELLING: kind, code, message


@dataclass
class PrefillJobs:
    quota: PeerQuota
    jobs: dict[int, Job] = field(default_factory=dict)
    held_back: dict[bytes, collections.deque[int]] = field(default_factory=dict)

    # ------------------------------------------------------------ transitions

    def refusal(self, peer: bytes) -> str | None:
        """Why one more job of ``peer`` is refused (its share of the job slots), or None."""
        return self.quota.refusal(peer)

    def accept(self, job_id: int, peer: bytes, pages: int, idle_s: float, cap_s: float,
               now: float) -> list[Command]:
        assert job_id not in self.jobs
        self.jobs[job_id] = Job(job_id, peer, pages, ProgressDeadline.start(now, idle_s, cap_s),
                                now, progress_sent=now)
        self.quota.accepted(peer)
        self.held_back.setdefault(peer, collections.deque()).append(job_id)
        return self._hand(peer)

    def step_started(self, job_id: int, now: float) -> None:
        job = self.jobs.get(job_id)
        if job is not None and job.state is JobState.QUEUED:
            job.state = JobState.COMPUTING
            job.first_step_at = now

    def last_layer(self, job_id: int, at: float) -> None:
        """The last layer of ``job``'s last chunk finished on the device at ``at``."""
        job = self.jobs.get(job_id)
        if job is not None and job.state is JobState.COMPUTING and job.last_layer_at is None:
            job.last_layer_at = at

    def computed(self, job_id: int, now: float) -> list[Command]:
        """Its last chunk is computed and its context write posted."""
        job = self.jobs.get(job_id)
        if job is None or job.state not in (JobState.QUEUED, JobState.COMPUTING):
            return []
        job.state = JobState.SETTLING
        job.computed_at = now
        return [Settle(job_id)]

    def cancel(self, job_id: int, kind: Literal["acked", "failed"], code: PrefillFailCode = "internal",
               message: str = "") -> list[Command]:
        """Stop ``job``: an abort (answered ``acked``) or a failure. No new writes; the answer
        and the pages wait for the writes already posted."""
        job = self.jobs.get(job_id)
        if job is None or job.state is JobState.CANCELLING:
            return []
        out: list[Command] = []
        if job.state in (JobState.QUEUED, JobState.COMPUTING):
            out.append(Unschedule(job_id))
        job.state = JobState.CANCELLING
        job.answer = (kind, code, message)
        return out + [Settle(job_id)]

    def settled(self, job_id: int, error: str | None, now: float) -> list[Command]:
        """Every write of ``job`` posted so far settled (``error``: the first that failed)."""
        job = self.jobs.get(job_id)
        if job is None or job.state not in (JobState.SETTLING, JobState.CANCELLING):
            return []  # an earlier Settle already ended it, or it was cancelled since
        del self.jobs[job_id]
        if job.state is JobState.CANCELLING:
            assert job.answer is not None
            kind, code, message = job.answer
            reply = Reply(job_id, "acked") if kind == "acked" else Reply(job_id, "failed", code,
                                                                         message)
        elif error is not None:
            reply = Reply(job_id, "failed", "transfer_failed", error)
        else:
            first = job.first_step_at or job.accepted_at
            computed = job.last_layer_at or job.computed_at or now
            reply = Reply(job_id, "done", timings=(first - job.accepted_at, computed - first,
                                                   now - computed))
        outcome: Literal["finished", "aborted", "errored"] = (
            "finished" if reply.kind == "done" else "aborted" if reply.kind == "acked"
            else "errored")
        self.quota.ended(job.peer, job.pages if job.handed else 0)
        out: list[Command] = [reply, Release(job_id, outcome)]
        return out + self._hand(job.peer)

    # ------------------------------------------------------------ time

    def expire(self, now: float) -> list[Command]:
        """Cancel every job still to compute whose deadline passed."""
        out: list[Command] = []
        for job in list(self.jobs.values()):
            if job.state in (JobState.HELD_BACK, JobState.QUEUED, JobState.COMPUTING) \
                    and job.clock.expired(now):
                out += self.cancel(job.id, "failed", "timeout", job.clock.why(now))
        return out

    def progressed(self, now: float) -> list[int]:
        """This prefiller computed something: progress for every job still to compute (its
        own or the queue's it waits in). Returns the jobs whose decoders should hear of it
        (at most every quarter of their idle timeout)."""
        notify = []
        for job in self.jobs.values():
            if job.state in (JobState.SETTLING, JobState.CANCELLING):
                continue
            job.clock.progress(now)
            if now - job.progress_sent >= job.clock.idle_s / 4:
                job.progress_sent = now
                notify.append(job.id)
        return notify

    # ------------------------------------------------------------ queries

    def may_write(self, job_id: int, now: float) -> bool:
        """Whether a write of ``job`` may be posted now (False: skip it; a job past its
        deadline must be cancelled, see ``overdue``)."""
        job = self.jobs.get(job_id)
        return (job is not None and job.state in (JobState.QUEUED, JobState.COMPUTING,
                                                  JobState.SETTLING)
                and not job.clock.expired(now))

    def overdue(self, job_id: int, now: float) -> str | None:
        """Why a live job may not write any more (its deadline passed), or None."""
        job = self.jobs.get(job_id)
        if job is None or job.state is JobState.CANCELLING or not job.clock.expired(now):
            return None
        return job.clock.why(now)

    def time_left(self, job_id: int, now: float) -> float:
        return self.jobs[job_id].clock.cap - now

    def state(self, job_id: int) -> JobState | None:
        job = self.jobs.get(job_id)
        return None if job is None else job.state

    # ------------------------------------------------------------ internals

    def _hand(self, peer: bytes) -> list[Command]:
        """Hand ``peer``'s held-back jobs to the scheduler, in order, while the pages they
        take stay within its share of the pool."""
        out: list[Command] = []
        queue = self.held_back.get(peer)
        while queue:
            job = self.jobs.get(queue[0])
            if job is not None and job.state is JobState.HELD_BACK:
                if not self.quota.fits(peer, job.pages):
                    return out
                job.handed = True
                job.state = JobState.QUEUED
                self.quota.handed(peer, job.pages)
                out.append(Schedule(job.id))
            queue.popleft()
        self.held_back.pop(peer, None)
        return out


def wire_reply(r: Reply, request_id: str, cached_tokens: int = 0, settled_at: float = 0.0
               ) -> PrefillDone | AbortAck | PrefillFailed:
    """The message that gives the decoder the answer ``r`` about its request
    (``cached_tokens``: of its prompt, taken from this node's prefix cache; ``settled_at``:
    this node's wall clock when the last write completed)."""
    if r.kind == "done":
        queue_s, compute_s, tail_s = r.timings
        return PrefillDone(request_id, queue_s + compute_s + tail_s, queue_s=queue_s,
                           compute_s=compute_s, tail_s=tail_s, cached_tokens=cached_tokens,
                           settled_at=settled_at)
    if r.kind == "acked":
        return AbortAck(request_id)
    return PrefillFailed(request_id, r.code, r.message)
