"""Tool calling (disagg.serving.tool_calls) and output constraints (disagg.serving.structured)
as the gateway maps them: the parsers of each family, whole and streamed in every split, the
forced-call grammars, and bad input named."""

from __future__ import annotations

import json
import random

import jsonschema
import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from disagg.serving.openai_api import ApiError, ChatBody, prepare_chat
from disagg.serving.structured import StructuredError, structured_output
from disagg.serving.tool_calls import (
    DS_CALL_BEGIN,
    DS_CALL_END,
    DS_CALLS_BEGIN,
    DS_CALLS_END,
    DS_SEP,
    ToolError,
    apply_tool_calls,
    family_of,
    plan_tools,
)
from disagg.serving.tool_stream import ToolStream

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"tz": {"enum": ["utc", "cet"]}}, "required": ["tz"]}}}

HERMES_OUT = ('Let me look. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
              '\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "utc"}}\n'
              '</tool_call>')
LLAMA_OUT = ('{"name": "get_weather", "parameters": {"city": "Paris"}}; '
             '{"name": "get_time", "parameters": {"tz": "utc"}}')
DS_OUT = (f"Sure.{DS_CALLS_BEGIN}{DS_CALL_BEGIN}function{DS_SEP}get_weather\n```json\n"
          f'{{"city": "Paris"}}\n```{DS_CALL_END}{DS_CALL_BEGIN}function{DS_SEP}get_time\n'
          f'```json\n{{"tz": "utc"}}\n```{DS_CALL_END}{DS_CALLS_END}')
WANT = [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "utc"})]


def plan(family, choice=None, parallel=None):
    template = {"hermes": "<tool_call>", "llama3_json": "<|python_tag|>",
                "deepseek_v3": DS_CALLS_BEGIN}[family]
    p = plan_tools([WEATHER, TIME], choice, parallel, template)
    assert p is not None and p.family == family
    return p


def joined(deltas):
    """(content, calls) of streamed deltas, joined as a client does: a call's first delta
    carries its index, id, type and name (arguments ""), later ones only argument pieces."""
    content, calls = "", {}
    for d in deltas:
        content += d.get("content", "")
        for c in d.get("tool_calls", []):
            if "id" in c:
                assert c["index"] == len(calls) and c["type"] == "function"
                assert c["function"]["arguments"] == ""
                calls[c["index"]] = {"id": c["id"], "name": c["function"]["name"], "args": ""}
            else:
                assert set(c) == {"index", "function"} and set(c["function"]) == {"arguments"}
                calls[c["index"]]["args"] += c["function"]["arguments"]
    return content, [calls[i] for i in range(len(calls))]


def streamed(p, pieces):
    s = ToolStream(p)
    deltas = [d for piece in pieces for d in s.push(piece)] + s.finish()
    return s, deltas


def splits(out, seed=0):
    """Every chunk size, every cut in two, and random splits into pieces of 1-9 characters."""
    rng = random.Random(seed)
    for size in range(1, len(out) + 1):
        yield [out[i:i + size] for i in range(0, len(out), size)]
    for cut in range(1, len(out)):
        yield [out[:cut], out[cut:]]
    for _ in range(100):
        cuts, i = [], 0
        while i < len(out):
            j = i + rng.randint(1, 9)
            cuts.append(out[i:j])
            i = j
        yield cuts


def check_streams_like_whole(p, out):
    content, calls = p.parse(out)
    want = [(c.name, c.arguments) for c in calls]
    for pieces in splits(out):
        s, deltas = streamed(p, pieces)
        text, got = joined(deltas)
        assert text.strip() == (content or "").strip(), pieces
        assert [(c["name"], c["args"]) for c in got] == want, pieces
        assert s.called == bool(calls)
    return want


@pytest.mark.parametrize("family, out, content", [
    ("hermes", HERMES_OUT, "Let me look."), ("llama3_json", LLAMA_OUT, None),
    ("deepseek_v3", DS_OUT, "Sure.")])
