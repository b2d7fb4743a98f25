"""A chat request that names no output length is capped by ``--default-max-tokens``
(``HttpLimits.default_max_tokens``), never past the rest of the context; one that names its
own is never lowered; 0 turns the cap off (OpenAI's rest of the context)."""

from __future__ import annotations

import json

import pytest

from disagg.cli.node import build_parser, http_limits_from_args
from disagg.serving.http_limits import HttpLimits
from disagg.serving.openai_api import ChatBody, decode_body, prepare_chat


class FakeTok:
    vocab_size = 100

    def encode(self, text):
        return [int(w[1:]) for w in text.split()]

    def apply_chat_template(self, messages, add_generation_prompt=True):
        return " ".join(m["content"] for m in messages) + " w99"


def chat(default: int, max_model_len: int = 4096, **kw) -> int:
    body = decode_body(json.dumps({"messages": [{"role": "user", "content": "w5 w6"}], **kw})
                       .encode(), ChatBody)
    return prepare_chat(body, FakeTok(), "m", max_model_len, 16, default).sampling.max_tokens


def test_the_default_caps_a_chat_request_without_a_length():
    assert chat(1024) == 1024
    assert chat(0) == 4096 - 3  # off: the rest of the context
    assert chat(1024, max_model_len=100) == 97  # never past the context
    assert chat(1024, max_tokens=2000) == 2000  # the request's own is kept
    assert chat(8, max_completion_tokens=20) == 20


def test_the_flag_sets_it_and_refuses_a_negative():
    assert HttpLimits().default_max_tokens == 1024
    args = build_parser().parse_args(["--default-max-tokens", "64"])
    assert http_limits_from_args(args).default_max_tokens == 64
    with pytest.raises(ValueError, match="--default-max-tokens"):
        http_limits_from_args(build_parser().parse_args(["--default-max-tokens", "-1"]))
