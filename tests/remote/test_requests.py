"""Checks of a PrefillRequest at the prefiller (disagg.remote.requests): skip_pages, and its ids
against the vocabulary as they are decoded, once, by the prefiller's scheduler (``PromptIds``),
the messenger having read only their count (``PrefillRequestIn``)."""

from __future__ import annotations

import msgspec
import pytest

from disagg.protocol.peer import (
    AbortPrefill,
    KVLayoutDesc,
    PeerRequest,
    PeerRequestIn,
    PrefillRequest,
    PrefillRequestIn,
    PrefillRequestOut,
    msgpack_array_len,
)
from disagg.remote.requests import NOT_IDS, OUT_OF_VOCAB, PromptIds, request_problem
from disagg.remote.transfer_plan import request_units

LAYOUT = KVLayoutDesc(num_layers=2, num_pages=32, num_kv_heads=2, page_size=4, head_dim=8,
                      dtype="float32", element_size=4, hidden_size=16)


def req(n: int, dst_pages: list[int], skip: int = 0) -> PrefillRequest:
    return PrefillRequest("0.1", 1, list(range(1, n + 1)), dst_pages, LAYOUT, b"", b"", 0, 5.0,
                          skip_pages=skip)


def test_skip_pages_must_be_full_pages_and_dst_pages_cover_the_rest():
    assert request_problem(LAYOUT, 100, req(10, [1, 2, 3])) is None
    assert request_problem(LAYOUT, 100, req(10, [2, 3], skip=1)) is None
    assert request_problem(LAYOUT, 100, req(10, [3], skip=2)) is None
    assert "skip_pages" in request_problem(LAYOUT, 100, req(10, [], skip=3))  # page 3 is partial
    assert "destination pages" in request_problem(LAYOUT, 100, req(10, [1, 2, 3], skip=1))
    assert "skip_pages" in request_problem(LAYOUT, 100, req(10, [1, 2, 3], skip=-1))


def test_expected_units_leave_out_the_held_pages():
    full = request_units(LAYOUT, LAYOUT, 10)
    assert full == 2 * 3 + 1
    assert request_units(LAYOUT, LAYOUT, 10, skip_pages=2) == 2 * 1 + 1


def test_a_prefillers_scheduler_checks_a_jobs_ids_as_it_decodes_them():
    ids = PromptIds(100)
    assert ids.decode(msgspec.msgpack.encode([0, 1, 99])) == [0, 1, 99]
    long = list(range(70000))
    assert PromptIds(70000).decode(memoryview(msgspec.msgpack.encode(long))) == long
    assert PromptIds(69999).decode(msgspec.msgpack.encode(long)) == OUT_OF_VOCAB
    for bad_id in (100, -1, 1 << 40):
        assert ids.decode(msgspec.msgpack.encode([1, bad_id, 3])) == OUT_OF_VOCAB
    for junk in ([1, "x"], [1.5], "abc", {"a": 1}):
        assert ids.decode(msgspec.msgpack.encode(junk)).startswith(NOT_IDS)
    truncated = msgspec.msgpack.encode([1, 2, 300])[:-1]
    for junk_bytes in (truncated, b""):
        assert ids.decode(junk_bytes).startswith(NOT_IDS)


def test_a_request_decoded_on_a_prefiller_keeps_its_ids_encoded():
    union = msgspec.msgpack.Decoder(PeerRequestIn)
    good = req(10, [1, 2, 3])
    fields = msgspec.structs.asdict(good)
    fields["prompt_ids"] = memoryview(msgspec.msgpack.encode(good.prompt_ids))
    sent = msgspec.msgpack.encode(PrefillRequestOut(**fields))  # as a decoder sends it
    for wire in (sent, msgspec.msgpack.encode(good)):  # a bin, or a plain array (tools, tests)
        got = union.decode(wire)
        assert isinstance(got, PrefillRequestIn) and isinstance(got, PrefillRequest)
        assert got.prompt_len == 10 and got.decoded() == good
        assert bytes(got.prompt_msgpack()) == msgspec.msgpack.encode(good.prompt_ids)
        assert request_problem(LAYOUT, 100, got, ids_in_vocab=True) is None
    assert isinstance(union.decode(sent).prompt_ids, memoryview)  # not decoded
    assert union.decode(msgspec.msgpack.encode(AbortPrefill("x"))) == AbortPrefill("x")
    fields["prompt_ids"] = memoryview(msgspec.msgpack.encode("not an array"))
    with pytest.raises(msgspec.ValidationError, match="prompt_ids"):  # a bad frame
        union.decode(msgspec.msgpack.encode(PrefillRequestOut(**fields)))
    bad = msgspec.structs.replace(good, prompt_ids=[1, 100, 3])
    plain = msgspec.msgpack.decode(msgspec.msgpack.encode(bad), type=PeerRequest)
    assert request_problem(LAYOUT, 100, plain) == OUT_OF_VOCAB


@pytest.mark.parametrize("n", [0, 1, 15, 16, 65535, 65536, 70000])
def test_an_arrays_count_is_read_from_its_header(n: int):
    encoded = msgspec.msgpack.encode(list(range(n)))
    assert msgpack_array_len(encoded) == n
    assert msgpack_array_len(memoryview(encoded)[:3 if n < 65536 else 5]) == n
    for other in (b"", b"\xdc\x01", b"\xdd\x00\x00", msgspec.msgpack.encode("abc"),
                  msgspec.msgpack.encode({"a": 1}), msgspec.msgpack.encode(5)):
        assert msgpack_array_len(other) is None
