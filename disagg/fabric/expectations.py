"""Pending ``expect`` calls of a receiving engine, shared by every backend.

An :class:`ExpectationTable` pairs the plain :class:`ImmCounter` with the futures waiting on
it. Engines call it from two threads: ``expect``/``cancel`` from the asyncio loop, ``arrive``/
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


@dataclass(eq=False)
class Expectation:
    """A pending ``expect``: await it, or ``cancel()`` it to free the immediate value."""

    imm: int
    count: int
    future: asyncio.Future[None]
    _table: ExpectationTable | None = field(default=None, repr=False)
    deadline: float = float("inf")

    def cancel(self) -> bool:
        return self._table is not None and self._table.cancel(self)

    def landed(self) -> int | None:
        """Units counted towards it so far while it is pending (None once it is not)."""
        return None if self._table is None else self._table.landed(self)

    def __await__(self) -> Any:
        return self.future.__await__()


class ExpectationTable:
    """Immediates counted regardless of order, and who waits for which."""

    def __init__(self, weight_bits: int = 0) -> None:
        self.counter = ImmCounter(weight_bits=weight_bits)
        self._waiting: dict[int, Expectation] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            return len(self._waiting)

    def expect(self, imm: int, count: int, future: asyncio.Future[None],
               deadline: float) -> Expectation:
        """Register; the future is resolved here if early arrivals already met the count."""
        e = Expectation(imm, count, future, self, deadline)
        with self._lock:
            if self.counter.expect(imm, count):
                future.set_result(None)
                return e
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
                key, units = self.counter.split(imm, n)
                if self.counter.arrive(key, units):
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
