"""The OpenAI request surface of issue 34, part A, as pure functions: penalties, logit_bias,
logprobs, echo, n and batched prompts into the client protocol; the logprobs shapes."""

from __future__ import annotations

import json

import pytest

from disagg.protocol import TokenLogprobs
from disagg.serving.openai_api import (
    ApiError,
    ChatBody,
    CompletionBody,
    decode_body,
    prepare_chat,
    prepare_completion,
)
from disagg.serving.openai_logprobs import chat_logprobs, choice_seed, completion_logprobs

from .test_openai_api import FakeTok


def comp(max_n: int = 16, **kw):
    return prepare_completion(decode_body(json.dumps(kw).encode(), CompletionBody), FakeTok(),
                              "m", 64, max_n)


def chat(**kw):
    return prepare_chat(decode_body(json.dumps(kw).encode(), ChatBody), FakeTok(), "m", 64)


def test_processors_map_onto_sampling_params():
    s = comp(prompt="w1", presence_penalty=0.5, frequency_penalty=-1, repetition_penalty=1.2,
             logit_bias={"7": -100, "8": 2.5}).sampling
    assert (s.presence_penalty, s.frequency_penalty, s.repetition_penalty) == (0.5, -1.0, 1.2)
    assert s.logit_bias == {7: -100.0, 8: 2.5}
    plain = comp(prompt="w1").sampling
    assert not plain.processed and plain.logprobs is None and plain.prompt_logprobs is None


def test_logprobs_and_echo():
    p = comp(prompt="w1 w2", logprobs=3, echo=True)
    assert p.sampling.logprobs == 3 and p.sampling.prompt_logprobs == 3 and p.echo
    assert p.prompt_texts == ["w1 w2"]
    p = comp(prompt="w1", echo=True)  # echo alone: the text, no logprobs computed
    assert p.echo and p.sampling.prompt_logprobs is None and p.sampling.logprobs is None
    c = chat(messages=[{"role": "user", "content": "w1"}], logprobs=True, top_logprobs=20)
    assert c.sampling.logprobs == 20 and c.sampling.prompt_logprobs is None
    assert chat(messages=[{"role": "user", "content": "w1"}], logprobs=True).sampling.logprobs == 0
    assert chat(messages=[{"role": "user", "content": "w1"}],
                logprobs=False).sampling.logprobs is None


@pytest.mark.parametrize("kw, param", [
    (dict(logprobs=True, top_logprobs=21), "top_logprobs"),
    (dict(top_logprobs=2), "top_logprobs"),
    (dict(n=17), "n"),
    (dict(logit_bias={"1": 1e300}), "logit_bias"),
])
def test_chat_refusals_name_the_parameter(kw, param):
    with pytest.raises(ApiError) as e:
        prepare_chat(decode_body(json.dumps({"messages": [{"role": "user", "content": "w1"}],
                                             **kw}).encode(), ChatBody), FakeTok(), "m", 64)
    assert e.value.status == 400 and e.value.param == param, e.value.message


def test_n_and_batched_prompts():
    p = comp(prompt=["w1 w2", [3, 4, 5]], n=3, max_n=6)
    assert p.all_prompts == [[1, 2], [3, 4, 5]] and p.n == 3
    assert p.prompt_texts == ["w1 w2", None]
    with pytest.raises(ApiError) as e:
        comp(prompt=["w1", "w2"], n=4, max_n=6)
    assert e.value.param == "n" and "--max-n 6" in e.value.message
    assert comp(prompt="w1").all_prompts == [[1]] and comp(prompt="w1").n == 1


def test_choice_seeds_distinct_and_reproducible():
    seeds = [choice_seed(7, j) for j in range(16)]
    assert seeds[0] == 7 and len(set(seeds)) == 16
    assert seeds == [choice_seed(7, j) for j in range(16)]
    assert all(0 <= s < 2**63 for s in seeds)
    assert choice_seed(8, 1) != choice_seed(7, 1)


def text(tid: int) -> str:
    return f"w{tid} "


def test_chat_logprobs_shape():
    out = chat_logprobs([TokenLogprobs(5, -0.5, [5, 6], [-0.5, -1.5])], text)
    assert out == {"content": [{"token": "w5 ", "logprob": -0.5, "bytes": list(b"w5 "),
                                "top_logprobs": [
                                    {"token": "w5 ", "logprob": -0.5, "bytes": list(b"w5 ")},
                                    {"token": "w6 ", "logprob": -1.5, "bytes": list(b"w6 ")}]}]}


def test_completion_logprobs_legacy_shape_with_echo():
    prompt = ([1, 22], [TokenLogprobs(22, -2.0, [3], [-0.1])])
    out = completion_logprobs([TokenLogprobs(4, -0.25, [4], [-0.25])], text, prompt=prompt)
    assert out["tokens"] == ["w1 ", "w22 ", "w4 "]
    assert out["token_logprobs"] == [None, -2.0, -0.25]
    assert out["top_logprobs"] == [None, {"w3 ": -0.1}, {"w4 ": -0.25}]
    assert out["text_offset"] == [0, 3, 7]
    later = completion_logprobs([TokenLogprobs(9, -1.0)], text, offset=7)
    assert later["text_offset"] == [7] and later["top_logprobs"] == [{}]
