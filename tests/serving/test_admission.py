"""The pure admission parts: the frontend's ClientBook and the scheduler's FairQueue."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from disagg.serving.admission import ClientBook, FairQueue, Limits, Reply


def test_frames_in_flight_are_bounded_per_client():
    book = ClientBook(max_inflight=3, max_backlog=10)
    assert [book.arrived(b"a", 7) for _ in range(4)] == [True, True, True, False]
    assert book.arrived(b"b", 8)  # another client is not affected
    book.handled(b"a", 2)
    assert book.arrived(b"a", 7) and book.arrived(b"a", 7) and not book.arrived(b"a", 7)
    book.handled(b"a", 99)  # never below zero
    assert book.clients[b"a"].inflight == 0


def test_a_slow_reader_keeps_its_replies_in_order():
    book = ClientBook(max_backlog=3)
    assert not book.must_queue(b"a")
    for i in range(3):
        assert not book.queue(b"a", Reply(bytes([i]), terminal=False))
    assert book.must_queue(b"a") and not book.must_queue(b"b")
    (identity, q), = book.pending()
    assert identity == b"a" and [r.payload for r in q] == [b"\0", b"\1", b"\2"]
    q.clear()
    book.drained(b"a")
    assert not book.must_queue(b"a") and book.backlog_size == 0


def test_a_client_past_the_backlog_is_stalled_and_keeps_only_terminal_replies():
    book = ClientBook(max_backlog=3)
    book.queue(b"a", Reply(b"t1", terminal=False))
    book.queue(b"a", Reply(b"end1", terminal=True))
    book.queue(b"a", Reply(b"t2", terminal=False))
    assert book.queue(b"a", Reply(b"t3", terminal=False))  # the 4th: stalled now
    assert book.is_stalled(b"a")
    assert not book.queue(b"a", Reply(b"t4", terminal=False))  # reported once
    book.queue(b"a", Reply(b"end2", terminal=True))
    (_, q), = book.pending()
    assert [r.payload for r in q] == [b"end1", b"end2"]
    assert book.dropped == 4
    q.clear()
    book.drained(b"a")  # caught up: served normally again
    assert not book.is_stalled(b"a")


def test_a_disconnect_names_the_clients_of_that_connection_only():
    book = ClientBook()
    book.arrived(b"a", 10)
    book.arrived(b"b", 11)
    book.arrived(b"c", 10)
    book.queue(b"a", Reply(b"x", terminal=False))
    assert book.disconnected(10) == [b"a", b"c"]
    assert set(book.clients) == {b"b"} and book.dropped == 1
    assert book.disconnected(10) == []
    book.arrived(b"b", 12)  # moved to another connection (fd reused elsewhere)
    assert book.disconnected(11) == []
    assert book.disconnected(12) == [b"b"]
    assert book.fd_of(b"b") is None  # forgotten: its next frame binds it afresh
    book.arrived(b"d", 13)
    assert book.fd_of(b"d") == 13


def test_bytes_in_flight_are_bounded_per_client_but_one_frame_always_fits():
    book = ClientBook(max_inflight=100, max_inflight_bytes=1000)
    assert book.arrived(b"a", 1, 5000)  # alone: however big (the socket caps frame size)
    assert not book.arrived(b"a", 1, 1)
    book.handled(b"a", 1)
    assert book.arrived(b"a", 1, 600) and not book.arrived(b"a", 1, 600)
    assert book.arrived(b"a", 1, 400)
    book.handled(b"a", 1)  # the 600-byte frame, handled first
    assert book.clients[b"a"].inflight_bytes == 400 and book.arrived(b"a", 1, 600)


def test_bounds_must_be_positive():
    with pytest.raises(ValueError):
        ClientBook(max_inflight=0)


def test_fair_queue_serves_clients_round_robin():
    q: FairQueue[str] = FairQueue()
    for i in range(5):
        q.push("flood", f"f{i}", deadline=100.0)
    q.push("one", "o0", deadline=100.0)
    q.push("two", "t0", deadline=100.0)
    q.push("one", "o1", deadline=100.0)
    assert len(q) == 8 and q.count("flood") == 5
    out = [q.pop() for _ in range(8)]
    assert out == ["f0", "o0", "t0", "f1", "o1", "f2", "f3", "f4"]
    assert q.pop() is None and len(q) == 0


def test_fair_queue_remove_and_deadlines():
    q: FairQueue[object] = FairQueue()
    a, b, c = object(), object(), object()
    q.push(1, a, deadline=5.0)
    q.push(1, b, deadline=9.0)
    q.push(2, c, deadline=7.0)
    assert q.next_deadline() == 5.0
    assert q.remove(1, b) and not q.remove(1, b) and not q.remove(3, a)
    assert len(q) == 2 and q.count(1) == 1
    assert q.expired(4.9) == []
    assert q.expired(7.0) == [a, c]
    assert len(q) == 0 and q.next_deadline() is None


# ---------------------------------------------------------------- fairness per tenant (issue 41)


def test_connections_per_address_are_capped_and_return_when_closed():
    book = ClientBook(max_conns_per_address=2)
    assert book.connection_allowed(10, "10.0.0.1") and book.connection_allowed(11, "10.0.0.1")
    assert book.connection_allowed(10, "10.0.0.1")  # one already admitted stays so
    assert not book.connection_allowed(12, "10.0.0.1")  # a third connection of that address
    assert book.connection_allowed(13, "10.0.0.2")  # another address is not affected
    assert book.connection_allowed(None, "10.0.0.1") and book.connection_allowed(14, None)
    book.arrived(b"a", 10)
    assert book.disconnected(10) == [b"a"]
    assert book.connection_allowed(12, "10.0.0.1")  # the closed one's place
    assert book.connection_allowed(11, "10.0.0.1") and not book.connection_allowed(15, "10.0.0.1")
    # an fd reused by another address after a close the book has not seen yet
    assert book.connection_allowed(11, "10.0.0.3")
    assert book.connection_allowed(15, "10.0.0.1")
    with pytest.raises(ValueError):
        ClientBook(max_conns_per_address=0)


def test_a_full_queue_admits_a_client_below_its_share_and_the_largest_gives_way():
    limits = Limits(per_client=100, queued=8)
    # room: admitted as before
    assert limits.admission(3, 7, 3, 1, 3) == (None, False)
    # full, one client (the flood) holds all 8; a newcomer's share is 4: the flood gives way
    assert limits.admission(0, 8, 0, 2, 8) == (None, True)
    # the flood itself, at or above its share, is refused, never the newcomer
    why, evict = limits.admission(8, 8, 8, 2, 8)
    assert not evict and why is not None and "its share of 4 among 2 clients" in why
    # the per-client bound counts the client however many connections it opened
    why, _ = limits.admission(100, 0)
    assert why is not None and "--max-requests-per-client" in why
    # a queue smaller than the clients: only one holding two more than this one gives way
    tiny = Limits(queued=2)
    assert tiny.admission(0, 2, 0, 3, 1) == (tiny.admission(0, 2, 0, 3, 1)[0], False)
    assert tiny.admission(0, 2, 0, 2, 2) == (None, True)


def test_the_newest_of_the_largest_client_is_the_one_to_give_way():
    q: FairQueue[str] = FairQueue()
    assert q.newest_of_largest() is None and q.largest() == 0 and q.clients("x") == 1
    flood = [f"f{i}" for i in range(4)]
    for f in flood:
        q.push("flood", f, deadline=1.0)
    q.push("one", "o0", deadline=1.0)
    assert q.largest() == 4 and q.clients("one") == 2 and q.clients("new") == 3
    assert q.newest_of_largest() == "f3"
    assert q.remove("flood", flood[3])
    assert q.newest_of_largest() == "f2"  # a removed entry is skipped


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.booleans()), max_size=200),
       st.integers(1, 12))
def test_a_client_below_its_share_is_never_refused_for_a_full_queue(ops, bound):
    """Clients push (True) or the scheduler starts one (False) in any order: whenever the
    queue is full, a client holding less than its share is admitted (someone else gives
    way), the queue never passes its bound, and nobody holds past its share by eviction."""
    limits = Limits(per_client=10_000, queued=bound)
    q: FairQueue[tuple[int, int]] = FairQueue()
    n = 0
    for client, push in ops:
        if not push:
            q.pop()
            continue
        why, evict = limits.admission(q.count(client), len(q), q.count(client),
                                      q.clients(client), q.largest())
        share = limits.share(q.clients(client))
        if len(q) >= bound and q.count(client) < share and bound >= q.clients(client):
            assert why is None and evict, "a client below its share was refused"
        if why is not None:
            assert q.count(client) >= share or q.largest() <= q.count(client) + 1
            continue
        if evict:
            victim = q.newest_of_largest()
            assert victim is not None and victim[0] != client
            assert q.count(victim[0]) > q.count(client) + 1
            assert q.remove(victim[0], victim)
        n += 1
        q.push(client, (client, n), deadline=1.0)
        assert len(q) <= bound
