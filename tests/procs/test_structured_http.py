"""Structured output and tool calls through the gateway with the official openai SDK, on a
mixed node serving a tiny random llama with a byte-level BPE tokenizer and a Hermes-style chat
template: ``chat.completions.parse`` with a pydantic model, a tool loop (a forced call, the
tool's answer in the history, then text), streamed calls, guided_* extra-body keys, and bad
input refused with a 400 naming the parameter while the node keeps serving."""

from __future__ import annotations

import json
import math
import re
from typing import Literal

import openai
import pydantic
import pytest

import nodes
from nodes import node, running
from tinymodels import add_byte_bpe_tokenizer, make_tiny_model

pytest.importorskip("xgrammar")

HERMES = (
    "{% if tools %}<|im_start|>system\n<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}"
    "</tools><|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.content %}{{ m.content }}"
    "{% endif %}{% for c in m.tool_calls or [] %}<tool_call>{\"name\": \"{{ c.function.name }}"
    "\", \"arguments\": {{ c.function.arguments | tojson }}}</tool_call>{% endfor %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "weather",
           "parameters": {"type": "object", "properties": {
               "city": {"enum": ["Paris", "Rome"]}, "unit": {"enum": ["c", "f"]}},
               "required": ["city", "unit"], "additionalProperties": False}}}


class Pet(pydantic.BaseModel):
    kind: Literal["cat", "dog"]
    legs: int = pydantic.Field(ge=0, le=8)
    vaccinated: bool


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(the gateway, the node's address, the model): a mixed node whose constrained rows
    overlap their decode steps (their masks follow each launched step, ``SeqChunk.late_mask``)."""
    path = make_tiny_model("llama", tmp_path_factory.mktemp("bpe-chat") / "llama")
    add_byte_bpe_tokenizer(path, chat_template=HERMES)
    addr, proc = node("mixed", path, tmp_path_factory.mktemp("structured-node"),
                      "--num-pages", "256", "--max-model-len", "512", "--overlap-schedule", "on")
    with running([proc]), nodes.gateway(addr, path, "tiny") as g:
        yield g, addr, path


@pytest.fixture(scope="module")
def gw(served):
    return served[0]


@pytest.fixture
def oai(gw):
    with nodes.openai_client(gw.url) as client:
        yield client


def test_parse_with_a_pydantic_model(oai):
    for seed in range(3):
        done = oai.chat.completions.parse(
            model="tiny", messages=[{"role": "user", "content": "a pet"}], response_format=Pet,
            max_tokens=200, temperature=1.0, seed=seed)
        pet = done.choices[0].message.parsed
        assert isinstance(pet, Pet), done.choices[0].message.content


def test_tool_loop_forced_call_then_text(oai):
    messages = [{"role": "user", "content": "weather in Paris?"}]
    r = oai.chat.completions.create(model="tiny", messages=messages, tools=[WEATHER],
                                    tool_choice="required", parallel_tool_calls=False,
                                    max_tokens=200, seed=1)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    call = choice.message.tool_calls[0]
    args = json.loads(call.function.arguments)
    assert call.function.name == "get_weather" and args["city"] in ("Paris", "Rome")
    messages += [choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    named = oai.chat.completions.create(
        model="tiny", messages=messages, tools=[WEATHER], max_tokens=100,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert set(json.loads(named.choices[0].message.tool_calls[0].function.arguments)) == {
        "city", "unit"}
    last = oai.chat.completions.create(model="tiny", messages=messages, tools=[WEATHER],
                                       tool_choice="none", max_tokens=5)
    assert last.choices[0].message.tool_calls is None
    assert last.choices[0].finish_reason in ("stop", "length")


def test_streamed_tool_call(oai):
    stream = oai.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "weather?"}], tools=[WEATHER],
        tool_choice="required", parallel_tool_calls=False, max_tokens=200, stream=True,
        seed=2)
    calls, reasons = [], []
    for ch in stream:
        delta = ch.choices[0].delta
        calls += delta.tool_calls or []
        reasons.append(ch.choices[0].finish_reason)
    assert reasons[-1] == "tool_calls"
    head, pieces = calls[0], calls[1:]
    assert head.id and head.function.name == "get_weather" and head.function.arguments == ""
    assert len(pieces) > 1 and all(p.id is None and p.index == 0 for p in pieces)
    args = json.loads("".join(p.function.arguments for p in pieces))  # streamed in pieces
    assert set(args) == {"city", "unit"}


def test_n_choices_with_tools_each_parse_their_own_calls(oai):
    """n = 3 with tools: each choice its own calls, whole and streamed (the same seeded
    outputs: streamed, each choice's header and argument pieces join to its whole calls)."""
    kw = dict(model="tiny", messages=[{"role": "user", "content": "weather?"}], tools=[WEATHER],
              tool_choice="required", parallel_tool_calls=False, max_tokens=200, n=3,
              temperature=1.0, seed=5)
    whole = oai.chat.completions.create(**kw)
    assert sorted(c.index for c in whole.choices) == [0, 1, 2]
    want = {}
    for c in whole.choices:
        assert c.finish_reason == "tool_calls" and c.message.tool_calls, c
        want[c.index] = [(t.function.name, t.function.arguments) for t in c.message.tool_calls]
        assert all(set(json.loads(a)) == {"city", "unit"} for _, a in want[c.index])
    got: dict[int, dict[int, list[str]]] = {0: {}, 1: {}, 2: {}}
    reasons = {}
    for ch in oai.chat.completions.create(stream=True, **kw):
        for c in ch.choices:
            for t in c.delta.tool_calls or []:
                if t.id is not None:
                    got[c.index][t.index] = [t.function.name, ""]
                else:
                    got[c.index][t.index][1] += t.function.arguments
            if c.finish_reason is not None:
                reasons[c.index] = c.finish_reason
    assert reasons == {0: "tool_calls", 1: "tool_calls", 2: "tool_calls"}
    assert {k: [tuple(v[i]) for i in sorted(v)] for k, v in got.items()} == want


def test_guided_keys_in_extra_body(oai):
    r = oai.completions.create(model="tiny", prompt="pick", max_tokens=20,
                               extra_body={"guided_choice": ["alpha", "beta"]})
    assert r.choices[0].text in ("alpha", "beta")
    r = oai.completions.create(model="tiny", prompt="x", max_tokens=20, temperature=1.0,
                               extra_body={"guided_regex": "[0-9]{2,4}"})
    assert re.fullmatch("[0-9]{2,4}", r.choices[0].text)


def test_constrained_logprobs_list_only_admitted_tokens(oai):
    """Logprobs of a constrained request are of the masked distribution: alternatives the
    grammar does not admit are left out (fewer than asked), and no value is null (-inf)."""
    r = oai.completions.create(model="tiny", prompt="pick", max_tokens=20, logprobs=5,
                               extra_body={"guided_choice": ["alpha", "beta"]})
    lp = r.choices[0].logprobs
    assert r.choices[0].text in ("alpha", "beta") and lp.tokens
    assert all(isinstance(v, float) and math.isfinite(v) for v in lp.token_logprobs)
    for top in lp.top_logprobs:
        assert 1 <= len(top) <= 5 and all(isinstance(v, float) and math.isfinite(v)
                                           for v in top.values())
        assert sum(math.exp(v) for v in top.values()) <= 1 + 1e-4
    assert min(len(top) for top in lp.top_logprobs) < 5  # the text's end admits only EOS
    chat = oai.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "pick"}], max_tokens=20,
        logprobs=True, top_logprobs=20, extra_body={"guided_choice": ["alpha", "beta"]})
    content = chat.choices[0].logprobs.content
    assert "".join(e.token for e in content).startswith(chat.choices[0].message.content)
    assert [t.token for t in content[-1].top_logprobs] == [content[-1].token]  # EOS alone
    for e in content:
        assert isinstance(e.logprob, float) and math.isfinite(e.logprob)
        assert 1 <= len(e.top_logprobs) < 20
        assert all(isinstance(t.logprob, float) and math.isfinite(t.logprob)
                   for t in e.top_logprobs)


