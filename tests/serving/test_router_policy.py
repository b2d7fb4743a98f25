"""The router's load-balancing policy (disagg.serving.routing), without sockets."""

from __future__ import annotations

import pytest

from disagg.serving.routing import LoadBalancer


def live(peers, dead_after=2.0, now=0.0):
    lb = LoadBalancer(peers, dead_after)
    for p in peers:
        lb.on_stats(p, 0, 0, now)
    return lb


def test_no_peer_is_live_before_its_first_stats():
    lb = LoadBalancer(["a", "b"])
    assert lb.pick() is None
    assert lb.on_stats("b", 0, 0, 0.0) is True
    assert lb.pick() == "b"


def test_ties_rotate():
    lb = live(["a", "b", "c"])
    assert [lb.pick() for _ in range(6)] == ["a", "b", "c", "a", "b", "c"]


def test_least_in_flight_wins():
    lb = live(["a", "b"])
    lb.on_start("a")
    lb.on_start("a")
    lb.on_start("b")
    assert lb.pick() == "b"
    lb.on_start("b")
    lb.on_start("b")
    assert lb.pick() == "a"
    lb.on_end("b")
    lb.on_end("b")
    lb.on_end("b")
    assert lb.peers["b"].load == 0 and lb.pick() == "b"


def test_external_load_from_stats_counts():
    lb = live(["a", "b"])
    lb.on_start("a")  # ours: 1 on a
    lb.on_stats("a", 1, 0, 0.1)  # a's snapshot shows only ours
    lb.on_stats("b", 3, 2, 0.1)  # b has 5 from other clients
    assert lb.peers["a"].load == 1 and lb.peers["b"].load == 5
    assert lb.pick() == "a"
    lb.on_end("a")
    assert lb.peers["a"].load == 0  # our request ended: no phantom external load


def test_silent_peer_dies_and_comes_back():
    lb = live(["a", "b"], dead_after=2.0, now=0.0)
    lb.on_stats("a", 0, 0, 1.5)
    assert lb.check(2.5) == ["b"]
    assert lb.check(2.6) == []  # reported once
    assert {lb.pick() for _ in range(4)} == {"a"}
    assert lb.pick(exclude={"a"}) is None
    assert lb.on_stats("b", 0, 0, 3.0) is True
    assert lb.alive() == ["a", "b"]


def test_bad_configuration():
    with pytest.raises(ValueError, match="at least one"):
        LoadBalancer([])
    with pytest.raises(ValueError, match="twice"):
        LoadBalancer(["a", "a"])


def test_random_walk_keeps_counts_consistent():
    import random

    rng = random.Random(0)
    lb = live(["a", "b", "c"])
    live_reqs: list[str] = []
    for _ in range(2000):
        if live_reqs and rng.random() < 0.45:
            lb.on_end(live_reqs.pop(rng.randrange(len(live_reqs))))
        else:
            p = lb.pick()
            assert p is not None
            lb.on_start(p)
            live_reqs.append(p)
        loads = [lb.peers[x].in_flight for x in "abc"]
        assert sum(loads) == len(live_reqs)
        assert max(loads) - min(loads) <= max(1, len(live_reqs))  # never wildly unbalanced
