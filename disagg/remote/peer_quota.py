"""Per-peer bounds at a prefiller: job slots and pages one decoder connection may hold."""

from __future__ import annotations


class PeerQuota:
    """At most ``max_jobs`` accepted jobs per peer (past that its requests are refused,
    ``overloaded``, while others are still served), and at most ``max_pages`` pages of its
    jobs in the scheduler's hands at once (its prompts' pages here, from when a job is handed
    over to its end): its further jobs wait in the messenger, holding no page."""

    def __init__(self, max_jobs: int, max_pages: int):
        self.max_jobs = max(1, max_jobs)
        self.max_pages = max(1, max_pages)
        self.jobs: dict[bytes, int] = {}
        self.pages: dict[bytes, int] = {}

    def refusal(self, peer: bytes) -> str | None:
        """Why one more job of ``peer`` is refused now, or None."""
        jobs = self.jobs.get(peer, 0)
        if jobs >= self.max_jobs:
            return f"this decoder holds {jobs} jobs here (at most {self.max_jobs} per decoder)"
        return None

    def fits(self, peer: bytes, pages: int) -> bool:
        """Whether a job of ``pages`` pages may go to the scheduler now (a peer holding none
        may always send one: the prefiller checked that it fits its pool)."""
        held = self.pages.get(peer, 0)
        return held == 0 or held + pages <= self.max_pages

    def accepted(self, peer: bytes) -> None:
        self.jobs[peer] = self.jobs.get(peer, 0) + 1

    def handed(self, peer: bytes, pages: int) -> None:
        self.pages[peer] = self.pages.get(peer, 0) + pages

    def ended(self, peer: bytes, pages: int) -> None:
        """A job of ``peer`` ended; ``pages``: what it held in the scheduler (0 if never)."""
        jobs = self.jobs.get(peer, 0) - 1
        held = self.pages.get(peer, 0) - pages
        if jobs > 0:
            self.jobs[peer] = jobs
        else:
            self.jobs.pop(peer, None)
        if held > 0:
            self.pages[peer] = held
        else:
            self.pages.pop(peer, None)
