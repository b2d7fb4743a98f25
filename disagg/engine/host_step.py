"""A ``StepPlan`` flattened into host arrays, one row per token and per sequence, and
bounds-checked (it crossed a process boundary) before it touches the cache: numpy over the
whole plan, no per-token Python (``ModelRunner``'s host work per step)."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

import numpy as np

from disagg.engine.picking import check_processor_ids
from disagg.protocol.executor import StepPlan


@dataclass
class HostStep:
    """A plan flattened into host arrays (one row per token / per sequence)."""

    token_ids: np.ndarray  # [T] int64
    positions: np.ndarray  # [T] int64
    slots: np.ndarray  # [T] int64, page * page_size + offset
    tables: np.ndarray  # [B, max_pages] int32, zero-padded
    seq_lens: np.ndarray  # [B] int32
    cu: np.ndarray  # [B + 1] int32
    sample_rows: list[int]  # the last row of each sampled chunk (its last 1 + num_draft rows)
    hidden_rows: list[int]
    max_q_len: int
    max_seq_len: int


def flatten_plan(plan: StepPlan, page_size: int, num_pages: int, vocab: int) -> HostStep:
    """Flatten and bounds-check a plan (it crossed a process boundary) before it touches the
    cache. Raises ValueError naming the offending slot."""
    chunks = plan.chunks
    if not chunks:
        raise ValueError("empty plan")
    n = np.fromiter((len(c.token_ids) for c in chunks), dtype=np.int64, count=len(chunks))
    start = np.fromiter((c.start_pos for c in chunks), dtype=np.int64, count=len(chunks))
    npages = np.fromiter((len(c.block_table) for c in chunks), dtype=np.int64, count=len(chunks))
    end = start + n
    bad = (n < 1) | (start < 0)
    if bad.any():
        raise ValueError(f"slot {chunks[int(bad.argmax())].slot}: empty chunk or negative start")
    for c in chunks:
        if c.num_draft and not (c.sample and 0 < c.num_draft < len(c.token_ids)):
            raise ValueError(f"slot {c.slot}: num_draft {c.num_draft} needs a sampled chunk "
                             "longer than its drafts")
        if c.follow and (len(c.token_ids) != 1 or c.num_draft or c.draft_tokens):
            raise ValueError(f"slot {c.slot}: a follow chunk carries one token and no drafts")
        if c.logit_bias or c.penalty_ids or c.seen_ids or c.prompt_rows:
            check_processor_ids(c, vocab)
    short = npages * page_size < end
    if short.any():
        i = int(short.argmax())
        raise ValueError(f"slot {chunks[i].slot}: block table too short for position {end[i] - 1}")
    flat_tables = np.fromiter(chain.from_iterable(c.block_table for c in chunks), dtype=np.int64,
                              count=int(npages.sum()))
    if flat_tables.size and (flat_tables.min() < 0 or flat_tables.max() >= num_pages):
        row = np.repeat(np.arange(len(chunks)), npages)
        bad_pages = (flat_tables < 0) | (flat_tables >= num_pages)
        raise ValueError(f"slot {chunks[int(row[bad_pages.argmax()])].slot}: page id out of range")
    total = int(n.sum())
    ids = np.fromiter(chain.from_iterable(c.token_ids for c in chunks), dtype=np.int64,
                      count=total)
    if ids.min() < 0 or ids.max() >= vocab:
        row = np.repeat(np.arange(len(chunks)), n)
        bad_ids = (ids < 0) | (ids >= vocab)
        raise ValueError(f"slot {chunks[int(row[bad_ids.argmax()])].slot}: token id out of "
                         "vocabulary")
    b = len(chunks)
    cu = np.zeros(b + 1, dtype=np.int64)
    np.cumsum(n, out=cu[1:])
    tok_row = np.repeat(np.arange(b), n)
    positions = start[tok_row] + (np.arange(total) - cu[:-1][tok_row])
    width = int(npages.max())
    tables = np.zeros((b, width), dtype=np.int64)
    tstart = np.zeros(b, dtype=np.int64)
    np.cumsum(npages[:-1], out=tstart[1:])
    page_row = np.repeat(np.arange(b), npages)
    tables[page_row, np.arange(flat_tables.size) - tstart[page_row]] = flat_tables
    slots = tables[tok_row, positions // page_size] * page_size + positions % page_size
    last = cu[1:] - 1
    return HostStep(
        token_ids=ids, positions=positions, slots=slots, tables=tables.astype(np.int32),
        seq_lens=end.astype(np.int32), cu=cu.astype(np.int32),
        sample_rows=[int(last[i]) + j for i, c in enumerate(chunks) if c.sample
                     for j in range(-c.num_draft, 1)],
        hidden_rows=[int(last[i]) for i, c in enumerate(chunks) if c.want_hidden],
        max_q_len=int(n.max()), max_seq_len=int(end.max()))
