"""Prefill-side KV messenger.

Receives: ``PrefillRequest`` / ``AbortPrefill`` / ``Ping`` from decode nodes (ROUTER on the
node's ``--listen``); ``StepAnnounce`` / ``StepDone`` (+ context rows) from the scheduler.
Sends: ``PrefillJob`` / ``CancelJob`` / ``ReleaseJob`` / ``MessengerStats`` to the scheduler;
``Pong`` / ``PrefillDone`` / ``PrefillFailed`` / ``AbortAck`` to decoders; page writes through
the transfer engine, layer by layer as the layer counter advances (SEED.md 11-16).
Owns: the jobs (one per accepted PrefillRequest), the layer-counter poller thread, the context
staging buffer.

A job expires after the request's ``timeout_s`` without progress (a step or layer computed here:
the job's own, or the queue's it waits in) or at its absolute deadline (``disagg.deadlines``),
and no write of it is posted past that deadline; decoders hear of the progress
(``PrefillProgress``) so that their own idle deadline follows it.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import msgspec
import torch
import zmq
import zmq.asyncio

from disagg import security
from disagg.actors.layer_poller import LayerPoller
from disagg.actors.messenger_base import MessengerBase
from disagg.actors.transfer import TransferEngine
from disagg.deadlines import ProgressDeadline, job_cap_s
from disagg.protocol import (
    AbortAck,
    AbortPrefill,
    CancelJob,
    KVLayoutDesc,
    MessengerStats,
    PeerRequest,
    Ping,
    Pong,
    PrefillDone,
    PrefillFailed,
    PrefillJob,
    PrefillProgress,
    PrefillRequest,
    ReleaseJob,
    StatsQuery,
    StatsReply,
    StatsRequest,
    StepAnnounce,
    StepDone,
    ToMessenger,
)
from disagg.transfer_plan import (
    ChunkPlan,
    Runs,
    context_write,
    incompatibility,
    pages_to_send,
    plan_chunk,
)

log = logging.getLogger(__name__)

MAX_STATS_WAITING = 1000  # Stats requests of one peer answered by one query (more: dropped)



@dataclass
class Job:
    id: int
    peer: bytes  # decoder's ROUTER identity
    req: PrefillRequest
    dst_kv: list[Any]  # decoded MemoryDescriptor per decoder rank
    dst_ctx: Any
    clock: ProgressDeadline  # idle deadline pushed by progress, under the absolute cap
    accepted_at: float
    progress_sent: float = 0.0  # when the decoder last got a PrefillProgress of it
    futures: list[asyncio.Future[None]] = field(default_factory=list)
    first_step_at: float | None = None
    first_post_at: float | None = None
    writes: int = 0  # posted so far
    bytes: int = 0
    computed_at: float | None = None
    computed: bool = False  # last chunk done and context write posted
    cancelled: bool = False
    ended: bool = False


@dataclass
class Step:
    announce: StepAnnounce
    next_layer: int = 0  # layers [0, next_layer) handed to the engine
    plans: dict[int, ChunkPlan | None] = field(default_factory=dict)  # by chunk index, lazily


class PrefillMessenger(MessengerBase):
    def __init__(
        self,
        listen: str,
        ctx: zmq.asyncio.Context,
        sched_sock: zmq.asyncio.Socket,
        transfer: TransferEngine,
        layout: KVLayoutDesc,
        kvs: list[torch.Tensor],  # every rank's KV cache, mapped into this process
        counter: Any,
        vocab_size: int,
        max_jobs: int = 256,
        kv_fds: list[int | None] | None = None,  # their allocations' fds (cuMem on CUDA)
    ):
        self.vocab_size = vocab_size
        self.sock = ctx.socket(zmq.ROUTER)
        security.server(self.sock)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, 64 << 20)
        self.sock.bind(listen)
        self.address = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        super().__init__(sched_sock, transfer, layout, kvs, kv_fds, max_jobs)
        self.ctx_of: dict[int, int] = {}
        self.counter = counter
        self.jobs: dict[int, Job] = {}
        self.by_peer: dict[tuple[bytes, str], int] = {}
        self.steps: dict[int, Step] = {}
        self.queued_tokens = 0
        self.stats_waiting: dict[bytes, int] = {}  # peer -> StatsRequests its query answers
        self._ids = itertools.count(1)
        self._peer_dec = msgspec.msgpack.Decoder(PeerRequest)
        self._sched_dec = msgspec.msgpack.Decoder(ToMessenger)
        self.layerwise_steps = 0
        self.poller: LayerPoller | None = None

    # ------------------------------------------------------------------ loop

    async def run(self) -> None:
        """Loop: 1. wait for a decoder frame or a scheduler message; 2. handle it (accept,
        abort, ping / announce, step done). Layer progress arrives via the poller thread."""
        self.poller = LayerPoller(self.counter, self.layout.num_layers,
                                  asyncio.get_running_loop(), self.on_layers)
        poller = zmq.asyncio.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self.sched, zmq.POLLIN)
        try:
            while True:
                events = dict(await poller.poll(1000))
                if self.sock in events:
                    await self._from_peers()
                if self.sched in events:
                    await self._from_scheduler()
                self._expire()
        finally:
            self.poller.stop()

    async def _from_peers(self) -> None:
        while True:
            try:
                frames = await self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            peer = frames[0]
            try:
                if len(frames) != 2:
                    raise msgspec.ValidationError("expected one message frame")
                msg = self._peer_dec.decode(frames[1])
            except (msgspec.DecodeError, msgspec.ValidationError) as e:
                self.bad_frames += 1
                log.warning("bad frame from a decoder: %s", e)
                continue
            match msg:
                case Ping(seq=seq):
                    await self._reply(peer, Pong(seq, self.queued_tokens, self.layout,
                                                 self.transfer.transport))
                case PrefillRequest() as req:
                    await self._accept(peer, req)
                case AbortPrefill(request_id=rid):
                    await self._abort(peer, rid)
                case StatsRequest():
                    # one query in flight per peer: a flood of them costs the scheduler one
                    waiting = self.stats_waiting.get(peer, 0)
                    self.stats_waiting[peer] = min(waiting + 1, MAX_STATS_WAITING)
                    if not waiting:
                        await self._to_scheduler(StatsQuery(peer))

    async def _from_scheduler(self) -> None:
        while True:
            try:
                frames = await self.sched.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            match self._sched_dec.decode(frames[0]):
                case StepAnnounce() as a:
                    self.steps[a.step_id] = Step(a)
                    now = time.monotonic()
                    for c in a.chunks:
                        job = self.jobs.get(c.job)
                        if job is not None and job.first_step_at is None:
                            job.first_step_at = now
                    self._progressed(now)
                    assert self.poller is not None
                    self.poller.follow(a.step_id, a.counter_base)
                case StepDone() as d:
                    self._step_done(d, frames[1] if len(frames) > 1 else None)
                case StatsReply(peer=peer, stats=stats):
                    # this messenger's fields as they are now: the copy the scheduler holds
                    # may predate a job's end it already freed the pages of
                    reply = msgspec.structs.replace(stats, bad_frames=self.bad_frames,
                                                    **msgspec.structs.asdict(self.stats()))
                    for _ in range(self.stats_waiting.pop(peer, 1)):
                        await self._reply(peer, reply)

    # ------------------------------------------------------------------ requests

    def validate(self, req: PrefillRequest) -> str | None:
        """Why a PrefillRequest cannot be served, or None (bounds-checks before any write)."""
        why = incompatibility(self.layout, req.dst_layout)
        if why:
            return why
        n = len(req.prompt_ids)
        if n == 0:
            return "empty prompt"
        if any(not 0 <= t < self.vocab_size for t in req.prompt_ids):
            return "token id outside the vocabulary"
        d = req.dst_layout
        if len(req.dst_pages) != -(-n // d.page_size):
            return f"{len(req.dst_pages)} destination pages for {n} tokens of page size {d.page_size}"
        if len(set(req.dst_pages)) != len(req.dst_pages):
            return "destination pages repeat"
        if any(not 0 <= p < d.num_pages for p in req.dst_pages):
            return "destination page id out of range"
        if n > self.layout.num_pages * self.layout.page_size:
            return "prompt larger than this prefiller's KV pool"
        if not 0 < req.timeout_s <= 3600:
            return f"timeout_s out of range: {req.timeout_s}"
        return None

    async def _accept(self, peer: bytes, req: PrefillRequest) -> None:
        why = self.validate(req)
        dst_kv: list[Any] = []
        dst_ctx = None
        if why is None:
            try:
                dst_kv = [self.transfer.decode_descriptor(d)
                          for d in req.dst_kv_ranks or [req.dst_kv]]
                dst_ctx = self.transfer.decode_descriptor(req.dst_ctx)
                if len(dst_kv) != req.dst_layout.tp_size:
                    why = f"{len(dst_kv)} KV descriptors for tp_size {req.dst_layout.tp_size}"
                elif any(d.length < req.dst_layout.total_bytes for d in dst_kv):
                    why = "KV descriptor smaller than the advertised layout"
                elif not 0 <= req.ctx_offset <= dst_ctx.length - self.layout.context_bytes:
                    why = "context offset outside the context buffer"
            except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as e:
                why = f"bad memory descriptor: {e}"
        if why is None and (peer, req.request_id) in self.by_peer:
            why = f"duplicate request id {req.request_id!r}"
        if why is None and not self.ctx_free:
            await self._reply(peer, PrefillFailed(req.request_id, "overloaded", "too many jobs"))
            return
        if why is not None:
            await self._reply(peer, PrefillFailed(req.request_id, "bad_request", why))
            return
        now = time.monotonic()
        cap_s = job_cap_s(req.timeout_s, len(req.prompt_ids), req.deadline_unix, time.time())
        if cap_s <= 0:
            await self._reply(peer, PrefillFailed(req.request_id, "timeout",
                                                  "the request's deadline passed before it was read"))
            return
        job = Job(next(self._ids), peer, req, dst_kv, dst_ctx,
                  ProgressDeadline.start(now, req.timeout_s, cap_s), now, progress_sent=now)
        self.jobs[job.id] = job
        self.by_peer[(peer, req.request_id)] = job.id
        self.ctx_of[job.id] = self.ctx_free.pop()
        self.queued_tokens += len(req.prompt_ids)
        await self._to_scheduler(PrefillJob(job.id, req.prompt_ids))

    async def _abort(self, peer: bytes, rid: str) -> None:
        job_id = self.by_peer.get((peer, rid))
        if job_id is None:
            await self._reply(peer, AbortAck(rid))  # nothing of it can land
            return
        self._cancel(self.jobs[job_id], ack=True)

    def _cancel(self, job: Job, ack: bool, code: str = "", message: str = "") -> None:
        """Stop a job: no new writes; reply and free pages once posted writes settle."""
        if job.cancelled or job.ended:
            return
        job.cancelled = True
        if not job.computed:
            self._send_soon(CancelJob(job.id))
        reply: Any = AbortAck(job.req.request_id) if ack else PrefillFailed(
            job.req.request_id, code, message)
        self._spawn(self._finish(job, reply))

    # ------------------------------------------------------------------ layers and steps

    def on_layers(self, step_id: int, layers_done: int, seen_at: float | None = None) -> None:
        """Called in the loop by the poller: ship every newly finished layer of the step.
        ``seen_at``: when the poller saw the counter reach ``layers_done`` (for the lag metric)."""
        step = self.steps.get(step_id)
        if step is None:
            return
        if seen_at is not None and self.metrics is not None and layers_done > step.next_layer:
            self.metrics.observe_layer_lag(time.monotonic() - seen_at)
        if step.next_layer == 0 and layers_done < self.layout.num_layers and step.announce.chunks:
            self.layerwise_steps += 1  # shipping starts while later layers still compute
        if layers_done > step.next_layer:
            self._progressed(time.monotonic())
        for layer in range(step.next_layer, layers_done):
            for i, chunk in enumerate(step.announce.chunks):
                job = self.jobs.get(chunk.job)
                if job is None or job.cancelled:
                    continue
                plan = self._plan(step, i, job)
                if plan is None:
                    continue
                for sr, dr in plan.by_pair:  # every source rank sends in parallel
                    self._post(job, self.kv_regions[sr], job.dst_kv[dr],
                               plan.layer((sr, dr), layer))
        step.next_layer = max(step.next_layer, layers_done)

    def _plan(self, step: Step, i: int, job: Job) -> ChunkPlan | None:
        """The writes of chunk ``i`` of ``step`` for every layer (planned at its first layer;
        None when the chunk completes no page)."""
        if i not in step.plans:
            chunk = step.announce.chunks[i]
            idx = pages_to_send(chunk.start, chunk.start + chunk.count, chunk.total,
                                self.layout.page_size)
            step.plans[i] = plan_chunk(
                self.layout, job.req.dst_layout, [chunk.pages[j] for j in idx],
                [job.req.dst_pages[j] for j in idx], seed=job.req.key) if idx else None
        return step.plans[i]

    def _step_done(self, done: StepDone, hidden: bytes | None) -> None:
        step = self.steps.get(done.step_id)
        if step is None:
            return
        if done.ok:
            self.on_layers(done.step_id, self.layout.num_layers)  # whatever the poller missed
        del self.steps[done.step_id]
        if done.ok:
            self._progressed(time.monotonic())
        if not done.ok:
            for c in step.announce.chunks:
                if c.job in self.jobs:
                    self._cancel(self.jobs[c.job], False, "internal", f"step failed: {done.error}")
            return
        for c in step.announce.chunks:
            self.queued_tokens -= c.count
        row_bytes = self.layout.context_bytes
        for i, job_id in enumerate(done.context_jobs):
            job = self.jobs.get(job_id)
            if job is None or job.cancelled or hidden is None:
                continue
            slot = self.ctx_of[job_id]
            self.ctx_buf[slot] = torch.frombuffer(bytearray(hidden[i * row_bytes:(i + 1) * row_bytes]),
                                                  dtype=torch.uint8)
            w = context_write(slot * row_bytes, job.req.ctx_offset, row_bytes)
            self._post(job, self.ctx_region, job.dst_ctx, Runs.of([w]))
            job.computed = True
            job.computed_at = time.monotonic()
            self._spawn(self._finish(job, None))
        self._send_soon(self.stats())

    def _post(self, job: Job, src: Any, dst: Any, runs: Runs) -> None:
        now = time.monotonic()
        left = job.clock.cap - now  # no write may still be queued or posted past the cap
        if job.clock.expired(now):  # the decoder may reuse the pages: never write
            self._cancel(job, False, "timeout", job.clock.why(now))
            return
        if job.first_post_at is None:
            job.first_post_at = time.monotonic()
        job.writes += len(runs)
        job.bytes += int(runs.length.sum())
        try:
            job.futures.extend(self.transfer.write(src, dst, runs, job.req.key,
                                                   timeout=min(left, self.transfer.timeout_s)))
        except Exception as e:  # out of range: refuse, never write outside
            log.error("job %d: refused writes: %s", job.id, e)
            self._cancel(job, False, "transfer_failed", str(e))

    async def _finish(self, job: Job, reply: Any) -> None:
        """Wait for every posted write to settle, then answer the decoder and free pages."""
        results = await asyncio.gather(*job.futures, return_exceptions=True)
        if job.ended:
            return
        if reply is None:  # the normal end: all writes done at the source
            if job.cancelled:
                return  # a cancel raced the last step; its own _finish answers
            errors = [r for r in results if isinstance(r, BaseException)]
            reply = (self._done(job) if not errors else PrefillFailed(
                job.req.request_id, "transfer_failed", str(errors[0])))
            if not errors and self.metrics is not None:
                self.metrics.observe_transfer("sent", job.bytes, job.writes, time.monotonic()
                                              - (job.first_post_at or job.accepted_at))
        job.ended = True
        await self._reply(job.peer, reply)
        self.jobs.pop(job.id, None)
        self.by_peer.pop((job.peer, job.req.request_id), None)
        self.ctx_free.append(self.ctx_of.pop(job.id))
        outcome = ("finished" if isinstance(reply, PrefillDone)
                   else "aborted" if isinstance(reply, AbortAck) else "errored")
        await self._pages_back(ReleaseJob(job.id, outcome))

    @staticmethod
    def _done(job: Job) -> PrefillDone:
        now = time.monotonic()
        first = job.first_step_at or job.accepted_at
        computed = job.computed_at or now
        return PrefillDone(job.req.request_id, now - job.accepted_at, queue_s=first - job.accepted_at,
                           compute_s=computed - first, tail_s=now - computed)

    def _expire(self) -> None:
        now = time.monotonic()
        for job in [j for j in self.jobs.values() if j.clock.expired(now) and not j.cancelled
                    and not j.computed]:
            self._cancel(job, False, "timeout", job.clock.why(now))

    def _progressed(self, now: float) -> None:
        """This prefiller computed something (a step was scheduled, a layer or a step done):
        progress for every job still to compute, its own or the queue's it waits in; its
        decoder hears of it at most every quarter of its idle timeout."""
        for job in self.jobs.values():
            if job.cancelled or job.computed:
                continue
            job.clock.progress(now)
            if now - job.progress_sent >= job.clock.idle_s / 4:
                job.progress_sent = now
                self._spawn(self._reply(job.peer, PrefillProgress(job.req.request_id)))

    # ------------------------------------------------------------------ plumbing

    def stats(self) -> MessengerStats:
        lag = 0
        for s in self.steps.values():
            done = max(0, min(self.layout.num_layers, self.counter.read() - s.announce.counter_base))
            lag = max(lag, done - s.next_layer)
        return MessengerStats(
            transfers_in_flight=sum(1 for j in self.jobs.values() if j.futures and not j.ended),
            kv_writes_sent=self.transfer.writes_sent, kv_bytes_sent=self.transfer.bytes_sent,
            layer_lag=lag, layerwise_steps=self.layerwise_steps)

    async def _reply(self, peer: bytes, msg: Any) -> None:
        try:
            await self.sock.send_multipart([peer, self._enc.encode(msg)], zmq.NOBLOCK)
        except zmq.ZMQError as e:
            log.debug("could not reply to a decoder: %s", e)

    def _send_soon(self, msg: Any) -> None:
        self._spawn(self._to_scheduler(msg))

    def close(self) -> None:
        self._cancel_tasks()
        self.sock.close()
