"""Prefill-side KV messenger.

Receives: ``PrefillRequest`` / ``AbortPrefill`` / ``Ping`` / ``OwnershipOffer`` /
``ChallengeAnswer`` from decode nodes (ROUTER on the node's ``--listen``), and from clients
pointed at it ``stats`` / ``ping`` (served) or ``generate`` / ``abort`` (``bad_request``:
``client_reply``); ``StepAnnounce`` / ``StepDone`` (+ context rows) from the scheduler.
Sends: ``PrefillJob`` / ``CancelJob`` / ``ReleaseJob`` / ``MessengerStats`` to the scheduler;
``Pong`` / ``PrefillDone`` / ``PrefillFailed`` / ``AbortAck`` / ``Challenge`` to decoders; page
writes through the transfer engine, layer by layer as the layer counter advances.
Owns: the jobs (one per accepted PrefillRequest), the layer-counter poller thread, the context
staging buffer.

Requests get a verdict (``remote.admission``: the ``remote.requests`` checks, the ownership
gate's status, the job table's room) and pass the ownership gate (``actors.ownership_gate``)
before they become jobs; their ids stay encoded here (``PrefillRequestIn``: their count read)
and go on to the scheduler as they came, which decodes them once, checking each against the
vocabulary (``JobRefused``: the request refused by name); each job's lifecycle (peer shares,
deadlines, one answer, pages released after it) is ``remote.prefill.PrefillJobs``. Pages a job's first chunk starts after
(this node's prefix cache) go out at once; the rest layer by layer; none the decoder holds.
The context write (a unit the decoder counts) carries the last hidden row for MTP, after the
step; else it is a zero-row marker posted with the last chunk's last layer (no step-end tail).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from typing import Any

import msgspec
import torch
import zmq
import zmq.asyncio

from disagg import trace
from disagg.actors.messenger_base import MessengerBase
from disagg.actors.prefill_messenger.client_frames import client_reply
from disagg.actors.prefill_messenger.layer_poller import LayerPoller
from disagg.actors.prefill_messenger.ownership_gate import OwnershipGate
from disagg.actors.prefill_messenger.prefill_jobs import Job, JobWrites
from disagg.actors.sockets import (
    PEER_FRAME_BYTES,
    LoopPoller,
    disconnected_fds,
    listening,
    peer_address,
    peer_key,
    pending_frames,
    source_fd,
)
from disagg.protocol import StatsRequest
from disagg.protocol.inproc import (
    CancelJob,
    JobHostPages,
    JobRefused,
    MessengerStats,
    PrefillJob,
    ReleaseJob,
    StatsQuery,
    StatsReply,
    StepAnnounce,
    StepDone,
    ToMessenger,
)
from disagg.protocol.peer import (
    AbortAck,
    AbortPrefill,
    ChallengeAnswer,
    KVLayoutDesc,
    OwnershipOffer,
    PeerRequestIn,
    Ping,
    Pong,
    PrefillFailCode,
    PrefillFailed,
    PrefillProgress,
    PrefillRequest,
)
from disagg.remote.admission import (
    Admit,
    Destinations,
    Facts,
    Park,
    Refuse,
    Verdict,
    destinations,
    refusal_with_ids,
    verdict,
)
from disagg.remote.ownership import Conn
from disagg.remote.peer_quota import PeerQuota
from disagg.remote.prefill import Command as LifeCommand
from disagg.remote.prefill import (
    JobState,
    PrefillJobs,
    Release,
    Reply,
    Schedule,
    Settle,
    Unschedule,
    wire_reply,
)
from disagg.serving.metrics import Metrics
from disagg.transfer import TransferEngine

log = logging.getLogger(__name__)

MAX_STATS_WAITING = 1000  # Stats requests of one peer answered by one query (more: dropped)


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
        peer_share: float = 0.5,  # of the job slots and the page pool, per peer connection
        ownership_timeout_s: float = 5.0,  # a peer proves it owns its endpoint within this
        metrics: Metrics | None = None,
        layerwise_min_tokens: int = 0,  # shorter steps ship all layers at once (JobWrites)
        host_kv: list[torch.Tensor] | None = None,  # the host KV tier's memory, per rank
        dp: int = 1,  # --dp: kvs are every rank's executors in rank order, layout one rank's
    ):
        self.vocab_size = vocab_size
        # decoders' node keys only
        self.sock, self.monitor = listening(ctx, listen, max_frame=PEER_FRAME_BYTES, who="nodes")
        self.address = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        super().__init__(sched_sock, transfer, layout, kvs, kv_fds, max_jobs + 1, metrics)
        zero_slot = self.ctx_free.pop(0)  # never written: the context marker's source
        self.life = PrefillJobs(PeerQuota(int(max_jobs * peer_share),
                                          int(layout.num_pages * peer_share)))
        self.gate = OwnershipGate(transfer, ownership_timeout_s, self.life.quota.max_jobs,
                                  self._reply, self._accept, self._spawn)
        self.ctx_of: dict[int, int] = {}
        self.counter = counter
        self.jobs: dict[int, Job] = {}
        self.by_peer: dict[tuple[bytes, str], int] = {}
        self.queued_tokens = 0
        self.stats_waiting: dict[bytes, int] = {}  # peer -> StatsRequests its query answers
        self.conns: set[tuple[bytes, int | None]] = set()  # connections frames came on
        self._ids = itertools.count(1)
        self._peer_dec = msgspec.msgpack.Decoder(PeerRequestIn)  # a request's ids not decoded
        self.queued_of: dict[int, int] = {}  # job -> its tokens in queued_tokens
        self._sched_dec = msgspec.msgpack.Decoder(ToMessenger)
        self.writes = JobWrites(layout, self.life, transfer, self.kv_regions, self.ctx_region,
                                zero_slot, self._fail, self._progressed, metrics,
                                layerwise_min_tokens, dp)
        if host_kv and not transfer.engine.device_memory:  # the fabric ships host memory
            # slot-major: a layout of one page a layer gives its offsets (JobWrites.ship_host)
            self.writes.host = ([transfer.register(t, access="source") for t in host_kv],
                                msgspec.structs.replace(layout, num_pages=1))
        self.poller: LayerPoller | None = None
        # job -> its spans (traces exported); shared with the writes (layers-pushed events)
        self.traces: dict[int, trace.Phases] = self.writes.traces

    # ------------------------------------------------------------------ loop

    async def run(self) -> None:
        """Loop: 1. wait for a decoder frame or a scheduler message; 2. handle it (accept,
        abort, ping / announce, step done). Layer progress arrives via the poller thread."""
        self.poller = LayerPoller(self.counter, self.layout.num_layers,
                                  asyncio.get_running_loop(), self.writes.on_layers)
        poller = LoopPoller()  # woken in one loop turn (pyzmq's takes several)
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self.sched, zmq.POLLIN)
        poller.register(self.monitor, zmq.POLLIN)
        try:
            while True:
                events = dict(await poller.poll(1000))
                if self.monitor in events:  # first: a reused connection's fd is known gone
                    await self._connection_events()
                if self.sock in events:
                    await self._from_peers()
                if self.sched in events:
                    await self._from_scheduler()
                self._carry_out(self.life.expire(time.monotonic()))
                await self.gate.tick(time.monotonic())
        finally:
            poller.close()
            self.poller.stop()

    async def _from_peers(self) -> None:
        async for zframes in pending_frames(self.sock):
            arrived = time.monotonic()  # a job's queue clock starts here, before its checks
            frames = [f.bytes for f in zframes]
            peer = frames[0]
            conn = (peer, source_fd(zframes[0]))
            if conn not in self.conns:
                # a new connection may reuse a closed one's fd: the monitor reported that
                # close before this frame could arrive, so take it in first
                await self._connection_events()
                if len(self.conns) >= 1 << 16:  # fds never reported (None): start over
                    self.conns.clear()
                self.conns.add(conn)
                self.gate.seen(conn, peer_key(zframes[-1]), peer_address(zframes[-1]))
            try:
                if len(frames) != 2:
                    raise msgspec.ValidationError("expected one message frame")
                msg = self._peer_dec.decode(frames[1])  # the scheduler decodes a job's ids
            except (msgspec.DecodeError, msgspec.ValidationError) as e:
                self.bad_frames += 1  # not a peer's frame (a client's too: counted, answered)
                answer = client_reply(frames[1]) if len(frames) == 2 else None
                if answer is not None:  # a client's frame: answered, not logged as garbage
                    await self._reply(peer, answer)
                    continue
                log.warning("bad frame from a decoder: %s", e)
                continue
            match msg:
                case Ping(seq=seq):
                    await self._reply(peer, Pong(seq, self.queued_tokens, self.layout,
                                                 self.transfer.transport,
                                                 dp_ranks=self.writes.dp))
                case PrefillRequest() as req:
                    trace.mark("p.arrived", req.request_id, at=arrived)
                    trace.mark("p.req_in", req.request_id)
                    await self._accept(peer, req, conn, arrived)
                case AbortPrefill(request_id=rid):
                    await self._abort(peer, rid, conn)
                case ChallengeAnswer(id=cid, nonce=nonce):
                    self.gate.answered(conn, cid, nonce)
                case OwnershipOffer() as offer:  # check ahead of its requests
                    await self.gate.offered(peer, conn, offer)
                case StatsRequest():
                    # one query in flight per peer: a flood of them costs the scheduler one
                    waiting = self.stats_waiting.get(peer, 0)
                    self.stats_waiting[peer] = min(waiting + 1, MAX_STATS_WAITING)
                    if not waiting:
                        await self._to_scheduler(StatsQuery(peer))

    async def _from_scheduler(self) -> None:
        async for zframes in pending_frames(self.sched):
            frames = [f.bytes for f in zframes]
            match self._sched_dec.decode(frames[0]):
                case StepAnnounce() as a:
                    self.writes.announce(a)
                    now = time.monotonic()
                    for c in a.chunks:
                        if trace.enabled() and c.job in self.jobs:
                            trace.mark("link", self.jobs[c.job].req.request_id, "=s", a.step_id)
                        first = self.life.state(c.job) is JobState.QUEUED
                        if first and self.traces and c.job in self.traces:
                            self.traces[c.job].enter("prefill_compute")  # layers pushed
                        self.life.step_started(c.job, a.sent_at or now)
                        if first and c.start > 0:  # it starts after pages from the cache
                            self.writes.ship_cached(c, now)
                    self._progressed(now)
                    assert self.poller is not None
                    self.poller.follow(a.step_id, a.counter_base)
                case JobHostPages(job=job, pages=pages):  # before its first announce
                    self.writes.ship_host(job, pages, time.monotonic())
                case JobRefused(job=job, message=message):  # its ids: refused by name
                    self._fail(job, "bad_request", message)
                case StepDone() as d:
                    trace.mark("p.step_done", "s", d.step_id)
                    self._step_done(d, frames[1] if len(frames) > 1 else None)
                case StatsReply(peer=peer, stats=stats):
                    # this messenger's fields as they are now: the copy the scheduler holds
                    # may predate a job's end it already freed the pages of
                    # jobs held back for their peer's page share, and requests waiting for
                    # the ownership check, are admitted but not running: they are waiting too
                    held = sum(self.life.state(j) is JobState.HELD_BACK for j in self.jobs)
                    held += self.gate.waiting()
                    reply = msgspec.structs.replace(stats, bad_frames=self.bad_frames,
                                                    waiting=stats.waiting + held,
                                                    **msgspec.structs.asdict(self.stats()))
                    for _ in range(self.stats_waiting.pop(peer, 1)):
                        await self._reply(peer, reply)

    # ------------------------------------------------------------------ requests

    async def _accept(self, peer: bytes, req: PrefillRequest, conn: Conn,
                      arrived: float | None = None) -> None:
        """Take a request (``arrived``: when its frame was read; None after the ownership
        check it waited for: now), park it for that check, or answer why not: the verdict
        is ``remote.admission``'s, on the facts gathered here; the ids are checked by the
        scheduler as it decodes them (a refusal here names a bad id first, as before)."""
        v: Verdict | Destinations = destinations(self.layout, self.vocab_size, req, self.transfer.decode_descriptor,
                         self.transfer.lanes, ids_in_vocab=True)
        now = time.monotonic()
        if isinstance(v, Destinations):
            v = verdict(self.layout, req, v, Facts(
                duplicate=(peer, req.request_id) in self.by_peer,
                owned=self.gate.status(conn, v.addresses, now),
                busy=self.life.refusal(peer), free_slots=len(self.ctx_free),
                now_unix=time.time()))
        if isinstance(v, Refuse):
            v = refusal_with_ids(self.layout, self.vocab_size, req, v)
        match v:
            case Refuse(code=code, message=message):
                await self._reply(peer, PrefillFailed(req.request_id, code, message))
            case Park(dest=dest):  # no job, no pages before the check
                await self.gate.park(peer, conn, req, dest.ctx, dest.lanes)
            case Admit(dest=dest, pages=pages, cap_s=cap_s):
                job = Job(next(self._ids), peer, req, dest.kv, dest.ctx)
                self.jobs[job.id] = job
                self.writes.add(job)
                self.by_peer[(peer, req.request_id)] = job.id
                self.ctx_of[job.id] = self.ctx_free.pop()
                self.queued_tokens += req.prompt_len
                self.queued_of[job.id] = req.prompt_len
                if trace.tracing():  # a child of the decoder's remote-prefill span
                    self._trace_job(job.id, req, now if arrived is None else arrived)
                self._carry_out(self.life.accept(job.id, peer, pages, req.timeout_s, cap_s,
                                                 now if arrived is None else arrived))
                trace.mark("p.accepted", req.request_id)

    def _trace_job(self, job_id: int, req: PrefillRequest, arrived: float) -> None:
        """The job's spans: ``prefill`` (arrival to its answer), its ``prefill_queue`` first."""
        t0 = time.time_ns() - int(1e9 * (time.monotonic() - arrived))
        phases = trace.Phases("prefill", req.traceparent, t0, request_id=req.request_id,
                              tokens=req.prompt_len, skip_pages=req.skip_pages)
        phases.enter("prefill_queue", t0)
        trace.bind(req.request_id, phases.root)  # its hop marks: events
        self.traces[job_id] = phases

    def _carry_out(self, commands: list[LifeCommand]) -> None:
        """Do what the job machine decided, in its order."""
        for c in commands:
            match c:
                case Schedule(job=j):
                    self._send_soon(PrefillJob(j, self.jobs[j].req.prompt_msgpack(),
                                               self.jobs[j].req.cache_salt))
                case Unschedule(job=j):
                    self._send_soon(CancelJob(j))
                case Settle(job=j):
                    self._spawn(self._settle(self.jobs[j], self.writes.futures(j)))
                case Reply() as r:
                    self._answer(r)
                case Release(job=j, outcome=outcome):
                    self._spawn(self._pages_back(ReleaseJob(j, outcome)))

    async def _connection_events(self) -> None:
        for fd in await disconnected_fds(self.monitor):
            self.conns = {c for c in self.conns if c[1] != fd}
            self.gate.disconnected(fd)

    async def _abort(self, peer: bytes, rid: str, conn: Conn) -> None:
        self.gate.withdraw(conn, rid)
        job_id = self.by_peer.get((peer, rid))
        if job_id is None:
            await self._reply(peer, AbortAck(rid))  # nothing of it can land
            return
        self._carry_out(self.life.cancel(job_id, "acked"))

    def _fail(self, job_id: int, code: PrefillFailCode, message: str) -> None:
        """Stop a job that cannot go on: no new writes; answered once posted writes settle."""
        self._carry_out(self.life.cancel(job_id, "failed", code, message))

    # ------------------------------------------------------------------ layers and steps

    def _step_done(self, done: StepDone, hidden: bytes | None) -> None:
        announce = self.writes.step_done(done.step_id, done.ok)
        if announce is None:
            return
        if not done.ok:
            for c in announce.chunks:
                if c.job in self.jobs:
                    self._fail(c.job, "internal", f"step failed: {done.error}")
            return
        self._progressed(time.monotonic())
        for c in announce.chunks:
            if c.job in self.queued_of:
                self.queued_of[c.job] -= c.count
                self.queued_tokens -= c.count
        row_bytes = self.layout.context_bytes
        for i, job_id in enumerate(done.context_jobs):
            job = self.jobs.get(job_id)
            now = time.monotonic()
            if job is None or hidden is None or not self.life.may_write(job_id, now):
                if job is not None and (why := self.life.overdue(job_id, now)):
                    self._fail(job_id, "timeout", why)
                continue
            slot = None  # without MTP its marker went out with the last layer
            if self.layout.spec_method == "mtp":  # the decoder's MTP layer reads this row
                slot = self.ctx_of[job_id]
                self.ctx_buf[slot] = torch.frombuffer(
                    bytearray(hidden[i * row_bytes:(i + 1) * row_bytes]), dtype=torch.uint8)
            self.writes.post_context(job_id, slot)
            if self.traces and job_id in self.traces:
                self.traces[job_id].enter("kv_settle")  # computed: its last writes land
            self._carry_out(self.life.computed(job_id, now))
        self._send_soon(self.stats())

    async def _settle(self, job: Job, futures: list[asyncio.Future[None]]) -> None:
        """Wait for every write of ``job`` posted so far (``futures``) to settle; tell the
        machine."""
        results = await asyncio.gather(*futures, return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        trace.mark("p.settled", job.req.request_id)
        self._carry_out(self.life.settled(job.id, str(errors[0]) if errors else None,
                                          time.monotonic()))

    def _answer(self, r: Reply) -> None:
        """The decoder's one answer about a job (sent soon); the job is gone here now."""
        job, posted = self.jobs.pop(r.job), self.writes.finish(r.job)
        rid = job.req.request_id
        msg = wire_reply(r, rid, posted.cached_tokens, time.time())
        if r.kind == "done" and self.metrics is not None:
            self.metrics.observe_transfer("sent", posted.bytes, posted.writes, time.monotonic()
                                          - (posted.first_post_at or time.monotonic()))
        self.by_peer.pop((job.peer, rid), None)
        self.queued_tokens -= self.queued_of.pop(job.id, 0)  # cached, cancelled: not computed
        self.ctx_free.append(self.ctx_of.pop(job.id))
        self._spawn(self._reply(job.peer, msg))
        trace.mark("p.answered", rid)
        if self.traces and (phases := self.traces.pop(job.id, None)) is not None:
            trace.unbind(rid)
            phases.end(outcome=r.kind)

    def _progressed(self, now: float) -> None:
        """This prefiller computed something (a step was scheduled, a layer or a step done):
        progress for every job still to compute; decoders hear of it now and then."""
        for job_id in self.life.progressed(now):
            job = self.jobs[job_id]
            self._spawn(self._reply(job.peer, PrefillProgress(job.req.request_id)))

    # ------------------------------------------------------------------ plumbing

    def stats(self) -> MessengerStats:
        return MessengerStats(
            transfers_in_flight=self.writes.in_flight(),
            kv_writes_sent=self.transfer.writes_sent, kv_bytes_sent=self.transfer.bytes_sent,
            layer_lag=self.writes.layer_lag(self.counter.read()),
            layerwise_steps=self.writes.layerwise_steps,
            kv_pages_from_host=self.writes.host_pages_sent,
            kv_units_sent_by_rank=list(self.writes.units_by_rank))

    async def _reply(self, peer: bytes, msg: Any) -> None:
        try:
            await self.sock.send_multipart([peer, self._enc.encode(msg)], zmq.NOBLOCK)
        except zmq.ZMQError as e:
            log.debug("could not reply to a decoder: %s", e)

    def _send_soon(self, msg: Any) -> None:
        self._spawn(self._to_scheduler(msg))

    def close(self) -> None:
        self._cancel_tasks()
        self.sock.disable_monitor()
        self.monitor.close()
        self.sock.close()

