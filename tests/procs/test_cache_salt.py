"""The prefix cache is no oracle across tenants (issue 35, item 2): a prompt cached for one
salt gives another salt 0 cached tokens, over the client protocol and HTTP, on a mixed node
and across a prefill/decode pair (the prefiller's cache included), while the owner's repeat
hits; with CURVE client keys every key is its own tenant without asking (salting by tenant,
on by default), and only node keys see the Stats prefix counters."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from disagg.actors.router.router import start_router
from disagg.client import Client
from disagg.protocol import Finished, TokenChunk
from disagg.serving.routing import ROUTE_BLOCK
from disagg.serving.security import CurveKeys, load_client, load_node
from nodes import (
    PAGE,
    SHARED_MODEL,
    LoopThread,
    greedy,
    node,
    openai_client,
    pools_full,
    prompt,
    running,
    wait_for,
)
from tinymodels import free_port

NEW = 3


def run(addr: str, ids: list[int], salt: str | None = None,
        keys: CurveKeys | None = None) -> tuple[list[int], int]:
    """(tokens, usage.cached_tokens) of one greedy request."""
    c = Client(addr, keys)
    try:
        out: list[int] = []
        for msg in c.generate(prompt_token_ids=ids, sampling=greedy(NEW), cache_salt=salt,
                              timeout=60):
            if isinstance(msg, TokenChunk):
                out += msg.token_ids
        assert isinstance(msg, Finished)
        return out, msg.usage.cached_tokens
    finally:
        c.close()


def node_stats(addr: str, keys: CurveKeys | None = None):
    c = Client(addr, keys)
    try:
        return c.stats(timeout=10)
    finally:
        c.close()


@pytest.fixture(scope="module")
def model_dir(chat_llama) -> Path:
    return chat_llama


def test_another_salt_gets_no_cached_token_over_zmq_and_http(shared_node, shared_gateway):
    addr = shared_node  # a prompt of this test's own: nothing of it cached before
    secret = prompt(4 * PAGE + 1, salt=35)
    full = 4 * PAGE
    owner, cached = run(addr, secret, "tenant-a")
    assert cached == 0
    assert run(addr, secret, "tenant-b")[1] == 0  # the probe: nothing cached for it
    assert run(addr, secret)[1] == 0  # nor unsalted
    again, cached = run(addr, secret, "tenant-a")
    assert cached == full and again == owner  # the owner's repeat hits, same tokens
    assert run(addr, secret, "tenant-b")[1] == full  # b's own pages by now
    with openai_client(shared_gateway.url) as oai:
        def cached_over_http(salt: str) -> int:
            r = oai.completions.create(model=SHARED_MODEL, prompt=[secret], max_tokens=NEW,
                                       extra_body={"cache_salt": salt, "ignore_eos": True})
            return r.usage.prompt_tokens_details.cached_tokens
        assert cached_over_http("http-c") == 0
        assert cached_over_http("http-d") == 0
        assert cached_over_http("http-c") == full
    wait_for(lambda: pools_full(addr), what="every page free")


@pytest.fixture(scope="module")
def keydir(tmp_path_factory) -> Path:
    keys = tmp_path_factory.mktemp("salt_curve") / "keys"
    for extra in ([], ["--add-client", "bob"]):
        out = subprocess.run([sys.executable, "-m", "disagg", "keygen", str(keys), *extra],
                             capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
    return keys


@pytest.mark.fabric
def test_client_keys_are_tenants_across_a_pair_and_the_prefillers_cache(model_dir, keydir,
                                                                        tmp_path):
    """Alice and Bob send the same prompt without any salt of their own: each key is its own
    tenant (the default with CURVE). Bob's probe misses on the decoder and then on the
    prefiller (the salt travels with the decoder's request); Alice's repeat hits."""
    curve = ["--curve-keys", str(keydir / "node")]
    p_addr, p = node("prefill", model_dir, tmp_path, "--num-pages", "64", *curve)
    d_addr, d = node("decode", model_dir, tmp_path, "--num-pages", "64", "--prefill-peer",
                     p_addr, "--heartbeat", "0.2", *curve)
    alice, bob = load_client(keydir / "client"), load_client(keydir / "client-bob")
    operator = load_node(keydir / "node")
    with running([p, d]):
        wait_for(lambda: node_stats(d_addr, operator).prefill_peers_alive == 1,
                 what="prefiller seen")
        secret = prompt(4 * PAGE + 2, salt=36)
        owner, cached = run(d_addr, secret, keys=alice)
        assert cached == 0
        p_hits = node_stats(p_addr, operator).prefix_hit_tokens
        probe, cached = run(d_addr, secret, keys=bob)
        assert cached == 0 and probe == owner  # computed again, on the prefiller
        assert node_stats(p_addr, operator).prefix_hit_tokens == p_hits  # no hit there
        assert run(d_addr, secret, salt="alice?", keys=bob)[1] == 0  # a salt of bob's own
        again, cached = run(d_addr, secret, keys=alice)
        assert cached >= 4 * PAGE and again == owner
        seen = node_stats(d_addr, bob)  # a client key: the prefix counters read 0
        assert (seen.prefix_query_tokens, seen.prefix_hit_tokens) == (0, 0)
        assert seen.started > 0  # the rest of Stats as before
        assert node_stats(d_addr, operator).prefix_hit_tokens >= 4 * PAGE
        for addr in (p_addr, d_addr):
            wait_for(lambda a=addr: pools_full_with(a, operator), what=f"full pool on {addr}")


def pools_full_with(addr: str, keys: CurveKeys) -> bool:
    s = node_stats(addr, keys)
    return s.pages_free == s.pages_total


def test_a_router_salts_by_client_key_and_routes_each_tenant_to_its_own_cache(
        model_dir, keydir, tmp_path, monkeypatch):
    """Through a router (CURVE, two decode-capable nodes): Bob's copy of Alice's prompt gets
    0 cached tokens wherever it lands; Alice's repeat goes to the node holding her prefix
    (the router's keys carry her salt) and hits; Bob's Stats from the router read 0 for the
    prefix counters."""
    curve = ["--curve-keys", str(keydir / "node")]
    addrs, procs = zip(*(node("mixed", model_dir, tmp_path, "--num-pages", "48", *curve)
                         for _ in range(2)), strict=True)
    alice, bob = load_client(keydir / "client"), load_client(keydir / "client-bob")
    with running(list(procs)):
        monkeypatch.setenv("DISAGG_CURVE_KEYS", str(keydir / "node"))  # the router's keys
        lt = LoopThread()
        router, _ = lt.run(start_router(f"tcp://127.0.0.1:{free_port()}", list(addrs),
                                        poll_interval=0.2, dead_after=1.5, wait_for_peer=30))
        try:
            wait_for(lambda: len(router.balancer.alive()) == 2, what="both nodes live")
            secret = prompt(2 * ROUTE_BLOCK + 1, salt=37)
            owner, cached = run(router.address, secret, keys=alice)
            assert cached == 0
            assert run(router.address, secret, keys=bob)[1] == 0  # wherever it lands
            again, cached = run(router.address, secret, keys=alice)
            assert cached == (len(secret) - 1) // PAGE * PAGE and again == owner
            operator = load_node(keydir / "node")
            wait_for(lambda: node_stats(router.address, operator).prefix_hit_tokens > 0,
                     what="the hit in the router's Stats (node key)")
            seen = node_stats(router.address, bob)  # a client key: the prefix counters 0
            assert (seen.prefix_query_tokens, seen.prefix_hit_tokens) == (0, 0)
            assert seen.role == "router" and seen.pages_total == 2 * 48
        finally:
            lt.run(router.stop())
            lt.close()
