"""The choice policies (pure: no sockets, no asyncio): which decode node gets a router's next
request (``LoadBalancer``), and which prefiller a decoder's remote prefill (``PrefillerChoice``,
over the candidates of ``disagg.remote.prefillers.PrefillerTable``).

Load of a peer = requests this router has live on it (exact, updated at once) + the load its
last ``Stats`` showed beyond those (``running + waiting`` minus what this router had in flight
when the snapshot arrived: requests from other clients, held until the next snapshot).

Liveness comes from heartbeats, not from Stats latency: a peer is live while anything it sent
(a ``Pong``, which its frontend answers at once however busy its scheduler is, a Stats reply,
a token) is younger than ``dead_after`` seconds, and dead at once when its connection goes
down (a killed process); one that never answered is not live. A live peer is *chosen* only
while it accepts: not draining (its ``Pong`` or Stats says so) and not refusing (it answered
a heartbeat ``unavailable``: restarting). ``serving()`` is what a request would get, and so
what ``/health`` says.

Prefix-aware: the router remembers (``PrefixIndex``, bounded, least recently used forgotten
first) which peer it last sent each prompt prefix to, in blocks of ``ROUTE_BLOCK`` tokens (or
``ROUTE_BLOCK_CHARS`` characters of a text prompt), chained like the nodes' page hashes from
a root keyed by the request's cache salt (``route_root``). A
request goes to the live peer that got its longest known prefix, that peer's prefix cache
being the likeliest to hold it, unless that peer's load exceeds the least loaded one's by more
than ``max(SLACK_REQUESTS, SLACK_RATIO x least)``: then, as without a known prefix, the least
loaded live peer wins (ties rotate), so one hot prefix cannot pile onto one decoder.

A decoder chooses among its prefillers the same way, by queued prompt tokens rather than
requests (a slack of ``PREFILLER_SLACK_TOKENS``, ties at random), over prefixes of the
encoded prompt it sends (``encoded_prefix_keys``).
"""

from __future__ import annotations

import collections
import hashlib
import random
from array import array
from collections.abc import Callable
from dataclasses import dataclass

ROUTE_BLOCK = 64  # prompt tokens per prefix block
ROUTE_BLOCK_CHARS = 256  # characters per prefix block of a text prompt
ROUTE_BLOCK_BYTES = 128  # bytes per prefix block of encoded ids (decoder -> prefillers)
MAX_ENCODED_BLOCKS = 128  # 16 KiB: 3-5k ids of a 150k vocabulary (3 or 5 bytes each)
MAX_BLOCKS = 64  # leading blocks looked at per request
INDEX_ENTRIES = 1 << 17  # prefix blocks remembered, all peers
SLACK_REQUESTS = 4
SLACK_RATIO = 0.5
PREFILLER_SLACK_TOKENS = 4096  # queue a prefiller holding the prefix may have beyond the least


def route_root(salt: str | None) -> bytes:
    """The seed of a request's chained keys: empty unsalted (the keys as before), else 16
    bytes of its cache salt's digest (keys are 12), so that a salted prefix's keys never
    match an unsalted or differently salted one's (``disagg.serving.salting``)."""
    if salt is None:
        return b""
    return hashlib.blake2b(salt.encode(), digest_size=16, person=b"disagg.route").digest()


