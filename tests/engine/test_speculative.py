"""Speculative decoding: prompt-lookup drafting, verification (greedy, and sampled by comparing
each draft with the plain seeded draw), the scheduler's accounting, and greedy and seeded output
unchanged end to end (in-process engine)."""

from __future__ import annotations

import collections

import pytest
import torch

from disagg.engine.cache import PagePool
from disagg.engine.sampling import sample
from disagg.engine.scheduling import BatchScheduler, Sequence, Status
from disagg.engine.speculative import Speculation, propose_ngram, verify, verify_all
from disagg.llm import LLM
from disagg.model.loader import load_model
from disagg.protocol import SamplingParams
from disagg.protocol.executor import SeqChunk
from tinymodels import hf_greedy

PAGE = 4


def test_prompt_lookup_takes_the_longest_latest_match():
    # the last 2 tokens (7, 8) occur twice; the latest earlier occurrence is followed by 9, 1
    assert propose_ngram([7, 8, 5, 6, 7, 8, 9, 1, 2, 7, 8], 2) == [9, 1]
    # the 3-gram (6, 7, 8) matches once, preferred to the later 2-gram match
    assert propose_ngram([6, 7, 8, 3, 4, 7, 8, 5, 6, 7, 8], 3, n_max=3) == [3, 4, 7]
    assert propose_ngram([1, 2, 3, 4], 3) == []  # nothing repeats
    assert propose_ngram([5, 5, 5], 4) == [5]  # what follows the match, up to the end
    assert propose_ngram([1, 2, 1], 0) == []
    assert propose_ngram([4, 1, 2, 4], 2, n_min=2) == []  # only a 1-gram would match


def lookup_by_definition(tokens, k, n_max, n_min):
    """Longest n first; among matches of that n, the latest earlier occurrence."""
    for n in range(min(n_max, len(tokens) - 1), n_min - 1, -1):
        tail = tokens[len(tokens) - n:]
        for start in range(len(tokens) - 1 - n, -1, -1):
            if tokens[start:start + n] == tail:
                return tokens[start + n:start + n + k]
    return []


def test_prompt_lookup_equals_its_definition_on_random_sequences():
    g = torch.Generator().manual_seed(5)
    for trial in range(400):
        n = int(torch.randint(1, 40, (1,), generator=g))
        vocab = 2 + trial % 6
        tokens = torch.randint(0, vocab, (n,), generator=g).tolist()
        for n_max, n_min in ((4, 1), (3, 2)):
            assert propose_ngram(tokens, 3, n_max, n_min) == lookup_by_definition(
                tokens, 3, n_max, n_min), (tokens, n_max, n_min)


def chunk(tokens, k, temperature=0.0, seed=0, index=0, top_k=0, top_p=1.0):
    return SeqChunk(0, list(tokens), 10, [0, 1, 2, 3], True, temperature=temperature, seed=seed,
                    output_index=index, num_draft=k, top_k=top_k, top_p=top_p)


def onehot_logits(ids, vocab=8):
    out = torch.full((len(ids), vocab), -5.0)
    for row, i in enumerate(ids):
        out[row, i] = 5.0
    return out


def test_greedy_verification_keeps_the_targets_tokens():
    # the target would emit 3, 4, 5, 6 at the four positions of [x, d1, d2, d3]
    logits = onehot_logits([3, 4, 5, 6])
    assert verify(logits, chunk([1, 3, 4, 5], 3)) == [3, 4, 5, 6]  # all accepted + bonus
    assert verify(logits, chunk([1, 2, 4, 5], 3)) == [3]  # none: the correction only
    assert verify(logits, chunk([1, 3, 4, 7], 3)) == [3, 4, 5]  # two accepted, then 5
    tokens, counts = verify_all(torch.cat([logits, onehot_logits([2])]),
                                [chunk([1, 3, 4, 7], 3), chunk([9], 0)])
    assert tokens == [3, 4, 5, 2] and counts == [3, 1]


