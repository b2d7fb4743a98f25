"""Workloads and arrival processes for ``disagg-bench serve``: pure, seeded, no I/O.

Prompts are random token ids drawn uniformly from ``[MIN_TOKEN_ID, vocab_size)``; low ids are
ordinary tokens in every real vocabulary (special tokens sit at the top or at 0-2), so the
default ``vocab_size=1000`` is valid for any model. Every request gets fresh random ids, so no
two prompts share a prefix.

Workloads:

- ``fixed``: every request has ``input_len`` prompt tokens and asks for ``output_len`` tokens.
- ``sharegpt``: a ShareGPT-like length distribution synthesised from the seed, with no data
  set needed. Input and output lengths are independent lognormals whose medians and spreads
  approximate ShareGPT conversations under a Llama-style tokenizer (long right tails):
  input median 180, sigma 1.0 (mean ~297 before clipping); output median 150, sigma 0.8
  (mean ~207 before clipping). Lengths are rounded and clipped to ``[MIN_INPUT_LEN,
  max_input_len]`` and ``[1, max_output_len]``.

- ``multiturn``: conversations of ``num_turns`` turns. Every conversation starts with the
  same system prompt (``system_len`` tokens), and each turn sends the whole history (system
  prompt, earlier user messages and the answers the node gave) plus a new user message of
  ``user_len`` tokens; a turn is sent when the previous one finished. This is the traffic a
  prefix cache is for.

Every request uses ``ignore_eos`` so it produces exactly its requested output length (the
serve command sets it; the workload only decides lengths).

Arrivals: a gamma process with mean rate ``request_rate`` (req/s) and shape ``burstiness``;
``burstiness = 1`` is Poisson (exponential gaps), lower is burstier, higher is more regular;
``request_rate = inf`` releases everything at t = 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

MIN_TOKEN_ID = 10
MIN_INPUT_LEN = 4

SHAREGPT_INPUT_MEDIAN = 180.0
SHAREGPT_INPUT_SIGMA = 1.0
SHAREGPT_OUTPUT_MEDIAN = 150.0
SHAREGPT_OUTPUT_SIGMA = 0.8


@dataclass(frozen=True)
class RequestSpec:
    """One request to send: its prompt (token ids) and the number of output tokens wanted."""

    prompt_token_ids: list[int]
    output_len: int

    @property
    def input_len(self) -> int:
        return len(self.prompt_token_ids)


def random_prompt(rng: np.random.Generator, length: int, vocab_size: int) -> list[int]:
    if vocab_size <= MIN_TOKEN_ID:
        raise ValueError(f"vocab_size must be > {MIN_TOKEN_ID}, got {vocab_size} (--vocab-size)")
    return [int(t) for t in rng.integers(MIN_TOKEN_ID, vocab_size, size=length)]


def fixed_workload(num: int, input_len: int, output_len: int, vocab_size: int,
                   seed: int) -> list[RequestSpec]:
    if input_len < 1 or output_len < 1:
        raise ValueError(f"--input-len and --output-len must be >= 1, got {input_len}, {output_len}")
    rng = np.random.default_rng(seed)
    return [RequestSpec(random_prompt(rng, input_len, vocab_size), output_len) for _ in range(num)]


def copy_workload(num: int, input_len: int, output_len: int, vocab_size: int,
                  seed: int) -> list[RequestSpec]:
    """Copy-heavy prompts (for speculative decoding): a random passage of about
    ``input_len / 2`` tokens, then the passage again cut short, so that the natural
    continuation (a model's induction, or prompt lookup) is the rest of the passage."""
    if input_len < 4 or output_len < 1:
        raise ValueError(f"--workload copy needs --input-len >= 4 and --output-len >= 1, got "
                         f"{input_len}, {output_len}")
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(num):
        passage = random_prompt(rng, max(2, (input_len + 1) // 2), vocab_size)
        out.append(RequestSpec(passage + passage[:input_len - len(passage)], output_len))
    return out


def sharegpt_lengths(num: int, seed: int, max_input_len: int,
                     max_output_len: int) -> list[tuple[int, int]]:
    """(input_len, output_len) pairs from the ShareGPT-like lognormals, clipped."""
    if max_input_len < MIN_INPUT_LEN or max_output_len < 1:
        raise ValueError(f"--max-input-len must be >= {MIN_INPUT_LEN} and --max-output-len >= 1, "
                         f"got {max_input_len}, {max_output_len}")
    rng = np.random.default_rng([seed, 1])  # separate stream from the prompt contents
    ins = rng.lognormal(math.log(SHAREGPT_INPUT_MEDIAN), SHAREGPT_INPUT_SIGMA, size=num)
    outs = rng.lognormal(math.log(SHAREGPT_OUTPUT_MEDIAN), SHAREGPT_OUTPUT_SIGMA, size=num)
    return [(int(np.clip(round(i), MIN_INPUT_LEN, max_input_len)),
             int(np.clip(round(o), 1, max_output_len))) for i, o in zip(ins, outs, strict=True)]


def sharegpt_workload(num: int, vocab_size: int, seed: int, max_input_len: int,
                      max_output_len: int) -> list[RequestSpec]:
    rng = np.random.default_rng(seed)
    return [RequestSpec(random_prompt(rng, i, vocab_size), o)
            for i, o in sharegpt_lengths(num, seed, max_input_len, max_output_len)]


@dataclass(frozen=True)
class Conversation:
    """A multiturn conversation: its system prompt and one user message per turn."""

    index: int
    system: list[int]
    users: list[list[int]]
    output_len: int

    def prompt(self, turn: int, answers: list[list[int]]) -> list[int]:
        """Turn ``turn``'s prompt: the history (with the ``answers`` of earlier turns) plus
        its user message."""
        out = list(self.system)
        for k in range(turn):
            out += self.users[k] + answers[k]
        return out + self.users[turn]


def multiturn_workload(num_conversations: int, num_turns: int, system_len: int, user_len: int,
                       output_len: int, vocab_size: int, seed: int) -> list[Conversation]:
    if num_turns < 1 or user_len < 1 or output_len < 1 or system_len < 0:
        raise ValueError(f"--num-turns, --user-len and --output-len must be >= 1 and "
                         f"--system-len >= 0, got {num_turns}, {user_len}, {output_len}, "
                         f"{system_len}")
    rng = np.random.default_rng([seed, 3])
    system = random_prompt(rng, system_len, vocab_size)
    return [Conversation(c, system, [random_prompt(rng, user_len, vocab_size)
                                     for _ in range(num_turns)], output_len)
            for c in range(num_conversations)]


def arrival_times(num: int, request_rate: float, seed: int, burstiness: float = 1.0) -> list[float]:
    """Release time (seconds from the start) of each request; the first one arrives at 0."""
    if request_rate <= 0:
        raise ValueError(f"--request-rate must be > 0 (or inf), got {request_rate}")
    if burstiness <= 0:
        raise ValueError(f"--burstiness must be > 0, got {burstiness}")
    if math.isinf(request_rate):
        return [0.0] * num
    rng = np.random.default_rng([seed, 2])
    # gamma(shape k, scale theta) has mean k*theta; mean gap 1/rate -> theta = 1/(k*rate)
    gaps = rng.gamma(burstiness, 1.0 / (burstiness * request_rate), size=num)
    if num:
        gaps[0] = 0.0
    return [float(t) for t in np.cumsum(gaps)]
