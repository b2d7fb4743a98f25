"""A decoder's prefiller table (``disagg.remote.prefillers``) on a fake clock, and the choice of
a prefiller among its candidates (``disagg.serving.routing.PrefillerChoice``)."""

from __future__ import annotations

import msgspec
import pytest

from disagg.protocol.peer import MAX_DP_RANKS, KVLayoutDesc, Pong
from disagg.remote.prefillers import PrefillerTable, pong_problem
from disagg.serving.routing import PREFILLER_SLACK_TOKENS, PrefillerChoice

LAYOUT = KVLayoutDesc(num_layers=2, num_pages=16, num_kv_heads=1, page_size=4, head_dim=8,
                      dtype="float32", element_size=4, hidden_size=16)
OTHER = msgspec.structs.replace(LAYOUT, head_dim=16)
TIMEOUT = 5.0


def table(*addresses: str) -> PrefillerTable:
    t = PrefillerTable(LAYOUT, "fabric", TIMEOUT)
    for a in addresses:
        t.add(a)
    return t


def test_a_prefiller_is_alive_from_a_compatible_pong_until_it_is_silent() -> None:
    t = table("a")
    assert not t.alive("a") and t.alive_count() == 0  # dialed, never answered
    assert t.pong("a", 10.0, 7, LAYOUT, "fabric") is None
    assert t.alive("a") and t.alive_count() == 1 and t["a"].layout == LAYOUT
    assert t.expire(10.0 + TIMEOUT) == []  # silent for exactly the timeout: still alive
    assert t.expire(10.0 + TIMEOUT + 0.1) == ["a"]
    assert not t.alive("a")
    assert t.expire(100.0) == []  # reported dead once
    t.pong("a", 101.0, 0, LAYOUT, "fabric")  # it answers again
    assert t.alive("a")


def test_an_incompatible_pong_kills_it_and_is_reported_once() -> None:
    t = table("a")
    t.pong("a", 1.0, 0, LAYOUT, "fabric")
    why = t.pong("a", 2.0, 0, OTHER, "fabric")
    assert why is not None and not t.alive("a")
    assert t.pong("a", 3.0, 0, OTHER, "fabric") is None  # the same reason: no news
    assert t["a"].incompatible == why and not t.alive("a")
    assert t.pong("a", 4.0, 0, LAYOUT, "fabric") is None and t.alive("a")


def test_a_transport_mismatch_is_named_before_any_layout_difference() -> None:
    assert pong_problem(OTHER, "cuda-ipc", LAYOUT, "fabric") == (
        "transport mismatch: prefiller uses cuda-ipc, this decoder fabric")
    assert pong_problem(LAYOUT, "fabric", LAYOUT, "fabric") is None
    assert pong_problem(OTHER, "fabric", LAYOUT, "fabric") is not None
    t = table("a")
    assert t.pong("a", 1.0, 0, LAYOUT, "cuda-ipc") is not None and not t.alive("a")


def test_a_prefiller_that_left_the_peer_set_stays_dead_until_it_comes_back() -> None:
    t = table("a")
    t.pong("a", 1.0, 0, LAYOUT, "fabric")
    t.vanished("a")
    assert not t.alive("a") and t["a"].removed
    t.pong("a", 2.0, 0, LAYOUT, "fabric")  # a Pong already on its way
    assert not t.alive("a")
    assert t.expire(100.0) == []  # removed: never reported silent
    t.appeared("a")
    assert not t.alive("a")  # back, but alive only at its next Pong
    t.pong("a", 3.0, 0, LAYOUT, "fabric")
    assert t.alive("a")
    t.drop("a")
    assert "a" not in t and not t.alive("a")
    t.failed("a", 4.0)  # news of a forgotten prefiller is ignored
    t.succeeded("a")


def test_load_is_the_last_pong_queue_plus_what_was_sent_since() -> None:
    t = table("a", "b")
    t.pong("a", 1.0, 100, LAYOUT, "fabric")
    t.pong("b", 1.0, 50, LAYOUT, "fabric")
    t.sent("b", 80)
    assert t.candidates(1.0) == {"a": 100, "b": 130}
    t.pong("b", 2.0, 60, LAYOUT, "fabric")  # its queue now counts what was sent
    assert t.candidates(2.0) == {"a": 100, "b": 60}


