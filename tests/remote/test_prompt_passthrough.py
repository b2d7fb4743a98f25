"""A remote prefill's prompt ids are encoded once, by the decoder's frontend (``FromClient.of``):
the scheduler keeps those bytes, sends them less the last id (``drop_last_id``) with routing
keys taken from them (``encoded_prefix_keys``), and the messenger puts them into the
``PrefillRequest`` as they are, a bin (``PrefillRequestOut``): a prefiller reads the request the
plain struct holds, its ids left encoded (``PrefillRequestIn``) for its scheduler to decode."""

from __future__ import annotations

import msgspec
import pytest

from disagg.protocol import Abort, GenerateRequest
from disagg.protocol.inproc import (
    FromClient,
    SendPrefill,
    ToMessenger,
    drop_last_id,
    msgpack_array_header,
)
from disagg.protocol.peer import (
    KVLayoutDesc,
    PeerRequestIn,
    PrefillRequest,
    PrefillRequestIn,
    PrefillRequestOut,
)
from disagg.serving.routing import (
    MAX_ENCODED_BLOCKS,
    ROUTE_BLOCK_BYTES,
    encoded_prefix_keys,
    prefix_keys,
)

LAYOUT = KVLayoutDesc(num_layers=2, num_pages=8, num_kv_heads=2, page_size=4, head_dim=8,
                      dtype="float32", element_size=4, hidden_size=16)


@pytest.mark.parametrize("n", [0, 1, 15, 16, 70000])
def test_the_twin_reads_as_the_plain_request_on_a_prefiller(n: int) -> None:
    ids = [(i * 7919) % 152000 for i in range(n)]
    common = dict(request_id="r", key=5, dst_pages=[1, 2], dst_layout=LAYOUT, dst_kv=b"a",
                  dst_ctx=b"b", ctx_offset=64, timeout_s=1.5)
    for extra in ({}, dict(dst_kv_ranks=[b"x", b"y"], deadline_unix=12.5, challenge_slot=3,
                           challenge_key=9, skip_pages=1)):
        plain = PrefillRequest(prompt_ids=ids, **common, **extra)
        encoded = memoryview(msgspec.msgpack.encode(ids))
        twin = msgspec.msgpack.encode(PrefillRequestOut(prompt_ids=encoded, **common, **extra))
        got = msgspec.msgpack.decode(twin, type=PeerRequestIn)
        assert isinstance(got, PrefillRequestIn) and got.prompt_len == n
        assert bytes(got.prompt_msgpack()) == bytes(encoded)  # as sent, never decoded
        assert got.decoded() == plain


def test_send_prefill_carries_the_ids_encoded_once() -> None:
    ids = list(range(100, 300))
    msg = SendPrefill.of("r", 7, ids, [3, 4], 30.0, skip_pages=2,
                         route_keys=prefix_keys(ids, None))
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(msg), type=ToMessenger)
    assert isinstance(back, SendPrefill)
    assert back.prompt_ids() == ids and back.num_tokens == len(ids)
    assert back.route_keys == prefix_keys(ids, None) and back.skip_pages == 2
    assert bytes(back.prompt) == msgspec.msgpack.encode(ids)


@pytest.mark.parametrize("n", [1, 2, 15, 16, 17, 65535, 65536, 65537])
def test_dropping_the_last_id_of_encoded_ids_equals_encoding_all_but_it(n: int) -> None:
    for top in (100, 200, 70000, 1 << 31):  # ids of 1, 2, 3 and 5 bytes
        ids = [(i * 7919) % top for i in range(n)]
        encoded = msgspec.msgpack.encode(ids)
        assert drop_last_id(memoryview(encoded), n, ids[-1]) == msgspec.msgpack.encode(ids[:-1])
        assert msgpack_array_header(n) == encoded[:len(msgpack_array_header(n))]


def test_encoded_ids_that_are_not_what_the_caller_says_are_left_to_it() -> None:
    encoded = msgspec.msgpack.encode([5, 6, 300])
    assert drop_last_id(encoded, 3, 301) is None  # another last id
    assert drop_last_id(encoded, 4, 300) is None  # another length
    assert drop_last_id(b"", 1, 0) is None and drop_last_id(encoded, 0, 300) is None
    assert drop_last_id(msgspec.msgpack.encode("abc"), 3, 99) is None


def test_a_generate_requests_ids_travel_beside_it_and_come_back() -> None:
    req = GenerateRequest("a", prompt_token_ids=[3, 1, 4, 1, 5])
    env = msgspec.msgpack.decode(msgspec.msgpack.encode(FromClient.of(b"id", req)),
                                 type=FromClient)
    assert env.msg.prompt_token_ids is None  # type: ignore[union-attr]
    assert env.prompt is not None and bytes(env.prompt) == msgspec.msgpack.encode([3, 1, 4, 1, 5])
    assert env.generate_request() == req
    text = GenerateRequest("b", prompt="hi")
    assert FromClient.of(b"id", text).prompt is None and FromClient.of(b"id", text).msg == text
    assert FromClient.of(b"id", Abort("a")).prompt is None


def test_route_keys_from_encoded_ids_follow_the_shared_prefix() -> None:
    base = [(i * 7919) % 152000 for i in range(6000)]
    other = base[:2000] + [7] * 2000
    long = base + [1] * 70000  # an array32 header where base has an array16 one
    keys = [encoded_prefix_keys(msgspec.msgpack.encode(ids)) for ids in (base, other, long)]
    assert len(keys[0]) == MAX_ENCODED_BLOCKS and keys[0] == keys[2]
    shared = next(i for i, (a, b) in enumerate(zip(keys[0], keys[1], strict=True)) if a != b)
    assert 0 < shared <= len(msgspec.msgpack.encode(base[:2000])) // ROUTE_BLOCK_BYTES
    assert encoded_prefix_keys(b"") == [] and encoded_prefix_keys(msgspec.msgpack.encode([1])) == []