def test_sampled_verification_emits_the_plain_seeded_draws():
    """At each drafted position a sampled chunk emits exactly the token a step without drafts
    draws for that output index from the request's seed: drafts equal to those draws are kept,
    the first other one is replaced by the draw, and the step ends there."""
    g = torch.Generator().manual_seed(11)
    k = 4
    for trial in range(60):
        logits = torch.randn(k + 1, 12, generator=g) * (1 + trial % 4)  # flat to peaked
        kw = dict(temperature=(0.3, 0.7, 1.0, 1.5)[trial % 4], top_k=(0, 5)[trial % 2],
                  top_p=(1.0, 0.8, 1.0)[trial % 3])
        seed, index = 1000 + trial, trial % 7
        plain = [sample(logits[j:j + 1], [chunk([1], 0, seed=seed, index=index + j, **kw)])[0]
                 for j in range(k + 1)]
        assert verify(logits, chunk([1] + plain[:k], k, seed=seed, index=index, **kw)) == plain
        for m in range(k):  # the first m drafts right, the next one wrong
            drafts = plain[:m] + [(plain[m] + 1) % 12] + plain[m + 1:k]
            c = chunk([1] + drafts, k, seed=seed, index=index, **kw)
            assert verify(logits, c) == plain[:m + 1], (trial, m)
            tokens, counts = verify_all(torch.cat([logits, logits[:1]]),
                                        [c, chunk([1], 0, seed=seed, index=index, **kw)])
            assert tokens == plain[:m + 1] + plain[:1] and counts == [m + 1, 1]


def test_sampled_verification_keeps_the_target_distribution():
    """The first token emitted after drafting d follows p whether d is likely or not."""
    p = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = torch.log(p).repeat(2, 1)
    n = 3000
    for draft in (0, 3):
        seen = collections.Counter(
            verify(logits, chunk([1, draft], 1, temperature=1.0, seed=s))[0] for s in range(n))
        freq = torch.tensor([seen[i] / n for i in range(4)])
        assert torch.allclose(freq, p, atol=0.03), (draft, freq)
    # a seed reproduces the draw
    c = chunk([1, 2], 1, temperature=1.0, seed=42, index=3)
    assert verify(logits, c) == verify(logits, c)


def seq(slot, prompt, max_tokens=10, **kw):
    return Sequence(slot, str(slot), list(prompt), SamplingParams(max_tokens=max_tokens,
                                                                  ignore_eos=True, **kw), 0,
                    arrival=slot)


def sched(pages=32, budget=64, k=3, **kw):
    return BatchScheduler(PagePool(pages), PAGE, budget, 8, 256, spec_tokens=k,
                          propose=lambda s, n: [42] * n, **kw)


def run_prefill(s, seqs):
    for q in seqs:
        s.add(q)
    batch = s.schedule()
    s.update(batch, [7] * len(seqs))
    return batch


def test_drafts_fit_the_budget_and_what_may_still_be_emitted():
    s = sched(budget=6)
    a, b = seq(1, [1, 2, 3], max_tokens=3), seq(2, [4, 5])
    run_prefill(s, [a, b])
    batch = s.schedule()
    # a may emit 2 more tokens: 1 draft at most; b gets the rest of the 6-token budget
    assert [len(c.drafts) for c in batch.chunks] == [1, 3]
    assert batch.num_decodes == 0 and batch.num_tokens == 6
    wire = batch.chunks[0].to_wire()
    assert wire.token_ids == [7, 42] and wire.num_draft == 1 and wire.start_pos == 3


def test_accepted_tokens_advance_the_sequence_and_a_stop_inside_a_run_ends_it():
    s = sched()
    a = seq(1, [1, 2, 3], stop_token_ids=[9])
    b = seq(2, [4, 5, 6, 8])
    run_prefill(s, [a, b])
    batch = s.schedule()
    ups = s.update(batch, [42, 42, 9, 5, 42, 3], counts=[4, 2])  # a: stop at its 3rd token
    assert ups[0].new_token_ids == [42, 42, 9] and ups[0].finish_reason == "stop"
    assert a.status is Status.FINISHED
    assert ups[1].new_token_ids == [42, 3] and b.num_computed == 4 + 2 and b.num_tokens == 7
    assert (s.spec_draft_tokens, s.spec_accepted_tokens) == (6, 3 + 1)
    s.remove(b)
    assert s.pool.num_free == s.pool.num_pages


