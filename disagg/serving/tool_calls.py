"""Tool calling for the chat API, as pure functions: the ``tools`` / ``tool_choice`` /
``parallel_tool_calls`` fields checked, the tools handed to the model's chat template, and the
model's output turned into OpenAI ``tool_calls`` (whole, or as ``delta.tool_calls`` chunks).

``tool_choice``: ``none`` (the template gets no tools; plain text), ``auto`` (the default with
tools: the template renders them and the family's parser finds calls in the output),
``required`` and a named function (the output is forced by a JSON-schema grammar,
``ToolPlan.structured``: for a named function its arguments object, for ``required`` an array of
``{"name", "parameters"}`` objects, one item when ``parallel_tool_calls`` is false; parsed as
JSON, whatever the family).

The output formats (``auto``), by family, chosen from the chat template's text:

- ``hermes`` (Qwen 2.5 / 3, Hermes, the default): ``<tool_call>{"name": ..., "arguments":
  {...}}</tool_call>``, one block per call, text around them is the message content;
- ``llama3_json`` (Llama 3.1-3.3): the whole output is ``{"name": ..., "parameters": {...}}``
  (several separated by ``;``), after an optional ``<|python_tag|>``;
- ``deepseek_v3``: ``<｜tool▁calls▁begin｜>`` then per call ``<｜tool▁call▁begin｜>function
  <｜tool▁sep｜>NAME`` and the arguments in a json code fence ``<｜tool▁call▁end｜>`` (V3), or
  ``NAME<｜tool▁sep｜>ARGS`` (V3.1), then ``<｜tool▁calls▁end｜>``.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from disagg.protocol.structured import StructuredOutput

MAX_TOOLS = 128
TOOL_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
FAMILIES = ("hermes", "llama3_json", "deepseek_v3")

HERMES_START, HERMES_END = "<tool_call>", "</tool_call>"
DS_CALLS_BEGIN, DS_CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_CALL_BEGIN, DS_CALL_END, DS_SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
PYTHON_TAG = "<|python_tag|>"


class ToolError(ValueError):
    """A tools field the API refuses: ``param`` names it."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def family_of(chat_template: str | None) -> str:
    """The tool-call format a chat template teaches its model (``hermes`` when it says none)."""
    t = chat_template or ""
    if "tool▁calls▁begin" in t or "tool▁call▁begin" in t:
        return "deepseek_v3"
    if HERMES_START in t:
        return "hermes"
    if PYTHON_TAG in t or "ipython" in t:
        return "llama3_json"
    return "hermes"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text of the arguments object
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def to_openai(self, index: int | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.id, "type": "function",
                               "function": {"name": self.name, "arguments": self.arguments}}
        if index is not None:
            out = {"index": index, **out}
        return out


def check_tools(tools: list[Any]) -> list[dict[str, Any]]:
    """``tools`` in OpenAI's shape (``{"type": "function", "function": {"name",
    "description"?, "parameters"?}}``), each checked; ``ToolError`` names the first bad one."""
    if len(tools) > MAX_TOOLS:
        raise ToolError(f"tools: at most {MAX_TOOLS} tools, got {len(tools)}", "tools")
    out: list[dict[str, Any]] = []
    for i, t in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(t, dict) or t.get("type", "function") != "function":
            raise ToolError(f"{where} must be an object with type \"function\"", "tools")
        fn = t.get("function")
        if not isinstance(fn, dict):
            raise ToolError(f"{where}.function must be an object", "tools")
        name = fn.get("name")
        if not isinstance(name, str) or not TOOL_NAME.match(name):
            raise ToolError(f"{where}.function.name is required: 1-64 letters, digits, _ . or "
                            f"-, got {name!r}", "tools")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise ToolError(f"{where}.function.parameters must be a JSON schema object",
                            "tools")
        desc = fn.get("description")
        if desc is not None and not isinstance(desc, str):
            raise ToolError(f"{where}.function.description must be a string", "tools")
        clean: dict[str, Any] = {"name": name, "parameters": params}
        if desc is not None:
            clean["description"] = desc
        tool: dict[str, Any] = {"type": "function", "function": clean}
        out.append(tool)
    names = [t["function"]["name"] for t in out]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup is not None:
        raise ToolError(f"tools: the function name {dup!r} appears twice", "tools")
    return out


