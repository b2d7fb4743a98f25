"""A decoder's view of a prefiller's health: consecutive failed attempts and a back-off."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class PeerHealth:
    """After ``threshold`` consecutive failures (timeouts, refusals, transfer failures) a peer
    is *suspect* for ``base_s``, doubling with each further failure up to ``cap_s``; one
    success clears it. A decoder prefers live peers that are not suspect."""

    threshold: int = 2
    base_s: float = 10.0
    cap_s: float = 300.0
    failures: int = 0  # consecutive
    suspect_until: float = 0.0

    def failed(self, now: float) -> None:
        self.failures += 1
        if self.failures >= self.threshold:
            backoff = self.base_s * 2 ** min(self.failures - self.threshold, 30)
            self.suspect_until = now + min(self.cap_s, backoff)

    def succeeded(self) -> None:
        self.failures = 0
        self.suspect_until = 0.0

    def suspect(self, now: float) -> bool:
        return now < self.suspect_until
