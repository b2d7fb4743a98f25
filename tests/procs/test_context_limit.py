"""One context limit everywhere: a node whose KV pool is smaller than the model's context
reports the limit it enforces (Stats.max_model_len), the OpenAI gateway takes it for
/v1/models and its own checks, and a refusal names what to raise."""

from __future__ import annotations

import json
import urllib.request

import pytest

import nodes
from disagg.client import Client, RequestError
from disagg.protocol import SamplingParams
from nodes import prompt
from tinymodels import TINY

MODEL = "tiny-llama"
PAGES = 32  # 32 pages of 4 tokens: a 128-token pool, under the model's 512 positions


@pytest.fixture(scope="module")
def node(chat_llama, tmp_path_factory):
    addr, proc = nodes.node("mixed", chat_llama, tmp_path_factory.mktemp("ctx-log"),
                            "--num-pages", str(PAGES))
    with nodes.running([proc]), nodes.gateway(addr, chat_llama, MODEL) as gw:
        yield addr, gw


def post(url: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_the_node_reports_the_limit_its_pool_allows(node):
    addr, _ = node
    assert TINY["max_position_embeddings"] > PAGES * nodes.PAGE
    assert nodes.stats(addr).max_model_len == PAGES * nodes.PAGE


def test_the_gateway_advertises_and_enforces_the_nodes_limit(node):
    _, gw = node
    with urllib.request.urlopen(gw.url + "/v1/models", timeout=10) as r:
        assert json.loads(r.read())["data"][0]["max_model_len"] == PAGES * nodes.PAGE
    code, payload = post(gw.url + "/v1/completions",
                         {"model": MODEL, "prompt": prompt(200), "max_tokens": 1})
    assert code == 400, payload
    err = payload["error"]
    assert err["code"] == "context_length_exceeded" and str(PAGES * nodes.PAGE) in err["message"]
    code, payload = post(gw.url + "/v1/completions",
                         {"model": MODEL, "prompt": prompt(120), "max_tokens": 20})
    assert code == 400 and "max_tokens" == payload["error"]["param"], payload


def test_a_refusal_names_the_kv_pool_not_max_model_len(node):
    addr, _ = node
    c = Client(addr)
    try:
        with pytest.raises(RequestError) as e:
            list(c.generate(prompt_token_ids=prompt(200), sampling=SamplingParams(max_tokens=1)))
    finally:
        c.close()
    assert e.value.error.code == "bad_request"
    assert "KV pool" in e.value.error.message and "--max-model-len" not in e.value.error.message


def test_a_multi_megabyte_prompt_is_refused_from_its_size(node):
    addr, gw = node
    code, payload = post(gw.url + "/v1/completions",
                         {"model": MODEL, "prompt": "w5 " * (2 << 20), "max_tokens": 1})
    assert code == 400 and "characters" in payload["error"]["message"], payload
    c = Client(addr)
    try:
        with pytest.raises(RequestError, match="characters"):
            list(c.generate(prompt="w5 " * (2 << 20), sampling=SamplingParams(max_tokens=1)))
        # and the node serves on
        out = list(c.generate(prompt_token_ids=[5, 6], sampling=SamplingParams(max_tokens=2)))
    finally:
        c.close()
    assert out[-1].usage.completion_tokens == 2
