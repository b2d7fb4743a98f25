"""Cache salts outside the scheduler: routing keys (router and decoder -> prefiller), salts
derived per tenant, the front's policy (which frames are salted, whose Stats are redacted),
and the salt's validation on every way in (client protocol, OpenAI body, PrefillRequest)."""

from __future__ import annotations

import json
from array import array

import msgspec
import pytest

from disagg.protocol import MAX_CACHE_SALT, GenerateRequest, Stats
from disagg.protocol.peer import KVLayoutDesc, PrefillRequest
from disagg.remote.requests import request_problem
from disagg.serving.openai_api import (
    ApiError,
    ChatBody,
    CompletionBody,
    decode_body,
    prepare_chat,
    prepare_completion,
)
from disagg.serving.routing import (
    ROUTE_BLOCK,
    ROUTE_BLOCK_BYTES,
    PrefixIndex,
    _chain,
    encoded_prefix_keys,
    prefix_keys,
)
from disagg.serving.salting import (
    REDACTED_STATS,
    TENANT_PREFIX,
    TenantSalting,
    redact_stats,
    salt_by_tenant,
    tenant_salt,
)

IDS = list(range(1000, 1000 + 4 * ROUTE_BLOCK))
SALTS = [None, "a", "b", TENANT_PREFIX + "a"]


def test_routing_keys_of_one_prompt_share_nothing_across_salts():
    keys = {s: prefix_keys(IDS, None, s) for s in SALTS}
    flat = [k for ks in keys.values() for k in ks]
    assert all(len(ks) == 4 for ks in keys.values())
    assert len(set(flat)) == len(flat)  # no key in common between salts
    assert prefix_keys(IDS, None, "a") == keys["a"]  # the same salt: the same keys
    text = "x" * 1024
    assert set(prefix_keys(None, text, "a")).isdisjoint(prefix_keys(None, text, None))
    # unsalted: the keys as before salts (a chain from an empty root)
    assert keys[None] == _chain(memoryview(array("q", IDS)).cast("B"), ROUTE_BLOCK * 8)


def test_a_decoders_keys_for_its_prefillers_take_the_salt_too():
    enc = msgspec.msgpack.encode(IDS)
    keys = {s: encoded_prefix_keys(enc, s) for s in SALTS}
    flat = [k for ks in keys.values() for k in ks]
    assert keys[None] and len(set(flat)) == len(flat)
    assert encoded_prefix_keys(enc, "b") == keys["b"]
    assert keys[None] == _chain(memoryview(enc)[3:], ROUTE_BLOCK_BYTES, 128)  # array16 head


def test_a_salted_prefix_is_not_routed_to_the_peer_of_an_unsalted_one():
    index = PrefixIndex()
    load = {"p1": 0, "p2": 0}
    assert index.prefer(prefix_keys(IDS, None), "p1", load, 4) == "p1"
    assert index.prefer(prefix_keys(IDS, None), "p2", load, 4) == "p1"  # the known prefix
    assert index.prefer(prefix_keys(IDS, None, "b"), "p2", load, 4) == "p2"  # not b's
    assert index.prefer(prefix_keys(IDS, None, "b"), "p1", load, 4) == "p2"  # b's own


def test_tenant_salts_differ_by_tenant_and_salt_and_cannot_be_chosen():
    keys = ["K" * 40, "L" * 40]
    got = {(t, s): tenant_salt(t, s) for t in keys for s in [None, "a", "b"]}
    assert len(set(got.values())) == len(got)
    assert tenant_salt(keys[0], "a") == got[(keys[0], "a")]
    assert all(v.startswith(TENANT_PREFIX) and len(v) <= MAX_CACHE_SALT for v in got.values())
    # a tenant sending another's derived salt gets a salt of its own, not that one
    assert tenant_salt(keys[1], got[(keys[0], None)]) != got[(keys[0], None)]
    assert tenant_salt("a", "\0b") != tenant_salt("a\0", "b")


@pytest.mark.parametrize(("mode", "curve", "on"), [
    ("auto", True, True), ("auto", False, False), ("on", True, True), ("off", True, False),
    ("off", False, False)])
def test_salting_by_tenant_is_on_by_default_with_curve_client_keys(mode, curve, on):
    assert salt_by_tenant(mode, curve) is on


