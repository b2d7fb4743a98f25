"""Pure parts of the OpenAI API: validation, translation, stop strings, shapes."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from disagg.serving.openai_api import (
    CHAT_ROLES,
    ApiError,
    ChatBody,
    CompletionBody,
    StopMatcher,
    decode_body,
    node_error,
    prepare_chat,
    prepare_completion,
    sse,
)


class FakeTok:
    vocab_size = 100

    def encode(self, text):
        return [int(w[1:]) for w in text.split()]

    def apply_chat_template(self, messages, add_generation_prompt=True):
        return " ".join(m["content"] for m in messages) + " w99"


def comp(**kw):
    return prepare_completion(decode_body(json.dumps(kw).encode(), CompletionBody), FakeTok(),
                              "m", 64)


def chat(**kw):
    return prepare_chat(decode_body(json.dumps(kw).encode(), ChatBody), FakeTok(), "m", 64)


def test_completion_translation():
    p = comp(model="m", prompt="w1 w2", max_tokens=5, temperature=0.5, top_p=0.9, top_k=-1,
             seed=7, stop="w3", stop_token_ids=[4], ignore_eos=True, min_tokens=2, stream=True,
             stream_options={"include_usage": True}, user="someone", frequency_penalty=0)
    assert p.prompt_token_ids == [1, 2] and p.stop == ["w3"] and p.stream and p.include_usage
    s = p.sampling
    assert (s.max_tokens, s.temperature, s.top_p, s.top_k, s.seed) == (5, 0.5, 0.9, 0, 7)
    assert s.stop_token_ids == [4] and s.ignore_eos and s.min_tokens == 2
    assert comp(prompt=[3, 4]).prompt_token_ids == [3, 4]
    assert comp(prompt=[[3, 4]]).prompt_token_ids == [3, 4]
    d = comp(prompt="w1")
    assert d.sampling.max_tokens == 16 and d.sampling.temperature == 1.0 and not d.stream


def test_chat_translation_and_default_max_tokens():
    p = chat(messages=[{"role": "user", "content": [{"type": "text", "text": "w5 "},
                                                    {"type": "text", "text": "w6"}]}],
             max_completion_tokens=3)
    assert p.prompt_token_ids == [5, 6, 99] and p.sampling.max_tokens == 3
    assert chat(messages=[{"role": "user", "content": "w5"}]).sampling.max_tokens == 62


@pytest.mark.parametrize("kw, status, param", [
    (dict(model="x", prompt="w1"), 404, "model"),
    (dict(prompt="w1", max_tokens=64), 400, "max_tokens"),
    (dict(prompt="w1 " * 64), 400, "prompt"),
    (dict(prompt="w1", n=17), 400, "n"),
    (dict(prompt="w1", n=0), 400, "n"),
    (dict(prompt=["w1", "w2", "w3"], n=6), 400, "n"),
    (dict(prompt="w1", best_of=2), 400, "best_of"),
    (dict(prompt="w1", logprobs=6), 400, "logprobs"),
    (dict(prompt="w1", presence_penalty=2.5), 400, "presence_penalty"),
    (dict(prompt="w1", frequency_penalty=-3), 400, "frequency_penalty"),
    (dict(prompt="w1", repetition_penalty=0), 400, "repetition_penalty"),
    (dict(prompt="w1", logit_bias={"w1": 1}), 400, "logit_bias"),
    (dict(prompt="w1", logit_bias={"100": 1}), 400, "logit_bias"),
    (dict(prompt="w1", logit_bias={"5": 101}), 400, "logit_bias"),
    (dict(prompt=["w1", [1, 100]]), 400, "prompt"),
    (dict(prompt=["w1", "w1 " * 64]), 400, "prompt"),
    (dict(prompt=["w1", "w1 " * 60], max_tokens=5), 400, "max_tokens"),
    (dict(prompt="w1", stop=[""]), 400, "stop"),
    (dict(prompt="w1", stop=["a"] * 17), 400, "stop"),
    (dict(prompt=[1, True]), 400, "prompt"),
    (dict(prompt=[1, 100]), 400, "prompt"),
    (dict(prompt=[]), 400, "prompt"),
    (dict(prompt={"a": 1}), 400, "prompt"),
    (dict(prompt="w1", max_tokens=1.5), 400, "max_tokens"),
    (dict(prompt="w1", temperature="hot"), 400, "temperature"),
    (dict(prompt="w1", top_k=-2), 400, "top_k"),
])
def test_completion_refusals(kw, status, param):
    with pytest.raises(ApiError) as e:
        comp(**kw)
    assert e.value.status == status and e.value.param == param, e.value.message
    assert e.value.body()["error"]["message"] == e.value.message


def test_chat_refusals():
    for kw in (dict(messages=[]), dict(messages=[{"content": "w1"}]),
               dict(messages=[{"role": "user", "content": "w1"}], tools=[{"type": "function"}]),
               dict(messages=[{"role": "user", "content": "w1"}],
                    response_format={"type": "yaml"})):
        with pytest.raises(ApiError) as e:
            chat(**kw)
        assert e.value.status == 400


def test_no_tokenizer():
    body = decode_body(b'{"prompt": "w1"}', CompletionBody)
    with pytest.raises(ApiError, match="no tokenizer"):
        prepare_completion(body, None, "m", 64)
    assert prepare_completion(decode_body(b'{"prompt": [1]}', CompletionBody), None, "m",
                              64).prompt_token_ids == [1]


def test_stop_matcher_basics():
    m = StopMatcher(["END", "xy"])
    assert m.push("abc E") == ("abc", False)  # the last 2 chars may start "END"
    assert m.push("N") == (" ", False)
    assert m.push("D more") == ("", True)
    assert m.matched == "END"
    m = StopMatcher([])
    assert m.push("abc") == ("abc", False) and m.flush() == ""
    m = StopMatcher(["zzz"])
    assert m.push("ab") == ("", False) and m.flush() == "ab"


@given(st.text(alphabet="abxy", max_size=40), st.lists(st.text(alphabet="abxy", min_size=1,
                                                                max_size=4), max_size=3),
       st.lists(st.integers(1, 5), max_size=20))
def test_stop_matcher_never_emits_what_a_stop_string_cuts(text, stops, cuts):
    pieces, i = [], 0
    for c in cuts:
        pieces.append(text[i:i + c])
        i += c
    pieces.append(text[i:])
    m = StopMatcher(stops)
    out, hit = [], False
    for p in pieces:
        o, hit = m.push(p)
        out.append(o)
        if hit:
            break
    if not hit:
        out.append(m.flush())
    # the oracle: at the first chunk boundary where some stop string is in the text so far,
    # cut at the earliest of those (a stop string ends generation as soon as it is complete)
    want, done, seen = text, False, ""
    for p in pieces:
        seen += p
        found = [seen.find(s) for s in stops if s in seen]
        if found:
            want, done = seen[:min(found)], True
            break
    assert "".join(out) == want and hit == done


def test_sse_framing():
    assert sse({"a": 1}) == b'data: {"a":1}\n\n'
    assert sse("[DONE]") == b"data: [DONE]\n\n"


def test_null_means_default_for_n_stream_echo():
    body = {"prompt": "w1", "n": None, "stream": None, "echo": None}
    p = prepare_completion(decode_body(json.dumps(body).encode(), CompletionBody), FakeTok(),
                           "m", 64)
    assert not p.stream and p.prompt_token_ids == [1]
    c = chat(messages=[{"role": "user", "content": "w1"}], n=None, stream=None)
    assert not c.stream
    assert comp(prompt="w1", n=1, stream=True).stream


def test_deeply_nested_json_is_a_400():
    deep = b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    with pytest.raises(ApiError, match="nested too deeply") as e:
        decode_body(deep, CompletionBody)
    assert e.value.status == 400 and e.value.type == "invalid_request_error"
    with pytest.raises(ApiError) as e:
        decode_body(b'{"messages": [{"role": "user", "content": "w1"}], "tools": '
                    + b"[" * 100_000 + b"]" * 100_000 + b"}", ChatBody)
    assert e.value.status == 400


@pytest.mark.parametrize("role", CHAT_ROLES)
def test_chat_roles_accepted(role):
    assert chat(messages=[{"role": role, "content": "w7"}]).prompt_token_ids == [7, 99]


@pytest.mark.parametrize("role", ["wizard", "", "USER", "function"])
def test_chat_unknown_role_names_the_message(role):
    with pytest.raises(ApiError) as e:
        chat(messages=[{"role": "user", "content": "w1"}, {"role": role, "content": "w2"}])
    assert e.value.status == 400 and e.value.param == "messages[1].role", e.value.message
    assert "messages[1].role" in e.value.message and repr(role) in e.value.message


@pytest.mark.parametrize("kw, param", [
    (dict(temperature=1e-45), "temperature"),
    (dict(top_p=1e-300), "top_p"),
    (dict(stop_token_ids=[1] * 1025), "stop_token_ids"),
    (dict(stop_token_ids=[-1]), "stop_token_ids"),
])
def test_sampling_values_the_sampler_cannot_use_are_400(kw, param):
    with pytest.raises(ApiError) as e:
        comp(prompt="w1", **kw)
    assert e.value.status == 400 and e.value.param == param, e.value.message


@pytest.mark.parametrize("code, status, kind", [
    ("bad_request", 400, "invalid_request_error"),
    ("overloaded", 429, "rate_limit_error"),
    ("internal", 500, "server_error"),
    ("prefill_failed", 502, "server_error"),
    ("unavailable", 503, "server_error"),
    ("shutting_down", 503, "server_error"),
    ("timeout", 504, "server_error"),
    ("something_new", 500, "server_error"),
])
def test_node_error_status(code, status, kind):
    e = node_error(code, "why")
    assert (e.status, e.type, e.code, e.message) == (status, kind, code, "why")


NODE_VOCAB = 50


def _node_refusal(prompt_ids=(1, 2), **sampling):
    """The message the node's own check (``prepare_prompt``) refuses a request with."""
    from disagg.protocol import GenerateRequest, SamplingParams
    from disagg.serving.admission import RequestRejected, prepare_prompt

    req = GenerateRequest("r", prompt_token_ids=list(prompt_ids),
                          sampling=SamplingParams(**sampling))
    with pytest.raises(RequestRejected) as e:
        prepare_prompt(req, None, NODE_VOCAB, 8)
    return str(e.value)