def test_parsers_whole_and_streamed_in_every_split(family, out, content):
    p = plan(family)
    got_content, calls = p.parse(out)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in calls] == WANT
    check_streams_like_whole(p, out)


def test_arguments_stream_in_pieces_as_they_are_written():
    """A call's header goes out once its name is whole, before its arguments end; its
    arguments come in several pieces, each sent as soon as it is known."""
    p = plan("hermes")
    out = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    s = ToolStream(p)
    head = out.index('{"city"')
    assert s.push(out[:head - 2]) == []
    first = s.push(out[head - 2:head + 1])
    assert first[0]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": ""}
    assert [d["tool_calls"][0]["function"]["arguments"] for d in first[1:]] == ["{"]
    pieces = [d["tool_calls"][0]["function"]["arguments"]
              for ch in out[head + 1:] for d in s.push(ch)] + [
        d["tool_calls"][0]["function"]["arguments"] for d in s.finish()]
    assert len(pieces) > 5 and "{" + "".join(pieces) == '{"city": "Paris"}'


ODD_ARGS = [
    '{"q":"a\\"b\\u00e9\\ud83d\\ude00\\n","n":-1.5e3,"ok":true,"x":null,"l":[1,{"a":[]}],'
    '"e":{}}',
    '  {\n  "nested": {"deep": [ "x" , 2 ,false ] } ,"t":"\\/tab\\t"}  ',
    '"{\\"as\\": \\"a string\\"}"',  # arguments sent as a JSON string
    '{}',
]


@pytest.mark.parametrize("args", ODD_ARGS)
def test_streamed_arguments_join_to_the_whole_calls_for_any_json(args):
    """Escapes, surrogate pairs, numbers, literals, nesting and whitespace: the pieces join to
    exactly the non-streamed call's normalized arguments, in every family and forced mode."""
    outs = {
        "hermes": f'<tool_call>{{"name": "get_weather", "arguments": {args}}}</tool_call>',
        "llama3_json": f'{{"name": "get_weather", "parameters": {args}}}',
        "deepseek_v3": (f"{DS_CALLS_BEGIN}{DS_CALL_BEGIN}function{DS_SEP}get_weather\n"
                        f"```json\n{args}\n```{DS_CALL_END}{DS_CALL_BEGIN}get_time{DS_SEP}"
                        f"{args}{DS_CALL_END}{DS_CALLS_END}"),
    }
    for family, out in outs.items():
        want = check_streams_like_whole(plan(family), out)
        assert want and want[0][0] == "get_weather", family
    if args.lstrip().startswith("{"):
        named = plan("hermes", {"type": "function", "function": {"name": "get_time"}})
        assert check_streams_like_whole(named, args)[0][0] == "get_time"
        required = plan("hermes", "required")
        out = f'[{{"name": "get_time", "parameters": {args}}}, {{"name": "get_weather", ' \
            f'"parameters": {args}}}]'
        assert len(check_streams_like_whole(required, out)) == 2


def test_streams_without_parallel_calls_and_around_text():
    p = plan("hermes", parallel=False)
    assert len(check_streams_like_whole(p, HERMES_OUT)) == 1
    for text in ("plain text, no call", "<tool_call>not json</tool_call> then text",
                 "<tool_call>{\"nam", "a <tool_ b"):
        check_streams_like_whole(plan("hermes"), text)
    for text in ("plain", "  <|python_tag|>nope", "{\"no\": 1}"):
        check_streams_like_whole(plan("llama3_json"), text)
    check_streams_like_whole(plan("deepseek_v3"), "no tool tokens at all")


