"""Remote prefill deadlines that follow progress: the one rule both sides of a prefill apply.

An attempt (decoder) or job (prefiller) is given up when it made no progress for ``idle_s``
(``--prefill-timeout``), or at its absolute cap, whichever comes first. The cap grows with the
prompt: ``prefill_cap_s`` allows ``idle_s`` plus ``idle_s`` per 1024 prompt tokens. The decoder
sends the cap as ``PrefillRequest.deadline_unix``; the prefiller posts no write of the request
past it (and never allows itself more than the same rule gives); the decoder may reuse fenced
pages ``DEADLINE_GRACE_S`` after it. Pure: every clock reading is passed in.
"""

from __future__ import annotations

from dataclasses import dataclass

TOKENS_PER_TIMEOUT = 1024  # the cap allows one more --prefill-timeout per this many tokens
# After a request's absolute deadline: bytes posted just before it still on the wire, and the
# skew between the two hosts' wall clocks.
DEADLINE_GRACE_S = 2.0


def prefill_cap_s(idle_s: float, prompt_tokens: int) -> float:
    """The absolute budget of one remote prefill of ``prompt_tokens`` tokens."""
    return idle_s * (1.0 + max(0, prompt_tokens) / TOKENS_PER_TIMEOUT)


def job_cap_s(idle_s: float, prompt_tokens: int, deadline_unix: float, now_unix: float) -> float:
    """The prefiller's budget for a request read at ``now_unix``: the decoder's absolute
    deadline, however late it was read, and never more than the rule allows (<= 0: too late)."""
    cap = prefill_cap_s(idle_s, prompt_tokens)
    return min(cap, deadline_unix - now_unix) if deadline_unix > 0 else cap


def fence_expired(now_unix: float, deadline_unix: float, grace_s: float = DEADLINE_GRACE_S) -> bool:
    """True once no write of a request with this absolute deadline can land any more."""
    return deadline_unix > 0 and now_unix > deadline_unix + grace_s


@dataclass
class ProgressDeadline:
    """Idle deadline pushed forward by progress, bounded by an absolute cap (one clock)."""

    idle_s: float
    cap: float  # absolute: never later than this, whatever the progress
    last: float  # the last progress (or the start)
    cap_s: float = 0.0  # the cap's length, for messages

    @classmethod
    def start(cls, now: float, idle_s: float, cap_s: float) -> ProgressDeadline:
        return cls(idle_s, now + cap_s, now, cap_s)

    def progress(self, now: float) -> None:
        self.last = max(self.last, now)

    @property
    def expires_at(self) -> float:
        return min(self.last + self.idle_s, self.cap)

    def expired(self, now: float) -> bool:
        return now >= self.expires_at

    def why(self, now: float) -> str:
        """What expired, for logs and error messages."""
        if now >= self.cap:
            return f"not done within its absolute deadline ({self.cap_s:.1f}s for this prompt)"
        return f"no progress for {now - self.last:.1f}s (--prefill-timeout {self.idle_s:g}s)"