def test_an_unknown_mode_or_on_without_client_keys_is_refused_by_name():
    with pytest.raises(ValueError, match="--cache-salt-by-tenant"):
        salt_by_tenant("yes", True)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="--curve-keys"):
        salt_by_tenant("on", False)
    from disagg.config import CacheConfig, ConfigError, NodeConfig

    with pytest.raises(ConfigError, match="--cache-salt-by-tenant on needs --curve-keys"):
        NodeConfig(cache=CacheConfig(salt_by_tenant="on")).validate()
    with pytest.raises(ConfigError, match="--cache-salt-by-tenant"):
        CacheConfig(salt_by_tenant="yes").validate()  # type: ignore[arg-type]
    NodeConfig(cache=CacheConfig(salt_by_tenant="on"), curve_keys="/keys").validate()


def test_the_front_salts_client_keys_only_and_redacts_their_stats():
    front = TenantSalting("auto", curve_clients=True)
    req = GenerateRequest("r", prompt_token_ids=[1, 2], cache_salt="mine")
    assert front.request(req, "K" * 40).cache_salt == tenant_salt("K" * 40, "mine")
    assert front.request(req, None) is req  # a node key passes its salt on as it is
    off = TenantSalting("off", curve_clients=True)
    assert off.request(req, "K" * 40) is req
    stats = Stats("mixed", 8, 8, 4, 0, 0, 0, 0, 0, 0, 0, 0, 0, pages_cached=3,
                  prefix_query_tokens=40, prefix_hit_tokens=12)
    seen = front.stats(stats, tenant=True)
    assert all(getattr(seen, f) == 0 for f in REDACTED_STATS) and seen.pages_total == 8
    assert front.stats(stats, tenant=False) == stats and off.stats(stats, tenant=True) == stats
    assert redact_stats(stats).prefix_hit_tokens == 0


def test_a_too_long_salt_is_kept_for_admission_to_refuse():
    long = GenerateRequest("r", prompt_token_ids=[1], cache_salt="s" * (MAX_CACHE_SALT + 1))
    assert TenantSalting("on", True).request(long, "K").cache_salt == long.cache_salt
    assert "cache_salt" in (long.validate() or "")
    assert "cache_salt" in (GenerateRequest("r", prompt_token_ids=[1],
                                            cache_salt="").validate() or "")
    assert GenerateRequest("r", prompt_token_ids=[1], cache_salt="s").validate() is None


class FakeTok:
    vocab_size = 100

    def encode(self, text):
        return [int(w[1:]) for w in text.split()]

    def apply_chat_template(self, messages, add_generation_prompt=True):
        return " ".join(m["content"] for m in messages)


def test_the_openai_body_carries_cache_salt_as_vllm_accepts_it():
    body = {"model": "m", "prompt": "w1 w2", "max_tokens": 2, "cache_salt": "s1"}
    p = prepare_completion(decode_body(json.dumps(body).encode(), CompletionBody), FakeTok(),
                           "m", 64)
    assert p.cache_salt == "s1"
    chat = {"model": "m", "messages": [{"role": "user", "content": "w3"}], "cache_salt": "s2"}
    assert prepare_chat(decode_body(json.dumps(chat).encode(), ChatBody), FakeTok(), "m",
                        64).cache_salt == "s2"
    del body["cache_salt"]
    assert prepare_completion(decode_body(json.dumps(body).encode(), CompletionBody),
                              FakeTok(), "m", 64).cache_salt is None
    for bad in ["", "x" * (MAX_CACHE_SALT + 1)]:
        with pytest.raises(ApiError) as e:
            prepare_completion(decode_body(json.dumps({**body, "cache_salt": bad}).encode(),
                                           CompletionBody), FakeTok(), "m", 64)
        assert e.value.status == 400 and e.value.param == "cache_salt"
    with pytest.raises(ApiError) as e:
        decode_body(json.dumps({**body, "cache_salt": 5}).encode(), CompletionBody)
    assert e.value.param == "cache_salt"


def test_a_prefiller_refuses_a_bad_salt_by_name():
    layout = KVLayoutDesc(num_layers=2, num_pages=32, num_kv_heads=2, page_size=4, head_dim=8,
                          dtype="float32", element_size=4, hidden_size=16)
    ok = PrefillRequest("r", 1, [1, 2, 3], [0], layout, b"", b"", 0, 10.0, cache_salt="s")
    assert request_problem(layout, 100, ok) is None
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(ok), type=PrefillRequest)
    assert wire.cache_salt == "s"  # travels decoder -> prefiller
    for bad in ["", "x" * (MAX_CACHE_SALT + 1)]:
        req = msgspec.structs.replace(ok, cache_salt=bad)
        assert "cache_salt" in (request_problem(layout, 100, req) or "")
