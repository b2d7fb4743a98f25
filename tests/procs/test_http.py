"""The OpenAI-compatible gateway in front of a real mixed node, driven by the official client."""

from __future__ import annotations

import json
import socket
import time
from typing import Any

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

import nodes
from disagg.client import Client
from disagg.model.tokenizer import Tokenizer

MODEL = nodes.SHARED_MODEL
PAGES = nodes.SHARED_PAGES
MAX_LEN = nodes.SHARED_MAX_LEN


@pytest.fixture(scope="module")
def model_dir(chat_llama):
    return chat_llama


@pytest.fixture(scope="module")
def node(shared_node):
    return shared_node


@pytest.fixture(scope="module")
def gateway(shared_gateway):
    return shared_gateway


@pytest.fixture(scope="module")
def oai(gateway):
    with nodes.openai_client(gateway.url) as client:
        yield client


GREEDY = dict(temperature=0, extra_body={"ignore_eos": True})


def test_models_and_health(oai, gateway):
    assert [m.id for m in oai.models.list().data] == [MODEL]
    import urllib.request

    with urllib.request.urlopen(gateway.url + "/health", timeout=10) as r:
        assert r.status == 200


def test_completion_non_streaming_and_streaming_agree(oai, node):
    r = oai.completions.create(model=MODEL, prompt="w5 w17 w33", max_tokens=6, **GREEDY)
    choice = r.choices[0]
    assert choice.finish_reason == "length"
    assert r.usage.prompt_tokens == 3 and r.usage.completion_tokens == 6
    assert r.usage.total_tokens == 9
    # the same tokens as the node gives over its own protocol
    c = Client(node)
    from disagg.protocol import SamplingParams, TokenChunk

    direct = "".join(m.text for m in c.generate(prompt="w5 w17 w33", sampling=SamplingParams(
        max_tokens=6, ignore_eos=True)) if isinstance(m, TokenChunk))
    c.close()
    assert choice.text == direct and len(choice.text.split()) == 6

    chunks = list(oai.completions.create(model=MODEL, prompt="w5 w17 w33", max_tokens=6,
                                         stream=True, stream_options={"include_usage": True},
                                         **GREEDY))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == choice.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
    assert chunks[-1].usage.prompt_tokens == 3


def test_completion_prompt_as_token_ids(oai):
    r = oai.completions.create(model=MODEL, prompt=[5, 17, 33], max_tokens=3, **GREEDY)
    assert r.usage.prompt_tokens == 3 and r.usage.completion_tokens == 3


def test_chat_non_streaming_and_streaming(oai, model_dir):
    messages = [{"role": "system", "content": "w9"}, {"role": "user", "content": "w10 w11"}]
    tok = Tokenizer.from_dir(model_dir)
    prompt_len = len(tok.encode(tok.apply_chat_template(messages)))
    assert prompt_len == 8  # w3 w9 w4 w3 w10 w11 w4 w5
    r = oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, **GREEDY)
    msg = r.choices[0].message
    assert msg.role == "assistant" and len(msg.content.split()) == 5
    assert r.usage.prompt_tokens == prompt_len and r.usage.completion_tokens == 5

    stream = oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=5,
                                         stream=True, stream_options={"include_usage": True},
                                         **GREEDY)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == msg.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.prompt_tokens == prompt_len
    assert chunks[-1].usage.completion_tokens == 5


