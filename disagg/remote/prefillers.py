"""A decoder's table of its prefillers: liveness, load and health, in one place (pure: no
sockets, no asyncio, time passed in).

A prefiller is *alive* from a ``Pong`` that finds it compatible (its KV layout and transport
match this decoder's) until it is silent for ``peer_timeout_s``, answers incompatible, or
leaves the peer set (discovery: ``vanished``; a peer that comes back is alive again at its next
Pong). Its *load* is the queued tokens its last Pong reported plus the tokens sent to it since;
the choice weighs it per DP rank (``share``: a ``--dp N`` prefiller serves N queues at once, as
the router counts a node of N ranks as N times the seats).
Its *health* (``disagg.remote.peer_health``) makes it suspect after failed attempts. The choice
among the ``candidates`` is ``disagg.serving.routing.PrefillerChoice``; the decode messenger
feeds the events in and carries the sockets.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from disagg.protocol.peer import KVLayoutDesc
from disagg.remote.peer_health import PeerHealth
from disagg.remote.transfer_plan import incompatibility


@dataclass
class Prefiller:
    """What a decoder knows of one prefiller (by address)."""

    address: str
    alive: bool = False
    last_pong: float = 0.0  # monotonic seconds
    queued_tokens: int = 0  # from its last Pong
    sent_tokens: int = 0  # tokens sent to it since that Pong
    incompatible: str | None = None  # why its last Pong was refused
    layout: KVLayoutDesc | None = None  # from its last Pong: sizes the expected units
    removed: bool = False  # left the peer set (discovery): dead until it comes back
    health: PeerHealth = field(default_factory=PeerHealth)
    ranks: int = 1  # its DP ranks, from its last Pong

    @property
    def load(self) -> int:
        return self.queued_tokens + self.sent_tokens

    @property
    def share(self) -> int:
        """The load one of its DP ranks carries (rounded up: any load counts)."""
        return -(-self.load // self.ranks)


def pong_problem(theirs: KVLayoutDesc, transport: str, ours: KVLayoutDesc,
                 our_transport: str) -> str | None:
    """Why a prefiller that answered with ``theirs`` over ``transport`` cannot serve this
    decoder, or None."""
    if transport != our_transport:
        return f"transport mismatch: prefiller uses {transport}, this decoder {our_transport}"
    return incompatibility(theirs, ours)


class PrefillerTable:
    """The prefillers of one decoder, in the order they were added."""

    def __init__(self, layout: KVLayoutDesc, transport: str, peer_timeout_s: float) -> None:
        self.layout = layout  # this decoder's
        self.transport = transport  # this decoder's transfer transport
        self.peer_timeout_s = peer_timeout_s
        self.entries: dict[str, Prefiller] = {}

    def add(self, address: str) -> Prefiller:
        """A newly dialed prefiller: not alive before its first Pong."""
        p = self.entries[address] = Prefiller(address)
        return p

    def drop(self, address: str) -> None:
        """Forget a prefiller (closed: no attempt names it any more)."""
        self.entries.pop(address, None)

    def __getitem__(self, address: str) -> Prefiller:
        return self.entries[address]

    def __contains__(self, address: str) -> bool:
        return address in self.entries

    def alive(self, address: str) -> bool:
        p = self.entries.get(address)
        return p is not None and p.alive

    def alive_count(self) -> int:
        return sum(p.alive for p in self.entries.values())

    # ------------------------------------------------------------------ events

    def pong(self, address: str, now: float, queued_tokens: int, layout: KVLayoutDesc,
             transport: str, ranks: int = 1) -> str | None:
        """A Pong arrived: its load (over ``ranks`` DP ranks) replaces the last one, and it is
        alive if compatible and still in the peer set. Returns why it is refused when that is
        news (to log), else None."""
        p = self.entries[address]
        p.last_pong = now
        p.queued_tokens, p.sent_tokens, p.ranks = queued_tokens, 0, max(1, ranks)
        why = pong_problem(layout, transport, self.layout, self.transport)
        news = why if why and why != p.incompatible else None
        p.incompatible, p.layout = why, layout
        p.alive = why is None and not p.removed
        return news

    def expire(self, now: float) -> list[str]:
        """Those alive but silent for longer than ``peer_timeout_s``, now dead."""
        dead = [p for p in self.entries.values()
                if p.alive and not p.removed and now - p.last_pong > self.peer_timeout_s]
        for p in dead:
            p.alive = False
        return [p.address for p in dead]

    def vanished(self, address: str) -> None:
        """It left the peer set: dead from now on, as if silent."""
        p = self.entries[address]
        p.removed, p.alive = True, False

    def appeared(self, address: str) -> None:
        """Back in the peer set before it was dropped: its next Pong revives it."""
        self.entries[address].removed = False

    def sent(self, address: str, tokens: int) -> None:
        """A request of ``tokens`` prompt tokens went to it (its load until the next Pong)."""
        self.entries[address].sent_tokens += tokens

    def failed(self, address: str, now: float) -> None:
        """An attempt on it failed (timed out, refused, or it died under it)."""
        if (p := self.entries.get(address)) is not None:
            p.health.failed(now)

    def succeeded(self, address: str) -> None:
        """An attempt's KV landed: its health is clear."""
        if (p := self.entries.get(address)) is not None:
            p.health.succeeded()

    # ------------------------------------------------------------------ choice

    def candidates(self, now: float) -> dict[str, int]:
        """Address -> load per DP rank (``Prefiller.share``) of the live prefillers a request
        may go to: those not suspect, or every live one when all are."""
        live = [p for p in self.entries.values() if p.alive]
        healthy = [p for p in live if not p.health.suspect(now)] or live
        return {p.address: p.share for p in healthy}
