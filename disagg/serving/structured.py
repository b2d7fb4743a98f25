"""The OpenAI request fields that constrain the output, mapped onto one
``disagg.protocol.structured.StructuredOutput``: ``response_format`` (``json_object``,
``json_schema``), vLLM's extra-body keys ``guided_json`` / ``guided_regex`` / ``guided_grammar``
/ ``guided_choice`` and its newer ``structured_outputs`` object (``json``, ``regex``,
``grammar``, ``choice``, ``json_object``). At most one of them per request. Pure: what only a
compiler can tell (an invalid schema, a grammar admitting nothing) the node answers, naming
the same parameter.
"""

from __future__ import annotations

import json
from typing import Any

from disagg.protocol.structured import StructuredOutput

GUIDED = ("guided_json", "guided_regex", "guided_grammar", "guided_choice")
CONSTRAINT_FIELDS = ("response_format", *GUIDED, "structured_outputs")  # the body's fields
STRUCTURED_KEYS = {"json": "json", "regex": "regex", "grammar": "grammar", "choice": "choice",
                   "json_object": "json_object"}


class StructuredError(ValueError):
    """A constraint field the API refuses: ``param`` names it."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def _schema_text(schema: Any, param: str) -> str:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise StructuredError(f"{param}: the JSON schema is not valid JSON: {e}",
                                  param) from None
    if not isinstance(schema, (dict, bool)):
        raise StructuredError(f"{param}: a JSON schema is an object (or a boolean), got "
                              f"{type(schema).__name__}", param)
    return json.dumps(schema, separators=(",", ":"), sort_keys=True)


def _text(value: Any, param: str, what: str) -> str:
    if not isinstance(value, str) or not value:
        raise StructuredError(f"{param} must be a non-empty string ({what})", param)
    return value


def _choices(value: Any, param: str) -> list[str]:
    if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
        raise StructuredError(f"{param} must be a non-empty list of strings", param)
    return list(value)


def from_response_format(rf: dict[str, Any]) -> StructuredOutput | None:
    """OpenAI's ``response_format``: ``text`` (None), ``json_object``, or ``json_schema`` with
    ``{"name", "schema", "strict"}`` (xgrammar's JSON grammars are strict either way: no
    property or item the schema does not name)."""
    kind = rf.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput("json_object", param="response_format")
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict):
            raise StructuredError("response_format.json_schema must be an object with "
                                  "\"name\" and \"schema\"", "response_format")
        name = js.get("name")
        if name is not None and (not isinstance(name, str) or not name):
            raise StructuredError("response_format.json_schema.name must be a non-empty string",
                                  "response_format")
        if "schema" not in js:
            raise StructuredError("response_format.json_schema.schema is required",
                                  "response_format")
        strict = js.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise StructuredError("response_format.json_schema.strict must be a boolean",
                                  "response_format")
        return StructuredOutput("json", _schema_text(js["schema"], "response_format"),
                                param="response_format")
    raise StructuredError(f"response_format.type must be text, json_object or json_schema, "
                          f"got {kind!r}", "response_format")


def _from_guided(name: str, value: Any) -> StructuredOutput:
    if name == "guided_json":
        return StructuredOutput("json", _schema_text(value, name), param=name)
    if name == "guided_regex":
        return StructuredOutput("regex", _text(value, name, "a regular expression"), param=name)
    if name == "guided_grammar":
        return StructuredOutput("grammar", _text(value, name, "an EBNF grammar"), param=name)
    return StructuredOutput("choice", choices=_choices(value, name), param=name)


def _from_structured_outputs(so: dict[str, Any]) -> StructuredOutput | None:
    param = "structured_outputs"
    set_keys = [k for k in STRUCTURED_KEYS if so.get(k) not in (None, False)]
    unknown = [k for k in so if k not in STRUCTURED_KEYS and so[k] is not None
               and k not in ("disable_any_whitespace", "disable_additional_properties",
                             "whitespace_pattern", "backend")]
    if unknown:
        raise StructuredError(f"structured_outputs.{unknown[0]} is not supported (use json, "
                              "regex, grammar, choice or json_object)", param)
    if len(set_keys) > 1:
        raise StructuredError(f"structured_outputs takes one constraint, got {set_keys}", param)
    if not set_keys:
        return None
    key = set_keys[0]
    value = so[key]
    if key == "json":
        return StructuredOutput("json", _schema_text(value, param), param=param)
    if key == "json_object":
        return StructuredOutput("json_object", param=param)
    if key == "choice":
        return StructuredOutput("choice", choices=_choices(value, f"{param}.choice"),
                                param=param)
    what = "a regular expression" if key == "regex" else "an EBNF grammar"
    return StructuredOutput(key, _text(value, f"{param}.{key}", what), param=param)


def structured_output(fields: dict[str, Any]) -> StructuredOutput | None:
    """The request's constraint from its body ``fields`` (name -> value, None when absent),
    or None; ``StructuredError`` for a malformed one or more than one. The returned one has
    passed ``StructuredOutput.validate``."""
    found: list[StructuredOutput] = []
    rf = fields.get("response_format")
    if rf is not None:
        if not isinstance(rf, dict):
            raise StructuredError("response_format must be an object", "response_format")
        if (so := from_response_format(rf)) is not None:
            found.append(so)
    for name in GUIDED:
        if fields.get(name) is not None:
            found.append(_from_guided(name, fields[name]))
    so_body = fields.get("structured_outputs")
    if so_body is not None:
        if not isinstance(so_body, dict):
            raise StructuredError("structured_outputs must be an object", "structured_outputs")
        if (so := _from_structured_outputs(so_body)) is not None:
            found.append(so)
    if len(found) > 1:
        names = ", ".join(s.param for s in found)
        raise StructuredError(f"at most one output constraint per request, got {names}",
                              found[1].param)
    if not found:
        return None
    why = found[0].validate()
    if why is not None:
        raise StructuredError(why, found[0].param)
    return found[0]