def test_constrained_steps_overlap_with_their_masks_sent_late(served, oai):
    """Every row constrained: the decode steps still overlap (the masks follow each step the
    node launched ahead of the token they need), and the outputs obey the grammar."""
    before = nodes.stats(served[1]).steps_overlapped
    r = oai.completions.create(model="tiny", prompt="y", max_tokens=24, temperature=1.0, n=3,
                               seed=3, extra_body={"guided_regex": "[a-f]{12,20}!"})
    assert all(re.fullmatch("[a-f]{12,20}!", c.text) for c in r.choices), r.choices
    assert nodes.stats(served[1]).steps_overlapped > before


@pytest.mark.parametrize("env, overlap", [({"DISAGG_EXECUTOR_MASKS": "0"}, "on"),
                                          ({"DISAGG_EXECUTOR_MASKS": "0"}, "off"),
                                          ({}, "off")])
def test_late_masks_other_ways_give_the_same_outputs(served, oai, tmp_path, env, overlap):
    """The other ways to the masks draw the same seeded outputs as the default (each
    executor filling every mask from its own copies of the matchers,
    ``disagg.engine.grammar_mirror``, with overlapped decoding):
    ``DISAGG_EXECUTOR_MASKS=0``, the scheduler's pass filling them and sending them (a late
    step's masks before the next plan), and the default without overlapped decoding (each
    step's masks filled as it is launched)."""
    ask = dict(model="tiny", prompt="y", max_tokens=24, temperature=1.0, n=3, seed=5,
               extra_body={"guided_json": {"type": "object", "properties": {
                   "a": {"enum": ["x", "yy"]}, "b": {"type": "boolean"}},
                   "required": ["a", "b"], "additionalProperties": False}})
    want = [c.text for c in oai.completions.create(**ask).choices]
    addr, proc = node("mixed", served[2], tmp_path, "--num-pages", "256", "--max-model-len",
                      "512", "--overlap-schedule", overlap, env=env)
    with running([proc]), nodes.gateway(addr, served[2], "tiny") as g, \
            nodes.openai_client(g.url) as other:
        got = [c.text for c in other.completions.create(**ask).choices]
        assert (nodes.stats(addr).steps_overlapped > 0) is (overlap == "on")
    assert "out of step" not in proc.log_path.read_text()
    assert got == want and all(json.loads(t)["a"] in ("x", "yy") for t in want), (got, want)


