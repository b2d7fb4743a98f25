"""Overlapped decoding (disagg.engine.core; the core over a fake executor: test_core.py):
the step after a deferred one is scheduled without its tokens (follow chunks the runner fills
in on the device), token-exact with transformers and with stepping one at a time; pages of
sequences that end while a deferred step still writes them stay out of the pool until it
lands."""

from __future__ import annotations

import pytest

from disagg.engine.cache import PagePool
from disagg.engine.host_step import flatten_plan
from disagg.engine.scheduling import BatchScheduler, Sequence, Status
from disagg.llm import LLM
from disagg.model.loader import load_model
from disagg.protocol import SamplingParams
from disagg.protocol.executor import SeqChunk, StepPlan
from tinymodels import hf_greedy

PAGE = 4
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [9] * 12, list(range(10, 10 + 3 * PAGE + 1)), [3, 4]]


def make(pages=64, max_len=256):
    return BatchScheduler(PagePool(pages), PAGE, 16, 8, max_len, (2,))


def seq(slot, n_prompt, **params):
    return Sequence(slot, f"r{slot}", list(range(10, 10 + n_prompt)), SamplingParams(**params),
                    seed=slot, arrival=slot)


def decoding(s, *seqs):
    """Add ``seqs`` and run their prefill: the next batch decodes them all."""
    for q in seqs:
        s.add(q)
    batch = s.schedule()
    s.update(batch, [7] * sum(c.sample for c in batch.chunks))
    batch = s.schedule()
    assert batch is not None and batch.num_decodes == len(seqs)
    return batch


def test_ahead_step_follows_every_running_sequence_with_a_page_for_it():
    s = make()
    a, b = seq(0, 3, max_tokens=20, ignore_eos=True), seq(1, 4, max_tokens=20, ignore_eos=True)
    batch = decoding(s, a, b)  # a decodes position 3 (pages: 1), b position 4 (pages: 2)
    assert s.can_defer(batch)
    ahead = s.schedule_ahead(batch)
    assert ahead is not None and ahead.num_decodes == 2
    assert [(c.seq, c.start, c.count, c.follow) for c in ahead.chunks] == [
        (a, 4, 1, True), (b, 5, 1, True)]
    assert len(a.block_table) == 2 and len(b.block_table) == 2  # a crossed into a new page
    wire = ahead.chunks[0].to_wire()
    assert wire.follow and wire.token_ids == [0] and wire.output_index == 2
    assert wire.block_table == a.block_table
    # the tokens land in order: the deferred step's, then the follow step's
    s.update(batch, [21, 22])
    s.update(ahead, [31, 32])
    assert a.output_ids == [7, 21, 31] and b.output_ids == [7, 22, 32]
    assert (a.num_computed, b.num_computed) == (5, 6)


def test_no_ahead_step_with_new_work_and_none_for_a_last_token():
    s = make()
    a, b = seq(0, 3, max_tokens=2, ignore_eos=True), seq(1, 3, max_tokens=9, ignore_eos=True)
    batch = decoding(s, a, b)
    ahead = s.schedule_ahead(batch)  # a's token in flight is its second and last
    assert ahead is not None and [c.seq for c in ahead.chunks] == [b]
    s.add(seq(2, 3))
    assert not s.can_defer(batch) and s.schedule_ahead(batch) is None  # it waits to start
    full = make(pages=3)
    c, d = seq(3, 3, max_tokens=9, ignore_eos=True), seq(4, 4, max_tokens=9, ignore_eos=True)
    batch = decoding(full, c, d)  # c holds 1 page, d 2: none left for c's position 4
    assert full.pool.num_free == 0 and full.schedule_ahead(batch) is None


def test_pages_released_in_flight_wait_for_the_step_that_writes_them():
    s = make()
    a, b = seq(0, 3, max_tokens=20, ignore_eos=True), seq(1, 3, max_tokens=20, stop_token_ids=[5])
    batch = decoding(s, a, b)
    s.launched(batch)
    ahead = s.schedule_ahead(batch)
    assert ahead is not None
    s.launched(ahead)
    used = s.pool.num_pages - s.pool.num_free
    s.landed(batch)
    updates = s.update(batch, [8, 5])  # b stops at the deferred step: its follow row is waste
    assert [u.finish_reason for u in updates] == [None, "stop"] and b.status is Status.FINISHED
    s.remove(a)  # a is aborted while the follow step runs
    assert s.pool.num_pages - s.pool.num_free == used  # both still written by the step
    s.landed(ahead)
    assert s.update(ahead, [9, 9]) == []  # both ended: their tokens are dropped
    assert s.pool.num_free == s.pool.num_pages


def test_follow_chunks_carry_one_token():
    with pytest.raises(ValueError, match="slot 9: a follow chunk carries one token"):
        flatten_plan(StepPlan(1, [SeqChunk(9, [1, 2], 0, [0], True, follow=True)], 0), 4, 64,
                     100)


@pytest.fixture(scope="module")
def llama(tiny_models):
    return tiny_models["llama"], load_model(tiny_models["llama"], "float32")