def test_plain_text_stays_content_and_one_call_without_parallel():
    p = plan("hermes")
    assert p.parse("no call <tool_ here") == ("no call <tool_ here", [])
    s = ToolStream(p)
    deltas = s.push("no call <tool_") + s.push(" here") + s.finish()
    assert "".join(d["content"] for d in deltas) == "no call <tool_ here" and not s.called
    assert p.parse("<tool_call>not json</tool_call>") == ("<tool_call>not json</tool_call>", [])
    assert len(plan("hermes", parallel=False).parse(HERMES_OUT)[1]) == 1
    choice = {"message": {"role": "assistant", "content": HERMES_OUT}, "finish_reason": "stop"}
    apply_tool_calls(choice, p)
    assert choice["finish_reason"] == "tool_calls"
    assert [c["function"]["name"] for c in choice["message"]["tool_calls"]] == [
        "get_weather", "get_time"]


def test_forced_calls_have_schemas_that_their_outputs_satisfy():
    named = plan("hermes", {"type": "function", "function": {"name": "get_time"}})
    so = named.structured()
    assert so is not None and so.param == "tool_choice"
    jsonschema.validate({"tz": "cet"}, json.loads(so.spec))
    assert [(c.name, c.arguments) for c in named.parse('{"tz": "cet"}')[1]] == [
        ("get_time", '{"tz": "cet"}')]
    req = plan("llama3_json", "required", parallel=False)
    schema = json.loads(req.structured().spec)
    out = [{"name": "get_weather", "parameters": {"city": "Rome"}}]
    jsonschema.validate(out, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(out * 2, schema)  # parallel_tool_calls false: one call
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "nope", "parameters": {}}], schema)
    _, deltas = streamed(req, [json.dumps(out)[:5], json.dumps(out)[5:]])
    assert joined(deltas)[1][0]["name"] == "get_weather"
    assert plan_tools([WEATHER], "none", None, None) is None


@pytest.mark.parametrize("tools, choice, needle", [
    ([{"type": "function", "function": {"parameters": {}}}], None, "function.name"),
    ([{"type": "function", "function": {"name": "a b"}}], None, "function.name"),
    ([WEATHER, WEATHER], None, "twice"),
    ([WEATHER], {"type": "function", "function": {"name": "get_time"}}, "not in tools"),
    ([WEATHER], "sometimes", "tool_choice"),
    (None, "required", "needs tools"),
])
def test_bad_tools_are_named(tools, choice, needle):
    with pytest.raises(ToolError, match=needle) as e:
        plan_tools(tools, choice, None, None)
    assert e.value.param in ("tools", "tool_choice")


def test_family_from_template():
    assert family_of(None) == "hermes"
    assert family_of("{{ '<|python_tag|>' }}") == "llama3_json"
    assert family_of(f"{{{{ '{DS_CALLS_BEGIN}' }}}}") == "deepseek_v3"


@pytest.mark.parametrize("fields, kind, param", [
    ({"response_format": {"type": "json_object"}}, "json_object", "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object"}, "strict": True}}}, "json", "response_format"),
    ({"guided_json": '{"type": "integer"}'}, "json", "guided_json"),
    ({"guided_regex": "[a-z]+"}, "regex", "guided_regex"),
    ({"guided_grammar": 'root ::= "a"'}, "grammar", "guided_grammar"),
    ({"guided_choice": ["yes", "no"]}, "choice", "guided_choice"),
    ({"structured_outputs": {"regex": "a+"}}, "regex", "structured_outputs"),
    ({"structured_outputs": {"choice": ["a"]}}, "choice", "structured_outputs"),
])
def test_constraint_fields(fields, kind, param):
    so = structured_output(fields)
    assert so is not None and so.kind == kind and so.param == param
    assert structured_output({"response_format": {"type": "text"}}) is None


@pytest.mark.parametrize("fields, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"guided_json": "{bad"}, "guided_json"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ({"structured_outputs": {"xml": "<a/>"}}, "structured_outputs"),
])
def test_bad_constraint_fields_are_named(fields, param):
    with pytest.raises(StructuredError) as e:
        structured_output(fields)
    assert e.value.param == param


