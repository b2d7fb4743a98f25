"""The pure parts of the data plane's defences: ownership checks, per-peer bounds, peer health."""

from __future__ import annotations

import pytest

from disagg.fabric.descriptor import MemoryDescriptor
from disagg.remote.ownership import (
    CHALLENGE_AREA_BYTES,
    CHALLENGE_SLOTS,
    CHALLENGE_UNITS,
    NONCE_BYTES,
    SLOT_BYTES,
    NonceSlots,
    OwnershipBook,
    area_rows,
    endpoints,
    lane_weights,
    nonce_offset,
)
from disagg.remote.peer_health import PeerHealth
from disagg.remote.peer_quota import PeerQuota


def desc(address: bytes, key: int = 1) -> MemoryDescriptor:
    return MemoryDescriptor("fabric", "tcp", address, 0, 1 << 20, key)


@pytest.mark.parametrize("lanes", range(1, 17))
def test_lane_weights_always_add_up_to_what_the_decoder_expects(lanes):
    w = lane_weights(lanes)
    assert len(w) == lanes and sum(w) == CHALLENGE_UNITS and min(w) >= 1


def test_the_challenge_area_is_the_end_of_the_buffer_after_every_context_slot():
    row, slots = 256, 10
    length = (slots + area_rows(row)) * row
    first = nonce_offset(length, 0, 0)
    last = nonce_offset(length, CHALLENGE_SLOTS - 1, 15) + NONCE_BYTES
    assert first >= slots * row and first == length - CHALLENGE_AREA_BYTES
    assert last <= length
    assert nonce_offset(length, 1, 0) - nonce_offset(length, 0, 0) == SLOT_BYTES


def test_kv_on_an_endpoint_the_context_is_not_on_cannot_be_checked():
    lanes, why = endpoints([desc(b"me")], desc(b"me"), 1)
    assert [d.address for d in lanes] == [b"me"] and why is None
    _, why = endpoints([desc(b"victim")], desc(b"me"), 1)
    assert why is not None and "not on" in why


def test_a_right_answer_binds_the_connection_to_the_endpoint_for_the_ttl():
    book = OwnershipBook(ttl_s=100, retry_s=10)
    me, addrs = (b"\0a", 7), frozenset({b"ep"})
    assert book.status(me, addrs, 0) == "unknown"
    check = book.start(me, addrs, 1)
    with pytest.raises(KeyError):
        book.start(me, addrs, 1)  # one check per connection at a time
    assert book.answered(check, check.nonce, 1.0)
    assert book.status(me, addrs, 50) == "owned"
    assert book.status(me, addrs | {b"other"}, 50) == "unknown"
    assert book.status((b"\0b", 8), addrs, 50) == "unknown"  # bound to that connection only
    assert book.status(me, addrs, 101) == "unknown"  # re-checked after the ttl


def test_a_wrong_or_missing_answer_refuses_only_that_connection_for_a_while():
    book = OwnershipBook(ttl_s=100, retry_s=10)
    victim, attacker, addrs = (b"\0v", 3), (b"\0a", 4), frozenset({b"victim-ep"})
    check = book.start(attacker, addrs, 1)
    assert not book.answered(check, b"\0" * NONCE_BYTES, 0)
    assert book.status(attacker, addrs, 5) == "refused"
    assert book.status(attacker, addrs, 11) == "unknown"
    assert book.status(victim, addrs, 5) == "unknown"  # the victim is not refused for it
    check = book.start(attacker, addrs, 1)
    assert not book.answered(check, None, 20, remember_failure=False)
    assert book.status(attacker, addrs, 21) == "unknown"


def test_a_connection_that_goes_down_is_forgotten():
    book = OwnershipBook()
    a, b = (b"\0a", 5), (b"\0b", 6)
    for conn in (a, b):
        check = book.start(conn, frozenset({b"ep"}), 1)
        book.answered(check, check.nonce, 0)
    assert book.forget(5) == [a]
    assert book.status(a, frozenset({b"ep"}), 1) == "unknown"
    assert book.status(b, frozenset({b"ep"}), 1) == "owned"


def test_a_nonce_slot_whose_write_did_not_complete_rests_before_reuse():
    slots = NonceSlots(2, quarantine_s=60)
    a, b = slots.take(0), slots.take(0)
    assert {a, b} == {0, 1} and slots.take(0) is None
    slots.give(a, completed=True, now=0)
    slots.give(b, completed=False, now=0)
    assert slots.take(1) == a and slots.take(1) is None
    assert slots.take(61) == b


def test_per_peer_bounds_refuse_one_peer_and_not_the_others():
    q = PeerQuota(max_jobs=2, max_pages=10)
    for _ in range(2):
        assert q.refusal(b"greedy") is None
        q.accepted(b"greedy")
    assert q.refusal(b"greedy") is not None
    assert q.refusal(b"other") is None
    q.ended(b"greedy", 0)
    assert q.refusal(b"greedy") is None


def test_per_peer_pages_bound_what_the_scheduler_holds_but_never_one_job():
    q = PeerQuota(max_jobs=8, max_pages=10)
    assert q.fits(b"p", 50)  # holding none: one job always goes (the pool check is elsewhere)
    q.handed(b"p", 8)
    assert q.fits(b"p", 2) and not q.fits(b"p", 3)
    assert q.fits(b"other", 10)
    q.accepted(b"p")
    q.ended(b"p", 8)
    assert q.fits(b"p", 10)


def test_a_peer_is_suspect_after_consecutive_failures_with_a_capped_exponential_backoff():
    h = PeerHealth(threshold=2, base_s=5, cap_s=30)
    h.failed(0)
    assert not h.suspect(0)
    h.failed(0)
    assert h.suspect(4.9) and not h.suspect(5.1)
    h.failed(10)
    assert h.suspect(19.9) and not h.suspect(20.1)  # 10 s
    for _ in range(5):
        h.failed(100)
    assert h.suspect(129) and not h.suspect(131)  # capped
    h.succeeded()
    assert not h.suspect(100)
    h.failed(200)
    assert not h.suspect(200)  # the count starts over
