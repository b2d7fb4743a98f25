"""Checks of a PrefillRequest at the prefiller (disagg.remote.requests): skip_pages, and its ids
against the vocabulary as they are decoded (``in_vocab_requests``)."""

from __future__ import annotations

import msgspec
import pytest

from disagg.protocol.peer import (
    AbortPrefill,
    KVLayoutDesc,
    PeerRequest,
    PrefillRequest,
    in_vocab_requests,
)
from disagg.remote.requests import request_problem
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


def test_a_prefiller_checks_a_requests_ids_as_it_decodes_them():
    union, checked = in_vocab_requests(100)
    dec = msgspec.msgpack.Decoder(union)
    good = req(10, [1, 2, 3])
    got = dec.decode(msgspec.msgpack.encode(good))
    assert isinstance(got, checked) and isinstance(got, PrefillRequest)
    assert msgspec.structs.asdict(got) == msgspec.structs.asdict(good)
    assert msgspec.msgpack.encode(got) == msgspec.msgpack.encode(good)
    assert request_problem(LAYOUT, 100, got, ids_in_vocab=True) is None
    assert dec.decode(msgspec.msgpack.encode(AbortPrefill("x"))) == AbortPrefill("x")
    for bad_id in (100, -1):
        bad = msgspec.structs.replace(good, prompt_ids=[1, bad_id, 3])
        with pytest.raises(msgspec.ValidationError, match="prompt_ids"):
            dec.decode(msgspec.msgpack.encode(bad))
        plain = msgspec.msgpack.decode(msgspec.msgpack.encode(bad), type=PeerRequest)
        assert request_problem(LAYOUT, 100, plain) == "token id outside the vocabulary"
