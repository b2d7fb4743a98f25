"""Prefix caching: the pool's cached pages (LRU, references), the batch scheduler's matching
and registration, and greedy outputs token-exact with transformers for multi-turn
conversations, with the cache on and off."""

from __future__ import annotations

import pytest
import torch

from disagg.engine.cache import PagePool, page_hashes
from disagg.engine.scheduling import BatchScheduler, Sequence
from disagg.llm import LLM
from disagg.model.loader import load_model
from disagg.protocol import SamplingParams
from tinymodels import hf_greedy

PAGE = 4


def test_a_cached_page_is_free_evictable_and_reused_by_hash():
    pool = PagePool(4)
    [a, b] = pool.allocate(2)
    h = page_hashes([1, 2, 3, 4, 5, 6, 7, 8], PAGE, b"m", 2)
    pool.cache_page(a, h[0])
    pool.cache_page(b, h[1])
    pool.free([a, b])
    assert pool.num_free == 4 and pool.num_cached == 2
    assert pool.match(h) == [a, b] and pool.refcount(a) == 1 and pool.num_cached == 0
    assert pool.match([h[0]]) == [a] and pool.refcount(a) == 2  # shared by two requests
    pool.free([a, a, b])
    assert pool.match([page_hashes([9, 9, 9, 9], PAGE, b"m", 1)[0]]) == []


def test_the_least_recently_used_cached_page_is_evicted_first_and_forgotten():
    pool = PagePool(3)
    pages = pool.allocate(3)
    hs = [bytes([i]) * 16 for i in range(3)]
    for p, h in zip(pages, hs, strict=True):
        pool.cache_page(p, h)
    pool.free([pages[1]])
    pool.free([pages[0]])
    pool.free([pages[2]])  # LRU order: 1, 0, 2
    assert pool.allocate(1) == [pages[1]] and pool.num_cached == 2
    assert pool.match([hs[1]]) == []  # evicted: its hash is gone
    assert pool.match([hs[0]]) == [pages[0]]
    assert pool.allocate(3) is None  # one page in use, two free (one cached): not three


def test_hashes_chain_through_the_parent_and_the_model_identity():
    a = page_hashes([1, 2, 3, 4, 5, 6, 7, 8], PAGE, b"model-a", 2)
    assert page_hashes([1, 2, 3, 4], PAGE, b"model-a", 1) == a[:1]
    assert page_hashes([1, 2, 3, 4, 5, 6, 7, 8], PAGE, b"model-b", 2)[0] != a[0]
    assert page_hashes([0, 2, 3, 4, 5, 6, 7, 8], PAGE, b"model-a", 2)[1] != a[1]  # parent differs


def sched(pages: int = 32, caching: bool = True) -> BatchScheduler:
    return BatchScheduler(PagePool(pages), PAGE, 64, 8, 128, prefix_caching=caching,
                          cache_salt=b"m")


def seq(slot: int, prompt: list[int], n_out: int = 3) -> Sequence:
    return Sequence(slot, str(slot), prompt, SamplingParams(max_tokens=n_out, ignore_eos=True), 0,
                    arrival=slot)


def run(s: BatchScheduler, *seqs: Sequence) -> list[list[int]]:
    """Step until done, sampling token 7 + position (deterministic) for every sampled chunk."""
    for q in seqs:
        s.add(q)
    first_chunks: dict[int, int] = {}
    while s.has_work():
        batch = s.schedule()
        assert batch is not None
        for c in batch.chunks:
            first_chunks.setdefault(c.seq.slot, c.start)
        s.update(batch, [7 + c.start + c.count for c in batch.chunks if c.sample])
    return [[first_chunks[q.slot]] + q.output_ids for q in seqs]


def test_a_repeated_prefix_is_not_computed_again_and_generated_pages_are_cached_too():
    s = sched()
    base = list(range(10, 20))  # 10 tokens: 2 full pages + 2
    [[start_a, *out_a]] = run(s, seq(0, base))
    assert start_a == 0
    b = seq(1, base + [50, 51])  # 12 tokens: the first two pages are cached
    [[start_b, *_]] = run(s, b)
    assert start_b == 8 and b.cached_tokens == 8
    assert (s.prefix_query_tokens, s.prefix_hit_tokens) == (22, 8)
    # the next turn resends prompt + answer: a's generated tokens filled its third page
    turn = seq(2, base + out_a + [60])  # 14 tokens: pages 0-2 cached (12 tokens)
    [[start_t, *_]] = run(s, turn)
    assert start_t == 12 and turn.cached_tokens == 12
    assert s.pool.num_free == 32  # idle: every page free (some cached)
    assert s.pool.num_cached > 0


