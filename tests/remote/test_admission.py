"""The prefill node's verdict on a PrefillRequest (``disagg.remote.admission``): every refusal,
with the code and message a decoder gets, the wait for the ownership check, and a job."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from disagg.fabric.descriptor import MemoryDescriptor
from disagg.protocol.peer import KVLayoutDesc, PrefillRequest
from disagg.remote.admission import (
    NOT_OWNED,
    TOO_LATE,
    Admit,
    Destinations,
    Facts,
    Park,
    Refuse,
    destinations,
    verdict,
)
from disagg.remote.ownership import CHALLENGE_AREA_BYTES

LAYOUT = KVLayoutDesc(num_layers=2, num_pages=32, num_kv_heads=2, page_size=4, head_dim=8,
                      dtype="float32", element_size=4, hidden_size=16)
NOW = 1_000_000.0  # wall clock


def desc(address: bytes, length: int) -> MemoryDescriptor:
    return MemoryDescriptor(backend="fabric", provider="tcp", address=address, base=0,
                            length=length, key=1)


DESCRIPTORS = {
    b"kv": desc(b"A", LAYOUT.total_bytes),
    b"small": desc(b"A", LAYOUT.total_bytes - 1),
    b"elsewhere": desc(b"B", LAYOUT.total_bytes),
    b"ctx": desc(b"A", CHALLENGE_AREA_BYTES + 4 * LAYOUT.context_bytes),
}


def decode(data: bytes) -> Any:
    if data not in DESCRIPTORS:
        raise msgspec.DecodeError("junk")
    return DESCRIPTORS[data]


def request(**kw: Any) -> PrefillRequest:
    base: dict[str, Any] = dict(request_id="r1", key=7, prompt_ids=list(range(1, 11)),
                                dst_pages=[1, 2, 3], dst_layout=LAYOUT, dst_kv=b"kv",
                                dst_ctx=b"ctx", ctx_offset=0, timeout_s=5.0,
                                deadline_unix=NOW + 60)
    base.update(kw)
    return PrefillRequest(**base)


def checked(req: PrefillRequest) -> Destinations | Refuse:
    return destinations(LAYOUT, 100, req, decode, own_lanes=1)


def facts(**kw: Any) -> Facts:
    base: dict[str, Any] = dict(duplicate=False, owned="owned", busy=None, free_slots=4,
                                now_unix=NOW)
    base.update(kw)
    return Facts(**base)


def test_a_valid_request_has_its_destinations_decoded() -> None:
    d = checked(request())
    assert isinstance(d, Destinations)
    assert d.kv == [DESCRIPTORS[b"kv"]] and d.ctx == DESCRIPTORS[b"ctx"]
    assert d.addresses == frozenset({b"A"})
    two = checked(request(dst_layout=msgspec.structs.replace(LAYOUT, tp_size=2,
                                                                   num_kv_heads=1),
                          dst_kv_ranks=[b"kv", b"kv"]))
    assert isinstance(two, Destinations) and len(two.kv) == 2  # one per decoder rank


@pytest.mark.parametrize("kw, message", [
    (dict(prompt_ids=[]), "empty prompt"),
    (dict(prompt_ids=[1, 100, 2]), "token id outside the vocabulary"),
    (dict(dst_pages=[1, 1, 2]), "destination pages repeat"),
    (dict(dst_kv=b"junk"), "bad memory descriptor: junk"),
    (dict(dst_ctx=b"junk"), "bad memory descriptor: junk"),
    (dict(dst_kv=b"small"), "KV descriptor smaller than the advertised layout"),
    (dict(ctx_offset=4 * LAYOUT.context_bytes),
     "context offset outside the context buffer's slots"),
    (dict(dst_kv=b"elsewhere"), "KV descriptor on an endpoint the context descriptor is not on"),
])
def test_a_bad_request_or_descriptor_is_refused_bad_request(kw: dict[str, Any],
                                                            message: str) -> None:
    assert checked(request(**kw)) == Refuse("bad_request", message)


def test_ids_checked_as_they_were_decoded_are_not_checked_again() -> None:
    req = request(prompt_ids=[1, 100] + list(range(2, 10)))
    assert isinstance(destinations(LAYOUT, 100, req, decode, 1, ids_in_vocab=True),
                      Destinations)


def test_a_valid_request_is_admitted_with_its_pages_and_budget() -> None:
    req = request()
    dest = checked(req)
    assert isinstance(dest, Destinations)
    v = verdict(LAYOUT, req, dest, facts())
    assert isinstance(v, Admit) and v.dest is dest
    assert v.pages == 3  # 10 tokens of page size 4
    assert 0 < v.cap_s <= 60


@pytest.mark.parametrize("kw, expected", [
    (dict(duplicate=True), Refuse("bad_request", "duplicate request id 'r1'")),
    (dict(owned="refused"), Refuse("bad_request", NOT_OWNED)),
    (dict(busy="peer over its share"), Refuse("overloaded", "peer over its share")),
    (dict(free_slots=0), Refuse("overloaded", "too many jobs")),
    (dict(now_unix=NOW + 61), Refuse("timeout", TOO_LATE)),
])
def test_each_refusal_of_a_valid_request(kw: dict[str, Any], expected: Refuse) -> None:
    req = request()
    dest = checked(req)
    assert isinstance(dest, Destinations)
    assert verdict(LAYOUT, req, dest, facts(**kw)) == expected


def test_an_unproven_connection_waits_for_its_check_before_any_room_is_asked() -> None:
    req = request()
    dest = checked(req)
    assert isinstance(dest, Destinations)
    # no job slot, no deadline, nor the peer's share matter before the check
    assert verdict(LAYOUT, req, dest, facts(owned="unknown", free_slots=0, busy="x",
                                            now_unix=NOW + 61)) == Park(dest)
    # a duplicate is refused at once, and a failed check wins over a full table
    assert verdict(LAYOUT, req, dest, facts(owned="unknown", duplicate=True)).code == \
        "bad_request"  # type: ignore[union-attr]
    assert verdict(LAYOUT, req, dest, facts(owned="refused", free_slots=0)) == \
        Refuse("bad_request", NOT_OWNED)
