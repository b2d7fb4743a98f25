"""The batch scheduler driven directly with fake model outputs."""

from __future__ import annotations

from disagg.engine.cache import PagePool
from disagg.engine.scheduling import BatchScheduler, Sequence, Status
from disagg.protocol import SamplingParams


def make(pages=64, page_size=4, budget=16, max_running=8, max_len=256, eos=(2,)):
    return BatchScheduler(PagePool(pages), page_size, budget, max_running, max_len, eos)


def seq(slot, n_prompt, **params):
    return Sequence(slot, f"r{slot}", list(range(10, 10 + n_prompt)), SamplingParams(**params),
                    seed=slot, arrival=slot)


def run_step(s, token=7):
    batch = s.schedule()
    assert batch is not None
    n_sample = sum(c.sample for c in batch.chunks)
    return batch, s.update(batch, [token] * n_sample)


def test_chunked_prefill_respects_budget_and_samples_at_end():
    s = make(budget=5)
    a = seq(0, 12, max_tokens=2, ignore_eos=True)
    s.add(a)
    batch, _ = run_step(s)
    assert [(c.start, c.count, c.sample) for c in batch.chunks] == [(0, 5, False)]
    batch, _ = run_step(s)
    assert [(c.start, c.count, c.sample) for c in batch.chunks] == [(5, 5, False)]
    batch, ups = run_step(s)
    assert [(c.start, c.count, c.sample) for c in batch.chunks] == [(10, 2, True)]
    assert ups[0].new_token_ids == [7] and a.num_computed == 12
    batch, ups = run_step(s)
    assert batch.num_decodes == 1 and ups[0].finish_reason == "length"
    assert s.pool.num_free == s.pool.num_pages and not s.has_work()


def test_decodes_come_first_and_mix_with_prefill():
    s = make(budget=8)
    a = seq(0, 3, max_tokens=5, ignore_eos=True)
    s.add(a)
    run_step(s)
    b = seq(1, 20, max_tokens=1)
    s.add(b)
    batch, _ = run_step(s)
    assert batch.num_decodes == 1
    assert batch.chunks[0].seq is a and batch.chunks[1].seq is b
    assert batch.chunks[1].count == 7  # the budget left after the decode


def test_stop_conditions():
    s = make()
    eos = seq(0, 2, max_tokens=10)
    ignore = seq(1, 2, max_tokens=3, ignore_eos=True)
    stop = seq(2, 2, max_tokens=10, stop_token_ids=[9], ignore_eos=True)
    minimum = seq(3, 2, max_tokens=10, min_tokens=2)
    for q in (eos, ignore, stop, minimum):
        s.add(q)
    _, ups = run_step(s, token=2)
    reasons = {u.seq.slot: u.finish_reason for u in ups}
    assert reasons == {0: "stop", 1: None, 2: None, 3: None}
    _, ups = run_step(s, token=9)
    reasons = {u.seq.slot: u.finish_reason for u in ups}
    assert reasons == {1: None, 2: "stop", 3: None}
    _, ups = run_step(s, token=2)
    reasons = {u.seq.slot: u.finish_reason for u in ups}
    assert reasons == {1: "length", 3: "stop"}
    assert s.pool.num_free == s.pool.num_pages


def test_context_limit_finishes_with_length():
    s = make(max_len=6)
    a = seq(0, 4, max_tokens=100, ignore_eos=True)
    s.add(a)
    run_step(s)
    _, ups = run_step(s)
    assert ups[0].finish_reason == "length" and a.num_tokens == 6


def test_preemption_by_recompute_frees_and_requeues():
    s = make(pages=5, page_size=4, budget=64)
    a = seq(0, 8, max_tokens=8, ignore_eos=True)  # 2 pages, 4 at the end
    b = seq(1, 8, max_tokens=8, ignore_eos=True)  # together they outgrow 5 pages
    s.add(a)
    s.add(b)
    run_step(s)
    assert s.pool.num_free == 1
    for _ in range(4):  # both grow past their second page; the later arrival is preempted
        run_step(s)
    assert s.num_preemptions >= 1
    assert b.status is Status.WAITING and b.block_table == [] and b.num_computed == 0
    assert a.status is Status.RUNNING
    # when b is re-admitted it recomputes prompt + outputs and samples the next output index
    while a.status is Status.RUNNING:
        run_step(s)
    batch = s.schedule()
    assert batch is not None
    chunk = batch.chunks[0]
    assert chunk.seq is b and chunk.start == 0 and chunk.count == b.num_tokens and chunk.sample
    assert chunk.to_wire().output_index == len(b.output_ids)


def test_max_running_limits_admission_and_remove_frees_pages():
    s = make(max_running=2)
    seqs = [seq(i, 3, max_tokens=4) for i in range(3)]
    for q in seqs:
        s.add(q)
    batch, _ = run_step(s, token=5)
    assert len(batch.chunks) == 2 and len(s.waiting) == 1
    s.remove(seqs[0])
    assert seqs[0].status is Status.FINISHED and seqs[0].block_table == []
    batch, _ = run_step(s, token=5)
    assert {c.seq.slot for c in batch.chunks} == {1, 2}


def test_abort_during_step_keeps_token_alignment():
    s = make()
    a, b = seq(0, 2, max_tokens=5), seq(1, 2, max_tokens=5)
    s.add(a)
    s.add(b)
    batch = s.schedule()
    assert batch is not None
    s.remove(a)
    ups = s.update(batch, [11, 12])
    assert [(u.seq.slot, u.new_token_ids) for u in ups] == [(1, [12])]


def test_prefill_only_sequences_hold_pages_and_never_sample():
    s = make(budget=5)
    a = seq(0, 12)
    a.prefill_only = True
    s.add(a)
    wires = []
    ups = []
    while s.has_work():
        batch = s.schedule()
        assert batch is not None
        wires += [c.to_wire() for c in batch.chunks]
        ups += s.update(batch, [])
    assert [w.sample for w in wires] == [False, False, False]
    assert [w.want_hidden for w in wires] == [False, False, True]
    assert [(u.new_token_ids, u.finish_reason) for u in ups] == [([], "prefilled")]
    assert a.status is Status.HELD and len(a.block_table) == 3
    assert s.pool.num_free == s.pool.num_pages - 3
    pages = s.detach(a)
    s.free_pages(pages)
    assert s.pool.num_free == s.pool.num_pages


def test_remote_sequences_wait_for_kv_then_decode_last_prompt_token():
    s = make(pages=4, page_size=4)
    a = seq(0, 9, max_tokens=2, ignore_eos=True)
    pages = s.pool.allocate(3)  # held by the remote-prefill machine while the KV is on its way
    assert pages is not None and not s.has_work() and s.schedule() is None
    s.kv_arrived(a, pages)
    assert a.block_table == pages
    batch = s.schedule()
    assert batch is not None and batch.num_decodes == 1
    w = batch.chunks[0].to_wire()
    assert (w.start_pos, w.token_ids, w.sample, w.output_index) == (8, [18], True, 0)
    s.update(batch, [7])
    s.remove(a)
    assert s.pool.num_free == 4