def prefix_keys(token_ids: list[int] | None, text: str | None,
                salt: str | None = None) -> list[bytes]:
    """Chained keys of the request's leading full blocks (token ids, else text), seeded by
    its cache ``salt``."""
    if token_ids is not None:
        n = min(len(token_ids) // ROUTE_BLOCK, MAX_BLOCKS)
        ids = memoryview(array("q", token_ids[:n * ROUTE_BLOCK])).cast("B")  # one conversion
        return _chain(ids, ROUTE_BLOCK * 8, root=route_root(salt))
    if text is not None:
        return _chain(memoryview(text.encode()), ROUTE_BLOCK_CHARS, root=route_root(salt))
    return []


def encoded_prefix_keys(encoded: bytes | memoryview, salt: str | None = None) -> list[bytes]:
    """Chained keys of the leading full ``ROUTE_BLOCK_BYTES`` blocks of a msgpack array of
    token ids past its header: a decoder's keys for its prefillers, from the bytes it sends them
    (converting the ids to hash them costs a 4k-token prefix ~0.12 ms more on the 2-core box).
    Equal id prefixes give equal bytes, so equal keys; a block may end inside an id (a hint then
    claims part of one id too many). Seeded by the request's cache ``salt``, like
    ``prefix_keys``."""
    data = memoryview(encoded)
    if not data:
        return []
    first = data[0]
    head = 1 if first < 0xdc else 3 if first == 0xdc else 5  # fixarray, array16, array32
    return _chain(data[head:], ROUTE_BLOCK_BYTES, MAX_ENCODED_BLOCKS, route_root(salt))


def _chain(data: memoryview, block: int, most: int = MAX_BLOCKS, root: bytes = b"") -> list[bytes]:
    keys: list[bytes] = []
    h = root
    for i in range(min(len(data) // block, most)):
        h = hashlib.blake2b(h + data[i * block:(i + 1) * block], digest_size=12).digest()
        keys.append(h)
    return keys


class PrefixIndex:
    """Which peer each prefix block was last sent to (approximate: bounded LRU)."""

    def __init__(self, capacity: int = INDEX_ENTRIES):
        self.capacity = capacity
        self._peer: collections.OrderedDict[bytes, str] = collections.OrderedDict()

    def longest(self, keys: list[bytes]) -> list[tuple[int, str]]:
        """(blocks matched, peer) for every peer holding a leading run of ``keys``, longest
        first (a block's entry names the peer it went to last)."""
        found: dict[str, int] = {}
        for i, k in enumerate(keys):
            peer = self._peer.get(k)
            if peer is None:
                break
            found[peer] = i + 1
        return sorted(((n, p) for p, n in found.items()), reverse=True)

    def record(self, keys: list[bytes], peer: str) -> None:
        for k in keys:
            self._peer[k] = peer
            self._peer.move_to_end(k)
        while len(self._peer) > self.capacity:
            self._peer.popitem(last=False)

    def __len__(self) -> int:
        return len(self._peer)

    def prefer(self, keys: list[bytes], least: str, load: dict[str, int],
               slack: int) -> str:
        """The peer for a request with prefix ``keys`` among the candidates of ``load``
        (``least`` has the lowest): the one that got its longest known prefix while its load
        is within ``max(slack, SLACK_RATIO x least's)`` of the least's, else ``least``. The
        choice is recorded for the prefix."""
        bound = load[least] + max(slack, int(SLACK_RATIO * load[least]))
        chosen = least
        for _, peer in self.longest(keys):
            if peer in load and load[peer] <= bound:
                chosen = peer
                break
        if keys:
            self.record(keys, chosen)
        return chosen


@dataclass
class PeerLoad:
    address: str
    alive: bool = False
    last_reply: float | None = None  # monotonic seconds of the last thing it sent
    accepting: bool = True  # not draining, not refusing heartbeats (restarting)
    stats_asked: float | None = None  # a Stats request of ours not answered yet, since
    running: int = 0  # from the last Stats
    waiting: int = 0  # from the last Stats
    in_flight: int = 0  # requests this router has live on the peer now
    external: int = 0  # at the last Stats: running + waiting not explained by in_flight
    ranks: int = 1  # DP attention ranks (Stats.dp_ranks; 1 without --dp), each its own batch

    @property
    def load(self) -> int:
        return self.in_flight + self.external

    @property
    def share(self) -> float:
        """The load one of its DP ranks carries (a node of N ranks takes N times the
        requests of a one-rank node before it counts as busier)."""
        return self.load / self.ranks


class LoadBalancer:
    """The peers' loads and liveness; ``dynamic``: peers come and go (``add`` / ``remove``,
    discovery), so the set may start empty."""

    def __init__(self, peers: list[str], dead_after: float = 5.0, dynamic: bool = False):
        if not peers and not dynamic:
            raise ValueError("the router needs at least one --decode-peer")
        if len(set(peers)) != len(peers):
            raise ValueError(f"--decode-peer given twice: {peers}")
        if dead_after <= 0:
            raise ValueError(f"dead_after must be > 0, got {dead_after}")
        self.peers = {p: PeerLoad(p) for p in peers}
        self.order = list(peers)
        self.dead_after = dead_after
        self._turn = 0
        self.index = PrefixIndex()
        self.prefix_routed = 0  # requests sent to the peer of their known prefix

    def on_stats(self, peer: str, running: int, waiting: int, now: float,
                 draining: bool = False, ranks: int = 1) -> bool:
        """A Stats reply arrived (its loads; ``draining``: the node's; ``ranks``: its DP
        attention ranks). Returns True when the peer is (again) live because of it."""
        p = self.peers[peer]
        p.running, p.waiting, p.ranks = running, waiting, max(1, ranks)
        p.external = max(0, running + waiting - p.in_flight)
        p.stats_asked = None
        if draining:
            p.accepting = False
        return self.on_heard(peer, now)

    def on_heard(self, peer: str, now: float) -> bool:
        """Anything arrived from ``peer``: it is live. True when it is (again) live because of it."""
        p = self.peers[peer]
        p.last_reply = now
        revived = not p.alive
        p.alive = True
        return revived

    def on_pong(self, peer: str, draining: bool, now: float) -> bool:
        """A heartbeat's answer: live, and accepting unless ``draining``. True when revived."""
        self.peers[peer].accepting = not draining
        return self.on_heard(peer, now)

    def on_refused(self, peer: str, now: float) -> bool:
        """A heartbeat answered ``unavailable`` (the node restarts): live, not chosen until a
        ``Pong``. True when revived."""
        self.peers[peer].accepting = False
        return self.on_heard(peer, now)

    def on_down(self, peer: str) -> bool:
        """``peer``'s connection went down (its process is gone, and with it what it held of
        ours): dead at once. True when it was live."""
        p = self.peers.get(peer)
        if p is None or not p.alive:
            return False
        p.alive = False
        return True

    def stats_due(self, peer: str, now: float) -> bool:
        """Whether to ask ``peer`` for Stats now: none of ours is unanswered (a busy node answers
        them between steps; they are not piled up), or the last was asked ``dead_after`` ago.
        Marks it asked."""
        p = self.peers[peer]
        if p.stats_asked is not None and now - p.stats_asked < self.dead_after:
            return False
        p.stats_asked = now
        return True

    def check(self, now: float) -> list[str]:
        """Mark peers silent for longer than ``dead_after`` as dead; returns the newly dead."""
        dead = []
        for p in self.peers.values():
            if p.alive and (p.last_reply is None or now - p.last_reply > self.dead_after):
                p.alive = False
                dead.append(p.address)
        return dead

    def chosen(self, p: PeerLoad) -> bool:
        """Whether ``p`` may get new requests: live and accepting."""
        return p.alive and p.accepting

    def pick(self, exclude: set[str] | frozenset[str] = frozenset(),
             keys: list[bytes] | None = None) -> str | None:
        """The live peer not in ``exclude`` for a request with prefix ``keys``: the one that
        got its longest known prefix unless that one is too loaded, else the least loaded
        (ties rotate); None if none is live. The choice is recorded for the prefix."""
        least = self._least(exclude)
        if least is None:
            return None
        load = {a: -(-p.load // p.ranks) for a, p in self.peers.items()  # per DP rank
                if self.chosen(p) and a not in exclude}
        chosen = self.index.prefer(keys or [], least, load, SLACK_REQUESTS)
        self.prefix_routed += chosen != least
        return chosen

    def _least(self, exclude: set[str] | frozenset[str]) -> str | None:
        """The least loaded live peer not in ``exclude`` (ties rotate), or None."""
        n = len(self.order)
        best: PeerLoad | None = None
        for i in range(n):
            p = self.peers[self.order[(self._turn + i) % n]]
            if self.chosen(p) and p.address not in exclude and (best is None
                                                                 or p.share < best.share):
                best = p
        if best is None:
            return None
        self._turn = (self.order.index(best.address) + 1) % n
        return best.address

    def place(self, tried: set[str] | frozenset[str], keys: list[bytes] | None = None
              ) -> str | None:
        """The peer for a request that went to ``tried`` before: one it has not tried if any
        is live, else any live one (``pick``); None if none is live."""
        return self.pick(tried, keys) or self.pick(frozenset(), keys)

    def vanished(self, peer: str) -> None:
        """``peer`` left the peer set: dead at once (then its requests are moved or ended,
        and it is removed)."""
        self.peers[peer].alive = False

    def add(self, peer: str) -> bool:
        """A new peer (not live before its first Stats); False if it is known already."""
        if peer in self.peers:
            return False
        self.peers[peer] = PeerLoad(peer)
        self.order.append(peer)
        return True

    def remove(self, peer: str) -> None:
        """Forget ``peer`` (its requests must have been moved or ended first)."""
        if self.peers.pop(peer, None) is not None:
            self.order.remove(peer)

    def on_start(self, peer: str) -> None:
        self.peers[peer].in_flight += 1

    def on_end(self, peer: str) -> None:
        p = self.peers.get(peer)
        if p is not None:
            p.in_flight = max(0, p.in_flight - 1)

    def alive(self) -> list[str]:
        return [a for a in self.order if self.peers[a].alive]

    def serving(self) -> list[str]:
        """The peers a new request may go to now (live and accepting): none means a request
        gets ``unavailable``, and ``/health`` a 503."""
        return [a for a in self.order if self.chosen(self.peers[a])]


class PrefillerChoice:
    """A decoder's choice of prefiller for each remote prefill, remembering which one got
    each prompt prefix last."""

    def __init__(self, tiebreak: Callable[[], float] = random.random) -> None:
        self.index = PrefixIndex()  # which prefiller got each prompt prefix last
        self.tiebreak = tiebreak  # orders prefillers of equal load

    def pick(self, loads: dict[str, int], keys: list[bytes] | None = None) -> str | None:
        """Among the candidates of ``loads`` (address -> queued tokens), the one that got the
        longest known prefix of ``keys`` (its prefix cache likely holds it) unless its queue
        exceeds the shortest by more than ``PREFILLER_SLACK_TOKENS`` (or half of it), else the
        one with the fewest queued tokens (ties at random); None without candidates. The
        choice is recorded for the prefix."""
        if not loads:
            return None
        least = min(loads, key=lambda a: (loads[a], self.tiebreak()))
        return self.index.prefer(keys or [], least, loads, PREFILLER_SLACK_TOKENS)
