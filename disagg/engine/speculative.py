"""Speculative decoding: drafting by prompt lookup, and verification of drafted tokens.

A decode step of a sequence normally computes its one new token. With speculation the
scheduler appends up to K drafted tokens to that chunk (``SeqChunk.num_draft``); the model
computes all K+1 positions at once (causal, like a prefill chunk), and the runner verifies the
drafts against the target's own distributions at those positions (``verify``):

- every request keeps drafts while each equals the token the target itself emits at that
  position, then adds that token (the correction at the first mismatch, or a bonus after a
  fully accepted run). For greedy requests that token is the argmax; for sampled ones it is
  the draw ``disagg.engine.sampling.draw`` makes for that output index from the request's seed,
  exactly the draw a step without drafts makes ("sample and compare"). So the output is token
  for token what decoding without speculation gives, greedy or seeded, whichever positions a
  step happened to draft (up to the float noise of computing a position in a longer chunk,
  as between batch sizes). It is exact for any draft source (every emitted token is a plain
  draw of the target), and with deterministic drafts (prompt lookup, a draft model's or the
  MTP layer's greedy choice: a one-hot proposal q) it accepts a draft x with probability
  p(x), as rejection sampling would.

The KV the step wrote at rejected positions lies past the sequence's computed length: never
read, overwritten by the next step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from disagg.engine.sampling import Draw, draw_into
from disagg.protocol.executor import SeqChunk

if TYPE_CHECKING:
    from disagg.config import SchedulerConfig
    from disagg.engine.scheduling import Sequence

@dataclass(frozen=True)
class Speculation:
    """How a node drafts: ``method`` (ngram: prompt lookup in the scheduler; draft: the
    executor's draft model), ``tokens`` drafted per sequence and step."""

    method: str
    tokens: int
    lookup_max: int = 4
    lookup_min: int = 1

    def propose(self, seq: Sequence, k: int) -> list[int]:
        if self.method == "mtp":  # what the MTP layer drafted after the sequence's last step
            return list(seq.spec_state or [])[:k]
        return propose_ngram(token_array(seq), k, self.lookup_max, self.lookup_min)

    def scheduler_args(self) -> dict[str, Any]:
        """``BatchScheduler`` keyword arguments (``draft``: the executor's draft model drafts)."""
        if self.method == "draft":
            return {"spec_tokens": self.tokens, "draft_model": True}
        return {"spec_tokens": self.tokens, "propose": self.propose, "mtp": self.method == "mtp"}


def token_array(seq: Sequence) -> np.ndarray:
    """``seq``'s tokens as an int64 array, kept on the sequence and extended by the tokens
    added since the last call (converting the whole history every step costs more than the
    lookup itself)."""
    n, p = seq.num_tokens, len(seq.prompt_ids)
    buf, have = seq.spec_state if seq.spec_state is not None else (np.empty(0, np.int64), 0)
    if have > n:  # cannot shrink while alive; start over to be safe
        buf, have = np.empty(0, np.int64), 0
    if buf.shape[0] < n:
        grown = np.empty(max(n, 2 * buf.shape[0], 64), np.int64)
        grown[:have] = buf[:have]
        buf = grown
    if have < p:
        buf[have:p] = seq.prompt_ids[have:]
        have = p
    if have < n:
        buf[have:n] = seq.output_ids[have - p:]
    seq.spec_state = (buf, n)
    return buf[:n]


def speculation(cfg: SchedulerConfig) -> Speculation | None:
    """The node's drafting set-up from its config (None: speculation off)."""
    if cfg.speculative_method is None:
        return None
    return Speculation(cfg.speculative_method, cfg.num_speculative_tokens,
                       cfg.prompt_lookup_max, cfg.prompt_lookup_min)


def propose_ngram(tokens: list[int] | np.ndarray, k: int, n_max: int = 4,
                  n_min: int = 1, max_candidates: int = 256) -> list[int]:
    """Prompt lookup: find the latest earlier occurrence of the sequence's last ``n`` tokens
    (longest ``n`` first, from ``n_max`` down to ``n_min``) and propose the up to ``k`` tokens
    that followed it. Empty when nothing matches.

    One vectorised scan finds where the last token occurred; each candidate (latest first, at
    most ``max_candidates``) is extended backwards while it matches."""
    arr = np.asarray(tokens, dtype=np.int64)
    total = arr.shape[0]
    if k <= 0 or total < n_min + 1:
        return []
    best_n, best_j = 0, -1
    for j in np.flatnonzero(arr[:total - 1] == arr[total - 1])[::-1][:max_candidates].tolist():
        m = 1
        while m < n_max and j - m >= 0 and arr[j - m] == arr[total - 1 - m]:
            m += 1
        if m > best_n:
            best_n, best_j = m, j
            if m == n_max:
                break
    if best_n < n_min:
        return []
    return arr[best_j + 1:best_j + 1 + k].tolist()


def target_tokens(logits: torch.Tensor, chunks: list[SeqChunk]) -> torch.Tensor:
    """The target's own token at every row of ``logits`` (float32, ``1 + num_draft`` rows per
    chunk in order), on the device, not waited for: the argmax for greedy chunks; for sampled
    ones the draw of output index ``output_index + j`` at the chunk's row j, the very draw a
    step without drafts would make for that index."""
    at: list[int] = []
    rows: list[Draw] = []
    row = 0
    for c in chunks:
        n = c.num_draft + 1
        if c.temperature > 0.0:
            at += range(row, row + n)
            rows += [(c.temperature, c.top_k, c.top_p, c.seed, c.output_index + j)
                     for j in range(n)]
        row += n
    if row != logits.shape[0]:
        raise ValueError(f"{logits.shape[0]} logits rows for chunks needing {row}")
    out = logits.argmax(dim=-1)
    return draw_into(out, logits, at, rows) if at else out


def accept(targets: list[int], drafts: list[int]) -> list[int]:
    """The tokens a chunk emits given the target's token at each of its ``len(drafts) + 1``
    positions: the drafts while each equals the target's token, then the target's token (the
    correction at the first mismatch, or the bonus after the last draft)."""
    out: list[int] = []
    for t, d in zip(targets, drafts, strict=False):
        out.append(int(t))
        if t != d:
            return out
    out.append(int(targets[len(drafts)]))
    return out


def drafts_of(chunk: SeqChunk) -> list[int]:
    k = chunk.num_draft
    return chunk.token_ids[len(chunk.token_ids) - k:] if k else []


def verify(logits: torch.Tensor, chunk: SeqChunk, argmax: list[int] | None = None) -> list[int]:
    """The tokens a chunk with ``chunk.num_draft`` = k drafts emits, given the target's float32
    ``logits [k + 1, V]`` at its last k + 1 positions (``argmax``: their argmax, if already
    on the host). Returns the accepted drafts plus one target token (1 to k + 1 tokens)."""
    if chunk.temperature <= 0.0 and argmax is not None:
        return accept(argmax, drafts_of(chunk))
    return accept(target_tokens(logits, [chunk]).tolist(), drafts_of(chunk))


def verify_all(logits: torch.Tensor, chunks: list[SeqChunk]) -> tuple[list[int], list[int]]:
    """Tokens of every sampled chunk of a step (``logits``: their rows in order, 1 +
    ``num_draft`` each) and how many each emitted. One device-to-host copy for the step."""
    targets = target_tokens(logits, chunks).tolist()
    tokens: list[int] = []
    counts: list[int] = []
    row = 0
    for c in chunks:
        n = c.num_draft + 1
        out = accept(targets[row:row + n], drafts_of(c))
        tokens += out
        counts.append(len(out))
        row += n
    return tokens, counts


def emitted_per_chunk(tokens: list[int], counts: list[int] | None, sampled: int) -> list[list[int]]:
    """Split a step's flat sampled tokens into one list per sampled chunk."""
    counts = counts if counts is not None else [1] * sampled
    out, pos = [], 0
    for n in counts:
        out.append(tokens[pos:pos + n])
        pos += n
    return out