class FakeTok:
    vocab_size = 100
    max_token_chars = 8
    chat_template = "<tool_call>"

    def __init__(self):
        self.seen = None

    def encode(self, text):
        return [1] * max(1, len(text) // 8)

    def apply_chat_template(self, messages, add_generation_prompt=True, **kw):
        self.seen = (messages, kw.get("tools"))
        return json.dumps(messages)


def body_of(**kw):
    return msgspec.convert(kw, ChatBody)


def chat(**kw):
    body = body_of(messages=[{"role": "user", "content": "hi"}], max_tokens=8, **kw)
    tok = FakeTok()
    return prepare_chat(body, tok, "m", 4096), tok


def test_prepare_chat_maps_constraints_tools_and_history():
    prep, _ = chat(response_format={"type": "json_object"})
    assert prep.sampling.structured.kind == "json_object" and prep.tools is None
    prep, tok = chat(tools=[WEATHER], tool_choice="required")
    assert prep.tools.mode == "required" and prep.sampling.structured.param == "tool_choice"
    assert tok.seen[1][0]["function"]["name"] == "get_weather"
    history = [{"role": "user", "content": "weather?"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "c1", "type": "function", "function": {
                       "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
               {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    tok = FakeTok()
    prepare_chat(body_of(messages=history, max_tokens=8, tools=[WEATHER]), tok, "m", 4096)
    msgs = tok.seen[0]
    assert msgs[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert msgs[2]["tool_call_id"] == "c1"
    with pytest.raises(ApiError) as e:
        chat(tools=[{"type": "function", "function": {}}])
    assert e.value.status == 400 and e.value.param == "tools"
    with pytest.raises(ApiError) as e:
        chat(guided_json="{nope")
    assert e.value.param == "guided_json"
    with pytest.raises(ApiError) as e:
        chat(tools=[WEATHER], tool_choice="required", guided_regex="a")
    assert e.value.param == "tool_choice"
    with pytest.raises(ApiError) as e:
        prepare_chat(body_of(messages=[{"role": "user", "content": "x", "tool_call_id": "c"}],
                             max_tokens=8, tools=[WEATHER]), FakeTok(), "m", 4096)
    assert e.value.param == "messages"


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-10**20, 10**20)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner,
                                                                 max_size=3),
    max_leaves=8)


@settings(max_examples=150, deadline=None)
@given(args=st.dictionaries(st.text(max_size=5), JSON_VALUES, max_size=4),
       ascii_only=st.booleans(), indent=st.sampled_from([None, 0, 2]),
       family=st.sampled_from(["hermes", "llama3_json", "deepseek_v3"]),
       cuts=st.lists(st.integers(1, 9), min_size=1, max_size=40))
def test_any_json_arguments_stream_to_the_whole_calls(args, ascii_only, indent, family, cuts):
    """Whatever JSON the model writes (escaped or not, any layout), split anywhere, the pieces
    join to the non-streamed call's arguments."""
    text = json.dumps(args, ensure_ascii=ascii_only, indent=indent)
    out = {"hermes": f'<tool_call>{{"name": "get_time", "arguments": {text}}}</tool_call>',
           "llama3_json": f'{{"name": "get_time", "parameters": {text}}}',
           "deepseek_v3": f"{DS_CALLS_BEGIN}{DS_CALL_BEGIN}get_time{DS_SEP}{text}"
                          f"{DS_CALL_END}{DS_CALLS_END}"}[family]
    p = plan(family)
    want = [(c.name, c.arguments) for c in p.parse(out)[1]]
    assert want == [("get_time", json.dumps(args, ensure_ascii=False))]
    pieces, i = [], 0
    for n in cuts * (len(out) // sum(cuts) + 1):
        pieces.append(out[i:i + n])
        i += n
    _, deltas = streamed(p, [x for x in pieces if x])
    assert [(c["name"], c["args"]) for c in joined(deltas)[1]] == want
