"""Decode-side KV messenger: the network half of remote prefill, with the completion tracker.

Receives: ``SendPrefill`` / ``StopPrefill`` / ``ForgetPrefill`` from the scheduler
(``inproc://``), the commands of its ``disagg.remote.decode.DecodeRemote``; ``Pong`` /
``PrefillDone`` / ``PrefillFailed`` / ``AbortAck`` / ``PrefillProgress`` / ``Challenge`` from
prefill nodes (one DEALER per ``--prefill-peer`` address, or per address a ``dns:`` entry
resolves to as they come and go: ``disagg.actors.peer_discovery``; one that vanishes is dead);
expectation completions from the transfer engine.
Sends: ``PrefillRequest`` / ``AbortPrefill`` / ``Ping`` / ``ChallengeAnswer`` /
``OwnershipOffer`` to prefillers; ``AttemptEvent`` / ``PeersAlive`` / ``MessengerStats`` to the
scheduler.
Owns: the prefill peers (their sockets and challenge slots; their liveness, load and health
in the pure ``disagg.remote.prefillers.PrefillerTable``, the choice among them
``disagg.serving.routing.PrefillerChoice``), and per attempt the wire
state: its peer and connection epoch, context slot, registrations and expectation. Whether
an attempt is still wanted, when it times out, when its pages are free and whether it is
retried is the scheduler's state machine's call, not this actor's.

Each request names this decoder's challenge slot for that prefiller; a prefiller proves the
decoder owns the memory by writing a nonce there and asking for it (``Challenge`` ->
``ChallengeAnswer``, ``disagg.remote.ownership``). A prefiller found compatible on a new
connection is offered the endpoints at once (``OwnershipOffer``), so the check runs before
the first request rather than in its way. A prefiller whose attempts keep failing (timeouts,
refusals) is suspect for a back-off (``disagg.remote.peer_health``): others are preferred meanwhile.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import logging
import time
from typing import Any

import msgspec
import torch
import zmq
import zmq.asyncio

from disagg import trace
from disagg.actors.decode_messenger.prefill_peers import (
    OFFER_WINDOW_S,
    Challenges,
    DialedPeers,
    Peer,
    Wire,
    close_offer,
    new_epoch,
    offer_due,
)
from disagg.actors.messenger_base import MessengerBase
from disagg.actors.peer_discovery import PeerDiscovery
from disagg.actors.sockets import (
    HANDSHAKE_FAILED,
    LoopPoller,
    monitor_events,
    pending,
    pending_frames,
)
from disagg.engine.dp import rank_pages
from disagg.protocol.inproc import (
    AttemptEvent,
    ForgetPrefill,
    MessengerStats,
    PeersAlive,
    SendPrefill,
    StopPrefill,
    ToMessenger,
)
from disagg.protocol.peer import (
    AbortAck,
    AbortPrefill,
    Challenge,
    KVLayoutDesc,
    PeerReply,
    Ping,
    Pong,
    PrefillDone,
    PrefillFailed,
    PrefillProgress,
    PrefillRequestOut,
)
from disagg.remote.attempt_windows import AttemptWindows
from disagg.remote.deadlines import DEADLINE_GRACE_S
from disagg.remote.discovery import split_specs
from disagg.remote.ownership import area_rows
from disagg.remote.prefillers import PrefillerTable
from disagg.remote.transfer_plan import request_units
from disagg.serving.metrics import Metrics
from disagg.serving.routing import PrefillerChoice
from disagg.transfer import TransferEngine

log = logging.getLogger(__name__)

FORGOTTEN_KEPT = 4096  # attempts remembered after they ended, for a trailing PrefillDone

FENCE_GRACE_S = 1.0  # after a peer's connection went down, for bytes already on their way


class DecodeMessenger(MessengerBase):
    def __init__(
        self,
        peers: list[str],  # --prefill-peer entries: addresses and dns:NAME:PORT
        ctx: zmq.asyncio.Context,
        sched_sock: zmq.asyncio.Socket,
        transfer: TransferEngine,
        layout: KVLayoutDesc,
        kvs: list[torch.Tensor],  # every rank's KV cache, mapped into this process
        max_slots: int = 256,
        timeout_s: float = 60.0,
        heartbeat_s: float = 1.0,
        peer_timeout_s: float = 5.0,
        kv_fds: list[int | None] | None = None,  # their allocations' fds (cuMem on CUDA)
        metrics: Metrics | None = None,
        resolve_interval_s: float = 10.0,  # dns: entries re-resolved this often
        dp: int = 1,  # --dp: the ranks' executors are kvs in rank order, layout is one rank's
    ):
        # with a window per attempt the shared registrations need no remote access at all
        self.register_access = "source" if transfer.windows else "target"
        self.ctx = ctx
        static, names = split_specs(peers)
        self.prefillers = PrefillerTable(layout, transfer.transport, peer_timeout_s)
        self.dialed = DialedPeers(ctx, static, self.prefillers)
        self.peers = self.dialed.peers  # the same list, kept current by self.dialed
        self.discovery = PeerDiscovery(names, static, self.dialed.update, resolve_interval_s)
        # context slots, then the challenge area (its last bytes), never a context slot
        super().__init__(sched_sock, transfer, layout, kvs, kv_fds,
                         max_slots + area_rows(layout.context_bytes), metrics)
        self.ctx_free = [s for s in self.ctx_free if s < max_slots]
        self.challenges = Challenges(transfer, self.kv_regions, self.ctx_region, self.ctx_buf)
        self.timeout_s = timeout_s
        self.heartbeat_s = heartbeat_s
        self.dp, self.rank_width = dp, len(kvs) // dp  # executors (TP ranks) per DP rank
        self.wires: dict[str, Wire] = {}  # by request id
        self.attempt_windows = AttemptWindows()  # theirs: open until nothing of them can land
        # forgotten attempts -> their peer: a PrefillDone may trail the KV that ended them
        self.forgotten: collections.OrderedDict[str, Peer] = collections.OrderedDict()
        self.choice = PrefillerChoice()
        self._ping = itertools.count()
        self._peer_dec = msgspec.msgpack.Decoder(PeerReply)
        self._sched_dec = msgspec.msgpack.Decoder(ToMessenger)
        self._alive_reported = -1
        self._junk_reported = 0
        self.units_received = 0
        self._woke = 0.0  # when the loop's poll last returned (the dm.woke hop mark)

    # ------------------------------------------------------------------ loop

    async def run(self) -> None:
        """Loop: 1. wait for a scheduler or prefiller message (at most one heartbeat);
        2. handle it; 3. every heartbeat: apply peer set changes, ping peers, update
        liveness, expire drains."""
        poller = LoopPoller()  # woken in one loop turn (pyzmq's takes several)
        poller.register(self.sched, zmq.POLLIN)
        for p in self.peers:
            self.dialed.register(poller, p)
        if self.discovery.names:
            self._spawn(self.discovery.run())
        next_beat = 0.0
        try:
            while True:
                now = time.monotonic()
                if now >= next_beat:
                    self.dialed.apply(poller, lambda p: any(w.peer is p
                                                            for w in self.wires.values()))
                    await self._heartbeat(now)
                    next_beat = now + self.heartbeat_s
                events = dict(await poller.poll(max(1, int((next_beat - now) * 1000))))
                self._woke = time.monotonic()
                if self.sched in events:
                    await self._from_scheduler()
                for p in self.peers:
                    if p.monitor in events:  # first: a new process's Pong finds the epoch moved
                        await self._connection_events(p)
                    if p.sock in events:
                        await self._from_peer(p)
        finally:
            poller.close()

    async def _from_scheduler(self) -> None:
        async for frames in pending_frames(self.sched):  # uncopied: SendPrefill.prompt
            match self._sched_dec.decode(frames[0].buffer):  # stays a view into its frame
                case SendPrefill() as msg:
                    await self._send_request(msg)
                case StopPrefill(request_id=rid, blame=blame):
                    await self._stop(rid, blame)
                case ForgetPrefill(request_id=rid):
                    self._forget(rid)

    async def _from_peer(self, peer: Peer) -> None:
        async for data in pending(peer.sock):
            try:
                msg = self._peer_dec.decode(data)
            except (msgspec.DecodeError, msgspec.ValidationError) as e:
                self.bad_frames += 1
                log.warning("bad frame from prefiller %s: %s", peer.address, e)
                continue
            match msg:
                case Pong() as pong:
                    now = time.monotonic()
                    if why := self.prefillers.pong(peer.address, now, pong.queued_tokens,
                                                   pong.layout, pong.transport, pong.dp_ranks):
                        log.error("prefiller %s refused: %s", peer.address, why)
                    if self.prefillers.alive(peer.address) and offer_due(peer, now):
                        await self.challenges.offer(peer)
                    await self._report_alive()
                case Challenge() as ch:
                    self._spawn(self._answer(peer, ch))
                case PrefillFailed(request_id=rid, code=code, message=message):
                    if not rid:  # about no request: our OwnershipOffer
                        log.warning("prefiller %s: %s: %s", peer.address, code, message)
                    w = self._of(rid, peer)
                    if w is not None and w.wanted:
                        self.prefillers.failed(peer.address, time.monotonic())
                    if w is not None:  # no write of it can land any more
                        await self._settled(rid, "failed", code, message)
                case PrefillDone(request_id=rid) as done:
                    trace.mark("dm.done_in", rid)
                    timings = (done.queue_s, done.compute_s, done.tail_s,
                               done.settled_at - done.prefill_s if done.settled_at else 0.0)
                    if self._of(rid, peer) is not None:
                        await self._settled(rid, "done", timings=timings,
                                            cached_tokens=done.cached_tokens)
                    elif self.forgotten.get(rid) is peer:  # its KV landed before: news only
                        del self.forgotten[rid]
                        await self._event(AttemptEvent(rid, "done", timings=timings,
                                                       cached_tokens=done.cached_tokens))
                case AbortAck(request_id=rid):
                    if self._of(rid, peer) is not None:
                        await self._settled(rid, "acked")
                case PrefillProgress(request_id=rid):
                    if self._of(rid, peer) is not None:
                        await self._event(AttemptEvent(rid, "progress"))

    def _of(self, rid: str, peer: Peer) -> Wire | None:
        """The attempt ``rid`` if ``peer`` is the prefiller it went to (news of an attempt
        from any other peer is ignored)."""
        w = self.wires.get(rid)
        return w if w is not None and w.peer is peer else None

    # ------------------------------------------------------------------ attempts

    def pick(self, keys: list[bytes] | None = None) -> Peer | None:
        """The prefiller for a prompt with prefix ``keys`` (``PrefillerChoice`` among the
        table's candidates), or None when none is alive."""
        chosen = self.choice.pick(self.prefillers.candidates(time.monotonic()), keys)
        return next((p for p in self.peers if p.address == chosen), None)

    async def _answer(self, peer: Peer, ch: Challenge) -> None:
        """Answer ``peer``'s check (``Challenges.answer``); abstain when the request named no
        longer wants KV."""
        w = self.wires.get(ch.request_id) if ch.request_id else None
        await self.challenges.answer(peer, ch, bool(ch.request_id) and (w is None or not w.wanted))

    async def _send_request(self, msg: SendPrefill) -> None:
        trace.mark("dm.woke", msg.request_id, at=self._woke)
        trace.mark("dm.send_in", msg.request_id)
        peer = self.pick(msg.route_keys)
        if peer is None or not self.ctx_free:
            why = "no prefiller is alive" if peer is None else "no free context slot"
            await self._event(AttemptEvent(msg.request_id, "failed", "no_prefiller", why))
            return
        theirs = self.prefillers[peer.address].layout
        assert theirs is not None  # alive means it answered a Ping
        units = request_units(theirs, self.layout, msg.num_tokens, msg.skip_pages)
        ctx_slot = self.ctx_free.pop()
        exp = self.transfer.expect(msg.key, units, timeout=msg.cap_s)  # the engine's cap
        # --dp: the DP rank holding the pages; the prefiller sees that rank's executors only
        rank, pages = rank_pages(msg.dst_pages, self.layout.num_pages) if self.dp > 1 else (
            0, msg.dst_pages)
        regions = self.kv_regions[rank * self.rank_width:(rank + 1) * self.rank_width]
        window = self.transfer.window(regions + [self.ctx_region])
        w = Wire(msg.request_id, peer, peer.epoch, ctx_slot, exp, msg.num_tokens,
                 time.monotonic())
        self.attempt_windows.open(w.request_id, window,
                                  w.started_at + msg.cap_s + DEADLINE_GRACE_S)
        self.wires[w.request_id] = w
        self.prefillers.sent(peer.address, msg.num_tokens)
        req = PrefillRequestOut(  # the prompt's msgpack as the scheduler encoded it, a bin
            request_id=msg.request_id, key=msg.key, prompt_ids=msg.prompt,
            dst_pages=pages, dst_layout=self.layout,
            dst_kv=window.descriptors[0].encode(),
            dst_kv_ranks=[d.encode() for d in window.descriptors[:-1]],
            dst_ctx=window.descriptors[-1].encode(),
            ctx_offset=ctx_slot * self.layout.context_bytes, timeout_s=self.timeout_s,
            deadline_unix=time.time() + msg.cap_s, challenge_slot=peer.slot,
            challenge_key=self.challenges.key(peer), skip_pages=msg.skip_pages,
            cache_salt=msg.cache_salt, traceparent=msg.traceparent)
        await peer.sock.send(self._enc.encode(req))
        trace.mark("dm.req_out", msg.request_id)
        trace.mark("link", msg.request_id, "=k", msg.key)
        self._spawn(self._await_kv(w, units, pages, regions))

    async def _await_kv(self, w: Wire, units: int, dst_pages: list[int],
                        regions: list[Any]) -> None:
        try:
            await w.expectation
        except BaseException:  # noqa: BLE001 - stopped, or its cap passed: the machine's call
            return
        trace.mark("dm.kv", w.request_id)
        if not w.wanted:
            return
        # fabric over host staging: its pages mirror -> GPU first (no-op otherwise)
        for rank, region in enumerate(regions):
            await self.transfer.stage_in_pages(region, self.layout, dst_pages, lead=rank == 0)
        if not w.wanted:
            return
        self.prefillers.succeeded(w.peer.address)
        self.units_received += units
        if self.metrics is not None:  # units: pages per layer, plus one context
            nbytes = (units - 1) * self.layout.page_bytes + self.layout.context_bytes
            self.metrics.observe_transfer("received", nbytes, units,
                                          time.monotonic() - w.started_at)
        n = self.layout.context_bytes  # MTP needs the prefiller's last hidden state
        ctx = (bytes(self.ctx_buf.view(-1)[w.ctx_slot * n:(w.ctx_slot + 1) * n].cpu().numpy())
               if self.layout.spec_method == "mtp" else b"")
        await self._event(AttemptEvent(w.request_id, "landed", context=ctx))
        await self._to_scheduler(self.stats())

    async def _stop(self, rid: str, blame: bool) -> None:
        """No KV of ``rid`` is wanted: ask its prefiller to stop (queued even if it looks
        dead: a stopped process reads it when it resumes). Its registrations and expectation
        stay until it settles or is forgotten (``AttemptWindows``): writes already on their way
        land in its fenced pages, where a revoked key would drop their whole connection."""
        w = self.wires.get(rid)
        if w is None or not w.wanted:
            return
        w.wanted = False
        if blame:  # timed out, or its prefiller died
            self.prefillers.failed(w.peer.address, time.monotonic())
        self.attempt_windows.stop(rid)
        with contextlib.suppress(zmq.ZMQError):
            await w.peer.sock.send(self._enc.encode(AbortPrefill(rid)), zmq.NOBLOCK)
        if not self.prefillers.alive(w.peer.address) and not w.dead_reported:
            w.dead_reported = True
            await self._event(AttemptEvent(rid, "peer_dead", "prefiller_dead",
                                           f"prefiller {w.peer.address} is not answering"))

    async def _settled(self, rid: str, kind: Any, code: str = "", message: str = "",
                       timings: tuple[float, float, float, float] | None = None,
                       cached_tokens: int = 0) -> None:
        """Nothing more of ``rid`` will be written: revoke its window unless it still waits for
        its KV (before the scheduler may free its pages), and tell the scheduler once any staged
        copy into its pages is done too."""
        self.attempt_windows.settled(rid, done=kind == "done")
        await self.transfer.staging_idle()
        await self._event(AttemptEvent(rid, kind, code, message, timings, cached_tokens))

    def _forget(self, rid: str) -> None:
        w = self.wires.pop(rid, None)
        if w is None:
            return
        self.forgotten[rid] = w.peer
        while len(self.forgotten) > FORGOTTEN_KEPT:
            self.forgotten.popitem(last=False)
        w.expectation.cancel()
        self.attempt_windows.revoke(rid)
        self.ctx_free.append(w.ctx_slot)

    async def _event(self, ev: AttemptEvent) -> None:
        await self._to_scheduler(ev)

    # ------------------------------------------------------------------ liveness

    async def _heartbeat(self, now: float) -> None:
        seq = next(self._ping)
        for rid in self.attempt_windows.expire(now):  # the machine forgets them before this
            log.debug("attempt %s: window revoked at its deadline, not yet forgotten", rid)
        for address in self.prefillers.expire(now):
            log.warning("prefiller %s is not answering; declaring it dead", address)
        for p in self.peers:
            if self.prefillers[p.address].removed:
                continue
            if p.redial:  # something else answered on its address: dial again, from scratch
                p.redial = False
                with contextlib.suppress(zmq.ZMQError):
                    p.sock.disconnect(p.address)
                p.sock.connect(p.address)
            if p.offer_window is not None and now - p.offered_at > OFFER_WINDOW_S:
                close_offer(p)  # no check came
            try:
                await p.sock.send(self._enc.encode(Ping(seq)), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
        for w in list(self.wires.values()):
            if not self.prefillers.alive(w.peer.address) and not w.dead_reported:
                w.dead_reported = True
                gone = "left the peer set" if self.prefillers[w.peer.address].removed else "died"
                await self._event(AttemptEvent(w.request_id, "peer_dead", "prefiller_dead",
                                               f"prefiller {w.peer.address} {gone}"))
            elif (not w.wanted and not w.down_reported and w.peer.epoch > w.epoch
                  and now > w.peer.down_at + FENCE_GRACE_S):
                # the connection it was sent on went down: the process is gone (a stopped
                # one keeps its connections), nothing of it can land any more
                w.down_reported = True
                await self._settled(w.request_id, "conn_down")
            elif w.wanted:
                landed = w.expectation.landed()
                if landed is not None and landed > w.landed:
                    w.landed = landed
                    await self._event(AttemptEvent(w.request_id, "progress"))
        await self._report_alive()
        if self.transfer.junk != self._junk_reported:
            await self._to_scheduler(self.stats())

    async def _report_alive(self) -> None:
        n = self.prefillers.alive_count()
        if n != self._alive_reported:
            self._alive_reported = n
            await self._to_scheduler(PeersAlive(n))
            await self._to_scheduler(self.stats())

    # ------------------------------------------------------------------ plumbing

    def stats(self) -> MessengerStats:
        self._junk_reported = self.transfer.junk
        return MessengerStats(transfers_in_flight=len(self.wires),
                              kv_units_received=self.units_received,
                              prefill_peers_alive=self.prefillers.alive_count(),
                              kv_junk_immediates=self._junk_reported)

    async def _connection_events(self, peer: Peer) -> None:
        for event, _ in await monitor_events(peer.monitor):
            if event == zmq.EVENT_DISCONNECTED:
                peer.epoch += 1
                peer.down_at = time.monotonic()
                new_epoch(peer)  # its next Pong gets a fresh offer under a fresh key
            elif event & HANDSHAKE_FAILED:
                peer.redial = True

    def close(self) -> None:
        self._cancel_tasks()
        self.dialed.close()
