"""The router's liveness policy (disagg.serving.routing.LoadBalancer), without sockets: a peer
lives by its heartbeats (any reply, a Pong above all), not by how fast it answers Stats; a
dropped connection kills it at once; a draining or refusing peer is live but chosen for
nothing; ``serving()`` (what /health reports) is empty exactly when ``pick`` finds nothing."""

from __future__ import annotations

import random

from disagg.serving.routing import LoadBalancer


def test_a_busy_peer_that_answers_pings_but_no_stats_stays_live():
    lb = LoadBalancer(["a"], dead_after=3.0)
    lb.on_stats("a", 4, 0, 0.0)
    assert lb.stats_due("a", 0.0)  # asked at 0: the scheduler answers between long steps
    for t in (1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0):
        assert not lb.stats_due("a", t) or t >= 3.0  # not piled up while unanswered
        lb.on_pong("a", False, t)
        assert lb.check(t + 0.5) == []
    assert lb.alive() == ["a"] and lb.pick() == "a"


def test_stats_are_asked_again_once_answered_or_after_dead_after():
    lb = LoadBalancer(["a"], dead_after=3.0)
    assert lb.stats_due("a", 0.0)
    assert not lb.stats_due("a", 1.0)
    lb.on_stats("a", 0, 0, 1.5)
    assert lb.stats_due("a", 1.6)
    assert not lb.stats_due("a", 2.0)
    assert lb.stats_due("a", 4.7)  # the last one was lost: ask again


def test_a_silent_peer_dies_after_dead_after_whatever_it_answered_before():
    lb = LoadBalancer(["a", "b"], dead_after=2.0)
    lb.on_pong("a", False, 0.0)
    lb.on_pong("b", False, 0.0)
    lb.on_heard("a", 1.5)  # a token of a request: alive too
    assert lb.check(2.5) == ["b"]
    assert lb.serving() == ["a"]
    assert lb.on_pong("b", False, 3.0) is True  # revived by its next Pong
    assert lb.serving() == ["a", "b"]


def test_a_dropped_connection_kills_at_once_and_a_pong_revives():
    lb = LoadBalancer(["a", "b"], dead_after=3.0)
    lb.on_pong("a", False, 0.0)
    lb.on_pong("b", False, 0.0)
    assert lb.on_down("a") is True
    assert lb.on_down("a") is False  # reported once
    assert lb.on_down("unknown") is False
    assert lb.alive() == ["b"] and {lb.pick() for _ in range(4)} == {"b"}
    assert lb.on_pong("a", False, 0.5) is True
    assert lb.alive() == ["a", "b"]


def test_draining_and_refusing_peers_are_live_but_get_nothing():
    lb = LoadBalancer(["a", "b"], dead_after=3.0)
    lb.on_pong("a", False, 0.0)
    lb.on_pong("b", True, 0.0)  # draining
    assert lb.alive() == ["a", "b"] and lb.serving() == ["a"]
    assert {lb.pick() for _ in range(4)} == {"a"}
    assert lb.pick(exclude={"a"}) is None and lb.place({"a"}) == "a"
    lb.on_refused("a", 0.1)  # restarting: its door answers unavailable
    assert lb.serving() == [] and lb.pick() is None and lb.place(set()) is None
    assert lb.check(1.0) == []  # still live: it answers
    lb.on_pong("a", False, 1.0)
    assert lb.serving() == ["a"]
    lb.on_stats("a", 0, 0, 1.1, draining=True)  # Stats say draining too
    assert lb.serving() == []


def test_serving_agrees_with_pick_in_every_state():
    """Whatever happens (random heartbeats, drains, refusals, drops, silences), ``serving()``
    is empty exactly when a request finds no peer: /health and requests agree."""
    rng = random.Random(7)
    peers = ["a", "b", "c"]
    lb = LoadBalancer(peers, dead_after=2.0)
    now = 0.0
    for _ in range(3000):
        now += rng.random() * 0.5
        p = rng.choice(peers)
        event = rng.randrange(6)
        if event == 0:
            lb.on_pong(p, False, now)
        elif event == 1:
            lb.on_pong(p, rng.random() < 0.5, now)
        elif event == 2:
            lb.on_refused(p, now)
        elif event == 3:
            lb.on_down(p)
        elif event == 4:
            lb.on_stats(p, rng.randrange(4), 0, now, draining=rng.random() < 0.2)
        else:
            lb.check(now)
        picked = lb.pick()
        assert (picked is None) == (not lb.serving())
        if picked is not None:
            assert picked in lb.serving() and picked in lb.alive()