@pytest.mark.parametrize("budget", [64, 5])
def test_overlapped_greedy_equals_transformers(llama, budget):
    """Chunked prefills, sequences ending at different steps (length, a stop token), and a
    second wave once the first is done: every token as transformers', every page back."""
    path, model = llama
    refs = [hf_greedy(path, p, 12) for p in PROMPTS]
    llm = LLM(model, num_pages=64, page_size=PAGE, max_batch_tokens=budget, overlap=True)
    params = [SamplingParams(max_tokens=12, ignore_eos=True),
              SamplingParams(max_tokens=5, ignore_eos=True),
              SamplingParams(max_tokens=12, ignore_eos=True, stop_token_ids=[refs[2][6]]),
              SamplingParams(max_tokens=9, ignore_eos=True)]
    outs = llm.generate(PROMPTS, params)
    stop = refs[2].index(refs[2][6]) + 1
    assert [o.token_ids for o in outs] == [refs[0], refs[1][:5], refs[2][:stop], refs[3][:9]]
    assert [o.finish_reason for o in outs] == ["length", "length", "stop", "length"]
    assert llm.core.steps_ahead >= 4  # most decode steps went ahead
    assert llm.pool.num_free == llm.pool.num_pages
    again = llm.generate(PROMPTS[:2], SamplingParams(max_tokens=12, ignore_eos=True))
    assert [o.token_ids for o in again] == refs[:2]
    assert llm.pool.num_free == llm.pool.num_pages


def test_overlapped_seeded_sampling_draws_what_stepping_draws(llama):
    _, model = llama
    params = SamplingParams(max_tokens=10, ignore_eos=True, temperature=0.9, top_k=20, seed=3)
    one = LLM(model, num_pages=64, page_size=PAGE).generate(PROMPTS, params)
    two = LLM(model, num_pages=64, page_size=PAGE, overlap=True).generate(PROMPTS, params)
    assert [o.token_ids for o in one] == [o.token_ids for o in two]


def test_a_follow_chunk_needs_its_slot_sampled_by_the_step_before(llama):
    _, model = llama
    runner = LLM(model, num_pages=16, page_size=PAGE).runner
    follow = SeqChunk(5, [0], 3, [0], True, follow=True)
    with pytest.raises(ValueError, match="slot 5: follows a step that sampled no token"):
        runner.launch(StepPlan(0, [follow], 1))
    runner.execute(StepPlan(1, [SeqChunk(5, [7, 8, 9], 0, [0], True)], 0))
    tokens, _, _ = runner.execute(StepPlan(2, [follow], 1))  # slot 5's token follows
    assert len(tokens) == 1
    with pytest.raises(ValueError, match="slot 5: page id out of range"):
        runner.launch(StepPlan(3, [SeqChunk(5, [0], 4, [0, 99], True, follow=True)], 1))
    with pytest.raises(ValueError, match="slot 5: follows a step that sampled no token"):
        runner.launch(StepPlan(4, [follow], 1))  # a failed step leaves nothing to follow


def test_a_late_mask_step_picks_when_its_masks_come(llama):
    """A step with a ``late_mask`` chunk runs its forward pass at once and picks its tokens
    only with the masks (``Launched.with_masks``); until then nothing can wait for it or
    follow it, and a late chunk without a mask is picked unconstrained."""
    _, model = llama
    runner = LLM(model, num_pages=16, page_size=PAGE).runner
    vocab = model.arch.vocab_size
    first, _, _ = runner.execute(StepPlan(1, [SeqChunk(5, [7, 8, 9], 0, [0], True),
                                              SeqChunk(6, [4, 3], 0, [1], True)], 0))
    late = [SeqChunk(5, [0], 3, [0], True, follow=True, late_mask=True),
            SeqChunk(6, [0], 2, [1], True, follow=True, late_mask=True)]
    pending = runner.launch(StepPlan(2, late, 2))
    with pytest.raises(RuntimeError, match="grammar masks never arrived"):
        pending.wait()
    with pytest.raises(ValueError, match="follows a step that sampled no token"):
        runner.launch(StepPlan(3, [SeqChunk(5, [0], 4, [0, 2], True, follow=True)], 1))
    words = [0] * (-(-vocab // 32))
    words[41 // 32] |= 1 << (41 % 32)  # slot 5 may only say token 41
    mask = b"".join(w.to_bytes(4, "little", signed=False) for w in words)
    done = pending.with_masks({5: mask})
    tokens, _, _ = done.wait()
    assert tokens[0] == 41
    after, _, _ = runner.execute(StepPlan(4, [SeqChunk(5, [0], 4, [0, 2], True, follow=True)],
                                          1))
    assert len(after) == 1  # the picked step's tokens can be followed
    unmasked, _, _ = runner.execute(StepPlan(5, [SeqChunk(6, [4, 3, first[1]], 0, [1], True)],
                                             0))
    assert tokens[1] == unmasked[0]  # picked as without a grammar
