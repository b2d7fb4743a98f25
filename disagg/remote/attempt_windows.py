"""How long a decode attempt's window stays open: its fresh registrations of the decoder's
KV and context memory (``TransferEngine.window``), whose keys its ``PrefillRequest`` carries.

A window is revoked when nothing of its attempt can land any more, not when its KV stops
being wanted. The prefiller may already have writes of it on their way when the decoder gives
up (a client abort, a timeout, a migration); one that arrives under a revoked key makes
libfabric 1.17's tcp receiver drop the whole connection it came on, and with it every other
job's writes behind it (``transfer_failed`` for innocent requests). So a window of an attempt
no longer wanted is kept exactly as long as the decode machine (``disagg.remote.decode``)
fences its pages: late writes land in pages nobody else holds. It is revoked when

- its KV landed (the messenger forgets it as its pages become the sequence's): as ever;
- its prefiller says nothing more will be written (``AbortAck``, ``PrefillFailed``, a
  ``PrefillDone`` of an attempt no longer wanted) or the connection it went out on went down:
  revoked before the scheduler hears of it, so before its pages go back to the pool;
- the decode machine lets its pages go (``Forget``: acknowledged, or its fence's deadline,
  the attempt's cap + ``DEADLINE_GRACE_S``, passed);
- at the latest ``revoke_by`` (the cap + the grace from when the request went out, a moment
  after the machine's own fence deadline), whatever else happened: nothing leaks.

At most one window per attempt the messenger holds, and it holds an attempt only while it
lends it a context slot (``max_slots``: twice ``--max-running``): a bounded count. Pure: time
is passed in.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


class Revocable(Protocol):
    def close(self) -> None: ...


@dataclass
class _Open:
    window: Revocable
    revoke_by: float
    wanted: bool = True


class AttemptWindows:
    """The open windows of one decoder's attempts, by request id."""

    def __init__(self) -> None:
        self._open: dict[str, _Open] = {}

    def __len__(self) -> int:
        return len(self._open)

    def open(self, request_id: str, window: Revocable, revoke_by: float) -> None:
        """The window of a new attempt; revoked by ``revoke_by`` (monotonic) at the latest."""
        assert request_id not in self._open, f"attempt {request_id} already has a window"
        self._open[request_id] = _Open(window, revoke_by)

    def stop(self, request_id: str) -> None:
        """Its KV is no longer wanted: the window stays open (fenced pages take its late
        writes) until the attempt settles."""
        if (e := self._open.get(request_id)) is not None:
            e.wanted = False

    def settled(self, request_id: str, done: bool = False) -> bool:
        """Its prefiller will write nothing more of it: revoke (True if it was open). Not for
        ``done`` of an attempt still wanted: done at the source is not delivery, its KV landing
        ends it."""
        e = self._open.get(request_id)
        if e is None or (done and e.wanted):
            return False
        return self.revoke(request_id)

    def revoke(self, request_id: str) -> bool:
        """Close its window now (True if it was open)."""
        e = self._open.pop(request_id, None)
        if e is None:
            return False
        e.window.close()
        return True

    def expire(self, now: float) -> list[str]:
        """Revoke every window past its ``revoke_by``; their request ids."""
        late = [rid for rid, e in self._open.items() if now >= e.revoke_by]
        for rid in late:
            self.revoke(rid)
        return late

    def is_open(self, request_id: str) -> bool:
        return request_id in self._open

    def kept(self) -> int:
        """Windows kept open for attempts whose KV is no longer wanted."""
        return sum(not e.wanted for e in self._open.values())