@pytest.mark.parametrize("ranks", [["--tp", "2"], ["--devices", "cpu", "--dp", "2"]])
def test_executor_ranks_fill_the_same_masks(served, oai, tmp_path, ranks):
    """``--tp 2`` / ``--dp 2``: each rank keeps its own
    copies of the matchers (of every row, or of its own rows) and fills its own masks; the
    greedy constrained outputs equal the default one-executor node's."""
    asks = [dict(model="tiny", prompt=p, max_tokens=20, temperature=0.0,
                 extra_body={"guided_regex": "[a-f]{3,12}(!|\\?)"}) for p in ("q", "zz", "pet")]
    want = [oai.completions.create(**a).choices[0].text for a in asks]
    addr, proc = node("mixed", served[2], tmp_path, "--num-pages", "256", "--max-model-len",
                      "512", "--overlap-schedule", "on", *ranks)
    with running([proc]), nodes.gateway(addr, served[2], "tiny") as g, \
            nodes.openai_client(g.url) as other:
        got = [other.completions.create(**a).choices[0].text for a in asks]
        assert nodes.stats(addr).steps_overlapped > 0
    assert "out of step" not in proc.log_path.read_text()
    assert got == want and all(re.fullmatch("[a-f]{3,12}[!?]", t) for t in want), (got, want)


@pytest.mark.parametrize("kw, needle", [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "nonsense"}}}}, "response_format"),
    ({"extra_body": {"guided_grammar": "root ::= undefined_rule"}}, "guided_grammar"),
    ({"extra_body": {"guided_regex": "((("}}, "guided_regex"),
    # valid, but admitting no output at all (the node's matcher admits no first token)
    ({"extra_body": {"guided_regex": r"[^\s\S]"}}, "guided_regex"),
    ({"extra_body": {"guided_grammar": r"root ::= [^\x00-\U0010FFFF]"}}, "guided_grammar"),
    ({"tools": [{"type": "function", "function": {"parameters": {}}}]}, "tools"),
])
def test_bad_constraints_are_400_and_the_node_keeps_serving(oai, kw, needle):
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}],
                                    max_tokens=5, **kw)
    assert needle in str(e.value)
    assert e.value.param == needle  # the node's refusals (a grammar that fails to compile) too
    ok = oai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}],
                                     max_tokens=3, response_format={"type": "json_object"})
    assert ok.choices[0].message.content.startswith("{")


@pytest.mark.fabric
@pytest.mark.parametrize("env", [None, {"DISAGG_EXECUTOR_MASKS": "0"}])
def test_split_constrains_the_first_token_on_the_decoder(tmp_path_factory, env):
    """Prefill -> decode: the prefiller computes the prompt's KV (it never samples), the
    decoder's first step samples the first token under the grammar (its executors' copies of
    the matcher start there; with ``DISAGG_EXECUTOR_MASKS=0`` the scheduler's masks)."""
    path = make_tiny_model("llama", tmp_path_factory.mktemp("bpe-split") / "llama")
    add_byte_bpe_tokenizer(path, chat_template=HERMES)
    tmp = tmp_path_factory.mktemp("split-log")
    common = ["--num-pages", "160", "--max-model-len", "512", "--fabric-provider", "tcp"]
    p_addr, prefill = node("prefill", path, tmp, *common)
    d_addr, decode = node("decode", path, tmp, "--prefill-peer", p_addr, "--heartbeat", "0.2",
                          "--local-prefill-max-tokens", "0", "--overlap-schedule", "on", *common,
                          env=env)
    prompt = "a prompt long enough to go to the prefiller, " * 3
    with running([prefill, decode], [d_addr]), nodes.gateway(d_addr, path, "tiny") as g, \
            nodes.openai_client(g.url) as client:
        sent = nodes.stats(p_addr).kv_writes_sent
        free = client.completions.create(model="tiny", prompt=prompt, max_tokens=3,
                                         temperature=0, extra_body={"ignore_eos": True})
        first = free.choices[0].text[:1]
        word = "zq" if first != "z" else "qz"
        got = client.completions.create(model="tiny", prompt=prompt, max_tokens=10,
                                        temperature=0, extra_body={"guided_choice": [word]})
        assert got.choices[0].text == word and got.choices[0].finish_reason == "stop"
        assert nodes.stats(p_addr).kv_writes_sent > sent  # prefilled remotely
