"""Pending ``expect`` calls of a receiving engine, shared by every backend.

An :class:`ExpectationTable` pairs the plain :class:`ImmCounter` with the futures waiting on
it. Arrivals nobody expects are junk (``junk``), never an error: immediates come from peers.
Engines call it from two threads: ``expect``/``cancel`` from the asyncio loop, ``arrive``/
``expire``/``fail_all`` from their progress thread; one lock guards both. It never touches a
future itself: it returns ``(future, exception or None)`` events, and the engine hands them to
asyncio through its single door (``call_soon_threadsafe``).
"""

from __future__ import annotations

import asyncio
import collections
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from disagg.fabric.counter import ImmCounter

Event = tuple["asyncio.Future[None]", BaseException | None]


class TransferTimeout(TimeoutError):
    """A batch or an expectation passed its deadline (a peer may have died)."""


class NotPosted(TransferTimeout):
    """A batch that passed its deadline before any of its writes was posted: nothing of it
    can still read its source or land (a provider still connecting, say to a closed port)."""


@dataclass(eq=False)
class Expectation:
    """A pending ``expect``: await it, or ``cancel()`` it to free the immediate value."""

    imm: int
    count: int
    future: asyncio.Future[None]
    _table: ExpectationTable | None = field(default=None, repr=False)
    deadline: float = float("inf")
    standing: bool = False  # armed long before any write is due (a challenge key)

    def cancel(self) -> bool:
        return self._table is not None and self._table.cancel(self)

    def landed(self) -> int | None:
        """Units counted towards it so far while it is pending (None once it is not)."""
        return None if self._table is None else self._table.landed(self)

    def __await__(self) -> Any:
        return self.future.__await__()


JUNK_LOG_S = 10.0  # junk immediates are logged at most this often


class RateLimit:
    """Reports of a growing total, at most one per ``period_s``."""

    def __init__(self, period_s: float) -> None:
        self.period_s = period_s
        self.reported = 0
        self.next_at = float("-inf")

    def due(self, total: int, now: float) -> int:
        """How much ``total`` grew since the last report, if a report is due now; else 0."""
        if total <= self.reported or now < self.next_at:
            return 0
        grew, self.reported, self.next_at = total - self.reported, total, now + self.period_s
        return grew


class ExpectationTable:
    """Immediates counted regardless of order, and who waits for which."""

    def __init__(self, weight_bits: int = 0) -> None:
        self.counter = ImmCounter(weight_bits=weight_bits)
        self._waiting: dict[int, Expectation] = {}
        self._lock = threading.Lock()
        self._junk_log = RateLimit(JUNK_LOG_S)

    def __len__(self) -> int:
        with self._lock:
            return len(self._waiting)

    def urgent(self) -> bool:
        """Whether any pending expectation is not a standing one: writes are due soon, so a
        receiver that must poll for them (no completion fd) keeps its naps short."""
        with self._lock:
            return any(not e.standing for e in self._waiting.values())

    @property
    def junk(self) -> int:
        """Arrivals refused so far: unknown or finished key, zero weight, past the target."""
        return self.counter.junk

    def junk_report(self, now: float) -> str | None:
        """A log line about junk arrived since the last one, at most every ``JUNK_LOG_S``."""
        n = self._junk_log.due(self.counter.junk, now)
        if not n:
            return None
        last = self.counter.last_junk
        return (f"{n} immediates refused as junk (unknown or finished key, or past the expected "
                f"count; last key {last:#x}): a late write, or a stranger on the fabric")

    def expect(self, imm: int, count: int, future: asyncio.Future[None],
               deadline: float, standing: bool = False) -> Expectation:
        """Register, before the sender is told where to write: only arrivals after this count.
        ``standing``: armed ahead of need, with no write due soon (see :meth:`urgent`)."""
        e = Expectation(imm, count, future, self, deadline, standing)
        with self._lock:
            self.counter.expect(imm, count)
            self._waiting[imm] = e
        return e

    def cancel(self, e: Expectation) -> bool:
        """Forget ``e`` (its immediate may be expected afresh); False if it was no longer
        pending (met, expired or cancelled before)."""
        with self._lock:
            if self._waiting.get(e.imm) is not e:
                return False
            del self._waiting[e.imm]
            self.counter.cancel(e.imm)
        if not e.future.done():
            e.future.cancel()
        return True

    def landed(self, e: Expectation) -> int | None:
        """Units counted towards ``e`` so far, or None if it is no longer pending."""
        with self._lock:
            if self._waiting.get(e.imm) is not e:
                return None
            got = self.counter.progress(e.imm)
        return None if got is None else got[0]

    def arrive(self, imms: Iterable[int] | dict[int, int], events: list[Event]) -> None:
        """Count arrivals (a list of immediates, or immediate -> how many); met expectations
        become events."""
        counts = imms if isinstance(imms, dict) else collections.Counter(imms)
        with self._lock:
            for imm, n in counts.items():
                key, weight = self.counter.split(imm)
                if self.counter.arrive(key, weight, n):
                    e = self._waiting.pop(key, None)
                    if e is not None:
                        events.append((e.future, None))

    def expire(self, now: float, events: list[Event]) -> None:
        """Fail every expectation past its deadline with :class:`TransferTimeout`."""
        if not self._waiting:
            return
        with self._lock:
            for e in [e for e in self._waiting.values() if e.deadline <= now]:
                del self._waiting[e.imm]
                got = self.counter.progress(e.imm)
                self.counter.cancel(e.imm)
                events.append((e.future, TransferTimeout(
                    f"expectation imm {e.imm:#x}: {got[0] if got else '?'} of {e.count} "
                    f"units landed before the deadline")))

    def fail_all(self, exc: BaseException) -> list[Event]:
        with self._lock:
            out: list[Event] = [(e.future, exc) for e in self._waiting.values()]
            self._waiting.clear()
        return out
