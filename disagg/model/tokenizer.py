"""Tokenizer (``tokenizer.json`` via the ``tokenizers`` library), chat template, detokenizer."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer


class Tokenizer:
    def __init__(self, tok: HFTokenizer, chat_template: str | None = None, bos: str | None = None,
                 eos: str | None = None):
        self._tok = tok
        self.chat_template = chat_template
        self.bos_token = bos
        self.eos_token = eos

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer | None:
        """The directory's tokenizer, or None when it has no ``tokenizer.json``."""
        path = Path(path)
        file = path / "tokenizer.json"
        if not file.is_file():
            return None
        cfg: dict[str, Any] = {}
        cfg_file = path / "tokenizer_config.json"
        if cfg_file.is_file():
            cfg = json.loads(cfg_file.read_text())
        template = cfg.get("chat_template")
        jinja = path / "chat_template.jinja"
        if template is None and jinja.is_file():
            template = jinja.read_text()
        return cls(HFTokenizer.from_file(str(file)), template,
                   _token_text(cfg.get("bos_token")), _token_text(cfg.get("eos_token")))

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The most characters one token can stand for (its longest vocabulary entry; byte
        level vocabularies spell each byte as one character, and a character is >= 1 byte),
        so a text of n characters has at least n / max_token_chars tokens."""
        vocab = self._tok.get_vocab(with_added_tokens=True)
        return max(1, max((len(t) for t in vocab), default=1))

    @property
    def backend(self) -> HFTokenizer:
        """The ``tokenizers`` tokenizer (its vocabulary, for grammar-constrained decoding)."""
        return self._tok

    @property
    def vocab_size(self) -> int:
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str) -> list[int]:
        # The node feeds text exactly as given: no special tokens beyond what the
        # tokenizer's post-processor adds.
        return list(self._tok.encode(text).ids)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return str(self._tok.decode(ids, skip_special_tokens=skip_special_tokens))

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None) -> str:
        """The conversation as the model's template renders it (``tools``: OpenAI-shaped
        function tools, which templates that know tools render; None: no tools)."""
        if not self.chat_template:
            raise ValueError("this model has no chat template")
        import jinja2.sandbox

        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        return env.from_string(self.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt, tools=tools,
            bos_token=self.bos_token or "", eos_token=self.eos_token or "",
        )


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


class IncrementalDetokenizer:
    """Turns a growing list of output ids into text deltas without re-emitting text.

    Decodes a short window (from ``prefix_offset``) and holds back a trailing replacement
    character, which means a multi-byte character is still incomplete."""

    def __init__(self, tokenizer: Tokenizer | None, prompt_ids: list[int]):
        self.tok = tokenizer
        self.ids: list[int] = list(prompt_ids[-6:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    @classmethod
    def resumed(cls, tokenizer: Tokenizer | None, prompt_ids: list[int], output_ids: list[int],
                text_prefix: int, text_read: int) -> IncrementalDetokenizer:
        """The detokenizer of a stream another node started (``protocol.Resume``): as that
        node's stood after streaming ``output_ids``, the text of ``output_ids[:text_read]``
        streamed and its next delta decoded from ``text_prefix`` on (both 0: from the prompt's
        tail, as a new one), so that the next ``push`` returns what that node's would have."""
        d = cls(tokenizer, prompt_ids)
        if text_read == 0:
            d.ids.extend(output_ids)
        else:
            d.ids = list(output_ids[text_prefix:])
            d.read_offset = text_read - text_prefix
        return d

    def push(self, new_ids: list[int]) -> str:
        if self.tok is None:
            return ""
        self.ids.extend(new_ids)
        prefix = self.tok.decode(self.ids[self.prefix_offset : self.read_offset])
        full = self.tok.decode(self.ids[self.prefix_offset :])
        if full.endswith("\ufffd") or len(full) <= len(prefix):
            return ""
        delta = full[len(prefix) :]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        return delta
