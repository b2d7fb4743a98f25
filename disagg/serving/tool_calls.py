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

    def stream(self) -> ToolStream:
        return ToolStream(self)


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


class _Args:
    """A JSON value (a call's arguments) re-emitted piece by piece as it arrives, in the text
    ``json.dumps(json.loads(value), ensure_ascii=False)`` gives once it is whole (the
    non-streamed call's ``arguments``): whitespace dropped, ``, `` and ``: `` separators, each
    string's characters as they come (an escape once whole), a number or literal once it ends.
    ``done``: the top-level object or array closed; ``broken``: the text is not such JSON (the
    call's end reconciles against the whole parse, ``ToolStream``)."""

    def __init__(self) -> None:
        self.depth = 0
        self.in_str = False
        self.esc = ""  # an escape sequence begun inside a string
        self.scalar = ""  # a number or literal begun
        self.done = False
        self.broken = False

    def feed(self, text: str) -> tuple[str, int]:
        """(the normalized text newly known, how many characters of ``text`` it read)."""
        out: list[str] = []
        i = 0
        while i < len(text) and not (self.done or self.broken):
            c = text[i]
            if self.in_str:
                self._string_char(c, out)
            elif self.scalar and (c.isalnum() or c in "+-."):
                self.scalar += c
            else:
                if self.scalar:
                    self._flush_scalar(out)
                    if self.broken:
                        break
                self._structural(c, out)
            i += 1
        return "".join(out), i

    def _string_char(self, c: str, out: list[str]) -> None:
        if self.esc:
            self.esc += c
            whole = _escape_whole(self.esc)
            if whole is None:
                return
            self.esc = ""
            try:
                out.append(json.dumps(json.loads(f'"{whole}"'), ensure_ascii=False)[1:-1])
            except ValueError:
                self.broken = True
        elif c == "\\":
            self.esc = c
        elif c == '"':
            self.in_str = False
            out.append('"')
        else:
            out.append(json.dumps(c, ensure_ascii=False)[1:-1])

    def _flush_scalar(self, out: list[str]) -> None:
        try:
            out.append(json.dumps(json.loads(self.scalar)))
        except ValueError:
            self.broken = True
        self.scalar = ""

    def _structural(self, c: str, out: list[str]) -> None:
        if c in " \t\r\n":
            return
        if self.depth == 0 and c not in "{[":
            self.broken = True  # arguments that are not an object (a JSON string, say)
        elif c in "{[":
            self.depth += 1
            out.append(c)
        elif c in "}]":
            self.depth -= 1
            out.append(c)
            self.done = self.depth == 0
        elif c in ",:":
            out.append(c + " ")
        elif c == '"':
            self.in_str = True
            out.append(c)
        elif c.isalnum() or c == "-":
            self.scalar = c
        else:
            self.broken = True


def _escape_whole(esc: str) -> str | None:
    """The escape ``esc`` (from its backslash) once whole (a surrogate pair's two), else None."""
    if len(esc) < 2 or esc[1] == "u" and len(esc) < 6:
        return None
    if esc[1] != "u" or not "d800" <= esc[2:6].lower() <= "dbff" or len(esc) == 12:
        return esc
    tail = esc[6:]  # after a high surrogate: its low half, or not
    return None if "\\u".startswith(tail) or tail.startswith("\\u") else esc


_OBJECT_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*'
                          r'"(?:arguments|parameters)"\s*:\s*(?=[{\[])')
_DS_V3_HEAD = re.compile(r"\s*function" + re.escape(DS_SEP)
                         + r"([^\n]*)\n\s*(?:```[^\n]*\n\s*)?(?=[{\[])")
_DS_V31_HEAD = re.compile(r"(.*?)" + re.escape(DS_SEP) + r"\s*(?=[{\[])", re.DOTALL)


def _object_head(body: str) -> tuple[str, int] | None:
    m = _OBJECT_HEAD.match(body)
    if m is None:
        return None
    try:
        return json.loads(f'"{m.group(1)}"'), m.end()
    except ValueError:
        return None


def _ds_head(body: str) -> tuple[str, int] | None:
    m = _DS_V3_HEAD.match(body)
    if m is not None:
        return m.group(1).strip(), m.end()
    m = _DS_V31_HEAD.match(body)
    if m is not None and m.group(1).strip() != "function":
        return m.group(1).strip(), m.end()
    return None


def _object_call(body: str) -> ToolCall | None:
    try:
        return _call_from_object(json.loads(body))
    except ValueError:
        return None


def _ds_call(body: str) -> ToolCall | None:
    calls = parse_deepseek_v3(DS_CALLS_BEGIN + DS_CALL_BEGIN + body)[1]
    return calls[0] if calls else None


