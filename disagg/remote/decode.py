"""The decode side of remote prefill: one pure state machine for every remote request.

A request a prefiller fills goes ``QUEUED`` (admitted, no pages yet) -> ``SENT`` (pages taken,
an attempt in flight) -> one outcome: ``Ready`` (its KV landed: the pages become the sequence's),
``Local`` (prefill it here), ``Fail`` (an error to the client), or it is cancelled by the
scheduler (the request ended). An attempt goes::

    WAITING --landed--------------------------------------------> (gone: Ready)
    WAITING --refused / failed by the prefiller-----------------> (settled)
    WAITING --timeout | cancel----> DRAINING --ack / done / failed / conn down--> (settled)
    WAITING --peer dead-----------> FENCED
                                    DRAINING --peer dead | no ack in peer timeout--> FENCED
                                    FENCED --ack / done / failed / conn down / deadline--> (gone)

The retry rule (``--on-prefill-failure retry``): a request gets at most ``MAX_ATTEMPTS`` (2)
attempts. An attempt whose failure was acknowledged (nothing of it can land any more) is
retried at once on the same pages; an attempt that had to be fenced (its prefiller does not
answer) leaves its pages fenced and the retry waits at the head of the queue for new pages.
Every page reserved for a remote request belongs to this machine until ``Ready`` hands it to
the sequence or ``Free`` returns it to the pool, which happens only once no write of any
attempt can reach it. Time is passed in (monotonic seconds); nothing here sleeps or sends.
"""

from __future__ import annotations

import collections
import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from disagg.protocol.inproc import AttemptEventKind
from disagg.remote.deadlines import DEADLINE_GRACE_S, ProgressDeadline, prefill_cap_s
from disagg.remote.transfer_plan import make_key

MAX_ATTEMPTS = 2  # --on-prefill-failure retry: the first attempt and one retry

OnFailure = Literal["error", "retry", "local"]


class AttemptState(enum.Enum):
    WAITING = "waiting"  # its KV is wanted; the prefiller may write
    DRAINING = "draining"  # KV no longer wanted; abort sent, waiting for an acknowledgement
    FENCED = "fenced"  # the request moved on; its pages stay out of the pool until released


# ---------------------------------------------------------------- commands (what to do)


@dataclass(frozen=True)
class Send:
    """Messenger: send the prefill request of ``slot`` under ``request_id`` / ``key``, asking
    for writes into ``pages`` (all of the request's pages; the prompt's lead ones are named)."""

    slot: int
    request_id: str
    key: int
    pages: tuple[int, ...]
    cap_s: float  # its absolute budget (the prefiller gets it as deadline_unix)


@dataclass(frozen=True)
class Abort:
    """Messenger: stop wanting the KV of ``request_id`` (close its window, cancel its wait) and
    ask its prefiller to stop; ``blame``: count it against the prefiller's health."""

    request_id: str
    blame: bool


@dataclass(frozen=True)
class Forget:
    """Messenger: nothing of ``request_id`` can land any more; drop what it holds for it."""

    request_id: str


@dataclass(frozen=True)
class Ready:
    """Scheduler: the KV of ``slot`` landed in ``pages``: decode it from here."""

    slot: int
    pages: tuple[int, ...]


@dataclass(frozen=True)
class Local:
    """Scheduler: prefill ``slot`` on this node (it holds no page of the machine any more)."""

    slot: int
    why: str


@dataclass(frozen=True)
class Fail:
    """Scheduler: end ``slot`` with an error (it holds no page of the machine any more)."""

    slot: int
    code: Literal["timeout", "prefill_failed"]
    message: str


@dataclass(frozen=True)
class Free:
    """Scheduler: these pages go back to the pool (no write can reach them any more)."""

    pages: tuple[int, ...]


Command = Send | Abort | Forget | Ready | Local | Fail | Free


# ---------------------------------------------------------------- state


@dataclass
class Attempt:
    slot: int
    generation: int
    pages: tuple[int, ...]
    clock: ProgressDeadline  # WAITING: idle deadline pushed by progress, under the cap
    fence_until: float  # no write of it can land after this (cap + grace)
    state: AttemptState = AttemptState.WAITING
    drain_until: float = 0.0  # DRAINING: when to stop waiting for an acknowledgement
    failure: tuple[str, str] | None = None  # why its KV stopped being wanted
    orphan: bool = False  # its request ended or moved on; only its pages are left

    @property
    def request_id(self) -> str:
        return f"{self.slot}.{self.generation}"


@dataclass
class Remote:
    slot: int
    tokens: int  # prompt tokens the prefiller computes (all but the last)
    pages_wanted: int  # the whole prompt's pages (the side takes cached ones among them)
    queue_until: float  # a request still queued past this ends with ``timeout``
    attempts: int = 0  # started so far
    attempt: Attempt | None = None  # the attempt whose KV is wanted (None: queued)