def plan_tools(tools: list[Any] | None, tool_choice: Any, parallel: bool | None,
               chat_template: str | None) -> ToolPlan | None:
    """The request's tool plan, or None when no tool may be called (no tools, or
    ``tool_choice`` ``none``)."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise ToolError("tool_choice needs tools", "tool_choice")
        return None
    checked = check_tools(tools)
    names = [t["function"]["name"] for t in checked]
    choice = "auto" if tool_choice is None else tool_choice
    if choice == "none":
        return None
    name = None
    if isinstance(choice, dict):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if choice.get("type", "function") != "function" or not isinstance(name, str):
            raise ToolError("tool_choice must be none, auto, required or {\"type\": "
                            "\"function\", \"function\": {\"name\": ...}}", "tool_choice")
        if name not in names:
            raise ToolError(f"tool_choice names the function {name!r}, which is not in tools",
                            "tool_choice")
        mode = "named"
    elif choice in ("auto", "required"):
        mode = choice
    else:
        raise ToolError(f"tool_choice must be none, auto, required or a named function, got "
                        f"{choice!r}", "tool_choice")
    return ToolPlan(checked, mode, name, parallel is not False, family_of(chat_template))


@dataclass(frozen=True)
class ToolPlan:
    tools: list[dict[str, Any]]  # OpenAI's shape, checked (what the template receives)
    mode: str  # auto | required | named
    name: str | None  # mode named: the function
    parallel: bool  # parallel_tool_calls (default true)
    family: str  # one of FAMILIES

    def params_of(self, name: str) -> dict[str, Any]:
        return next(t["function"]["parameters"] for t in self.tools
                    if t["function"]["name"] == name)

    def structured(self) -> StructuredOutput | None:
        """The grammar forcing the output of ``required`` / a named function (None: auto)."""
        if self.mode == "named":
            assert self.name is not None
            return StructuredOutput("json", json.dumps(self.params_of(self.name)),
                                    param="tool_choice")
        if self.mode != "required":
            return None
        items = [{"type": "object", "properties": {
            "name": {"const": t["function"]["name"]}, "parameters": t["function"]["parameters"]},
            "required": ["name", "parameters"], "additionalProperties": False}
            for t in self.tools]
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
        if not self.parallel:
            schema["maxItems"] = 1
        return StructuredOutput("json", json.dumps(schema), param="tool_choice")

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(message content, tool calls) of a whole output; no calls: the text as content."""
        if self.mode == "named":
            assert self.name is not None
            return None, [ToolCall(self.name, _normal_json(text))]
        if self.mode == "required":
            try:
                items = json.loads(text)
            except ValueError:
                return text, []
            calls = [ToolCall(it["name"], json.dumps(it.get("parameters", {}),
                                                     ensure_ascii=False))
                     for it in items if isinstance(it, dict) and isinstance(it.get("name"), str)]
            return (None, calls) if calls else (text, [])
        content, calls = PARSERS[self.family](text)
        if calls and not self.parallel:
            calls = calls[:1]
        return content, calls



def _normal_json(text: str) -> str:
    try:
        return json.dumps(json.loads(text), ensure_ascii=False)
    except ValueError:
        return text.strip()


def _call_from_object(obj: Any) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models emit the arguments as a JSON string
        return ToolCall(obj["name"], _normal_json(args))
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def parse_hermes(text: str) -> tuple[str | None, list[ToolCall]]:
    calls: list[ToolCall] = []
    content: list[str] = []
    rest = text
    while (i := rest.find(HERMES_START)) >= 0:
        content.append(rest[:i])
        body_start = i + len(HERMES_START)
        j = rest.find(HERMES_END, body_start)
        body = rest[body_start:] if j < 0 else rest[body_start:j]
        try:
            call = _call_from_object(json.loads(body))
        except ValueError:
            call = None
        if call is None:
            return text, []  # not a call after all: the output is text
        calls.append(call)
        rest = "" if j < 0 else rest[j + len(HERMES_END):]
    content.append(rest)
    joined = "".join(content).strip()
    return (joined or None) if calls else text, calls


