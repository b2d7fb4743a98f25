"""The OpenAI gateway in front of a live decode node with a prefill peer (KV over libfabric tcp
on loopback), driven by the official client: the issue's acceptance path."""

from __future__ import annotations

import json
import socket

import pytest

import nodes
from nodes import node, openai_client, running, stats, wait_for

pytestmark = pytest.mark.fabric

MODEL = "tiny-llama"
MAX_LEN = 512


@pytest.fixture(scope="module")
def model_dir(chat_llama):
    return chat_llama


@pytest.fixture(scope="module")
def pair(model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("log")
    common = ["--num-pages", "160", "--max-model-len", str(MAX_LEN), "--fabric-provider", "tcp"]
    p_addr, prefill = node("prefill", model_dir, tmp, *common)
    d_addr, decode = node("decode", model_dir, tmp, "--prefill-peer", p_addr, "--heartbeat", "0.2",
                          "--local-prefill-max-tokens", "0", *common)
    with running([prefill, decode], [d_addr]):
        yield p_addr, d_addr


@pytest.fixture(scope="module")
def gateway(pair, model_dir):
    with nodes.gateway(pair[1], model_dir, MODEL) as gw:
        yield gw


@pytest.fixture(scope="module")
def oai(gateway):
    with openai_client(gateway.url) as client:
        yield client


GREEDY = dict(temperature=0, extra_body={"ignore_eos": True})


def test_chat_and_completions_over_a_prefill_decode_pair(oai, pair):
    sent_before = stats(pair[0]).kv_writes_sent
    messages = [{"role": "user", "content": "w10 w11 w12 w13 w14 w15 w16"}]
    r = oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, **GREEDY)
    assert r.usage.prompt_tokens == 10 and r.usage.completion_tokens == 5
    chunks = list(oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=5,
                                              stream=True, stream_options={"include_usage": True},
                                              **GREEDY))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == r.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 5
    assert stats(pair[0]).kv_writes_sent > sent_before  # the prompts went through the prefiller
    ref = oai.completions.create(model=MODEL, prompt="w7 w8 w9 w10 w11", max_tokens=8, **GREEDY)
    stop = ref.choices[0].text.split()[3]
    s = oai.completions.create(model=MODEL, prompt="w7 w8 w9 w10 w11", max_tokens=8, stop=stop,
                               **GREEDY)
    assert s.choices[0].text == ref.choices[0].text[:ref.choices[0].text.index(stop)]
    assert s.choices[0].finish_reason == "stop"


def test_disconnect_frees_pages_on_both_nodes(gateway, pair):
    before = stats(pair[1])
    body = json.dumps({"model": MODEL, "prompt": "w5 w6 w7 w8 w9 w10", "max_tokens": 480,
                       "temperature": 0, "ignore_eos": True, "stream": True}).encode()
    sock = socket.create_connection((gateway.host, gateway.port), timeout=30)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    got = b""
    while b'"text":" w' not in got:
        got += sock.recv(4096)
    sock.close()
    wait_for(lambda: stats(pair[1]).aborted > before.aborted, what="abort on the decode node")
    for addr in pair:
        wait_for(lambda a=addr: (s := stats(a)).pages_free == s.pages_total and s.running == 0,
                 what=f"pages freed on {addr}")


def test_echo_prompt_logprobs_equal_on_a_mixed_node_and_a_pair(oai, pair, shared_gateway):
    """A request asking prompt logprobs is prefilled on the decoder itself (README): the echo
    logprobs equal a mixed node's, and the prefiller computes nothing for it."""
    ids = [44, 45, 46, 9, 120, 77, 3, 18, 250, 61, 11]
    kw = dict(model=MODEL, prompt=ids, max_tokens=4, echo=True, logprobs=3, **GREEDY)
    sent_before = stats(pair[0]).kv_writes_sent
    split = oai.completions.create(**kw).choices[0]
    assert stats(pair[0]).kv_writes_sent == sent_before
    with openai_client(shared_gateway.url) as mixed_client:
        mixed = mixed_client.completions.create(**kw).choices[0]
    assert split.text == mixed.text
    a, b = split.logprobs, mixed.logprobs
    assert a.tokens == b.tokens and a.text_offset == b.text_offset
    assert a.token_logprobs[0] is None and b.token_logprobs[0] is None
    assert a.token_logprobs[1:] == pytest.approx(b.token_logprobs[1:], abs=1e-5)
    for x, y in zip(a.top_logprobs[1:], b.top_logprobs[1:], strict=True):
        assert x.keys() == y.keys() and list(x.values()) == pytest.approx(list(y.values()),
                                                                           abs=1e-5)
