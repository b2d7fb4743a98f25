"""Logprobs, echo, n > 1, batched prompts, penalties and logit_bias through the OpenAI gateway
in front of the shared mixed node, driven by the official client (issue 34, part A wiring; the
math is checked in-process, tests/engine/test_logprobs.py)."""

from __future__ import annotations

import json
import urllib.request

import pytest
import torch

import nodes

MODEL = nodes.SHARED_MODEL
PAGE = nodes.PAGE
GREEDY = dict(temperature=0, extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def oai(shared_gateway):
    with nodes.openai_client(shared_gateway.url) as client:
        yield client


@pytest.fixture(scope="module")
def hf(chat_llama):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(chat_llama,
                                                             dtype=torch.float32).eval()


def words(ids: list[int]) -> str:
    return " ".join(f"w{i}" for i in ids)


def test_chat_logprobs_streaming_and_not(oai):
    messages = [{"role": "user", "content": "w21 w22 w23"}]
    r = oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, logprobs=True,
                                    top_logprobs=3, **GREEDY)
    content = r.choices[0].logprobs.content
    assert len(content) == 5
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].token == entry.token  # greedy: the most likely
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)
        assert entry.bytes == list(entry.token.encode())
    assert [e.token for e in content] == r.choices[0].message.content.split()  # word tokens
    chunks = list(oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=5,
                                              logprobs=True, top_logprobs=3, stream=True,
                                              **GREEDY))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs
                for e in c.choices[0].logprobs.content]
    assert [(e.token, round(e.logprob, 5)) for e in streamed] == \
        [(e.token, round(e.logprob, 5)) for e in content]
    plain = oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, **GREEDY)
    assert plain.choices[0].logprobs is None
    assert plain.choices[0].message.content == r.choices[0].message.content


def test_completions_echo_logprobs_equal_transformers(oai, hf):
    ids = [31, 32, 40, 7, 99, 12, 5, 61, 8]
    r = oai.completions.create(model=MODEL, prompt=ids, max_tokens=3, echo=True, logprobs=2,
                               **GREEDY)
    lp = r.choices[0].logprobs
    assert r.choices[0].text.startswith(words(ids))
    assert len(lp.tokens) == len(ids) + 3 and lp.token_logprobs[0] is None
    assert lp.top_logprobs[0] is None
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)
    for i in range(1, len(ids)):
        assert lp.token_logprobs[i] == pytest.approx(float(ref[i - 1, ids[i]]), abs=1e-4)
        assert len(lp.top_logprobs[i]) == 2
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    # usage: the prompt computed whole (prompt logprobs need every position)
    assert r.usage.prompt_tokens_details.cached_tokens == 0


def test_n_choices_one_prefill_distinct_seeds(oai, shared_node):
    prompt = words(nodes.prompt(23, salt=34))
    before = nodes.stats(shared_node)
    kw = dict(model=MODEL, prompt=prompt, max_tokens=6, n=4, temperature=1.0, seed=1234,
              extra_body={"ignore_eos": True})
    r = oai.completions.create(**kw)
    after = nodes.stats(shared_node)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    texts = [c.text for c in r.choices]
    assert len(set(texts)) > 1  # distinct seeds
    assert [c.text for c in oai.completions.create(**kw).choices] == texts  # reproducible
    one = oai.completions.create(**{**kw, "n": 1})
    assert one.choices[0].text == texts[0]  # choice 0 draws with the request's seed
    full = (23 - 1) // PAGE * PAGE  # the prompt's full pages (its last token always computed)
    assert after.prefix_hit_tokens - before.prefix_hit_tokens >= 3 * full
    assert r.usage.prompt_tokens == 23 and r.usage.completion_tokens == 24
    assert r.usage.prompt_tokens_details.cached_tokens >= full


