"""What a gateway's /health says (disagg.serving.health), without sockets: behind a router its
ready(); on a node, a recent Stats answer from a node that neither refuses nor drains."""

from __future__ import annotations

from disagg.protocol import Stats
from disagg.serving.health import Health


def stats(draining: int = 0) -> Stats:
    return Stats("mixed", 8, 8, 16, 0, 0, 0, 0, 0, 0, 0, 0, 0, draining=draining)


def test_a_node_is_healthy_while_its_stats_are_recent_and_it_takes_requests():
    h = Health(stats_interval=1.0)
    assert h.unhealthy(0.0) is not None  # never answered
    h.on_stats(stats(), 10.0)
    assert h.unhealthy(14.9) is None
    assert "recently" in (h.unhealthy(15.0) or "")  # 5 s without an answer
    h.on_error("unavailable", "the node is restarting after executor failure; retry after 3 s")
    assert "refuses requests" in (h.unhealthy(11.0) or "")
    h.on_stats(stats(), 12.0)  # serving again
    assert h.unhealthy(12.0) is None
    h.on_error("overloaded", "too many frames")  # a refused poll is not a refusing node
    assert h.unhealthy(12.0) is None
    h.on_stats(stats(draining=1), 13.0)
    assert h.unhealthy(13.0) == "the node is draining"


def test_behind_a_router_health_is_its_ready():
    why: list[str | None] = [None]
    h = Health(stats_interval=1.0, ready=lambda: why[0])
    assert h.unhealthy(0.0) is None  # no Stats needed: the router knows its peers
    why[0] = "no decode node is available"
    assert h.unhealthy(0.0) == "no decode node is available"


def test_drain_is_taken_from_loopback_only():
    """POST /drain on the metrics endpoint (a pod's own preStop hook) comes from loopback."""
    from disagg.actors.http.metrics_server import _loopback

    assert _loopback("127.0.0.1") and _loopback("::1")
    assert not _loopback("10.0.0.7") and not _loopback(None) and not _loopback("x")
