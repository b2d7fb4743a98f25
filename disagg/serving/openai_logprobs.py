"""OpenAI's logprobs shapes from the node's ``TokenLogprobs`` (pure functions), and the seeds of
a request's choices.

- chat (``logprobs: true``, ``top_logprobs`` 0-20): ``{"content": [{"token", "logprob",
  "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}`` per choice (and per SSE chunk,
  for the chunk's tokens);
- completions (``logprobs`` 0-5; ``echo``): the legacy ``{"tokens", "token_logprobs",
  "top_logprobs", "text_offset"}``: ``top_logprobs`` a ``{token: logprob}`` map per token,
  ``text_offset`` each token's first character in the choice's text; with ``echo`` the prompt's
  tokens come first, the first of them with ``null`` logprob and alternatives (nothing
  predicts it).

A token's text is its own decoding (``TokenText``); with no tokenizer it is ``token_id:N``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from disagg.protocol import TokenLogprobs

TokenText = Callable[[int], str]
MAX_COMPLETION_LOGPROBS = 5  # OpenAI's bound for /v1/completions logprobs

_MASK64 = (1 << 64) - 1


def choice_seed(seed: int, index: int) -> int:
    """The seed of choice ``index`` of a request seeded ``seed``: ``seed`` itself for choice 0
    (so n = 1 draws what it always drew), else a SplitMix64 mix of (seed, index) in [0, 2**63),
    distinct per choice and reproducible."""
    if index == 0:
        return seed
    z = (seed + 0x9E3779B97F4A7C15 * (index + 1)) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


def token_text_of(tokenizer: Any) -> TokenText:
    """Each token's own text through ``tokenizer`` (special tokens kept), or ``token_id:N``."""
    if tokenizer is None:
        return lambda tid: f"token_id:{tid}"
    return lambda tid: tokenizer.decode([tid], skip_special_tokens=False)


def _chat_entry(text: TokenText, tid: int, lp: float) -> dict[str, Any]:
    s = text(tid)
    return {"token": s, "logprob": lp, "bytes": list(s.encode())}


def chat_logprobs(entries: list[TokenLogprobs], text: TokenText) -> dict[str, Any]:
    """A chat choice's (or chunk's) ``logprobs`` object."""
    return {"content": [
        {**_chat_entry(text, e.token_id, e.logprob),
         "top_logprobs": [_chat_entry(text, t, lp)
                          for t, lp in zip(e.top_ids, e.top_logprobs, strict=True)]}
        for e in entries]}


def completion_logprobs(entries: list[TokenLogprobs], text: TokenText, offset: int = 0,
                        prompt: tuple[list[int], list[TokenLogprobs]] | None = None
                        ) -> dict[str, Any]:
    """A completion choice's (or chunk's) ``logprobs``: ``entries`` from character ``offset``
    of the choice's text; ``prompt`` (echo): the prompt's ids and their logprobs (one per
    prompt token after the first), placed first from offset 0."""
    tokens: list[str] = []
    token_lps: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    offsets: list[int] = []

    def put(tid: int, e: TokenLogprobs | None) -> None:
        nonlocal offset
        s = text(tid)
        tokens.append(s)
        offsets.append(offset)
        offset += len(s)
        token_lps.append(None if e is None else e.logprob)
        tops.append(None if e is None else {text(t): lp for t, lp in
                                            zip(e.top_ids, e.top_logprobs, strict=True)})

    if prompt is not None:
        ids, lps = prompt
        offset = 0
        for i, tid in enumerate(ids):
            put(tid, lps[i - 1] if 0 < i <= len(lps) else None)
    for e in entries:
        put(e.token_id, e)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops,
            "text_offset": offsets}
