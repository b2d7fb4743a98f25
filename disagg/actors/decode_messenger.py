"""Decode-side KV messenger, with the completion tracker.

Receives: ``NeedPrefill`` / ``CancelRemote`` from the scheduler (``inproc://``); ``Pong`` /
``PrefillDone`` / ``PrefillFailed`` / ``AbortAck`` from prefill nodes (one DEALER per
``--prefill-peer``); expectation completions from the transfer engine.
Sends: ``PrefillRequest`` / ``AbortPrefill`` / ``Ping`` to prefillers; ``KVReady`` /
``RemoteFailed`` / ``RemoteReleased`` / ``PeersAlive`` / ``MessengerStats`` to the scheduler.
Owns: the attempts (one per PrefillRequest sent), peer liveness and load, the context buffer.

A request's pages are never reported free while a write into them may still land: after a
timeout or a client abort the attempt drains (AbortPrefill -> AbortAck, or the prefiller's own
PrefillDone/PrefillFailed, or the prefiller declared dead) before the scheduler hears of it.
Each request names this decoder's challenge slot for that prefiller; a prefiller proves the
decoder owns the memory by writing a nonce there and asking for it (``Challenge`` ->
``ChallengeAnswer``, ``disagg.ownership``). A prefiller whose attempts keep failing (timeouts,
refusals) is suspect for a back-off (``disagg.peer_health``): others are preferred meanwhile.
An attempt times out after ``--prefill-timeout`` without progress (KV units of its key landing,
or the prefiller's ``PrefillProgress``), or at its absolute deadline (``disagg.deadlines``).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import random
import time
from dataclasses import dataclass, field
from typing import Any

import msgspec
import torch
import zmq
import zmq.asyncio

from disagg import security
from disagg.actors.messenger_base import MessengerBase
from disagg.actors.transfer import TransferEngine
from disagg.deadlines import DEADLINE_GRACE_S, ProgressDeadline, fence_expired, prefill_cap_s
from disagg.fabric.topology import MAX_LANES
from disagg.ownership import CHALLENGE_SLOTS, CHALLENGE_UNITS, NONCE_BYTES, area_rows, nonce_offset
from disagg.peer_health import PeerHealth
from disagg.protocol import (
    AbortAck,
    AbortPrefill,
    CancelRemote,
    Challenge,
    ChallengeAnswer,
    KVLayoutDesc,
    KVReady,
    MessengerStats,
    NeedPrefill,
    PeerReply,
    PeersAlive,
    Ping,
    Pong,
    PrefillDone,
    PrefillFailed,
    PrefillProgress,
    PrefillRequest,
    PrefillTimings,
    RemoteFailed,
    RemoteReleased,
    ToMessenger,
)
from disagg.transfer_plan import incompatibility, make_key, new_generation, request_units

log = logging.getLogger(__name__)

# a failed ZMTP/CURVE handshake (an impostor or a plain socket on a prefiller's address)
HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                    | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
FENCE_GRACE_S = 1.0  # after a peer's connection went down, for bytes already on their way
CHALLENGE_WAIT_S = 2.0  # for a challenge's nonce to land before reading it anyway
CHALLENGE_ARMED_S = 3600.0  # an armed challenge key is re-armed after this
CHALLENGE_SLOT = (1 << 8) - 1  # the slot bits of challenge keys (logs only: generations are random)


@dataclass
class Peer:
    address: str
    sock: zmq.asyncio.Socket
    alive: bool = False
    last_pong: float = 0.0
    queued_tokens: int = 0  # from its last Pong
    sent_tokens: int = 0  # tokens we sent since that Pong
    incompatible: str | None = None
    layout: KVLayoutDesc | None = None  # from its last Pong: sizes the expected units
    monitor: Any = None  # zmq monitor socket: connection events of ``sock``
    epoch: int = 0  # connections to this address that went down (a dead process's did)
    down_at: float = 0.0  # when the last one went down (monotonic)
    redial: bool = False  # a handshake failed: libzmq may not retry by itself (NOTES.md)
    slot: int = 0  # its challenge slot in the context buffer's challenge area
    challenge: Any = None  # (key, Expectation) a challenge's nonce writes land under
    health: PeerHealth = field(default_factory=PeerHealth)


@dataclass
class Attempt:
    slot: int
    generation: int
    need: NeedPrefill
    peer: Peer
    ctx_slot: int
    expectation: Any
    clock: ProgressDeadline  # waiting: idle deadline pushed by progress, under the cap
    tries: int
    epoch: int = 0  # the peer's connection epoch when the request was sent
    started_at: float = 0.0
    deadline_unix: float = 0.0  # the cap, wall clock: the prefiller posts no write after it
    deadline: float = 0.0  # draining: when to stop waiting for the acknowledgement
    landed: int = 0  # units of its key seen landed (progress)
    state: str = "waiting"  # waiting (for KV) -> draining (no KV wanted; writes may land)
    cancelled: bool = False  # the request ended on the decode side
    failure: tuple[str, str] | None = None
    window: Any = None  # its registrations (TransferEngine.window): closed once no KV is wanted

    @property
    def request_id(self) -> str:
        return f"{self.slot}.{self.generation}"


class DecodeMessenger(MessengerBase):
    def __init__(
        self,
        peers: list[str],
        ctx: zmq.asyncio.Context,
        sched_sock: zmq.asyncio.Socket,
        transfer: TransferEngine,
        layout: KVLayoutDesc,
        kvs: list[torch.Tensor],  # every rank's KV cache, mapped into this process
        max_slots: int = 256,
        timeout_s: float = 60.0,
        heartbeat_s: float = 1.0,
        peer_timeout_s: float = 5.0,
        on_failure: str = "error",
        max_tries: int = 2,
        kv_fds: list[int | None] | None = None,  # their allocations' fds (cuMem on CUDA)
    ):
        # with a window per attempt the shared registrations need no remote access at all
        self.register_access = "source" if transfer.windows else "target"
        self.peers: list[Peer] = []
        for address in peers:
            sock = ctx.socket(zmq.DEALER)
            security.client(sock)
            sock.setsockopt(zmq.LINGER, 0)
            monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED | HANDSHAKE_FAILED)
            sock.connect(address)
            self.peers.append(Peer(address, sock, monitor=monitor,
                                   slot=len(self.peers) % CHALLENGE_SLOTS))
        # context slots, then the challenge area (its last bytes), never a context slot
        super().__init__(sched_sock, transfer, layout, kvs, kv_fds,
                         max_slots + area_rows(layout.context_bytes))
        self.ctx_free = [s for s in self.ctx_free if s < max_slots]
        self.timeout_s = timeout_s
        self.heartbeat_s = heartbeat_s
        self.peer_timeout_s = peer_timeout_s
        self.max_tries = max_tries if on_failure == "retry" else 1
        self.attempts: dict[str, Attempt] = {}  # by request id
        self.by_slot: dict[int, Attempt] = {}
        self.completed: dict[str, int] = {}  # request id -> slot, KV landed, PrefillDone due
        self._ping = itertools.count()
        self._peer_dec = msgspec.msgpack.Decoder(PeerReply)
        self._sched_dec = msgspec.msgpack.Decoder(ToMessenger)
        self._alive_reported = -1
        self._junk_reported = 0
        self.units_received = 0

    # ------------------------------------------------------------------ loop

    async def run(self) -> None:
        """Loop: 1. wait for a scheduler or prefiller message (at most one heartbeat);
        2. handle it; 3. every heartbeat: ping peers, update liveness, expire drains."""
        poller = zmq.asyncio.Poller()
        poller.register(self.sched, zmq.POLLIN)
        for p in self.peers:
            poller.register(p.sock, zmq.POLLIN)
            poller.register(p.monitor, zmq.POLLIN)
        next_beat = 0.0
        while True:
            now = time.monotonic()
            if now >= next_beat:
                await self._heartbeat(now)
                next_beat = now + self.heartbeat_s
            events = dict(await poller.poll(max(1, int((next_beat - now) * 1000))))
            if self.sched in events:
                await self._from_scheduler()
            for p in self.peers:
                if p.sock in events:
                    await self._from_peer(p)
                if p.monitor in events:
                    await self._connection_events(p)

    async def _from_scheduler(self) -> None:
        while True:
            try:
                data = await self.sched.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            match self._sched_dec.decode(data):
                case NeedPrefill() as need:
                    await self._start(need, tries=1)
                case CancelRemote(slot=slot):
                    a = self.by_slot.get(slot)
                    if a is None:
                        await self._to_scheduler(RemoteReleased(slot))
                    else:
                        a.cancelled = True
                        await self._drain(a, ("cancelled", "the request ended"))

    async def _from_peer(self, peer: Peer) -> None:
        while True:
            try:
                data = await peer.sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                msg = self._peer_dec.decode(data)
            except (msgspec.DecodeError, msgspec.ValidationError) as e:
                self.bad_frames += 1
                log.warning("bad frame from prefiller %s: %s", peer.address, e)
                continue
            match msg:
                case Pong() as pong:
                    peer.last_pong = time.monotonic()
                    peer.queued_tokens, peer.sent_tokens = pong.queued_tokens, 0
                    why = incompatibility(pong.layout, self.layout)
                    if pong.transport != self.transfer.transport:
                        why = (f"transport mismatch: prefiller uses {pong.transport}, "
                               f"this decoder {self.transfer.transport}")
                    if why and why != peer.incompatible:
                        log.error("prefiller %s refused: %s", peer.address, why)
                    peer.incompatible = why
                    peer.layout = pong.layout
                    peer.alive = peer.incompatible is None
                    await self._report_alive()
                case Challenge() as ch:
                    self._spawn(self._answer(peer, ch))
                case PrefillFailed(request_id=rid, code=code, message=message):
                    a = self.attempts.get(rid)
                    if a is not None and a.state == "waiting" and a.peer is peer:
                        peer.health.failed(time.monotonic())
                    if a is not None:  # no write of it can land any more
                        await self._settled(a, a.failure or (code, message))
                case PrefillDone(request_id=rid) as done:
                    slot = self.completed.pop(rid, None)
                    if slot is not None:
                        await self._to_scheduler(PrefillTimings(slot, done.queue_s,
                                                                done.compute_s, done.tail_s))
                    a = self.attempts.get(rid)
                    if a is not None and a.state in ("draining", "fenced"):
                        await self._settled(a, a.failure or ("cancelled", "the request ended"))
                case AbortAck(request_id=rid):
                    a = self.attempts.get(rid)
                    if a is not None and a.state in ("draining", "fenced"):
                        await self._settled(a, a.failure or ("cancelled", "the request ended"))
                case PrefillProgress(request_id=rid):
                    a = self.attempts.get(rid)
                    if a is not None and a.peer is peer:
                        a.clock.progress(time.monotonic())

    # ------------------------------------------------------------------ attempts

    def pick(self) -> Peer | None:
        """The live, compatible prefiller with the fewest queued tokens (ties at random),
        among those not suspect if there are any."""
        live = [p for p in self.peers if p.alive]
        if not live:
            return None
        now = time.monotonic()
        healthy = [p for p in live if not p.health.suspect(now)] or live
        return min(healthy, key=lambda p: (p.queued_tokens + p.sent_tokens, random.random()))

    def _challenge_key(self, peer: Peer) -> int:
        """The key ``peer``'s next challenge writes carry: expected before any request names
        it (only arrivals after ``expect`` count); a fresh one once it was used or expired."""
        if peer.challenge is None or peer.challenge[1].future.done():
            key = make_key(CHALLENGE_SLOT, new_generation())
            exp = self.transfer.expect(key, CHALLENGE_UNITS, timeout=CHALLENGE_ARMED_S)
            exp.future.add_done_callback(lambda f: f.cancelled() or f.exception())
            peer.challenge = (key, exp)
        return int(peer.challenge[0])

    async def _answer(self, peer: Peer, ch: Challenge) -> None:
        """Read back the nonce ``peer`` wrote into its challenge slot (once it landed, or
        after ``CHALLENGE_WAIT_S``) and send it: proof that this process owns the memory.
        The slot is read even when the wait timed out: a nonce written under a challenge key
        this side had already rotated lands (counted as junk) without completing the wait.
        Abstains (empty answer) when the request named no longer wants KV: it was aborted,
        and its registration may have closed before the nonce could land."""
        a = self.attempts.get(ch.request_id) if ch.request_id else None
        if ch.request_id and (a is None or a.state != "waiting"):
            with contextlib.suppress(zmq.ZMQError):
                await peer.sock.send(self._enc.encode(ChallengeAnswer(ch.id, b"")), zmq.NOBLOCK)
            return
        if peer.challenge is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.shield(peer.challenge[1].future), CHALLENGE_WAIT_S)
        n = NONCE_BYTES * max(1, min(ch.lanes, MAX_LANES))
        start = nonce_offset(self.ctx_buf.numel(), peer.slot, 0)
        nonce = bytes(self.ctx_buf.view(-1)[start:start + n].cpu().numpy().tobytes())
        with contextlib.suppress(zmq.ZMQError):
            await peer.sock.send(self._enc.encode(ChallengeAnswer(ch.id, nonce)), zmq.NOBLOCK)

    async def _start(self, need: NeedPrefill, tries: int) -> None:
        peer = self.pick()
        if peer is None or not self.ctx_free:
            why = "no prefiller is alive" if peer is None else "no free context slot"
            await self._pages_back(RemoteFailed(need.slot, "no_prefiller", why))
            return
        gen = self._new_generation(need.slot)
        key = make_key(need.slot, gen)
        assert peer.layout is not None  # alive means it answered a Ping
        units = request_units(peer.layout, self.layout, len(need.prompt_ids))
        ctx_slot = self.ctx_free.pop()
        cap_s = prefill_cap_s(self.timeout_s, len(need.prompt_ids))
        exp = self.transfer.expect(key, units, timeout=cap_s)  # the engine enforces the cap
        window = self.transfer.window(self.kv_regions + [self.ctx_region])
        now = time.monotonic()
        a = Attempt(need.slot, gen, need, peer, ctx_slot, exp,
                    ProgressDeadline.start(now, self.timeout_s, cap_s), tries, epoch=peer.epoch,
                    started_at=now, deadline_unix=time.time() + cap_s, window=window)
        self.attempts[a.request_id] = a
        self.by_slot[need.slot] = a
        peer.sent_tokens += len(need.prompt_ids)
        req = PrefillRequest(
            request_id=a.request_id, key=key, prompt_ids=need.prompt_ids,
            dst_pages=need.dst_pages, dst_layout=self.layout,
            dst_kv=window.descriptors[0].encode(),
            dst_kv_ranks=[d.encode() for d in window.descriptors[:-1]],
            dst_ctx=window.descriptors[-1].encode(),
            ctx_offset=ctx_slot * self.layout.context_bytes, timeout_s=self.timeout_s,
            deadline_unix=a.deadline_unix, challenge_slot=peer.slot,
            challenge_key=self._challenge_key(peer))
        await peer.sock.send(self._enc.encode(req))
        self._spawn(self._await_kv(a, units))

    async def _await_kv(self, a: Attempt, units: int) -> None:
        try:
            await a.expectation
        except asyncio.CancelledError:
            return  # cancelled by a drain; that path reports
        except Exception as e:  # the expectation's deadline (the attempt's cap) passed
            if a.state == "waiting":
                await self._drain(a, ("timeout", f"{a.clock.why(time.monotonic())}: {e}"))
            return
        if a.state != "waiting":
            return
        # fabric over host staging: its pages mirror -> GPU first (no-op otherwise)
        for region in self.kv_regions:
            await self.transfer.stage_in_pages(region, self.layout, a.need.dst_pages)
        if a.state != "waiting":
            return
        a.peer.health.succeeded()
        self.units_received += units
        if self.metrics is not None:  # units: pages per layer, plus one context
            nbytes = (units - 1) * self.layout.page_bytes + self.layout.context_bytes
            self.metrics.observe_transfer("received", nbytes, units,
                                          time.monotonic() - a.started_at)
        self._forget(a)
        self.completed[a.request_id] = a.slot  # its PrefillDone brings the prefiller's timings
        while len(self.completed) > 4096:
            self.completed.pop(next(iter(self.completed)))
        await self._to_scheduler(KVReady(a.slot))
        await self._to_scheduler(self.stats())

    async def _drain(self, a: Attempt, failure: tuple[str, str]) -> None:
        """Stop wanting the KV; ask the prefiller to stop (queued even if it looks dead: a
        stopped process reads it when it resumes). Pages are reported free only once no write
        can land: an acknowledgement, or the attempt's deadline (``_fence``)."""
        if a.state != "waiting":
            return
        if failure[0] != "cancelled":  # timed out, or its prefiller died
            a.peer.health.failed(time.monotonic())
        a.state = "draining"
        a.failure = failure
        a.expectation.cancel()
        a.window.close()  # revoked: the provider refuses its writes not yet being received
        a.deadline = time.monotonic() + self.peer_timeout_s
        with contextlib.suppress(zmq.ZMQError):
            await a.peer.sock.send(self._enc.encode(AbortPrefill(a.request_id)), zmq.NOBLOCK)
        if not a.peer.alive:
            await self._fence(a)

    async def _fence(self, a: Attempt) -> None:
        """The prefiller does not answer: report the failure now, but keep the pages fenced
        until no write of the attempt can land: the prefiller acknowledges (it was only slow or
        stopped, and read our AbortPrefill when it resumed), or the connection the request went
        out on goes down (the process is gone), or the attempt's absolute deadline passed (plus
        a grace): a prefiller posts nothing past it, whenever it reads the request."""
        if a.state == "fenced":
            return
        a.state = "fenced"
        if not a.cancelled:
            code, message = a.failure or ("prefiller_dead", "prefiller stopped")
            await self._to_scheduler(RemoteFailed(a.slot, code, message, pages_free=False,
                                                  fence=a.generation))
        if self.by_slot.get(a.slot) is a:
            del self.by_slot[a.slot]  # the slot may start over (locally); keep only the fence
        await self._to_scheduler(self.stats())

    async def _settled(self, a: Attempt, failure: tuple[str, str]) -> None:
        """No write of ``a`` can land any more: retry, or report to the scheduler."""
        await self.transfer.staging_idle()  # nor a staged copy into its pages
        if a.state == "waiting":
            a.expectation.cancel()
        fenced = a.state == "fenced"  # its failure was reported already
        self._forget(a)
        if fenced or a.cancelled:
            await self._pages_back(self._released(a))
        elif a.tries < self.max_tries and self.pick() is not None:
            log.warning("prefill of slot %d failed (%s: %s); retrying", a.slot, *failure)
            await self._start(a.need, a.tries + 1)
            await self._to_scheduler(self.stats())
        else:
            await self._pages_back(RemoteFailed(a.slot, failure[0], failure[1]))

    @staticmethod
    def _released(a: Attempt) -> RemoteReleased:
        """Which fence to lift: the scheduler's cancel fence, or this attempt's failure fence."""
        return RemoteReleased(a.slot, 0 if a.cancelled else a.generation)

    def _new_generation(self, slot: int) -> int:
        """A random generation whose key no attempt in flight has (unguessable by a peer)."""
        live = {make_key(a.slot, a.generation) for a in self.attempts.values()}
        while make_key(slot, gen := new_generation()) in live:
            pass
        return gen

    def _forget(self, a: Attempt) -> None:
        a.window.close()  # no write of it is wanted any more
        if self.attempts.pop(a.request_id, None) is not None:
            self.ctx_free.append(a.ctx_slot)
        if self.by_slot.get(a.slot) is a:
            del self.by_slot[a.slot]

    # ------------------------------------------------------------------ liveness

    async def _heartbeat(self, now: float) -> None:
        seq = next(self._ping)
        for p in self.peers:
            if p.redial:  # something else answered on its address: dial again, from scratch
                p.redial = False
                with contextlib.suppress(zmq.ZMQError):
                    p.sock.disconnect(p.address)
                p.sock.connect(p.address)
            if p.alive and now - p.last_pong > self.peer_timeout_s:
                log.warning("prefiller %s is not answering; declaring it dead", p.address)
                p.alive = False
            try:
                await p.sock.send(self._enc.encode(Ping(seq)), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
        for a in list(self.attempts.values()):
            dead = not a.peer.alive
            if a.state == "draining" and (dead or now > a.deadline):
                # no acknowledgement within the peer timeout: fence until the deadline
                await self._fence(a)
            elif a.state == "waiting" and dead:
                await self._drain(a, ("prefiller_dead", f"prefiller {a.peer.address} died"))
            elif a.state == "waiting" and self._timed_out(a, now):
                await self._drain(a, ("timeout", f"prefill of {len(a.need.prompt_ids)} tokens "
                                                 f"on {a.peer.address}: {a.clock.why(now)}"))
            elif a.state == "fenced" and (
                    # the connection it was sent on went down (the process is gone: a stopped
                    # one keeps its connections), or its absolute deadline passed: nothing of
                    # it can land any more
                    (a.peer.epoch > a.epoch and now > a.peer.down_at + FENCE_GRACE_S)
                    or fence_expired(time.time(), a.deadline_unix, DEADLINE_GRACE_S)):
                self._forget(a)
                await self._pages_back(self._released(a))
        await self._report_alive()
        if self.transfer.junk != self._junk_reported:
            await self._to_scheduler(self.stats())

    @staticmethod
    def _timed_out(a: Attempt, now: float) -> bool:
        """Count units of its key that landed since the last look as progress; then whether
        its idle deadline or its cap passed."""
        landed = a.expectation.landed()
        if landed is not None and landed > a.landed:
            a.landed = landed
            a.clock.progress(now)
        return a.clock.expired(now)

    async def _report_alive(self) -> None:
        n = sum(p.alive for p in self.peers)
        if n != self._alive_reported:
            self._alive_reported = n
            await self._to_scheduler(PeersAlive(n))
            await self._to_scheduler(self.stats())

    # ------------------------------------------------------------------ plumbing

    def stats(self) -> MessengerStats:
        self._junk_reported = self.transfer.junk
        return MessengerStats(transfers_in_flight=len(self.attempts),
                              kv_units_received=self.units_received,
                              prefill_peers_alive=sum(p.alive for p in self.peers),
                              kv_junk_immediates=self._junk_reported)

    async def _connection_events(self, peer: Peer) -> None:
        from zmq.utils.monitor import parse_monitor_message

        while True:
            try:
                frames = await peer.monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            event = parse_monitor_message(frames)["event"]
            if event == zmq.EVENT_DISCONNECTED:
                peer.epoch += 1
                peer.down_at = time.monotonic()
            elif event & HANDSHAKE_FAILED:
                peer.redial = True

    def close(self) -> None:
        self._cancel_tasks()
        for p in self.peers:
            p.sock.disable_monitor()
            p.monitor.close()
            p.sock.close()