@dataclass(frozen=True)
class Policy:
    on_failure: OnFailure = "error"
    idle_timeout_s: float = 60.0  # --prefill-timeout
    peer_timeout_s: float = 5.0  # an abort unacknowledged this long fences the pages
    queue_timeout_s: float = 600.0  # --queue-timeout

    @property
    def max_attempts(self) -> int:
        return MAX_ATTEMPTS if self.on_failure == "retry" else 1


@dataclass
class DecodeRemote:
    """Every remote request of a decode node and every attempt whose writes may still land."""

    policy: Policy
    new_generation: Callable[[], int]  # random, unguessable (transfer_plan.new_generation)
    peers_alive: int = 0
    queue: collections.deque[int] = field(default_factory=collections.deque)  # slots, no pages
    requests: dict[int, Remote] = field(default_factory=dict)  # slot -> request
    attempts: dict[str, Attempt] = field(default_factory=dict)  # request id -> attempt

    # ------------------------------------------------------------ requests

    def admit(self, slot: int, tokens: int, pages_wanted: int, now: float) -> None:
        """Queue a request for remote prefill (the caller decided it wants one)."""
        assert slot not in self.requests, f"slot {slot} is already remote"
        self.requests[slot] = Remote(slot, tokens, pages_wanted,
                                     now + self.policy.queue_timeout_s)
        self.queue.append(slot)

    def head(self) -> tuple[int, int] | None:
        """(slot, pages its prompt covers) of the request that gets pages next, or None. A
        queued request holds no page: the caller reserves its cached and new pages at once."""
        if not self.queue:
            return None
        r = self.requests[self.queue[0]]
        return r.slot, r.pages_wanted

    def reserved(self, slot: int, pages: list[int], now: float) -> list[Command]:
        """The head request got its pages: start its first attempt (or its retry)."""
        assert self.queue and self.queue[0] == slot, "pages go to the head of the queue"
        self.queue.popleft()
        return self._start(self.requests[slot], tuple(pages), now)

    def cancel(self, slot: int, now: float) -> list[Command]:
        """The request ended on this side (client abort, disconnect, shutdown)."""
        r = self.requests.pop(slot, None)
        if r is None:
            return []
        if r.attempt is None:
            self.queue.remove(slot)
            return []
        a, r.attempt = r.attempt, None
        a.orphan = True
        if a.state is AttemptState.WAITING:
            return self._drain(a, ("cancelled", "the request ended"), now, blame=False)
        return []

    def set_peers_alive(self, n: int) -> list[Command]:
        """Live compatible prefillers; with none, queued requests are prefilled here."""
        self.peers_alive = n
        out: list[Command] = []
        if n == 0:
            while self.queue:
                slot = self.queue.popleft()
                del self.requests[slot]
                out.append(Local(slot, "no prefiller is alive"))
        return out

    # ------------------------------------------------------------ events of an attempt

    def event(self, request_id: str, kind: AttemptEventKind, now: float, code: str = "",
              message: str = "") -> list[Command]:
        """Something the messenger saw about an attempt: its KV ``landed``; ``progress``
        (units landed, or the prefiller computed for it); the prefiller ``failed`` it (or it
        could not be sent: code ``no_prefiller``); its ``done`` or ``acked`` (nothing more of
        it will be written); its prefiller declared dead (``peer_dead``); the connection it
        went out on went down (``conn_down``: the process is gone)."""
        a = self.attempts.get(request_id)
        if a is None:
            return []  # late news of an attempt that is over
        if kind == "progress":
            if a.state is AttemptState.WAITING:
                a.clock.progress(now)
            return []
        if kind == "landed":
            if a.state is not AttemptState.WAITING:
                return []
            r = self._owner(a)
            del self.attempts[request_id]
            if r is not None:
                r.attempt = None
                del self.requests[r.slot]
            return [Forget(request_id), Ready(a.slot, a.pages)]
        if kind == "peer_dead":
            if a.state is AttemptState.WAITING:
                out = self._drain(a, ("prefiller_dead", message or "its prefiller died"), now,
                                  blame=True)
                return out + self._fence(a, now)
            if a.state is AttemptState.DRAINING:
                return self._fence(a, now)
            return []
        if kind == "done" and a.state is AttemptState.WAITING:
            return []  # the writes completed at the source; their arrival completes it here
        if kind == "conn_down" and a.state is AttemptState.WAITING:
            return []  # ZeroMQ reconnects; the peer's liveness decides
        # failed / done / acked / conn_down: nothing of the attempt can land any more
        failure = (code or "prefill_failed", message) if kind == "failed" else None
        return self._settled(a, failure, now)

    # ------------------------------------------------------------ time

    def next_deadline(self) -> float | None:
        times = [a.clock.expires_at for a in self.attempts.values()
                 if a.state is AttemptState.WAITING]
        times += [a.drain_until for a in self.attempts.values()
                  if a.state is AttemptState.DRAINING]
        times += [a.fence_until for a in self.attempts.values()]
        if self.queue:
            times.append(self.requests[self.queue[0]].queue_until)
        return min(times) if times else None

    def expire(self, now: float) -> list[Command]:
        """Apply every deadline passed by ``now``: queued too long (``Fail`` timeout), no
        progress or past the cap (drain), no acknowledgement (fence), past the fence."""
        out: list[Command] = []
        while self.queue and self.requests[self.queue[0]].queue_until <= now:
            slot = self.queue.popleft()
            del self.requests[slot]
            out.append(Fail(slot, "timeout", f"the request waited "
                            f"{self.policy.queue_timeout_s:g}s without starting "
                            "(--queue-timeout)"))
        for a in list(self.attempts.values()):
            if a.request_id not in self.attempts:
                continue
            if a.state is AttemptState.WAITING and a.clock.expired(now):
                out += self._drain(a, ("timeout", f"prefill of slot {a.slot}: "
                                                  f"{a.clock.why(now)}"), now, blame=True)
            elif a.state is AttemptState.DRAINING and now >= a.drain_until:
                out += self._fence(a, now)
            if a.request_id in self.attempts and now >= a.fence_until:
                out += self._settled(a, None, now)  # the prefiller posts nothing past it
        return out

    # ------------------------------------------------------------ queries

    def waiting_for_kv(self) -> int:
        """Requests queued for pages or waiting for their KV."""
        return len(self.requests)

    def in_flight(self) -> int:
        """Attempts whose writes may still land (the decode side's transfers in flight)."""
        return len(self.attempts)

    def pages_fenced(self) -> int:
        """Pages held for attempts whose KV is no longer wanted."""
        return sum(len(a.pages) for a in self.attempts.values() if a.orphan)

    def pages_held(self) -> int:
        return sum(len(a.pages) for a in self.attempts.values())

    # ------------------------------------------------------------ transitions

    def _start(self, r: Remote, pages: tuple[int, ...], now: float) -> list[Command]:
        live = {make_key(a.slot, a.generation) for a in self.attempts.values()}
        while make_key(r.slot, gen := self.new_generation()) in live:
            pass
        cap_s = prefill_cap_s(self.policy.idle_timeout_s, r.tokens)
        a = Attempt(r.slot, gen, pages, ProgressDeadline.start(now, self.policy.idle_timeout_s,
                                                               cap_s),
                    fence_until=now + cap_s + DEADLINE_GRACE_S)
        r.attempts += 1
        r.attempt = a
        self.attempts[a.request_id] = a
        return [Send(r.slot, a.request_id, make_key(r.slot, gen), pages, cap_s)]

    def _drain(self, a: Attempt, failure: tuple[str, str], now: float,
               blame: bool) -> list[Command]:
        a.state = AttemptState.DRAINING
        a.failure = failure
        a.drain_until = now + self.policy.peer_timeout_s
        return [Abort(a.request_id, blame)]

    def _fence(self, a: Attempt, now: float) -> list[Command]:
        """Nobody acknowledges: the request moves on now; the pages wait for the fence."""
        a.state = AttemptState.FENCED
        r = self._owner(a)
        if r is None:
            return []
        r.attempt = None
        a.orphan = True
        return self._outcome(r, a.failure or ("prefiller_dead", "prefiller stopped"), None, now)

    def _settled(self, a: Attempt, failure: tuple[str, str] | None,
                 now: float) -> list[Command]:
        """Nothing of ``a`` can land any more: its pages are free to reuse."""
        del self.attempts[a.request_id]
        out: list[Command] = [Forget(a.request_id)]
        r = self._owner(a)
        if r is None:
            return out + [Free(a.pages)]
        r.attempt = None
        return out + self._outcome(r, a.failure or failure or ("prefill_failed", "failed"),
                                   a.pages, now)

    def _outcome(self, r: Remote, failure: tuple[str, str], pages: tuple[int, ...] | None,
                 now: float) -> list[Command]:
        """The attempt of ``r`` failed: retry (same ``pages`` when they are settled, else new
        ones), prefill locally, or fail it."""
        code, message = failure
        p = self.policy
        if code != "no_prefiller" and p.on_failure == "retry" and r.attempts < p.max_attempts \
                and self.peers_alive > 0:
            if pages is not None:
                return self._start(r, pages, now)
            self.queue.appendleft(r.slot)
            return []
        del self.requests[r.slot]
        out: list[Command] = [Free(pages)] if pages is not None else []
        if code == "no_prefiller" or p.on_failure == "local":
            return out + [Local(r.slot, f"{code}: {message}")]
        return out + [Fail(r.slot, "timeout" if code == "timeout" else "prefill_failed",
                           f"{code}: {message}")]

    def _owner(self, a: Attempt) -> Remote | None:
        r = self.requests.get(a.slot)
        return r if r is not None and r.attempt is a else None
