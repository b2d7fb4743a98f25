"""The decode messenger's prefill peers: what it holds per peer and per attempt (``Peer``,
``Wire``: sockets, connection epochs, challenge and offer state), dialing and closing peers as
the set changes at run time (``DialedPeers``, discovery), and the ownership offer a decoder
makes a compatible peer ahead of its requests. Their liveness, load and health are the pure
``disagg.remote.prefillers.PrefillerTable``, kept in step here as peers are dialed and closed."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import torch
import zmq
import zmq.asyncio

from disagg.actors.sockets import LoopPoller, dialing
from disagg.fabric.topology import MAX_LANES
from disagg.protocol.peer import Challenge, ChallengeAnswer, OwnershipOffer
from disagg.remote.ownership import CHALLENGE_SLOTS, CHALLENGE_UNITS, NONCE_BYTES, nonce_offset
from disagg.remote.prefillers import PrefillerTable
from disagg.remote.transfer_plan import make_key, new_generation

log = logging.getLogger(__name__)

REOFFER_S = 150.0  # an OwnershipOffer is repeated this often (a prefiller's binding: 300 s)
OFFER_WINDOW_S = 30.0  # an offer's window is revoked after this if no check came
CHALLENGE_WAIT_S = 2.0  # for a challenge's nonce to land before reading it anyway
CHALLENGE_ARMED_S = 3600.0  # an armed challenge key is re-armed after this
CHALLENGE_SLOT = (1 << 8) - 1  # the slot bits of challenge keys (logs only: generations are random)


@dataclass
class Peer:
    """The sockets and wire state of one prefiller (its liveness: ``PrefillerTable``)."""

    address: str
    sock: zmq.asyncio.Socket
    monitor: Any = None  # zmq monitor socket: connection events of ``sock``
    epoch: int = 0  # connections to this address that went down (a dead process's did)
    down_at: float = 0.0  # when the last one went down (monotonic)
    redial: bool = False  # a handshake failed: libzmq may not retry by itself (NOTES.md)
    slot: int = 0  # its challenge slot in the context buffer's challenge area
    challenge: Any = None  # (key, Expectation) a challenge's nonce writes land under
    offered_epoch: int = -1  # the connection epoch its last OwnershipOffer went out on
    offered_at: float = 0.0  # when (monotonic)
    offer_window: Any = None  # that offer's registrations, until the check is answered
    answered_nonce: bytes = b""  # the nonce its last challenge was answered with


@dataclass
class Wire:
    """What the messenger holds for one attempt (``SendPrefill`` until ``ForgetPrefill``)."""

    request_id: str
    peer: Peer
    epoch: int  # the peer's connection epoch when the request was sent
    ctx_slot: int
    expectation: Any  # cancelled when forgotten (a stopped attempt's late units count here)
    tokens: int
    started_at: float
    wanted: bool = True  # until StopPrefill
    landed: int = 0  # units of its key seen landed (progress)
    dead_reported: bool = False
    down_reported: bool = False


def dial(ctx: zmq.asyncio.Context, address: str, peers: list[Peer], after: int = -1) -> Peer:
    """A new peer at ``address``, its challenge slot the first after ``after`` that none of
    ``peers`` holds (a slot freed by a peer that left is reused last: a late nonce of the old
    peer would spoil the new one's first challenge), shared only past ``CHALLENGE_SLOTS``."""
    used = {p.slot for p in peers}
    slots = [(after + 1 + i) % CHALLENGE_SLOTS for i in range(CHALLENGE_SLOTS)]
    slot = next((s for s in slots if s not in used), len(peers) % CHALLENGE_SLOTS)
    sock, monitor = dialing(ctx, address)
    return Peer(address, sock, monitor=monitor, slot=slot)


class DialedPeers:
    """The prefillers this decoder dials: the static ``--prefill-peer`` addresses, then those
    discovery reports appearing (dialed) or vanishing (dead from then on, as if silent, and
    closed once no attempt names them). ``peers`` is one list for the messenger's lifetime;
    ``table`` gets an entry for each peer while it is dialed."""

    def __init__(self, ctx: zmq.asyncio.Context, static: list[str],
                 table: PrefillerTable) -> None:
        self.ctx = ctx
        self.table = table
        self.peers: list[Peer] = []
        for address in static:
            self.peers.append(dial(ctx, address, self.peers, len(self.peers) - 1))
            table.add(address)
        self._changes: list[tuple[str, bool]] = []  # (address, appeared) not yet applied
        self._last_slot = len(self.peers) - 1  # challenge slot of the peer dialed last

    def register(self, poller: LoopPoller, peer: Peer) -> None:
        poller.register(peer.sock, zmq.POLLIN)
        poller.register(peer.monitor, zmq.POLLIN)

    async def update(self, appeared: list[str], vanished: list[str]) -> None:
        """Discovery's news, applied by ``apply`` at the messenger's next heartbeat."""
        self._changes += [(a, True) for a in appeared] + [(a, False) for a in vanished]

    def apply(self, poller: LoopPoller, in_use: Callable[[Peer], bool]) -> None:
        """Dial the peers that appeared (their Pongs are checked like a static peer's); those
        that vanished are dead from now on (the heartbeat reports their attempts
        ``peer_dead``), and are closed once ``in_use`` says no attempt names them."""
        for address, appeared in self._changes:
            p = next((p for p in self.peers if p.address == address), None)
            if p is None and appeared:
                p = dial(self.ctx, address, self.peers, self._last_slot)
                self._last_slot = p.slot
                self.peers.append(p)
                self.table.add(address)
                self.register(poller, p)
            elif p is not None and appeared:  # back before it was closed: its Pong revives it
                self.table.appeared(address)
            elif p is not None:
                self.table.vanished(address)
                log.warning("prefiller %s left the peer set; treating it as dead", address)
        self._changes.clear()
        for p in [p for p in self.peers if self.table[p.address].removed and not in_use(p)]:
            self.peers.remove(p)
            self.table.drop(p.address)
            poller.unregister(p.sock)
            poller.unregister(p.monitor)
            close_peer(p)

    def close(self) -> None:
        for p in self.peers:
            close_peer(p)


class Challenges:
    """This decoder's side of the ownership checks its prefillers run: the key each peer's
    challenge writes carry, the offer of its endpoints, and the answers read back from the
    challenge area of the context buffer ``ctx_buf``."""

    def __init__(self, transfer: Any, kv_regions: list[Any], ctx_region: Any,
                 ctx_buf: torch.Tensor) -> None:
        self.transfer = transfer  # disagg.transfer.TransferEngine
        self.kv_regions, self.ctx_region, self.ctx_buf = kv_regions, ctx_region, ctx_buf
        self._enc = msgspec.msgpack.Encoder()

    def key(self, peer: Peer) -> int:
        """The key ``peer``'s next challenge writes carry: expected before any request names
        it (only arrivals after ``expect`` count); a fresh one once it was used or expired."""
        if peer.challenge is None or peer.challenge[1].future.done():
            key = make_key(CHALLENGE_SLOT, new_generation())
            exp = self.transfer.expect(key, CHALLENGE_UNITS, timeout=CHALLENGE_ARMED_S,
                                       standing=True)
            exp.future.add_done_callback(lambda f: f.cancelled() or f.exception())
            peer.challenge = (key, exp)
        return int(peer.challenge[0])

    async def offer(self, peer: Peer) -> None:
        """Offer ``peer`` (just found compatible on this connection) this decoder's endpoints,
        so that it checks ownership before any request waits on it (``OwnershipOffer``)."""
        offer = make_offer(peer, self.transfer, self.kv_regions, self.ctx_region,
                           self.key(peer), time.monotonic())
        with contextlib.suppress(zmq.ZMQError):
            await peer.sock.send(self._enc.encode(offer), zmq.NOBLOCK)

    async def answer(self, peer: Peer, ch: Challenge, abstain: bool) -> None:
        """Read back the nonce ``peer`` wrote into its challenge slot (once it landed, or
        after ``CHALLENGE_WAIT_S``) and send it: proof that this process owns the memory.
        The slot is read even when the wait timed out: a nonce written under a challenge key
        this side had already rotated lands (counted as junk) without completing the wait.
        ``abstain`` (an empty answer): the request named no longer wants KV (aborted; its
        registration may have closed before the nonce could land). Its nonce is read all the
        same and counts as answered: else the next check, under a key whose expectation an
        earlier one completed, would find it in the slot and answer with it (a wrong answer
        that refuses the connection for a while: seen after a prefiller restarted, reading
        requests queued to it that the decoder had aborted meanwhile)."""
        nonce = await self._read_nonce(peer, ch, wait_key=not abstain)
        reply = ChallengeAnswer(ch.id, b"" if abstain else nonce)
        with contextlib.suppress(zmq.ZMQError):
            await peer.sock.send(self._enc.encode(reply), zmq.NOBLOCK)
        if abstain:
            return
        if not ch.request_id:  # the check of our offer: its window is done with
            close_offer(peer)

    async def _read_nonce(self, peer: Peer, ch: Challenge, wait_key: bool) -> bytes:
        """The nonce of ``ch`` in ``peer``'s slot, once it landed (or after the waits),
        recorded as the last one answered. ``wait_key``: first wait for the writes of the
        current challenge key (not for an abstention: its writes may carry an older key, and
        its answer must reach the prefiller within the ownership timeout)."""
        if wait_key and peer.challenge is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.shield(peer.challenge[1].future), CHALLENGE_WAIT_S)
        n = NONCE_BYTES * max(1, min(ch.lanes, MAX_LANES))
        start = nonce_offset(self.ctx_buf.numel(), peer.slot, 0)
        deadline = time.monotonic() + CHALLENGE_WAIT_S
        # the slot still holds the last nonce answered: this check's writes carry a key whose
        # expectation an earlier check completed, and may not have landed yet
        while (nonce := bytes(self.ctx_buf.view(-1)[start:start + n].cpu().numpy().tobytes())
               ) == peer.answered_nonce and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        peer.answered_nonce = nonce
        return nonce