def test_a_dp_prefiller_is_weighed_per_rank() -> None:
    """A --dp 4 prefiller's queue is shared by four ranks (Pong.dp_ranks): with 300 tokens
    queued it is chosen over a one-rank prefiller with 100 (75 a rank), as the router counts
    a node of N ranks as N times the seats."""
    t = table("dp", "one")
    t.pong("dp", 1.0, 300, LAYOUT, "fabric", ranks=4)
    t.pong("one", 1.0, 100, LAYOUT, "fabric")
    assert t.candidates(1.0) == {"dp": 75, "one": 100}
    assert PrefillerChoice(tiebreak=lambda: 0.0).pick(t.candidates(1.0)) == "dp"
    t.sent("dp", 200)  # 500 over four ranks: 125 a rank, now busier than the other
    assert PrefillerChoice(tiebreak=lambda: 0.0).pick(t.candidates(1.0)) == "one"
    t.pong("dp", 2.0, 1, LAYOUT, "fabric", ranks=4)
    assert t.candidates(2.0)["dp"] == 1  # rounded up: any queue counts
    # on the wire: an older prefiller's Pong is one rank; a bad rank count is a bad frame
    old = Pong(1, 5, LAYOUT, "fabric")
    dec = msgspec.msgpack.Decoder(Pong)
    raw = msgspec.to_builtins(old)
    del raw["dp_ranks"]
    assert dec.decode(msgspec.msgpack.encode(raw)).dp_ranks == 1
    for bad in (0, MAX_DP_RANKS + 1):
        with pytest.raises(msgspec.ValidationError):
            dec.decode(msgspec.msgpack.encode({**raw, "dp_ranks": bad}))


def test_suspects_are_left_out_while_others_are_healthy() -> None:
    t = table("a", "b")
    for a in "ab":
        t.pong(a, 0.0, 0, LAYOUT, "fabric")
    t.failed("a", 1.0)
    assert set(t.candidates(1.0)) == {"a", "b"}  # one failure: not suspect yet
    t.failed("a", 1.0)
    base = t["a"].health.base_s
    assert set(t.candidates(1.0)) == {"b"}
    assert set(t.candidates(1.0 + base)) == {"a", "b"}  # its back-off ended
    t.failed("b", 2.0)
    t.failed("b", 2.0)
    assert set(t.candidates(2.0)) == {"a", "b"}  # all suspect: every live one
    t.succeeded("a")
    assert set(t.candidates(2.0)) == {"a"}
    t.expire(100.0)
    assert t.candidates(100.0) == {}  # none alive


def test_the_choice_takes_the_shortest_queue_with_ties_broken_by_the_tiebreak() -> None:
    draws = iter([0.1, 0.9, 0.9, 0.1, 0.2, 0.8])  # one per candidate and pick
    c = PrefillerChoice(tiebreak=lambda: next(draws))
    assert c.pick({}) is None
    assert c.pick({"a": 5, "b": 3}) == "b"  # whatever a drew
    assert c.pick({"a": 3, "b": 3}) == "b"  # a drew 0.9, b 0.1
    assert c.pick({"a": 3, "b": 3}) == "a"  # a drew 0.2, b 0.8


def test_the_choice_follows_a_known_prefix_within_the_slack() -> None:
    c = PrefillerChoice(tiebreak=lambda: 0.0)
    keys = [b"k1", b"k2"]
    assert c.pick({"a": 0, "b": 0}, keys) == "a"  # recorded for the prefix
    assert c.pick({"a": PREFILLER_SLACK_TOKENS, "b": 0}, keys) == "a"  # within the slack
    longer = keys + [b"k3"]
    assert c.pick({"a": PREFILLER_SLACK_TOKENS + 1, "b": 0}, longer) == "b"  # past it
    assert c.pick({"a": 0, "b": 10}, longer) == "b"  # b got the longest prefix last
    assert c.pick({"a": 0}, longer) == "a"  # b not a candidate (dead or suspect)
    # half the shortest queue is the slack when that is more
    big = 4 * PREFILLER_SLACK_TOKENS
    other = [b"x"]
    assert c.pick({"a": 0, "b": 0}, other) == "a"
    assert c.pick({"a": big + big // 2, "b": big}, other) == "a"
    assert c.pick({"a": big + big // 2 + 1, "b": big}, other) == "b"
