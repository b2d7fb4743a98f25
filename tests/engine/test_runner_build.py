"""The runner's vectorised plan flattening against the per-chunk definition, and the CUDA
graph bucket choice (pure functions; no GPU)."""

from __future__ import annotations

import random

import numpy as np
import pytest

from disagg.engine.cache import slot_mapping
from disagg.engine.cuda_graphs import buckets_for, pick_bucket
from disagg.engine.host_step import flatten_plan
from disagg.protocol.executor import SeqChunk, StepPlan


def random_plan(rng: random.Random, page: int, num_pages: int) -> StepPlan:
    chunks = []
    nd = rng.randint(0, 5)
    for i in range(nd + rng.randint(0 if nd else 1, 4)):
        n = 1 if i < nd else rng.randint(1, 20)
        start = rng.randint(0, 40)
        pages = rng.sample(range(num_pages), -(-(start + n) // page) + rng.randint(0, 2))
        chunks.append(SeqChunk(i * 3, [rng.randrange(100) for _ in range(n)], start, pages,
                               rng.random() < 0.7, rng.random() < 0.3))
    return StepPlan(1, chunks, nd)


@pytest.mark.parametrize("seed", range(30))
def test_flatten_matches_per_chunk_definition(seed):
    rng = random.Random(seed)
    page, num_pages = rng.choice([1, 4, 16]), 64
    plan = random_plan(rng, page, num_pages)
    h = flatten_plan(plan, page, num_pages, 100)
    ids, pos, slots, rows, hidden, cu = [], [], [], [], [], [0]
    for i, c in enumerate(plan.chunks):
        n = len(c.token_ids)
        ids += c.token_ids
        pos += range(c.start_pos, c.start_pos + n)
        slots += slot_mapping(c.block_table, c.start_pos, n, page)
        cu.append(cu[-1] + n)
        if c.sample:
            rows.append(cu[-1] - 1)
        if c.want_hidden:
            hidden.append(cu[-1] - 1)
        assert h.tables[i, : len(c.block_table)].tolist() == c.block_table
        assert not h.tables[i, len(c.block_table):].any()
        assert h.seq_lens[i] == c.start_pos + n
    assert h.token_ids.tolist() == ids and h.positions.tolist() == pos
    assert h.slots.tolist() == slots and h.cu.tolist() == cu
    assert h.sample_rows == rows and h.hidden_rows == hidden
    assert h.max_q_len == max(len(c.token_ids) for c in plan.chunks)
    assert h.tables.dtype == np.int32 and h.seq_lens.dtype == np.int32


@pytest.mark.parametrize(("chunk", "message"), [
    (SeqChunk(9, [], 0, [0], True), "slot 9: empty chunk"),
    (SeqChunk(9, [1], -1, [0], True), "slot 9: empty chunk or negative start"),
    (SeqChunk(9, [1, 2, 3, 4, 5], 0, [0], True), "slot 9: block table too short"),
    (SeqChunk(9, [1], 0, [64], True), "slot 9: page id out of range"),
    (SeqChunk(9, [1], 0, [-1], True), "slot 9: page id out of range"),
    (SeqChunk(9, [100], 0, [0], True), "slot 9: token id out of vocabulary"),
])
def test_flatten_rejects_bad_chunks(chunk, message):
    ok = SeqChunk(1, [1, 2], 0, [3], True)
    with pytest.raises(ValueError, match=message):
        flatten_plan(StepPlan(1, [ok, chunk], 0), 4, 64, 100)


def test_buckets():
    assert buckets_for(256) == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    assert buckets_for(48) == [1, 2, 4, 8, 16, 32, 48]
    assert buckets_for(1) == [1]
    assert buckets_for(1000) == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    b = buckets_for(100)
    assert [pick_bucket(n, b) for n in (1, 3, 64, 65, 100, 101)] == [1, 4, 64, 100, 100, None]