def test_a_result_cannot_push_more_tokens_than_drafted():
    s = sched(k=1)
    a = seq(1, [1, 2, 3])
    run_prefill(s, [a])
    batch = s.schedule()
    s.update(batch, [42, 5, 6, 7], counts=[4])
    assert a.output_ids == [7, 42, 5] and a.num_computed == 5


def test_preemption_and_abort_with_drafts_in_flight_leave_the_pool_full():
    s = sched(pages=5, k=3)
    a, b = seq(1, [1, 2, 3], max_tokens=20), seq(2, [4, 5, 6], max_tokens=20)
    run_prefill(s, [a, b])
    for _ in range(3):
        batch = s.schedule()
        assert batch is not None
        running = [c for c in batch.chunks if c.sample]
        s.update(batch, [42] * sum(len(c.drafts) + 1 for c in running),
                 counts=[len(c.drafts) + 1 for c in running])
    assert s.num_preemptions > 0
    batch = s.schedule()
    assert batch is not None and any(c.drafts for c in batch.chunks)
    for q in (a, b):
        s.remove(q)  # aborted while the step runs
    assert s.update(batch, [1] * 8, counts=[1] * len([c for c in batch.chunks if c.sample])) == []
    assert s.pool.num_free == s.pool.num_pages


PROMPTS = [
    [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7],  # repetitive: drafts from the prompt
    [9] * 12,
    list(range(10, 10 + 3 * PAGE + 1)),  # nothing repeats at first
    [3, 4],
]


@pytest.fixture(scope="module")
def llama(tiny_models):
    return tiny_models["llama"], load_model(tiny_models["llama"], "float32")


@pytest.mark.parametrize("budget", [64, 5])
def test_greedy_with_prompt_lookup_equals_transformers(llama, budget):
    path, model = llama
    llm = LLM(model, num_pages=64, page_size=PAGE, max_batch_tokens=budget,
              speculative=Speculation("ngram", 3))
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=16, ignore_eos=True))
    assert [o.token_ids for o in outs] == [hf_greedy(path, p, 16) for p in PROMPTS]
    s = llm.scheduler
    assert 0 < s.spec_accepted_tokens < s.spec_draft_tokens  # some accepted, some rejected
    assert llm.pool.num_free == llm.pool.num_pages


def test_stops_inside_accepted_runs_and_seeded_sampling_reproduces(llama):
    path, model = llama
    spec = Speculation("ngram", 4)
    ref = hf_greedy(path, PROMPTS[1], 16)
    llm = LLM(model, num_pages=64, page_size=PAGE, speculative=spec)
    # a stop token and max_tokens wherever they fall
    stop = llm.generate([PROMPTS[1]], SamplingParams(max_tokens=16, ignore_eos=True,
                                                     stop_token_ids=[ref[9]]))[0]
    assert stop.token_ids == ref[:ref.index(ref[9]) + 1] and stop.finish_reason == "stop"
    for n in (1, 5, 7):
        assert llm.generate([PROMPTS[1]], SamplingParams(max_tokens=n, ignore_eos=True))[
            0].token_ids == ref[:n]
    sampled = SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.8, seed=7)
    first = llm.generate(PROMPTS, sampled)
    again = LLM(model, num_pages=64, page_size=PAGE, max_batch_tokens=7,
                speculative=spec).generate(PROMPTS, sampled)
    assert [o.token_ids for o in first] == [o.token_ids for o in again]
    assert llm.pool.num_free == llm.pool.num_pages


