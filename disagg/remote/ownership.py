"""Proof that a decoder owns the memory it asks a prefiller to write into (pure bookkeeping).

A PrefillRequest names fabric endpoints (the lanes of its descriptors) that the prefiller will
write into. Before its first write to an endpoint named by a peer connection, the prefiller
checks that this connection owns it, by challenge:

1. it writes a random nonce (``NONCE_BYTES`` per lane) through each lane of the request's
   context descriptor into that descriptor's *challenge area*: the last ``CHALLENGE_AREA_BYTES``
   of the context buffer, never a context slot (a decoder keeps them out of its slots), at the
   request's ``challenge_slot``; every write carries the request's ``challenge_key`` with
   weights summing to ``CHALLENGE_UNITS``, which the decoder expects beforehand;
2. once the writes completed at the source it sends ``Challenge(id, lanes)`` on the connection;
3. the decoder waits for those units to land, reads the area and answers
   ``ChallengeAnswer(id, nonce)``.

Registrations grant remote write only, so only a process that can read the endpoint's memory,
the one that owns the endpoint, can answer; a connection naming another process's endpoint
gets ``PrefillFailed bad_request`` and no write of its requests is ever posted. Verified
(connection, endpoint address) bindings are cached for ``ttl_s``; the messenger forgets a
connection's when it goes down.
"""

from __future__ import annotations

import hmac
import itertools
import secrets
from dataclasses import dataclass, field
from typing import Any

from disagg.fabric.lanes import lanes_of
from disagg.fabric.topology import MAX_LANES

NONCE_BYTES = 16
CHALLENGE_SLOTS = 64  # challenge slots in a decoder's area (one per prefiller it talks to)
SLOT_BYTES = NONCE_BYTES * MAX_LANES
CHALLENGE_AREA_BYTES = CHALLENGE_SLOTS * SLOT_BYTES  # at the end of the context buffer
CHALLENGE_UNITS = MAX_LANES  # units one challenge's writes carry in all, whatever the lanes

Conn = tuple[bytes, Any]  # (ROUTER identity, the connection's fd or None)


def area_rows(row_bytes: int) -> int:
    """Context-buffer rows a decoder adds (after its slots) to hold the challenge area."""
    return -(-CHALLENGE_AREA_BYTES // row_bytes)


def nonce_offset(ctx_length: int, slot: int, lane: int) -> int:
    """Byte offset, in a context buffer of ``ctx_length`` bytes, of one lane's nonce."""
    return ctx_length - CHALLENGE_AREA_BYTES + slot * SLOT_BYTES + lane * NONCE_BYTES


def lane_weights(lanes: int) -> list[int]:
    """Units carried by the nonce write of each of ``lanes`` lanes: ``CHALLENGE_UNITS`` in all,
    at least one each, so the decoder's expectation does not depend on the lane count."""
    if not 1 <= lanes <= MAX_LANES:
        raise ValueError(f"1..{MAX_LANES} lanes, got {lanes}")
    q, r = divmod(CHALLENGE_UNITS, lanes)
    return [q + (i < r) for i in range(lanes)]


def endpoints(kv: list[Any], ctx: Any, own_lanes: int) -> tuple[list[Any], str | None]:
    """The lanes of ``ctx`` a challenge writes through (those this sender writes to), and why
    the request cannot be checked (a KV lane on an endpoint those lanes are not on), or None."""
    ctx_lanes = lanes_of(ctx)[:own_lanes]
    addresses = {d.address for d in ctx_lanes}
    for d in kv:
        if any(lane.address not in addresses for lane in lanes_of(d)[:own_lanes]):
            return ctx_lanes, "KV descriptor on an endpoint the context descriptor is not on"
    return ctx_lanes, None


@dataclass
class Check:
    """One challenge under way on a connection."""

    id: int
    conn: Conn
    addresses: frozenset[bytes]
    nonce: bytes = field(repr=False)


class OwnershipBook:
    """Which endpoint addresses each peer connection proved it owns, which it failed to (not
    asked again for ``retry_s``), and the one check under way per connection."""

    def __init__(self, ttl_s: float = 300.0, retry_s: float = 10.0, max_conns: int = 4096):
        self.ttl_s = ttl_s
        self.retry_s = retry_s
        self.max_conns = max_conns
        self.owned: dict[Conn, dict[bytes, float]] = {}  # conn -> address -> valid until
        self.refused: dict[Conn, dict[bytes, float]] = {}  # conn -> address -> refused until
        self.checks: dict[Conn, Check] = {}
        self._ids = itertools.count(secrets.randbits(31))

    def status(self, conn: Conn, addresses: frozenset[bytes], now: float) -> str:
        """``owned`` (every address verified), ``refused`` (one failed lately) or ``unknown``."""
        refused = self.refused.get(conn, {})
        if any(refused.get(a, 0.0) > now for a in addresses):
            return "refused"
        owned = self.owned.get(conn, {})
        return "owned" if all(owned.get(a, 0.0) > now for a in addresses) else "unknown"

    def start(self, conn: Conn, addresses: frozenset[bytes], lanes: int) -> Check:
        """A new check of ``addresses`` with a fresh nonce of ``lanes`` lanes."""
        if conn in self.checks:
            raise KeyError("a check is already under way on this connection")
        check = Check(next(self._ids) & 0x7FFFFFFF, conn, addresses,
                      secrets.token_bytes(NONCE_BYTES * lanes))
        self.checks[conn] = check
        return check

    def answered(self, check: Check, answer: bytes | None, now: float,
                 remember_failure: bool = True) -> bool:
        """End ``check`` with the peer's ``answer`` (None: none came); True if it proves
        ownership. A failure is remembered for ``retry_s`` unless ``remember_failure`` is off."""
        if self.checks.get(check.conn) is check:
            del self.checks[check.conn]
        ok = answer is not None and hmac.compare_digest(answer, check.nonce)
        book = self.owned if ok else self.refused
        if not ok and not remember_failure:
            return False
        if check.conn not in book and len(book) >= self.max_conns:
            book.pop(next(iter(book)))  # the oldest connection's bindings: re-checked if needed
        entries = book.setdefault(check.conn, {})
        until = now + (self.ttl_s if ok else self.retry_s)
        for a in check.addresses:
            entries[a] = until
        return ok

    def forget(self, fd: Any) -> list[Conn]:
        """The connection on ``fd`` went down: drop its bindings; returns its conns."""
        gone = {c for book in (self.owned, self.refused, self.checks) for c in book if c[1] == fd}
        for c in gone:
            self.owned.pop(c, None)
            self.refused.pop(c, None)
            self.checks.pop(c, None)
        return list(gone)


class NonceSlots:
    """Source slots for nonces. A slot whose write did not complete may still be read by the
    provider later (a write posted towards an endpoint that never answers): it is not reused
    for ``quarantine_s``, so a late send can never carry another check's nonce."""

    def __init__(self, n: int, quarantine_s: float = 600.0):
        self.free = list(range(n - 1, -1, -1))
        self.quarantined: dict[int, float] = {}
        self.quarantine_s = quarantine_s

    def take(self, now: float) -> int | None:
        for s, until in list(self.quarantined.items()):
            if until <= now:
                del self.quarantined[s]
                self.free.append(s)
        return self.free.pop() if self.free else None

    def give(self, slot: int, completed: bool, now: float) -> None:
        if completed:
            self.free.append(slot)
        else:
            self.quarantined[slot] = now + self.quarantine_s
