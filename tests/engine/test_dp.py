"""DP ranks under one scheduler (disagg.engine.dp): the rank choice, the pool over every
rank's pages (a sequence's pages on one rank, per-rank prefix caching), and a step split by
rank and merged back in chunk order."""

from __future__ import annotations

import random

import pytest

from disagg.engine.cache import PagePool, page_hashes
from disagg.engine.dp import (
    DPPagePool,
    choose_rank,
    merge_results,
    pending_by_rank,
    preemption_victim,
    split_plan,
)
from disagg.engine.scheduling import BatchScheduler
from disagg.engine.sequence import Sequence
from disagg.protocol import SamplingParams
from disagg.protocol.executor import SeqChunk, StepPlan, StepResult


def test_rank_choice_fewest_pending_then_most_free():
    assert choose_rank([5, 3], [10, 10], 2) == 1
    assert choose_rank([3, 3], [4, 9], 2) == 1
    assert choose_rank([3, 3], [9, 9], 2) == 0
    assert choose_rank([0, 9], [1, 9], 2) == 1  # rank 0 has no room
    assert choose_rank([0, 0], [1, 1], 2) is None
    assert choose_rank([0, 0], [9, 9], 2, started=[4, 3]) == 1  # one after another: alternate


def test_a_sequence_stays_on_its_rank_and_pages_return():
    pool = DPPagePool(8, 2)
    pool.loads = lambda: [0, 0]
    a = pool.allocate(3)
    assert a is not None and {pool.rank_of(p) for p in a} == {0}
    pool.loads = lambda: [10, 0]  # rank 0 busier: the next sequence goes to rank 1
    b = pool.allocate(2)
    assert b is not None and {pool.rank_of(p) for p in b} == {1}
    more = pool.allocate(5, after=a[-1])
    assert more is not None and {pool.rank_of(p) for p in more} == {0}
    assert pool.allocate(1, after=a[-1]) is None  # rank 0 full, though rank 1 has room
    assert pool.free_on(0) == 0 and pool.free_on(1) == 6 and pool.num_free == 6
    pool.free(a + more + b)
    assert pool.num_free == pool.num_pages == 16
    with pytest.raises(ValueError):
        pool.free([3])


def test_prefix_matches_on_the_rank_that_cached_it():
    pool = DPPagePool(8, 2)
    pool.loads = lambda: [0, 0]
    hashes = page_hashes(list(range(12)), 4, b"root", 3)
    pool.loads = lambda: [9, 0]
    pages = pool.allocate(3)
    assert pages is not None and pool.rank_of(pages[0]) == 1
    for p, h in zip(pages, hashes, strict=True):
        pool.cache_page(p, h)
    pool.free(pages)
    assert pool.num_cached == 3 and pool.cached_run(hashes) == 3
    pool.loads = lambda: [0, 9]  # rank 0 is idler, but only rank 1 holds the prefix
    got = pool.match(hashes[:2])
    assert got == pages[:2] and all(pool.refcount(p) == 1 for p in got)
    assert pool.match(page_hashes([7, 7, 7, 7], 4, b"root", 1)) == []


def test_pending_tokens_by_rank():
    assert pending_by_rank([([0, 1], 5), ([9], 1), ([], 7), ([2], 1)], 8, 2) == [6, 1]


def chunk(slot, pages, sample=True, n=1):
    return SeqChunk(slot, [slot] * n, 0, pages, sample)


def test_split_and_merge_keep_the_step_order():
    plan = StepPlan(7, [chunk(1, [9]), chunk(2, [0]), chunk(3, [1, 2], n=5),
                        chunk(4, [10, 11], sample=False, n=3)], num_decodes=2, defer=True)
    parts = split_plan(plan, 8, 3)
    assert [[c.slot for c in p.chunks] for p in parts] == [[2, 3], [1, 4], []]
    assert [p.num_decodes for p in parts] == [1, 1, 0]
    assert parts[1].chunks[1].block_table == [2, 3] and all(p.defer for p in parts)
    assert parts[2].step_id == 7  # an empty plan: the rank joins the step with no rows
    results = [StepResult(7, [20, 30]), StepResult(7, [10], logprobs=None), StepResult(7, [])]
    merged = merge_results(plan, results, 8)
    assert merged.token_ids == [10, 20, 30] and merged.error is None
    failed = merge_results(plan, [results[0], StepResult(7, [], error="boom"), results[2]], 8)
    assert failed.error == "boom" and failed.token_ids == []
    short = merge_results(plan, [StepResult(7, [20]), results[1], results[2]], 8)
    assert short.error is not None