def seeded_requests():
    """Each prompt with near-greedy draws (drafts often accepted) and flatter ones (mostly
    rejected), top-k and top-p among them; a seed per request."""
    kinds = [(0.02, 0, 1.0), (0.1, 0, 1.0), (1.0, 20, 0.9), (0.3, 5, 1.0)]
    prompts = [p for p in PROMPTS for _ in kinds]
    params = [SamplingParams(max_tokens=16, ignore_eos=True, temperature=t, top_k=k, top_p=p,
                             seed=100 + i) for i, (t, k, p) in enumerate(kinds * len(PROMPTS))]
    return prompts, params


@pytest.fixture(scope="module")
def seeded_alone(llama):
    """Every seeded request's tokens run alone, without speculation."""
    _, model = llama
    prompts, params = seeded_requests()
    return [LLM(model, num_pages=64, page_size=PAGE).generate([pr], [p])[0].token_ids
            for pr, p in zip(prompts, params, strict=True)]


def test_seeded_sampling_is_the_same_alone_batched_and_with_prompt_lookup(llama, seeded_alone):
    """Which output indices a step drafts depends on the batch (its token budget, the other
    sequences); a seeded request's tokens do not: several K, budgets that cut the drafts."""
    _, model = llama
    prompts, params = seeded_requests()
    batched = LLM(model, num_pages=96, page_size=PAGE).generate(prompts, params)
    assert [o.token_ids for o in batched] == seeded_alone
    accepted = rejected = 0
    for k in (1, 3, 8):
        for budget in (64, 5, 9):
            llm = LLM(model, num_pages=96, page_size=PAGE, max_batch_tokens=budget,
                      speculative=Speculation("ngram", k))
            outs = llm.generate(prompts, params)
            assert [o.token_ids for o in outs] == seeded_alone, (k, budget)
            s = llm.scheduler
            accepted += s.spec_accepted_tokens
            rejected += s.spec_draft_tokens - s.spec_accepted_tokens
            assert llm.pool.num_free == llm.pool.num_pages
    assert accepted > 0 and rejected > 0  # both branches of the verification ran


@pytest.mark.parametrize("draft_kind", ["same", "other"])
def test_seeded_sampling_is_the_same_with_a_draft_model(llama, tiny_models, seeded_alone,
                                                         draft_kind):
    path, model = llama
    draft = model if draft_kind == "same" else load_model(tiny_models["qwen2"], "float32")
    prompts, params = seeded_requests()
    for budget in (64, 6):
        llm = LLM(model, num_pages=96, page_size=PAGE, max_batch_tokens=budget,
                  speculative=Speculation("draft", 3), draft_model=draft)
        assert [o.token_ids for o in llm.generate(prompts, params)] == seeded_alone, budget
        s = llm.scheduler
        assert s.spec_accepted_tokens < s.spec_draft_tokens
        if draft_kind == "same":  # its greedy drafts match the near-greedy draws
            assert s.spec_accepted_tokens > 0
        assert llm.pool.num_free == llm.pool.num_pages


@pytest.mark.parametrize("draft_kind", ["same", "other"])
def test_greedy_with_a_draft_model_equals_transformers(llama, tiny_models, draft_kind):
    """The target as its own draft (every draft accepted: the mechanism's upper bound) and a
    different tiny model of the same vocabulary (most rejected); chunked prefills, a prompt
    cached from an earlier request (the draft catches up over it), stops inside runs."""
    path, model = llama
    draft = model if draft_kind == "same" else load_model(tiny_models["qwen2"], "float32")
    llm = LLM(model, num_pages=64, page_size=PAGE, max_batch_tokens=6,
              speculative=Speculation("draft", 3), draft_model=draft)
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    refs = [hf_greedy(path, p, 16) for p in PROMPTS]
    assert [o.token_ids for o in llm.generate(PROMPTS, params)] == refs
    s = llm.scheduler
    if draft_kind == "same":
        assert s.spec_accepted_tokens == s.spec_draft_tokens > 0
    else:
        assert s.spec_accepted_tokens < s.spec_draft_tokens
    again = llm.generate([PROMPTS[2] + refs[2]], SamplingParams(max_tokens=5, ignore_eos=True))
    assert again[0].token_ids == hf_greedy(path, PROMPTS[2] + refs[2], 5)
    assert llm.pool.num_free == llm.pool.num_pages
