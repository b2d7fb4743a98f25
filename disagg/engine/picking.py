"""What a step's logits become on the device: processed (penalties, logit_bias), sampled, and
the logprobs the rows asked for; prompt logprobs from a prefill's hidden rows.

The model runner (``disagg.engine.runner``) calls these after the forward pass, the CUDA
graph's included; the math is ``disagg.engine.sampling``'s.
"""

from __future__ import annotations

import numpy as np
import torch

from disagg.engine.sampling import (
    LogprobRows,
    has_processors,
    process_logits,
    prompt_logprobs,
    sample_device,
    token_logprobs,
)
from disagg.engine.speculative import verify_all
from disagg.model.transformer import Transformer
from disagg.protocol import MAX_TOP_LOGPROBS
from disagg.protocol.executor import SeqChunk, StepPlan

# the runner's follow fill: (input rows, source rows, the previous step's tokens on the device)
Fill = tuple[np.ndarray, np.ndarray, torch.Tensor]


def check_processor_ids(c: SeqChunk, vocab: int) -> None:
    """Bounds of a chunk's logits-processor and prompt-logprob fields (it crossed a process
    boundary): ValueError naming the slot."""
    ids = [t for t, _ in c.logit_bias] + c.penalty_ids + c.seen_ids
    if c.prompt_rows:
        if c.prompt_rows == len(c.token_ids):  # its last row predicts the token after
            ids.append(c.prompt_next)
        if not (0 < c.prompt_rows <= len(c.token_ids)
                and 0 <= c.prompt_logprobs <= MAX_TOP_LOGPROBS):
            raise ValueError(f"slot {c.slot}: prompt_rows {c.prompt_rows} / prompt_logprobs "
                             f"{c.prompt_logprobs} out of range")
    if ids and (min(ids) < 0 or max(ids) >= vocab):
        raise ValueError(f"slot {c.slot}: logits-processor token id out of vocabulary")
    if not -1 <= c.logprobs <= MAX_TOP_LOGPROBS:
        raise ValueError(f"slot {c.slot}: logprobs {c.logprobs} out of range")
    if c.num_draft and (has_processors(c) or c.logprobs >= 0):
        raise ValueError(f"slot {c.slot}: drafts with logits processors or logprobs")


def follow_tokens(chunks: list[SeqChunk], sampled: list[SeqChunk], fill: Fill | None,
                  device: torch.device) -> torch.Tensor | None:
    """Per sampled row, the in-flight token a follow chunk's output holds beyond its
    ``penalty_ids`` (on the device, -1 where none), for the penalties; None when no follow
    chunk has a processor. ``fill``: the runner's (input rows, source rows, the previous
    step's tokens) of the follow chunks, in chunk order."""
    if fill is None or not any(c.follow and has_processors(c) for c in chunks):
        return None
    row_of = {id(c): j for j, c in enumerate(sampled)}
    follows = [row_of[id(c)] for c in chunks if c.follow]
    out = torch.full((len(sampled),), -1, dtype=torch.int64, device=device)
    _, src, last = fill
    return out.index_copy_(0, torch.tensor(follows, dtype=torch.int64).to(device),
                           last.index_select(0, torch.from_numpy(src).to(device)))


def pick(logits: torch.Tensor, chunks: list[SeqChunk], sampled: list[SeqChunk],
         argmax: torch.Tensor | None, fill: Fill | None
         ) -> tuple[torch.Tensor, LogprobRows | None]:
    """One token per row of ``logits`` (row i: ``sampled[i]``, the sampling chunks of
    ``chunks``) after the rows' logits processors, on the device, and the logprobs of the
    rows that asked. ``argmax``: the raw rows' argmax when already computed (a graph's)."""
    processed = process_logits(logits, sampled,
                               follow_tokens(chunks, sampled, fill, logits.device))
    if processed is not logits:
        argmax = None  # a processed greedy row's token is its processed argmax
    tokens = sample_device(processed, sampled, argmax)  # masks the constrained rows in place
    return tokens, token_logprobs(processed, sampled, tokens)  # so: the masked distribution


def verify_rows(logits: torch.Tensor, sampled: list[SeqChunk]
                ) -> tuple[list[int], list[int], LogprobRows | None]:
    """A step with drafts: verified tokens and counts (``verify_all``) over processed rows (a
    chunk with processors or logprobs carries no drafts: one row, as a plain decode), with the
    logprobs of the chunks that asked."""
    per_row = [c for c in sampled for _ in range(c.num_draft + 1)]
    logits = process_logits(logits, per_row)
    tokens, counts = verify_all(logits, sampled)
    if not any(c.logprobs >= 0 for c in sampled):
        return tokens, counts, None
    row_tok = [0] * len(per_row)
    row = pos = 0
    for c, n in zip(sampled, counts, strict=True):
        row_tok[row] = tokens[pos]  # a chunk asking logprobs has one row and one token
        row, pos = row + c.num_draft + 1, pos + n
    return tokens, counts, token_logprobs(
        logits, per_row, torch.tensor(row_tok, dtype=torch.int64).to(logits.device))


def prompt_rows(model: Transformer, plan: StepPlan, cu: np.ndarray, hidden: torch.Tensor
                ) -> LogprobRows | None:
    """Raw logprobs of the prompt tokens after the chunks' ``prompt_rows`` rows (each row
    predicts the token after it; ``cu``: the chunks' first rows in ``hidden``), with the
    alternatives each chunk asked for, keyed by slot (one entry per row, in order)."""
    asked = [(i, c) for i, c in enumerate(plan.chunks) if c.prompt_rows]
    if not asked:
        return None
    rows: list[int] = []
    targets: list[int] = []
    keys: list[int] = []
    ks: list[int] = []
    for i, c in asked:
        first = int(cu[i])
        rows += range(first, first + c.prompt_rows)
        targets += (c.token_ids + [c.prompt_next])[1:c.prompt_rows + 1]
        keys += [c.slot] * c.prompt_rows
        ks += [c.prompt_logprobs] * c.prompt_rows
    dev = hidden.device
    idx = torch.tensor(rows, dtype=torch.int64).to(dev, non_blocking=True)
    tgt = torch.tensor(targets, dtype=torch.int64).to(dev, non_blocking=True)
    return LogprobRows(keys, ks, *prompt_logprobs(model.logits, hidden.index_select(0, idx),
                                                  tgt, max(ks)))