def offer_due(peer: Peer, now: float) -> bool:
    """Whether ``peer`` (alive) should get an ``OwnershipOffer`` now: not yet on this
    connection, or the last one is ``REOFFER_S`` old (its binding would lapse)."""
    return peer.offered_epoch != peer.epoch or now - peer.offered_at > REOFFER_S


def make_offer(peer: Peer, transfer: Any, kv_regions: list[Any], ctx_region: Any, key: int,
               now: float) -> OwnershipOffer:
    """The offer of this decoder's endpoints to ``peer``: a window on the context buffer for
    its check (with per-attempt windows only that: requests get their own; else the shared
    KV descriptors too, which a cuda-ipc prefiller maps once the check passed)."""
    close_offer(peer)
    window = transfer.window(([] if transfer.windows else kv_regions) + [ctx_region])
    peer.offer_window, peer.offered_epoch, peer.offered_at = window, peer.epoch, now
    return OwnershipOffer(window.descriptors[-1].encode(), peer.slot, key,
                          [d.encode() for d in window.descriptors[:-1]])


def new_epoch(peer: Peer) -> None:
    """Its connection went down (the process behind it may be a new one next time): the
    challenge key its requests and offer carried so far is retired with its expectation
    (requests queued meanwhile, read by a new process, name that key: their checks must not
    complete the next one's expectation), and the offer's window closed, so that its next
    Pong gets a fresh offer under a fresh key at once (``offer_due``)."""
    if peer.challenge is not None:
        peer.challenge[1].cancel()
        peer.challenge = None
    close_offer(peer)


def close_offer(peer: Peer) -> None:
    """The offer's check was answered (or never came): revoke its window."""
    if peer.offer_window is not None:
        peer.offer_window.close()
        peer.offer_window = None


def close_peer(peer: Peer) -> None:
    """Close its sockets and stop expecting its challenge writes."""
    if peer.challenge is not None:
        peer.challenge[1].cancel()
    close_offer(peer)
    peer.sock.disable_monitor()
    peer.monitor.close()
    peer.sock.close()