def parse_llama3_json(text: str) -> tuple[str | None, list[ToolCall]]:
    s = text.strip()
    if s.startswith(PYTHON_TAG):
        s = s[len(PYTHON_TAG):].lstrip()
    if not s.startswith("{"):
        return text, []
    dec = json.JSONDecoder()
    calls, pos = [], 0
    while pos < len(s):
        try:
            obj, end = dec.raw_decode(s, pos)
        except ValueError:
            return text, []
        call = _call_from_object(obj)
        if call is None:
            return text, []
        calls.append(call)
        pos = end
        while pos < len(s) and s[pos] in " \t\r\n;":
            pos += 1
    return None, calls


def parse_deepseek_v3(text: str) -> tuple[str | None, list[ToolCall]]:
    i = text.find(DS_CALLS_BEGIN)
    if i < 0:
        return text, []
    content = text[:i].strip() or None
    body = text[i + len(DS_CALLS_BEGIN):]
    end = body.find(DS_CALLS_END)
    body = body if end < 0 else body[:end]
    calls = []
    for part in body.split(DS_CALL_BEGIN)[1:]:
        part = part.split(DS_CALL_END)[0]
        left, sep, right = part.partition(DS_SEP)
        if not sep:
            return text, []
        if left.strip() == "function":  # V3: function<sep>NAME\n```json\nARGS\n```
            name, _, args = right.partition("\n")
            args = args.strip()
            if args.startswith("```"):
                args = args.split("\n", 1)[1] if "\n" in args else ""
                args = args.rsplit("```", 1)[0]
        else:  # V3.1: NAME<sep>ARGS
            name, args = left, right
        calls.append(ToolCall(name.strip(), _normal_json(args)))
    return (content, calls) if calls else (text, [])


PARSERS = {"hermes": parse_hermes, "llama3_json": parse_llama3_json,
           "deepseek_v3": parse_deepseek_v3}
STARTS = {"hermes": HERMES_START, "deepseek_v3": DS_CALLS_BEGIN}


def template_messages(messages: list[Any]) -> list[dict[str, Any]]:
    """Assistant ``tool_calls`` as chat templates read them: each call's ``arguments`` as an
    object (OpenAI sends a JSON string; Qwen's and Llama's templates apply ``tojson``)."""
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if calls:
            fixed = []
            for c in calls:
                fn = dict(c.get("function") or {})
                args = fn.get("arguments")
                if isinstance(args, str):
                    try:
                        fn["arguments"] = json.loads(args)
                    except ValueError:
                        pass
                fixed.append({**c, "function": fn})
            m = {**m, "tool_calls": fixed}
        out.append(m)
    return out


def check_history(messages: list[Any]) -> None:
    """Assistant ``tool_calls`` and ``tool_call_id`` (of ``tool`` messages) are where they
    belong and well formed (``ToolError`` naming the message)."""
    for i, m in enumerate(messages):
        calls = m.get("tool_calls")
        if calls is not None:
            if m.get("role") != "assistant" or not isinstance(calls, list):
                raise ToolError(f"messages[{i}].tool_calls belong to an assistant message, as "
                                "a list", "messages")
            for j, c in enumerate(calls):
                fn = c.get("function") if isinstance(c, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                    raise ToolError(f"messages[{i}].tool_calls[{j}].function.name is required",
                                    "messages")
        call_id = m.get("tool_call_id")
        if call_id is not None and m.get("role") != "tool":
            raise ToolError(f"messages[{i}].tool_call_id belongs to a tool message",
                            "messages")


def finish_reason(reason: str, called: bool) -> str:
    """OpenAI's ``tool_calls`` for an output that ended by itself with calls."""
    return "tool_calls" if called and reason == "stop" else reason


def apply_tool_calls(choice: dict[str, Any], plan: ToolPlan) -> None:
    """A whole chat choice (``message.content`` the output) with its calls parsed into
    ``message.tool_calls`` (and ``finish_reason`` ``tool_calls``), in place."""
    msg = choice["message"]
    content, calls = plan.parse(msg.get("content") or "")
    if not calls:
        return
    msg["content"] = content
    msg["tool_calls"] = [c.to_openai() for c in calls]
    choice["finish_reason"] = finish_reason(choice["finish_reason"], True)
