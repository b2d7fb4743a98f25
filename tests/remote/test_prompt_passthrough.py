"""A remote prefill's prompt ids are encoded once on the decoder (``SendPrefill.of``) and the
messenger puts those bytes into the ``PrefillRequest`` as they are (``PrefillRequestOut``):
what a prefiller reads must be exactly what the plain struct would have encoded."""

from __future__ import annotations

import msgspec
import pytest

from disagg.protocol.inproc import SendPrefill, ToMessenger
from disagg.protocol.peer import KVLayoutDesc, PeerRequest, PrefillRequest, PrefillRequestOut
from disagg.serving.routing import prefix_keys

LAYOUT = KVLayoutDesc(num_layers=2, num_pages=8, num_kv_heads=2, page_size=4, head_dim=8,
                      dtype="float32", element_size=4, hidden_size=16)


@pytest.mark.parametrize("n", [0, 1, 15, 16, 70000])
def test_the_twin_encodes_the_same_bytes(n: int) -> None:
    ids = [(i * 7919) % 152000 for i in range(n)]
    common = dict(request_id="r", key=5, dst_pages=[1, 2], dst_layout=LAYOUT, dst_kv=b"a",
                  dst_ctx=b"b", ctx_offset=64, timeout_s=1.5)
    for extra in ({}, dict(dst_kv_ranks=[b"x", b"y"], deadline_unix=12.5, challenge_slot=3,
                           challenge_key=9, skip_pages=1)):
        plain = msgspec.msgpack.encode(PrefillRequest(prompt_ids=ids, **common, **extra))
        raw = msgspec.Raw(msgspec.msgpack.encode(ids))
        twin = msgspec.msgpack.encode(PrefillRequestOut(prompt_ids=raw, **common, **extra))
        assert twin == plain
        got = msgspec.msgpack.decode(twin, type=PeerRequest)
        assert isinstance(got, PrefillRequest) and got.prompt_ids == ids


def test_send_prefill_carries_the_ids_encoded_once() -> None:
    ids = list(range(100, 300))
    msg = SendPrefill.of("r", 7, ids, [3, 4], 30.0, skip_pages=2,
                         route_keys=prefix_keys(ids, None))
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(msg), type=ToMessenger)
    assert isinstance(back, SendPrefill)
    assert back.prompt_ids() == ids and back.num_tokens == len(ids)
    assert back.route_keys == prefix_keys(ids, None) and back.skip_pages == 2
    assert bytes(back.prompt) == msgspec.msgpack.encode(ids)
