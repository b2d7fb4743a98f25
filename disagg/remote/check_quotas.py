"""Who may start an ownership check at a prefiller now, and what a failed one costs (pure: no
sockets, time passed in).

A check costs the prefiller a nonce source slot and a write towards an endpoint the offerer
names (``disagg.remote.ownership``). So checks under way are bounded in all, per peer
*identity* (the decoder's node key and address with CURVE, else its connection) and per peer
*address*: neither many connections of one peer nor many peers of one host take every slot. A
check that fails costs its identity: it backs off exponentially (``backoff_s`` after the first
failure in a row, doubling up to ``backoff_max_s``; a passed check forgets it), so offers naming
a closed port, or a wrong answer, cannot be repeated at the prefiller's expense. A request
whose check cannot start now waits (``CheckWaits``, in arrival order, first when a check ends);
an offer is dropped (its first request is checked then)."""

from __future__ import annotations

import collections
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Generic, Literal, TypeVar

Outcome = Literal["passed", "failed", "inconclusive"]
K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


@dataclass
class Failures:
    count: int  # failures in a row
    until: float  # no check of the identity starts before this (monotonic)


class CheckQuotas:
    def __init__(self, max_checks: int = 64, per_identity: int = 8, per_address: int = 16,
                 backoff_s: float = 0.5, backoff_max_s: float = 60.0, max_tracked: int = 4096):
        if min(max_checks, per_identity, per_address, max_tracked) < 1:
            raise ValueError("check bounds must be >= 1")
        self.max_checks = max_checks
        self.per_identity = per_identity
        self.per_address = per_address
        self.backoff_s = backoff_s
        self.backoff_max_s = backoff_max_s
        self.max_tracked = max_tracked
        self.under_way = 0
        self.by_identity: collections.Counter[Hashable] = collections.Counter()
        self.by_address: collections.Counter[str] = collections.Counter()
        # identities whose last checks failed, oldest first (bounded: the oldest forgotten)
        self.failures: collections.OrderedDict[Hashable, Failures] = collections.OrderedDict()

    def refusal(self, identity: Hashable, address: str, now: float) -> str | None:
        """Why a check of ``identity`` at ``address`` cannot start now, or None."""
        f = self.failures.get(identity)
        if f is not None and f.until > now:
            return (f"its last {f.count} ownership checks failed: the next may start in "
                    f"{f.until - now:.1f} s")
        if self.under_way >= self.max_checks:
            return "too many ownership checks under way"
        if self.by_identity[identity] >= self.per_identity:
            return "too many ownership checks of this decoder under way"
        if address and self.by_address[address] >= self.per_address:
            return "too many ownership checks from this address under way"
        return None

    def backed_off_until(self, identity: Hashable) -> float:
        f = self.failures.get(identity)
        return 0.0 if f is None else f.until

    def started(self, identity: Hashable, address: str) -> None:
        self.under_way += 1
        self.by_identity[identity] += 1
        if address:
            self.by_address[address] += 1

    def ended(self, identity: Hashable, address: str, outcome: Outcome, now: float) -> None:
        """A check of ``identity`` ended: ``passed`` forgets its failures, ``failed`` backs it
        off once more, ``inconclusive`` (the decoder abstained) changes nothing."""
        self.under_way = max(0, self.under_way - 1)
        _decrement(self.by_identity, identity)
        if address:
            _decrement(self.by_address, address)
        if outcome == "passed":
            self.failures.pop(identity, None)
        elif outcome == "failed":
            f = self.failures.pop(identity, None)
            count = 1 if f is None else f.count + 1
            wait = min(self.backoff_max_s, self.backoff_s * 2.0 ** (count - 1))
            self.failures[identity] = Failures(count, now + wait)
            while len(self.failures) > self.max_tracked:
                self.failures.popitem(last=False)


def _decrement(counter: collections.Counter[K], key: K) -> None:
    counter[key] -= 1
    if counter[key] <= 0:
        del counter[key]


@dataclass
class Waiting(Generic[V]):
    item: V
    deadline: float


class CheckWaits(Generic[K, V]):
    """Checks that could not start yet, one per connection, in arrival order, each with its
    deadline (``expired`` takes out those past it)."""

    def __init__(self) -> None:
        self.entries: collections.OrderedDict[K, Waiting[V]] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self.entries)

    def __contains__(self, conn: object) -> bool:
        return conn in self.entries

    def add(self, conn: K, item: V, deadline: float) -> None:
        if conn not in self.entries:
            self.entries[conn] = Waiting(item, deadline)

    def remove(self, conn: K) -> V | None:
        w = self.entries.pop(conn, None)
        return None if w is None else w.item

    def expired(self, now: float) -> list[tuple[K, V]]:
        out = [(c, w.item) for c, w in self.entries.items() if w.deadline <= now]
        for c, _ in out:
            del self.entries[c]
        return out

    def in_order(self) -> list[tuple[K, V]]:
        return [(c, w.item) for c, w in self.entries.items()]