def test_a_chunk_spanning_ranks_is_refused():
    with pytest.raises(ValueError, match="span DP ranks"):
        split_plan(StepPlan(1, [chunk(1, [7, 8])], 1), 8, 2)


def test_batch_scheduler_over_ranks_balances_and_frees():
    """Random admissions through the real BatchScheduler: every sequence's pages on one rank,
    both ranks used, and the pool whole once all finish."""
    rng = random.Random(0)
    pool = DPPagePool(16, 2)
    sched = BatchScheduler(pool, 4, 32, 8, 64, [2])  # type: ignore[arg-type]
    pool.loads = lambda: pending_by_rank(((s.block_table, s.num_tokens - s.num_computed)
                                          for s in sched.running), 16, 2)
    for i in range(6):
        ids = [rng.randrange(3, 90) for _ in range(rng.randrange(1, 12))]
        sched.add(Sequence(i, f"r{i}", ids, SamplingParams(max_tokens=4, ignore_eos=True), 0, i))
    ranks_used = set()
    for _ in range(60):
        batch = sched.schedule()
        if batch is None:
            break
        for c in batch.chunks:
            assert len({pool.rank_of(p) for p in c.seq.block_table}) == 1
            ranks_used.add(pool.rank_of(c.seq.block_table[0]))
        plan_tokens = [5 for c in batch.chunks if c.sample]
        sched.update(batch, plan_tokens)
    assert ranks_used == {0, 1}
    assert not sched.has_work() and pool.num_free == pool.num_pages


def test_a_preemption_victim_is_on_the_rank_short_of_pages():
    pool = DPPagePool(4, 2)

    def seq(slot: int, arrival: int, pages: list[int]) -> Sequence:
        s = Sequence(slot, f"r{slot}", [5, 6], SamplingParams(max_tokens=4), 0, arrival)
        s.block_table = pages
        return s

    a, c, b, fresh = seq(0, 0, [0, 1]), seq(1, 1, [2]), seq(2, 2, [4, 5]), seq(3, 3, [])
    running = [a, c, b, fresh]
    assert preemption_victim(pool, a, running, set()) is c  # b arrived later, on rank 1
    assert preemption_victim(pool, b, running, set()) is b  # no one else on rank 1
    assert preemption_victim(pool, a, running, {1}) is a  # c is in this step
    assert preemption_victim(pool, fresh, running, set()) is b  # no pages yet: any rank
    one = PagePool(8)  # one rank: the latest arrival holding pages, as before --dp
    assert preemption_victim(one, a, running, set()) is b


def test_the_scheduler_preempts_on_the_rank_short_of_pages():
    """Rank 0 full: the decode needing a page there preempts rank 0's later sequence, not
    the latest arrival (on rank 1, whose pages would not help); rank 1 keeps running."""
    pool = DPPagePool(2, 2)
    sched = BatchScheduler(pool, 4, 64, 8, 64, [2], prefix_caching=False)  # type: ignore[arg-type]
    ranks = [[0, 9], [0, 9], [9, 0]]  # loads steering s0, s1 to rank 0 and s2 to rank 1
    pool.loads = lambda: ranks.pop(0) if ranks else [0, 0]
    seqs = [Sequence(i, f"r{i}", [7, 8, 9, 10], SamplingParams(max_tokens=6, ignore_eos=True),
                     0, i) for i in range(3)]
    for s in seqs:
        sched.add(s)
    batch = sched.schedule()
    assert batch is not None and [pool.rank_of(s.block_table[0]) for s in seqs] == [0, 0, 1]
    sched.update(batch, [3, 3, 3])
    batch = sched.schedule()  # every decode needs a second page; rank 0 has none left
    assert batch is not None and sched.num_preemptions == 1
    assert [c.seq.slot for c in batch.chunks] == [0, 2]  # s1 preempted, s2 still running
    assert seqs[1].block_table == [] and len(seqs[2].block_table) == 2


def _per_rank(pool: DPPagePool, batch) -> dict[int, int]:
    out: dict[int, int] = {}
    for c in batch.chunks:
        r = pool.rank_of(c.seq.block_table[0])
        out[r] = out.get(r, 0) + c.count
    return out