@dataclass
class _Call:
    """One call being streamed: its body so far, its header (once its name is known) and its
    arguments' normalized text sent so far."""

    id: str
    name: str | None = None  # set once the header went out
    args: _Args | None = None
    fed: int = 0  # characters of the body read by args
    sent: str = ""
    silent: bool = False  # parallel_tool_calls false, a call after the first: dropped
    index: int = 0


class ToolStream:
    """A streamed output turned into chat deltas as OpenAI streams them: text outside calls as
    ``{"content": ...}`` (holding back what may begin a call's opening tag; after a call, only
    text that is not all whitespace), and each call as ``delta.tool_calls`` entries: the first
    carries its index, id, type and name (once the name is whole), the next ones pieces of its
    ``function.arguments`` as the model writes them (``_Args``: joined, they are the whole
    call's ``arguments``, the text ``ToolPlan.parse`` gives). At a call's end the whole call is
    parsed and what its arguments have beyond the pieces sent follows (all of it for arguments
    that are not a JSON object, such as a JSON string). A forced output (named: the output is
    the arguments; ``required``: an array of calls) streams the same way.

    Where streaming cannot take back what it sent, it differs from ``ToolPlan.parse`` on
    malformed output only: a call cut short (``length``) keeps the arguments sent; a later
    block that does not parse is dropped (whole: the output turns to text). ``called``: some
    call was sent."""

    def __init__(self, plan: ToolPlan):
        self.plan = plan
        self.kind = plan.family if plan.mode == "auto" else plan.mode
        self.held = ""  # text not handled yet; in a call: the call's body so far
        self.raw = ""  # the whole output so far
        self.emitted = ""  # content sent
        self.phase = {"named": "call", "required": "between"}.get(self.kind, "text")
        self.calls = 0  # calls sent
        self.call: _Call | None = self._new_call() if self.kind == "named" else None
        self._tried = 0  # body characters searched for an object's end

    @property
    def called(self) -> bool:
        return self.calls > 0

    def push(self, text: str) -> list[dict[str, Any]]:
        self.raw += text
        self.held += text
        out: list[dict[str, Any]] = []
        while getattr(self, f"_{self.phase}")(out, False):
            pass
        return _merged(out)

    def finish(self) -> list[dict[str, Any]]:
        """The deltas of what is held, once the output is complete."""
        out: list[dict[str, Any]] = []
        while getattr(self, f"_{self.phase}")(out, True):
            pass
        if self.phase == "call":
            self._end_call(self.held, "", "done", out)
            while getattr(self, f"_{self.phase}")(out, True):
                pass
        self.held = ""
        return _merged(out)

    # ---- phases: each handles ``held``; True when it changed phase (run the next)

    def _text(self, out: list[dict[str, Any]], final: bool) -> bool:
        if self.kind == "llama3_json":  # a call is the whole output: decided by how it begins
            s = self.held.lstrip()
            if not final and (not s or PYTHON_TAG.startswith(s)):
                return False
            if s.startswith("{") or s.startswith(PYTHON_TAG):
                self.held = s[len(PYTHON_TAG):] if s.startswith(PYTHON_TAG) else s
                self.phase = "between"
            else:
                self.phase = "plain"
            return True
        start = STARTS[self.kind]
        i = self.held.find(start)
        if i >= 0:
            self._content(i, out, True)
            self.held = self.held[len(start):]
            if self.kind == "hermes":
                self.call, self.phase = self._new_call(), "call"
            else:
                self.phase = "between"
            return True
        keep = 0 if final else _partial_suffix(self.held, start)
        self._content(len(self.held) - keep, out, final)
        return False

    def _plain(self, out: list[dict[str, Any]], final: bool) -> bool:
        self._content(len(self.held), out, True)
        return False

    def _done(self, out: list[dict[str, Any]], final: bool) -> bool:
        self.held = ""
        return False

    def _between(self, out: list[dict[str, Any]], final: bool) -> bool:
        if self.kind == "deepseek_v3":
            b, e = self.held.find(DS_CALL_BEGIN), self.held.find(DS_CALLS_END)
            if e >= 0 and (b < 0 or e < b):
                self.phase = "done"
            elif b >= 0:
                self.held = self.held[b + len(DS_CALL_BEGIN):]
                self.call, self.phase = self._new_call(), "call"
            else:  # text between calls is no part of the message
                keep = max(_partial_suffix(self.held, DS_CALL_BEGIN),
                           _partial_suffix(self.held, DS_CALLS_END))
                self.held = self.held[len(self.held) - keep:]
                return False
            return True
        seps = " \t\r\n;" if self.kind == "llama3_json" else " \t\r\n,["
        self.held = self.held.lstrip(seps)
        if not self.held:
            return False
        if self.held[0] == "{":
            self.call, self.phase, self._tried = self._new_call(), "call", 0
        elif self.calls == 0:
            self._to_text()
        else:
            self.phase = "done"
        return True

    def _call(self, out: list[dict[str, Any]], final: bool) -> bool:
        body = self.held
        end, rest = self._call_end(body)
        if end < 0:
            self._progress(body, out)
            return False
        nxt = {"hermes": "text", "named": "done"}.get(self.kind, "between")
        self._end_call(body[:end], body[rest:], nxt, out)
        return True

    # ---- one call

    def _call_end(self, body: str) -> tuple[int, int]:
        """Where the call's body ends and the text after it starts (-1: not yet)."""
        if self.kind == "hermes":
            j = body.find(HERMES_END)
            return j, j + len(HERMES_END)
        if self.kind == "deepseek_v3":
            found = [(j, j + len(t) if t == DS_CALL_END else j)
                     for t in (DS_CALL_END, DS_CALL_BEGIN, DS_CALLS_END)
                     if (j := body.find(t)) >= 0]
            return min(found) if found else (-1, -1)
        if self.kind in ("llama3_json", "required"):
            call = self.call
            assert call is not None
            waiting = call.args is not None and not (call.args.done or call.args.broken)
            if waiting or "}" not in body[self._tried:]:
                return -1, -1
            self._tried = len(body)
            try:
                _, j = json.JSONDecoder().raw_decode(body)
            except ValueError:
                return -1, -1
            return j, j
        return -1, -1  # named: the whole output

    def _new_call(self) -> _Call:
        silent = not self.plan.parallel and self.calls > 0
        return _Call(id=f"call_{uuid.uuid4().hex[:24]}", silent=silent)

    def _head(self, body: str) -> tuple[str, int] | None:
        if self.kind == "named":
            assert self.plan.name is not None
            return self.plan.name, 0
        return _ds_head(body) if self.kind == "deepseek_v3" else _object_head(body)

    def _whole(self, body: str) -> ToolCall | None:
        if self.kind == "named":
            assert self.plan.name is not None
            return ToolCall(self.plan.name, _normal_json(body))
        return _ds_call(body) if self.kind == "deepseek_v3" else _object_call(body)

    def _progress(self, body: str, out: list[dict[str, Any]]) -> None:
        call = self.call
        assert call is not None
        if call.name is None:
            head = self._head(body)
            if head is None:
                return
            self._header(call, head[0], out)
            call.args, call.fed = _Args(), head[1]
        if call.args is not None and not (call.args.done or call.args.broken):
            piece, used = call.args.feed(body[call.fed:])
            call.fed += used
            self._arguments(call, piece, out)

    def _end_call(self, body: str, rest: str, nxt: str, out: list[dict[str, Any]]) -> None:
        call = self.call
        assert call is not None
        self._progress(body, out)
        whole = self._whole(body)
        self.call, self.held, self.phase = None, rest, nxt
        if whole is None:
            if call.name is None and self.calls == 0:
                self._to_text()  # not a call after all: the output is text
            return  # begun and sent: what was sent stays
        if call.name is None:
            self._header(call, whole.name, out)
        if whole.arguments.startswith(call.sent):
            self._arguments(call, whole.arguments[len(call.sent):], out)

    def _header(self, call: _Call, name: str, out: list[dict[str, Any]]) -> None:
        call.name = name
        if call.silent:
            return
        call.index, self.calls = self.calls, self.calls + 1
        out.append({"tool_calls": [{"index": call.index, "id": call.id, "type": "function",
                                    "function": {"name": name, "arguments": ""}}]})

    def _arguments(self, call: _Call, piece: str, out: list[dict[str, Any]]) -> None:
        call.sent += piece
        if piece and not call.silent:
            out.append({"tool_calls": [{"index": call.index,
                                        "function": {"arguments": piece}}]})

    # ---- content

    def _to_text(self) -> None:
        """Everything not sent yet is content (no call was sent: what was is a prefix)."""
        self.held, self.phase, self.call = self.raw[len(self.emitted):], "plain", None

    def _content(self, upto: int, out: list[dict[str, Any]], final: bool) -> None:
        text = self.held[:upto]
        if self.calls and not text.strip():
            if final:  # whitespace around calls is no content
                self.held = self.held[upto:]
            return
        self.held = self.held[upto:]
        if text:
            self.emitted += text
            out.append({"content": text})


def _merged(deltas: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Deltas with neighbouring content, or argument pieces of one call, joined (one chunk
    each); a call's first delta (its header) stays its own."""
    out: list[dict[str, Any]] = []
    for d in deltas:
        last = out[-1] if out else None
        if last is not None and "content" in d and "content" in last:
            last["content"] += d["content"]
            continue
        calls = d.get("tool_calls")
        prev = last.get("tool_calls") if last is not None else None
        if calls and prev and "id" not in calls[0] and "id" not in prev[0] \
                and calls[0]["index"] == prev[0]["index"]:
            prev[0]["function"]["arguments"] += calls[0]["function"]["arguments"]
            continue
        out.append(d)
    return out


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that begins ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


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
