"""The decode messenger's prefill peers: what it holds per peer and per attempt (``Peer``,
``Wire``), and dialing and closing peers as the set changes at run time (discovery)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import zmq.asyncio

from disagg.actors.sockets import dialing
from disagg.protocol.peer import KVLayoutDesc
from disagg.remote.ownership import CHALLENGE_SLOTS
from disagg.remote.peer_health import PeerHealth


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


def close_peer(peer: Peer) -> None:
    """Close its sockets and stop expecting its challenge writes."""
    if peer.challenge is not None:
        peer.challenge[1].cancel()
    peer.sock.disable_monitor()
    peer.monitor.close()
    peer.sock.close()