def test_every_page_is_hashed_once_and_a_lookup_stops_at_its_first_miss(monkeypatch):
    """A new prompt's lookup hashes one page (the miss); its pages are hashed as they are
    cached, none twice; a prompt whose prefix is cached hashes only that prefix to find it."""
    import disagg.engine.scheduling as scheduling

    hashed: list[int] = []

    def counting(tokens, ps, parent, count):
        hashed.append(count)
        return page_hashes(tokens, ps, parent, count)

    monkeypatch.setattr(scheduling, "page_hashes", counting)
    s = sched()
    a = seq(0, list(range(100, 141)))  # 41 tokens: 10 full pages
    assert s.prefix_hashes(a) == page_hashes(a.prompt_ids, PAGE, s.cache_root, 1)
    assert sum(hashed) == 1
    run(s, a)
    n = len(a.known_hashes)
    assert n == (41 + 2) // PAGE  # every full page computed, generated ones too (3 outputs)
    assert a.known_hashes == page_hashes(a.prompt_ids + a.output_ids, PAGE, s.cache_root, n)
    assert sum(hashed) == n  # none twice: the lookup's page was not hashed again
    hashed.clear()
    b = seq(1, list(range(100, 141)) + [7])  # 42 tokens: its 10 full pages are cached
    assert len(s.prefix_hashes(b)) == 10 and sum(hashed) == 10
    [[start, *_]] = run(s, b)
    assert start == 40 and b.cached_tokens == 40


def test_a_lookup_again_finds_pages_cached_since_the_last_one():
    """A waiting head looks up at every step: pages another request cached meanwhile are
    found, past the miss its first lookup stopped at."""
    s = sched()
    prompt = list(range(200, 221))  # 21 tokens: 5 full pages
    waiting = seq(1, prompt)
    assert len(s.prefix_hashes(waiting)) == 1  # nothing cached: stops at page 0
    run(s, seq(0, prompt))  # caches the prompt's pages
    assert s.prefix_hashes(waiting) == page_hashes(prompt, PAGE, s.cache_root, 5)
    [[start, *_]] = run(s, waiting)
    assert start == 20 and waiting.cached_tokens == 20


def test_the_last_token_is_always_computed_and_the_cache_can_be_off():
    s = sched()
    p = list(range(30, 38))  # exactly two pages
    run(s, seq(0, p))
    again = seq(1, p)
    [[start, *_]] = run(s, again)
    assert start == 4 and again.cached_tokens == 4  # the second page holds the last token
    off = sched(caching=False)
    run(off, seq(0, p))
    [[start_off, *_]] = run(off, seq(1, p))
    assert start_off == 0 and off.pool.num_cached == 0


def test_shared_cached_pages_are_never_freed_while_in_use():
    s = sched(pages=12)
    p = list(range(40, 49))  # 9 tokens
    run(s, seq(0, p))
    a, b = seq(1, p + [1, 2]), seq(2, p + [3, 4])
    s.add(a)
    s.add(b)
    batch = s.schedule()
    assert batch is not None and a.block_table[:2] == b.block_table[:2]
    shared = a.block_table[0]
    assert s.pool.refcount(shared) == 2
    s.remove(a)
    assert s.pool.refcount(shared) == 1  # b still holds it: not free, not evictable
    s.update(batch, [1, 1])
    s.remove(b)
    assert s.pool.num_free == 12


def test_a_small_pool_evicts_and_stays_correct(tiny_models):
    """Many distinct prompts through a tiny pool, then the latest again (cached) and the
    oldest again (evicted long ago): the same tokens as without the cache."""
    model = load_model(tiny_models["qwen3"], "float32")
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 300, (9,), generator=g).tolist() for _ in range(6)]
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    cached = LLM(model, num_pages=10, page_size=PAGE)
    plain = LLM(model, num_pages=10, page_size=PAGE, prefix_caching=False)
    for i, p in enumerate(prompts + [prompts[-1], prompts[0]]):
        hits = cached.scheduler.prefix_hit_tokens
        assert cached.generate([p], params)[0].token_ids == plain.generate([p], params)[0].token_ids
        if i == len(prompts):
            assert cached.scheduler.prefix_hit_tokens == hits + 2 * PAGE  # the latest: cached
        if i == len(prompts) + 1:
            assert cached.scheduler.prefix_hit_tokens == hits  # the oldest: evicted
    assert cached.pool.num_free == 10


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_multi_turn_conversations_are_token_exact_with_the_cache_on(tiny_models, kind):
    """Each turn resends the whole conversation plus a new message; turns hit the previous
    turn's prompt and answer in the cache, at and across page boundaries."""
    path = tiny_models[kind]
    llm = LLM(load_model(path, "float32"), num_pages=64, page_size=PAGE, max_batch_tokens=5)
    g = torch.Generator().manual_seed(11)
    history: list[int] = torch.randint(3, 300, (PAGE + 3,), generator=g).tolist()
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    hits = 0
    for turn in range(3):
        out = llm.generate([history], params)[0].token_ids
        assert out == hf_greedy(path, history, 5), f"turn {turn}"
        hits = llm.scheduler.prefix_hit_tokens
        history = history + out + torch.randint(3, 300, (turn + 2,), generator=g).tolist()
    assert hits >= 2 * PAGE  # later turns reused the earlier turns' pages
    assert llm.pool.num_free == 64
