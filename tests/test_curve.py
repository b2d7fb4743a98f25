"""CURVE: with --curve-keys, peers without the keys can submit neither requests nor prefills."""

from __future__ import annotations

import subprocess
import sys

import msgspec
import pytest
import zmq

from disagg.client import Client
from disagg.protocol import SamplingParams
from disagg.security import load
from nodes import node, running, wait_for
from tinymodels import hf_greedy, make_tiny_model

pytestmark = pytest.mark.fabric


@pytest.fixture(scope="module")
def secured(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("curve")
    keys = tmp / "keys"
    out = subprocess.run([sys.executable, "-m", "disagg", "keygen", str(keys)], check=True,
                         capture_output=True, text=True)
    assert "wrote CURVE keys" in out.stdout
    model = make_tiny_model("llama", tmp / "llama")
    curve = ["--num-pages", "64", "--curve-keys", str(keys)]
    p_addr, p = node("prefill", model, tmp, *curve)
    d_addr, d = node("decode", model, tmp, "--prefill-peer", p_addr, "--heartbeat", "0.2", *curve)
    with running([p, d]):  # Stats need the keys: the tests wait for the prefiller themselves
        yield load(keys), p_addr, d_addr, model


def test_client_with_keys_is_served_over_curve(secured):
    keys, p_addr, d_addr, model = secured
    c = Client(d_addr, keys)
    try:
        wait_for(lambda: c.stats(timeout=5).prefill_peers_alive == 1, what="prefiller seen")
        ids = [t for m in c.generate(prompt_token_ids=list(range(5, 14)),
                                     sampling=SamplingParams(max_tokens=4, ignore_eos=True))
               for t in getattr(m, "token_ids", [])]
        assert ids == hf_greedy(model, list(range(5, 14)), 4)
        assert c.stats().kv_units_received > 0  # the KV came over the fabric from the prefiller
    finally:
        c.close()


@pytest.mark.parametrize("target", ["decode", "prefill"])
def test_peer_without_keys_gets_nothing_in(secured, target):
    keys, p_addr, d_addr, _ = secured
    addr = d_addr if target == "decode" else p_addr
    before = Client(addr, keys).stats().started
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(addr)
    msg = ({"type": "generate", "request_id": "x", "prompt_token_ids": [5, 6, 7]}
           if target == "decode" else {"type": "stats"})
    sock.send(msgspec.msgpack.encode(msg))
    assert sock.poll(1500) == 0  # no handshake, no reply
    sock.close()
    ctx.term()
    c = Client(addr, keys)
    try:
        assert c.stats().started == before  # nothing was admitted
    finally:
        c.close()


def test_wrong_keys_are_refused(secured, tmp_path):
    from disagg.security import keygen

    _, _, d_addr, _ = secured
    other = keygen(tmp_path / "other")
    c = Client(d_addr, other)
    try:
        with pytest.raises(TimeoutError):
            c.stats(timeout=1.5)
    finally:
        c.close()
