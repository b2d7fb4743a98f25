"""The prefill node's verdict on a PrefillRequest (``disagg.remote.admission``): every refusal,
with the code and message a decoder gets, the wait for the ownership check, and a job."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from disagg.fabric.descriptor import MemoryDescriptor
from disagg.protocol.peer import KVLayoutDesc, PrefillRequest, PrefillRequestIn, PrefillRequestOut
from disagg.remote.admission import (
    NOT_OWNED,
    TOO_LATE,
    Admit,
    Destinations,
    Facts,
    Park,
    Refuse,
    destinations,
    refusal_with_ids,
    verdict,
)
from disagg.remote.ownership import CHALLENGE_AREA_BYTES
from disagg.remote.requests import NOT_IDS, OUT_OF_VOCAB

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


def arrived(req: PrefillRequest, ids: Any = None) -> PrefillRequest:
    """``req`` as a prefiller decodes it from a decoder: its ids (or ``ids``) a bin, encoded."""
    fields = msgspec.structs.asdict(req)
    fields["prompt_ids"] = memoryview(msgspec.msgpack.encode(req.prompt_ids if ids is None
                                                             else ids))
    got = msgspec.msgpack.decode(msgspec.msgpack.encode(PrefillRequestOut(**fields)),
                                 type=PrefillRequestIn)
    assert isinstance(got.prompt_ids, memoryview)
    return got


def first_refusal(req: PrefillRequest, **kw: Any) -> Destinations | Refuse | Admit | Park:
    """What the prefill messenger decides: its ids left to the scheduler, a refusal checked
    again with them."""
    v: Any = destinations(LAYOUT, 100, req, decode, 1, ids_in_vocab=True)
    if isinstance(v, Destinations):
        v = verdict(LAYOUT, req, v, facts(**kw))
    return refusal_with_ids(LAYOUT, 100, req, v) if isinstance(v, Refuse) else v


@pytest.mark.parametrize("bad_id", [100, -1])
def test_encoded_ids_outside_the_vocabulary_are_refused_first_as_before(bad_id: int) -> None:
    """The ids of a request that is refused anyway are decoded and named before whatever
    else refused it, as when every request's ids were decoded on arrival; one taken leaves
    its ids to the scheduler."""
    ids = [1, bad_id] + list(range(2, 10))
    for kw, other in ((dict(dst_kv=b"junk"), {}), ({}, dict(duplicate=True)),
                      ({}, dict(owned="refused")), ({}, dict(busy="peer share"))):
        req = arrived(request(**kw), ids)
        assert first_refusal(req, **other) == Refuse("bad_request", OUT_OF_VOCAB)
        plain = request(prompt_ids=ids, **kw)  # decoded and checked first: the same answer
        assert first_refusal(plain, **other) == refusal_with_ids(
            LAYOUT, 100, plain, Refuse("bad_request", "x")) == Refuse("bad_request", OUT_OF_VOCAB)
    assert isinstance(first_refusal(arrived(request(), ids)), Admit)  # the scheduler's to refuse
    # what comes before the ids still comes first; good ids keep the first refusal
    wide = msgspec.structs.replace(LAYOUT, num_layers=3)
    assert "num_layers" in first_refusal(arrived(request(dst_layout=wide), ids)).message  # type: ignore[union-attr]
    assert first_refusal(arrived(request(prompt_ids=[]))) == Refuse("bad_request", "empty prompt")
    assert first_refusal(arrived(request(dst_kv=b"junk"))) == Refuse(
        "bad_request", "bad memory descriptor: junk")
    assert first_refusal(arrived(request()), owned="refused") == Refuse("bad_request", NOT_OWNED)
    junk = first_refusal(arrived(request(dst_kv=b"junk"), [1, "x"]))
    assert isinstance(junk, Refuse) and junk.message.startswith(NOT_IDS)
