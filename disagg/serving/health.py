"""What a gateway's ``/health`` says (pure: no sockets, no asyncio, the time passed in): 503
with the reason whenever a request would not be served, so the probe and the requests agree.

Behind a router (``ready``: ``Router.ready``), whether a decode node is live and taking
requests now. On a node, whether its last Stats answer is recent (within ``max(5 s, 3 stats
intervals)``), and the node neither refused (restarting: ``unavailable``, stopping:
``shutting_down``) nor drains (``Stats.draining``).
"""

from __future__ import annotations

from collections.abc import Callable

from disagg.protocol import Stats

REFUSING = ("unavailable", "shutting_down")  # a node answering so takes no request


class Health:
    def __init__(self, stats_interval: float, ready: Callable[[], str | None] | None = None):
        self.limit_s = max(5.0, 3 * stats_interval)
        self.ready = ready
        self.last_stats: float | None = None  # monotonic seconds of the last Stats answer
        self.unready: str | None = None  # the node's: refusing or draining

    def on_stats(self, stats: Stats, now: float) -> None:
        self.last_stats = now
        self.unready = "the node is draining" if stats.draining else None

    def on_error(self, code: str, message: str) -> None:
        """A Stats poll answered ``code`` (the node answers, but may refuse requests)."""
        if code in REFUSING:
            self.unready = f"the node refuses requests: {message}"

    def unhealthy(self, now: float) -> str | None:
        """None while a request would be served, else why not."""
        if self.ready is not None:
            return self.ready()
        if self.last_stats is None or now - self.last_stats >= self.limit_s:
            return "the node has not answered a Stats request recently"
        return self.unready