def test_stop_strings(oai):
    ref = oai.completions.create(model=MODEL, prompt="w7 w8", max_tokens=10, **GREEDY)
    words = ref.choices[0].text.split()
    stop = words[4]
    cut = ref.choices[0].text.index(stop)
    want = ref.choices[0].text[:cut]
    r = oai.completions.create(model=MODEL, prompt="w7 w8", max_tokens=10, stop=[stop, "zzz"],
                               **GREEDY)
    assert r.choices[0].text == want
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens < 10
    chunks = list(oai.completions.create(model=MODEL, prompt="w7 w8", max_tokens=10, stop=stop,
                                         stream=True, **GREEDY))
    assert "".join(c.choices[0].text for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason == "stop"
    # a stop string spanning two token deltas (" w124", " w200" -> "124 w2")
    stop2 = words[4][1:] + " " + words[5][:2]
    cut2 = ref.choices[0].text.index(stop2)
    r = oai.completions.create(model=MODEL, prompt="w7 w8", max_tokens=10, stop=stop2, **GREEDY)
    assert r.choices[0].text == ref.choices[0].text[:cut2]
    assert r.choices[0].finish_reason == "stop"


def test_client_disconnect_aborts_the_request(gateway, node):
    before = nodes.stats(node)
    body = json.dumps({"model": MODEL, "prompt": "w5 w6", "max_tokens": MAX_LEN - 8,
                       "temperature": 0, "ignore_eos": True, "stream": True}).encode()
    sock = socket.create_connection((gateway.host, gateway.port), timeout=30)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    got = b""
    while b"data: " not in got:
        got += sock.recv(4096)
    assert got.startswith(b"HTTP/1.1 200")
    sock.close()  # mid-stream
    deadline = time.monotonic() + 30
    while True:
        s = nodes.stats(node)
        if s.aborted > before.aborted and s.running == 0 and s.waiting == 0:
            break
        assert time.monotonic() < deadline, f"the request was not aborted: {s}"
        time.sleep(0.05)
    assert s.pages_free == s.pages_total == PAGES
    assert s.finished == before.finished  # it did not run to the end


def scrape(url: str) -> dict[str, float]:
    import urllib.request

    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            key = s.name + "".join(f",{k}={v}" for k, v in sorted(s.labels.items()))
            out[key] = s.value
    return out


def test_metrics_parse_and_move(oai, gateway):
    m0 = scrape(gateway.url)
    assert "disagg_kv_pages_total,node=" + gateway.stats_label in m0
    assert m0["disagg_kv_pages_total,node=" + gateway.stats_label] == PAGES
    assert "disagg_kv_transfer_bytes_total,direction=sent" in m0
    oai.completions.create(model=MODEL, prompt="w5 w6", max_tokens=4, **GREEDY)
    with pytest.raises(openai.NotFoundError):
        oai.completions.create(model="nope", prompt="w5", max_tokens=4)
    m1 = scrape(gateway.url)
    assert m1["disagg_requests_total,outcome=length"] >= m0["disagg_requests_total,outcome=length"] + 1
    assert m1["disagg_generation_tokens_total"] >= m0["disagg_generation_tokens_total"] + 4
    assert m1["disagg_time_to_first_token_seconds_count"] > m0["disagg_time_to_first_token_seconds_count"]
    assert m1["disagg_e2e_request_latency_seconds_count"] > m0["disagg_e2e_request_latency_seconds_count"]
    assert m1["disagg_time_per_output_token_seconds_count"] > m0["disagg_time_per_output_token_seconds_count"]
    assert m1["disagg_inter_token_latency_seconds_count"] >= m0["disagg_inter_token_latency_seconds_count"] + 3
    assert m1["disagg_request_errors_total,code=model_not_found,type=invalid_request_error"] >= 1
    # the node's own counters arrive with the Stats poll
    deadline = time.monotonic() + 10
    key = "disagg_node_requests_total,node=" + gateway.stats_label + ",state=finished"
    while scrape(gateway.url).get(key, 0) <= m0.get(key, 0):
        assert time.monotonic() < deadline
        time.sleep(0.1)


def raw_post(url: str, path: str, body: bytes, method: str = "POST") -> tuple[int, dict]:
    import urllib.error
    import urllib.request

    req = urllib.request.Request(url + path, data=body if method == "POST" else None,
                                 method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _j(**kw: Any) -> bytes:
    base: dict[str, Any] = {"model": MODEL, "prompt": "w5 w6", "max_tokens": 4}
    base.update(kw)
    return json.dumps(base).encode()


@pytest.mark.parametrize("path, body, status, needle", [
    ("/v1/completions", b"{not json", 400, "not valid JSON"),
    ("/v1/completions", b"", 400, "empty"),
    ("/v1/completions", b"[1, 2]", 400, "invalid request"),
    ("/v1/completions", _j(max_tokens="many"), 400, "max_tokens"),
    ("/v1/completions", _j(max_tokens=10**9), 400, "maximum context length"),
    ("/v1/completions", _j(max_tokens=10**30), 400, "max_tokens"),
    ("/v1/completions", _j(max_tokens=0), 400, "max_tokens"),
    ("/v1/completions", _j(model="gpt-17"), 404, "gpt-17"),
    ("/v1/completions", _j(n=17), 400, "--max-n 16"),
    ("/v1/completions", _j(best_of=3), 400, "best_of"),
    ("/v1/completions", _j(logprobs=6), 400, "logprobs"),
    ("/v1/completions", _j(presence_penalty=9), 400, "presence_penalty"),
    ("/v1/completions", _j(logit_bias={"100000": 1}), 400, "logit_bias"),
    ("/v1/chat/completions", json.dumps({"model": MODEL, "logprobs": True, "top_logprobs": 21,
                                         "messages": [{"role": "user", "content": "w1"}]}
                                        ).encode(), 400, "top_logprobs"),
    ("/v1/completions", _j(temperature=-1), 400, "temperature"),
    ("/v1/completions", _j(top_p=0), 400, "top_p"),
    ("/v1/completions", _j(stream="yes"), 400, "stream"),
    ("/v1/completions", _j(stop=[1, 2]), 400, "stop"),
    ("/v1/completions", _j(prompt=None), 400, "prompt"),
    ("/v1/completions", _j(prompt=""), 400, "empty"),
    ("/v1/completions", _j(prompt=[5, 100000]), 400, "vocabulary"),
    ("/v1/completions", _j(prompt=["w1", [5, 100000]]), 400, "vocabulary"),
    ("/v1/completions", _j(prompt="w1 " * MAX_LEN), 400, "maximum context length"),
    ("/v1/completions", _j(seed=-3), 400, "seed"),
    ("/v1/completions", _j(min_tokens=9), 400, "min_tokens"),
    ("/v1/chat/completions", json.dumps({"model": MODEL}).encode(), 400, "messages"),
    ("/v1/chat/completions", json.dumps({"model": MODEL, "messages": "hi"}).encode(), 400,
     "messages"),
    ("/v1/chat/completions", json.dumps({"model": MODEL, "messages": [
        {"role": "user", "content": [{"type": "image_url"}]}]}).encode(), 400, "text"),
    ("/v1/nowhere", b"{}", 404, "no route"),
    ("/v1/completions", b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400,
     "nested too deeply"),
    ("/v1/completions", _j(temperature=1e-45), 400, "temperature"),
    ("/v1/completions", _j(top_p=1e-300), 400, "top_p"),
    # refused by the node (it knows the vocabulary): its bad_request is a 400
    ("/v1/completions", _j(stop_token_ids=[5, 100000]), 400, "stop_token_ids"),
    ("/v1/chat/completions", json.dumps({"model": MODEL, "messages": [
        {"role": "wizard", "content": "w1"}]}).encode(), 400, "messages[0].role"),
])
def test_bad_input_gets_4xx(gateway, path, body, status, needle):
    code, payload = raw_post(gateway.url, path, body)
    assert code == status, payload
    err = payload["error"]
    assert needle in err["message"] and err["type"] == "invalid_request_error", err


def test_null_n_stream_echo_mean_the_defaults(gateway):
    code, payload = raw_post(gateway.url, "/v1/completions", _j(n=None, stream=None, echo=None,
                                                                temperature=0))
    assert code == 200, payload
    assert payload["choices"][0]["finish_reason"] in ("length", "stop")
    body = json.dumps({"model": MODEL, "messages": [{"role": "developer", "content": "w1"},
                                                    {"role": "user", "content": "w2"}],
                       "max_tokens": 2, "n": None, "stream": None}).encode()
    code, payload = raw_post(gateway.url, "/v1/chat/completions", body)
    assert code == 200 and payload["object"] == "chat.completion", payload


def test_wrong_method_and_typed_errors(gateway, oai):
    code, payload = raw_post(gateway.url, "/v1/completions", b"", method="GET")
    assert code == 405 and "not allowed" in payload["error"]["message"]
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "w1"}],
                                    max_tokens=10**6)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        oai.chat.completions.create(model="other", messages=[{"role": "user", "content": "w1"}])
    # still serving
    r = oai.completions.create(model=MODEL, prompt="w5", max_tokens=2, **GREEDY)
    assert r.usage.completion_tokens == 2
