"""The decode messenger's prefill peers: what it holds per peer and per attempt (``Peer``,
``Wire``), dialing and closing peers as the set changes at run time (``DialedPeers``,
discovery), and the
ownership offer a decoder makes a compatible peer ahead of its requests."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.asyncio

from disagg.actors.sockets import dialing
from disagg.protocol.peer import KVLayoutDesc, OwnershipOffer
from disagg.remote.ownership import CHALLENGE_SLOTS
from disagg.remote.peer_health import PeerHealth

log = logging.getLogger(__name__)

REOFFER_S = 150.0  # an OwnershipOffer is repeated this often (a prefiller's binding: 300 s)
OFFER_WINDOW_S = 30.0  # an offer's window is revoked after this if no check came


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
    removed: bool = False  # left the peer set (discovery): dead for good, closed once unused
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
    expectation: Any
    window: Any  # its registrations (TransferEngine.window): closed once no KV is wanted
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
    closed once no attempt names them). ``peers`` is one list for the messenger's lifetime."""

    def __init__(self, ctx: zmq.asyncio.Context, static: list[str]) -> None:
        self.ctx = ctx
        self.peers: list[Peer] = []
        for address in static:
            self.peers.append(dial(ctx, address, self.peers, len(self.peers) - 1))
        self._changes: list[tuple[str, bool]] = []  # (address, appeared) not yet applied
        self._last_slot = len(self.peers) - 1  # challenge slot of the peer dialed last

    def register(self, poller: zmq.asyncio.Poller, peer: Peer) -> None:
        poller.register(peer.sock, zmq.POLLIN)
        poller.register(peer.monitor, zmq.POLLIN)

    async def update(self, appeared: list[str], vanished: list[str]) -> None:
        """Discovery's news, applied by ``apply`` at the messenger's next heartbeat."""
        self._changes += [(a, True) for a in appeared] + [(a, False) for a in vanished]

    def apply(self, poller: zmq.asyncio.Poller, in_use: Callable[[Peer], bool]) -> None:
        """Dial the peers that appeared (their Pongs are checked like a static peer's); those
        that vanished are dead from now on (the heartbeat reports their attempts
        ``peer_dead``), and are closed once ``in_use`` says no attempt names them."""
        for address, appeared in self._changes:
            p = next((p for p in self.peers if p.address == address), None)
            if p is None and appeared:
                p = dial(self.ctx, address, self.peers, self._last_slot)
                self._last_slot = p.slot
                self.peers.append(p)
                self.register(poller, p)
            elif p is not None:  # one back before it was closed: its next Pong revives it
                p.removed, p.alive = not appeared, p.alive and appeared
                if not appeared:
                    log.warning("prefiller %s left the peer set; treating it as dead", address)
        self._changes.clear()
        for p in [p for p in self.peers if p.removed and not in_use(p)]:
            self.peers.remove(p)
            poller.unregister(p.sock)
            poller.unregister(p.monitor)
            close_peer(p)

    def close(self) -> None:
        for p in self.peers:
            close_peer(p)


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
