"""The router's load-balancing policy (disagg.serving.routing), without sockets."""

from __future__ import annotations

import pytest

from disagg.serving.routing import (
    ROUTE_BLOCK,
    SLACK_REQUESTS,
    LoadBalancer,
    PrefixIndex,
    prefix_keys,
)


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


def test_a_dp_node_takes_requests_per_rank():
    """A --dp 2 node (Stats.dp_ranks: two) gets two requests for each one of a one-rank node."""
    lb = LoadBalancer(["one", "dp2"])
    lb.on_stats("one", 0, 0, 0.0)
    lb.on_stats("dp2", 0, 0, 0.0, ranks=2)
    picks = []
    for _ in range(6):
        peer = lb.pick()
        assert peer is not None
        lb.on_start(peer)
        picks.append(peer)
    assert picks.count("dp2") == 4 and picks.count("one") == 2
    assert lb.peers["dp2"].share == 2.0 and lb.peers["one"].share == 2.0


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


# ---------------------------------------------------------------- prefix-aware routing


def conversation(n_blocks: int, salt: int = 0) -> list[int]:
    return [(salt * 7919 + i) % 1000 + 10 for i in range(n_blocks * ROUTE_BLOCK)]


def test_requests_sharing_a_prefix_go_to_the_peer_that_got_it():
    lb = live(["a", "b", "c"])
    first = prefix_keys(conversation(3), None)
    peer = lb.pick(keys=first)
    lb.on_start(peer)
    # the next turn extends the conversation; another conversation goes elsewhere
    nxt = prefix_keys(conversation(5), None)
    assert lb.pick(keys=nxt) == peer and lb.prefix_routed == 1
    other = lb.pick(keys=prefix_keys(conversation(3, salt=1), None))
    assert other != peer


def test_a_hot_prefix_spreads_once_its_peer_is_too_loaded():
    lb = live(["a", "b"])
    keys = prefix_keys(conversation(2), None)
    hot = lb.pick(keys=keys)
    for _ in range(SLACK_REQUESTS):
        lb.on_start(hot)
        assert lb.pick(keys=keys) == hot  # within the slack: stays with its cache
    lb.on_start(hot)
    assert lb.pick(keys=keys) != hot  # past it: the least loaded peer takes it


def test_a_dead_or_excluded_prefix_peer_is_not_chosen():
    lb = live(["a", "b"])
    keys = prefix_keys(conversation(2), None)
    first = lb.pick(keys=keys)
    assert lb.pick(exclude={first}, keys=keys) != first
    lb.peers[first].alive = False
    assert lb.pick(keys=keys) not in (None, first)


def test_prefix_keys_chain_and_cover_text_prompts():
    a = prefix_keys(conversation(2), None)
    assert len(a) == 2 and prefix_keys(conversation(2)[:ROUTE_BLOCK], None) == a[:1]
    assert prefix_keys(conversation(1)[:-1], None) == []  # no full block
    text = prefix_keys(None, "x" * 600)
    assert len(text) == 2 and prefix_keys(None, "x" * 600 + "y") == text


def test_the_index_forgets_the_least_recently_used_blocks():
    index = PrefixIndex(capacity=3)
    k = [bytes([i]) * 12 for i in range(4)]
    index.record(k[:2], "a")
    index.record(k[2:], "b")
    assert len(index) == 3 and index.longest(k[:2]) == []  # k[0] forgotten
    assert index.longest(k[2:]) == [(2, "b")]


def test_prefer_keeps_a_prefix_with_its_peer_within_the_slack():
    index = PrefixIndex()
    keys = [b"a" * 12, b"b" * 12]
    assert index.prefer(keys, "x", {"x": 0, "y": 0}, slack=100) == "x"  # unknown: the least
    assert index.prefer(keys, "y", {"x": 100, "y": 0}, slack=100) == "x"  # within the slack
    assert index.prefer(keys, "y", {"x": 101, "y": 0}, slack=100) == "y"  # past it
    assert index.prefer(keys[:1], "x", {"x": 0, "y": 0}, slack=100) == "y"  # y got it last
    assert index.prefer(keys, "x", {"x": 0}, slack=100) == "x"  # y is no candidate