def test_echo_logprobs_with_n_choices_prefill_the_prompt_once(oai, shared_node):
    """echo + logprobs with n > 1: only choice 0 asks the prompt's logprobs (which take
    nothing from the prefix cache); the others get a copy and take the prompt's pages from the
    cache, whole and streamed."""
    ids = nodes.prompt(23, salt=35)
    full = (23 - 1) // PAGE * PAGE  # the prompt's full pages (its last token always computed)
    kw = dict(model=MODEL, prompt=ids, max_tokens=3, n=3, echo=True, logprobs=2,
              temperature=1.0, seed=8, extra_body={"ignore_eos": True})
    before = nodes.stats(shared_node)
    r = oai.completions.create(**kw)
    after = nodes.stats(shared_node)
    assert after.prefix_hit_tokens - before.prefix_hit_tokens >= 2 * full
    assert r.usage.prompt_tokens_details.cached_tokens >= full
    prompt_parts = [(c.logprobs.tokens[:23], c.logprobs.token_logprobs[:23],
                     c.logprobs.top_logprobs[:23], c.logprobs.text_offset[:23])
                    for c in r.choices]
    assert prompt_parts[0][1][0] is None and all(v is not None for v in prompt_parts[0][1][1:])
    assert prompt_parts[1] == prompt_parts[0] and prompt_parts[2] == prompt_parts[0]
    assert all(len(c.logprobs.tokens) == 23 + 3 for c in r.choices)
    before = nodes.stats(shared_node)
    streamed: dict[int, list] = {0: [], 1: [], 2: []}
    for chunk in oai.completions.create(stream=True, **{**kw, "seed": 9}):
        for c in chunk.choices:
            if c.logprobs is not None:
                streamed[c.index] += c.logprobs.token_logprobs
    after = nodes.stats(shared_node)
    assert after.prefix_hit_tokens - before.prefix_hit_tokens >= 2 * full
    assert all(len(v) == 23 + 3 for v in streamed.values())
    assert streamed[0][:23] == streamed[1][:23] == streamed[2][:23] == prompt_parts[0][1]


def test_n_streaming_chat(oai):
    chunks = list(oai.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "w50 w51"}], max_tokens=4, n=2,
        temperature=0.8, seed=5, stream=True, stream_options={"include_usage": True},
        extra_body={"ignore_eos": True}))
    text = {0: "", 1: ""}
    finished = set()
    for c in chunks:
        for ch in c.choices:
            text[ch.index] += ch.delta.content or ""
            if ch.finish_reason:
                finished.add(ch.index)
    assert finished == {0, 1} and all(text.values())
    assert chunks[-1].usage.completion_tokens == 8


def test_batched_prompts_equal_single_requests(oai):
    prompts = ["w60 w61 w62", "w70 w71", [80, 81, 82, 83]]
    r = oai.completions.create(model=MODEL, prompt=prompts, max_tokens=4, n=2, **GREEDY)
    assert [c.index for c in r.choices] == list(range(6))
    for i, p in enumerate(prompts):
        single = oai.completions.create(model=MODEL, prompt=p, max_tokens=4, **GREEDY)
        assert r.choices[2 * i].text == r.choices[2 * i + 1].text == single.choices[0].text
    assert r.usage.prompt_tokens == 3 + 2 + 4 and r.usage.completion_tokens == 24


def test_logit_bias_and_penalties_reach_the_sampler(oai):
    r = oai.completions.create(model=MODEL, prompt="w90 w91", max_tokens=5,
                               logit_bias={"17": 100}, **GREEDY)
    assert r.choices[0].text.split() == ["w17"] * 5
    base = oai.completions.create(model=MODEL, prompt="w90 w91", max_tokens=8, **GREEDY)
    assert len(set(base.choices[0].text.split())) == 8
    # negative penalties reward repeats: the output loops where greedy alone did not
    pen = oai.completions.create(model=MODEL, prompt="w90 w91", max_tokens=8,
                                 frequency_penalty=-2.0, presence_penalty=-2.0, **GREEDY)
    assert len(set(pen.choices[0].text.split())) < 8
    rep = oai.completions.create(model=MODEL, prompt="w90 w91", max_tokens=8,
                                 extra_body={"ignore_eos": True, "repetition_penalty": 0.05},
                                 temperature=0)
    assert len(set(rep.choices[0].text.split())) < 8


def test_bad_logprob_requests_named(shared_gateway):
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "w1"}],
                       "top_logprobs": 3}).encode()
    req = urllib.request.Request(shared_gateway.url + "/v1/chat/completions", body,
                                 {"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=30)
    err = json.loads(e.value.read())["error"]
    assert e.value.code == 400 and err["param"] == "top_logprobs"


def test_disagg_client_sampling_flags(shared_node):
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", "from disagg.cli.client import main; main()", "--connect",
         shared_node,
         "--prompt-token-ids", "5,6,7", "--max-tokens", "3", "--ignore-eos", "--json",
         "--logit-bias", "17:100", "--logprobs", "2", "--prompt-logprobs", "1"],
        capture_output=True, text=True, timeout=120, check=True)
    got = json.loads(out.stdout)
    assert got["token_ids"] == [17, 17, 17]
    assert [e[0] for e in got["logprobs"]] == [17, 17, 17]
    assert all(len(e[2]) == 2 and e[2][0] == 17 for e in got["logprobs"])
    assert [e[0] for e in got["prompt_logprobs"]] == [6, 7]
