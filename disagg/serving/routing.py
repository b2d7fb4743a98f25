"""Which decode node gets the next request: the router's pure policy (no sockets, no asyncio).

Load of a peer = requests this router has live on it (exact, updated at once) + the load its
last ``Stats`` showed beyond those (``running + waiting`` minus what this router had in flight
when the snapshot arrived: requests from other clients, held until the next snapshot). The least loaded live peer wins;
ties rotate. A peer is live while its last Stats reply is younger than ``dead_after`` seconds;
one that never answered is not live.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class PeerLoad:
    address: str
    alive: bool = False
    last_reply: float | None = None  # monotonic seconds of the last Stats reply
    running: int = 0  # from the last Stats
    waiting: int = 0  # from the last Stats
    in_flight: int = 0  # requests this router has live on the peer now
    external: int = 0  # at the last Stats: running + waiting not explained by in_flight

    @property
    def load(self) -> int:
        return self.in_flight + self.external


class LoadBalancer:
    def __init__(self, peers: list[str], dead_after: float = 5.0):
        if not peers:
            raise ValueError("the router needs at least one --decode-peer")
        if len(set(peers)) != len(peers):
            raise ValueError(f"--decode-peer given twice: {peers}")
        if dead_after <= 0:
            raise ValueError(f"dead_after must be > 0, got {dead_after}")
        self.peers = {p: PeerLoad(p) for p in peers}
        self.order = list(peers)
        self.dead_after = dead_after
        self._turn = 0

    def on_stats(self, peer: str, running: int, waiting: int, now: float) -> bool:
        """A Stats reply arrived. Returns True when the peer is (again) live because of it."""
        p = self.peers[peer]
        p.running, p.waiting = running, waiting
        p.external = max(0, running + waiting - p.in_flight)
        p.last_reply = now
        revived = not p.alive
        p.alive = True
        return revived

    def check(self, now: float) -> list[str]:
        """Mark peers silent for longer than ``dead_after`` as dead; returns the newly dead."""
        dead = []
        for p in self.peers.values():
            if p.alive and (p.last_reply is None or now - p.last_reply > self.dead_after):
                p.alive = False
                dead.append(p.address)
        return dead

    def pick(self, exclude: set[str] | frozenset[str] = frozenset()) -> str | None:
        """The least loaded live peer not in ``exclude`` (ties rotate), or None."""
        n = len(self.order)
        best: PeerLoad | None = None
        for i in range(n):
            p = self.peers[self.order[(self._turn + i) % n]]
            if p.alive and p.address not in exclude and (best is None or p.load < best.load):
                best = p
        if best is None:
            return None
        self._turn = (self.order.index(best.address) + 1) % n
        return best.address

    def on_start(self, peer: str) -> None:
        self.peers[peer].in_flight += 1

    def on_end(self, peer: str) -> None:
        p = self.peers[peer]
        p.in_flight = max(0, p.in_flight - 1)

    def alive(self) -> list[str]:
        return [a for a in self.order if self.peers[a].alive]
