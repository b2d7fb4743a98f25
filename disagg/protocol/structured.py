"""The constraint a request's output must satisfy (grammar-constrained decoding), as it travels
in ``SamplingParams.structured`` over both front doors (the ZeroMQ client protocol and the
OpenAI gateway, which maps ``response_format``, ``guided_*``, ``structured_outputs`` and forced
tool calls onto it). Only the node that samples (mixed or decode) compiles and applies it
(``disagg.engine.grammar``); a prefiller never sees it.
"""

from __future__ import annotations

from typing import Literal

import msgspec

MAX_GRAMMAR_CHARS = 64 << 10  # a schema / regex / grammar text, in characters
MAX_CHOICES = 256  # alternatives of a choice constraint
MAX_CHOICE_CHARS = 1024  # characters of one alternative

# json: ``spec`` is a JSON schema (JSON text); json_object: any JSON object (``spec`` unused);
# regex: ``spec`` is a regular expression; grammar: ``spec`` is EBNF (GBNF) as xgrammar reads
# it, its start rule ``root``; choice: the output is exactly one of ``choices``
StructuredKind = Literal["json", "json_object", "regex", "grammar", "choice"]
KINDS = ("json", "json_object", "regex", "grammar", "choice")


class StructuredOutput(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One constraint on the whole output (every token, the first included)."""

    kind: str  # a StructuredKind (plain str on the wire so an unknown one is refused by name)
    spec: str = ""  # the schema (JSON text), regex or grammar; "" for json_object / choice
    choices: list[str] = []  # kind "choice": the alternatives, 1..MAX_CHOICES
    # the request parameter this came from (``response_format``, ``guided_json``,
    # ``tool_choice``, ...): errors about the constraint name it
    param: str = "structured"

    def validate(self) -> str | None:
        """A message naming the parameter, or None (what only a compiler can tell, a schema or
        grammar that is invalid or admits nothing, the node answers when it compiles it)."""
        if self.kind not in KINDS:
            return f"{self.param}: the constraint kind must be one of {', '.join(KINDS)}, " \
                   f"got {self.kind!r}"
        if len(self.spec) > MAX_GRAMMAR_CHARS:
            return (f"{self.param}: the {self.kind} text has {len(self.spec)} characters, "
                    f"more than {MAX_GRAMMAR_CHARS}")
        if self.kind in ("json", "regex", "grammar") and not self.spec:
            return f"{self.param}: the {self.kind} constraint is empty"
        if self.kind == "choice":
            if not 1 <= len(self.choices) <= MAX_CHOICES:
                return (f"{self.param}: a choice needs 1-{MAX_CHOICES} alternatives, "
                        f"got {len(self.choices)}")
            if any(not c or len(c) > MAX_CHOICE_CHARS for c in self.choices):
                return f"{self.param}: each choice must have 1-{MAX_CHOICE_CHARS} characters"
        return None

    def key(self) -> tuple[str, str, tuple[str, ...]]:
        """What identifies the compiled grammar (its cache key)."""
        return self.kind, self.spec, tuple(self.choices)