def test_max_batch_tokens_bounds_each_rank():
    """--max-batch-tokens is per DP rank (as --max-running, and as vLLM's per-rank engines):
    four 12-token prompts under a budget of 8 fill both ranks to 8 in the first step (16 in
    all), and a rank out of tokens does not hold the other's decodes back."""
    pool = DPPagePool(32, 2)
    sched = BatchScheduler(pool, 4, 8, 8, 64, [2], prefix_caching=False)  # type: ignore[arg-type]
    pool.loads = lambda: pending_by_rank(((s.block_table, s.num_tokens - s.num_computed)
                                          for s in sched.running), 32, 2)
    for i in range(4):
        sched.add(Sequence(i, f"r{i}", [3 + i] * 12, SamplingParams(max_tokens=3,
                                                                  ignore_eos=True), 0, i))
    seen_both = False
    for _ in range(40):
        batch = sched.schedule()
        if batch is None:
            break
        per = _per_rank(pool, batch)
        assert all(n <= 8 for n in per.values()), per
        seen_both |= per == {0: 8, 1: 8}
        sched.update(batch, [5] * sum(1 for c in batch.chunks if c.sample))
    assert seen_both and not sched.has_work() and pool.num_free == pool.num_pages
    # between steps the budget is gone: a decoder's reservation may take any rank
    assert pool.budget is None and pool.allocate(1) is not None

    # decodes: rank 0 has three, a budget of 2 takes two of them and rank 1's one still runs
    pool = DPPagePool(16, 2)
    sched = BatchScheduler(pool, 4, 8, 8, 64, [2], prefix_caching=False)  # type: ignore[arg-type]
    steer = [[0, 9], [0, 9], [0, 9], [9, 0]]
    pool.loads = lambda: steer.pop(0) if steer else [0, 0]
    seqs = [Sequence(i, f"d{i}", [9], SamplingParams(max_tokens=4, ignore_eos=True), 0, i)
            for i in range(4)]
    for s in seqs:
        sched.add(s)
    first = sched.schedule()  # one-token prompts, all admitted
    assert first is not None and [pool.rank_of(s.block_table[0]) for s in seqs] == [0, 0, 0, 1]
    sched.update(first, [5] * 4)
    sched.max_batch_tokens = 2
    step = sched.schedule()
    assert step is not None and [c.seq.slot for c in step.chunks] == [0, 1, 3]
    assert _per_rank(pool, step) == {0: 2, 1: 1}


def test_rank_stats_and_metrics():
    from disagg.engine.cache import PagePool
    from disagg.engine.dp import rank_stats
    from disagg.protocol import Stats
    from disagg.serving.metrics import Metrics

    pool = DPPagePool(8, 2)
    pool.loads = lambda: [0, 5]
    table = pool.allocate(3)
    assert table is not None

    class Seq:
        block_table = table
        num_tokens = 3
        num_computed = 1

    ranks = rank_stats(pool, [Seq()], [0.5, 0.25])  # type: ignore[arg-type]
    assert [(r.rank, r.running, r.pages_free, r.started, r.all_to_all_s) for r in ranks] == [
        (0, 1, 5, 1, 0.5), (1, 0, 8, 0, 0.25)]
    assert rank_stats(PagePool(8), [], [0.0]) == []
    m = Metrics()
    m.update_stats(Stats("mixed", 16, 13, 4, 1, 0, 1, 0, 0, 0, 0, 0, 0, dp_ranks=ranks))
    text = m.render().decode()
    assert 'disagg_dp_rank_kv_pages_free{node="local",rank="0"} 5.0' in text
    assert 'disagg_dp_rank_all_to_all_seconds_total{node="local",rank="1"} 0.25' in text


def test_rank_pages_names_one_rank():
    from disagg.engine.dp import rank_pages

    assert rank_pages([9, 10, 15], 8) == (1, [1, 2, 7])
    assert rank_pages([0, 3], 8) == (0, [0, 3])
    with pytest.raises(ValueError, match="span"):
        rank_pages([7, 8], 8)


def test_hidden_rows_come_back_in_chunk_order():
    from disagg.engine.dp import merge_hidden

    def c(slot, pages, hidden):
        return SeqChunk(slot, [1, 2], 0, pages, False, want_hidden=hidden)

    plan = StepPlan(3, [c(1, [9], True), c(2, [0], True), c(3, [1], False), c(4, [10], True)],
                    0)
    results = [StepResult(3, [], hidden_rows=1), StepResult(3, [], hidden_rows=2)]
    frames = [b"BB", b"AACC"]  # rank 0: slot 2's row; rank 1: slots 1 and 4
    assert merge_hidden(plan, results, frames, 8) == b"AABBCC"
    assert merge_hidden(plan, [StepResult(3, []), StepResult(3, [])], [None, None], 8) is None
    with pytest.raises(ValueError, match="too few hidden rows"):
        merge_hidden(plan, [results[0], StepResult(3, [], hidden_rows=1)], [b"BB", b"AA"], 8)
