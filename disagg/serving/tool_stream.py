"""Tool calls as they stream (``ToolStream``, one per choice): OpenAI's ``delta.tool_calls``
entries from the model's output as it grows, a call's id, type and name once its name is
complete, then its arguments in pieces that join to the whole parse's (``disagg.serving.
tool_calls``: the formats, the plan and the whole-output parsers)."""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from disagg.serving.tool_calls import (
    DS_CALL_BEGIN,
    DS_CALL_END,
    DS_CALLS_BEGIN,
    DS_CALLS_END,
    DS_SEP,
    HERMES_END,
    PYTHON_TAG,
    STARTS,
    ToolCall,
    ToolPlan,
    _call_from_object,
    _normal_json,
    parse_deepseek_v3,
)


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