@pytest.mark.parametrize("refusal, prompt_param, param", [
    (lambda: _node_refusal(prompt_ids=[1, NODE_VOCAB]), "prompt", "prompt"),
    (lambda: _node_refusal(prompt_ids=[1, NODE_VOCAB]), "messages", "messages"),
    (lambda: _node_refusal(prompt_ids=list(range(9))), "prompt", "prompt"),
    (lambda: _node_refusal(logit_bias={NODE_VOCAB + 3: 1.0}), "prompt", "logit_bias"),
    (lambda: _node_refusal(stop_token_ids=[NODE_VOCAB]), "prompt", "stop_token_ids"),
    (lambda: _node_refusal(max_tokens=0), "prompt", "max_tokens"),
    (lambda: _node_refusal(top_p=0.0), "prompt", "top_p"),
    (lambda: _node_refusal(prompt_logprobs=21), "prompt", "logprobs"),
    (lambda: "guided_grammar: invalid grammar: undefined rule", "prompt", "guided_grammar"),
    (lambda: "tool_choice: the json constraint admits no output", "messages", "tool_choice"),
    (lambda: "request_id must have 1-256 characters", "prompt", None),
    (lambda: "structured: invalid regex", "prompt", None),
])
def test_node_refusals_name_the_request_parameter(refusal, prompt_param, param):
    """A node's bad_request reaches the client with ``param`` the parameter its message names
    (the messages here are the node's own, from its checks)."""
    e = node_error("bad_request", refusal(), prompt_param)
    assert (e.status, e.param) == (400, param), e.message
    assert e.body()["error"]["param"] == param
    assert node_error("internal", "max_tokens: whatever").param is None  # not the request's
