"""KV tiers behind the prefix cache: the tier index (LRU, pending copies, pins), the host
tier's bookkeeping over a recording mover (copies when pages become evictable, voided by an
eviction, reloads), tenant isolation through the salted hashes, and the tiered scheduler on a
device pool far smaller than the conversations, token-exact with transformers."""

from __future__ import annotations

import pytest
import torch

from disagg.config import CacheConfig, ConfigError
from disagg.engine.cache import PagePool, page_hashes, page_root
from disagg.engine.kv_tiers import Copy, KVTiers, TierIndex
from disagg.engine.prefix_tiers import TieredScheduler
from disagg.engine.scheduling import Sequence, Status
from disagg.llm import LLM
from disagg.model.loader import load_model
from disagg.protocol import SamplingParams
from tinymodels import hf_greedy

PAGE = 4


def h(i: int) -> bytes:
    return bytes([i]) * 16


def test_an_index_finds_only_committed_entries_and_evicts_the_least_recently_used():
    idx = TierIndex(2)
    assert idx.reserve(h(1)) == (0, None)
    assert idx.get(h(1)) is None and idx.known(h(1))  # pending: not found, not copied again
    assert idx.reserve(h(1)) is None
    idx.commit(h(1))
    assert idx.reserve(h(2)) == (1, None)
    idx.commit(h(2))
    assert idx.run([h(1), h(2), h(3)]) == 2
    idx.touch(h(1))  # LRU now: 2, 1
    assert idx.reserve(h(3)) == (1, h(2))  # 2's slot, 2 forgotten
    assert h(2) not in idx and idx.get(h(1)) == 0
    idx.abort(h(3))
    assert idx.num_used == 1 and idx.reserve(h(4)) == (1, None)


def test_a_pinned_slot_is_never_reused_and_a_full_pinned_index_skips_copies():
    idx = TierIndex(1)
    idx.reserve(h(1))
    idx.commit(h(1))
    idx.pin(0)
    assert idx.reserve(h(2)) is None  # the only slot is being read
    idx.unpin(0)
    assert idx.reserve(h(2)) == (0, h(1))


class Recorder:
    """A mover that records copies and finishes them when told."""

    page_bytes = 10

    def __init__(self) -> None:
        self.copies: list[Copy] = []
        self.finished: list[tuple[int, bool]] = []
        self.waited: list[int] = []

    def submit(self, copy: Copy) -> None:
        self.copies.append(copy)

    def land(self, ok: bool = True) -> None:
        self.finished += [(c.op, ok) for c in self.copies]
        self.copies = []

    def done(self) -> list[tuple[int, bool]]:
        out, self.finished = self.finished, []
        return out

    def busy(self) -> bool:
        return bool(self.copies)

    def wait(self, op: int) -> bool:
        self.waited.append(op)
        self.land()
        return True

    def expedite(self, op: int, page: int) -> bool:
        return False  # as if every copy had started

    def overlap(self, copy: Copy) -> bool:
        return False  # reloads go through submit: the sequence loads first


def pool_with_tiers(pages: int, slots: int) -> tuple[PagePool, KVTiers, Recorder]:
    pool, mover = PagePool(pages), Recorder()
    tiers = KVTiers(slots, mover)
    pool.tiers = tiers
    return pool, tiers, mover


def test_an_evictable_page_is_copied_once_and_found_in_the_host_tier_after_eviction():
    pool, tiers, mover = pool_with_tiers(2, 4)
    [a, b] = pool.allocate(2)
    pool.cache_page(a, h(1))
    pool.cache_page(b, h(2))
    pool.free([a, b])
    tiers.flush()
    [copy] = mover.copies
    assert copy.kind == "out" and copy.pages == (a, b)
    assert tiers.find([h(1)], pool.page_of).where[0][0] == "device"
    mover.land()
    tiers.poll()
    assert len(tiers.host) == 2 and tiers.counters.bytes_out == 20
    pool.match([h(1)])  # used again on the device, freed again: no second copy
    pool.free([a])
    tiers.flush()
    assert mover.copies == []
    pool.allocate(2)  # both evicted from the device
    found = tiers.find([h(1), h(2), h(3)], pool.page_of)
    assert [t for t, _, _ in found.where] == ["host", "host"]


def test_evicting_a_page_whose_copy_is_in_flight_waits_for_that_copy():
    pool, tiers, mover = pool_with_tiers(1, 4)
    [a] = pool.allocate(1)
    pool.cache_page(a, h(1))
    pool.free([a])
    tiers.flush()
    [copy] = mover.copies
    pool.allocate(1)  # to be written again: the copy must have read it
    assert mover.waited == [copy.op] and tiers.counters.copies_waited == 1
    tiers.poll()
    assert tiers.host.get(h(1)) is not None


def test_an_eviction_that_outwaits_its_pages_copy_never_finds_that_entry():
    """The copy outlives the wait's bound: the page is written again while the copy may
    still read it, so its host entry may be torn; when the copy ends it is dropped, not
    found, and its slot is free again (the scheduler goes on, never stuck or failing)."""
    pool, tiers, mover = pool_with_tiers(1, 4)
    mover.wait = lambda op: mover.waited.append(op) or False  # type: ignore[method-assign]
    [a] = pool.allocate(1)
    pool.cache_page(a, h(1))
    pool.free([a])
    tiers.flush()
    [copy] = mover.copies
    pool.allocate(1)
    assert mover.waited == [copy.op] and tiers.counters.copies_voided == 1
    assert tiers.stats()["tier_copies_voided"] == tiers.stats()["tier_copies_waited"] == 1
    mover.land()  # the copy ends after all, ok
    tiers.poll()
    assert tiers.host.get(h(1)) is None and tiers.host.num_used == 0
    assert tiers.counters.bytes_out == 0 and not tiers.busy()


def test_a_page_evicted_before_its_copy_was_sent_is_not_kept():
    pool, tiers, mover = pool_with_tiers(1, 4)
    [a] = pool.allocate(1)
    pool.cache_page(a, h(1))
    pool.free([a])  # queued, not flushed
    pool.allocate(1)
    tiers.flush()
    assert mover.copies == [] and tiers.counters.copies_skipped == 1
    assert tiers.host.num_used == 0


def test_eviction_takes_pages_whose_copy_is_done_first():
    pool, tiers, mover = pool_with_tiers(2, 4)
    [a, b] = pool.allocate(2)
    pool.cache_page(a, h(1))
    pool.free([a])
    tiers.flush()
    mover.land()
    tiers.poll()
    pool.cache_page(b, h(2))
    pool.free([b])  # b's copy queued, a's landed: a goes first though b is newer... and LRU
    tiers.flush()
    assert pool.allocate(1) == [a]
    assert mover.waited == []


def test_a_second_tenant_finds_nothing_of_the_first_in_the_host_tier():
    """The tiers are keyed by the chained hashes, whose root carries the cache salt: the
    same tokens under another salt hash differently in every tier."""
    sched = make_sched(pages=4, slots=16)
    tokens = list(range(10, 10 + 3 * PAGE + 1))
    run_all(sched, [mk(0, tokens, salt="alice")])
    flood(sched)  # alice's pages leave the device for the host tier
    root_a, root_b = page_root(b"m", "alice"), page_root(b"m", "bob")
    assert sched.tiers.tiers.host.run(page_hashes(tokens, PAGE, root_a, 3)) == 3
    assert sched.tiers.tiers.host.run(page_hashes(tokens, PAGE, root_b, 3)) == 0
    bob = mk(1, tokens, salt="bob")
    run_all(sched, [bob])
    assert bob.cached_tokens == 0
    alice = mk(2, tokens, salt="alice")
    run_all(sched, [alice])
    assert alice.cached_tokens == 3 * PAGE


class SyncRecorder(Recorder):
    def submit(self, copy: Copy) -> None:
        super().submit(copy)
        self.land()


def make_sched(pages: int, slots: int, mover: Recorder | None = None) -> TieredScheduler:
    return TieredScheduler(PagePool(pages), PAGE, 64, 8, 256, prefix_caching=True,
                           cache_salt=b"m", tiers=KVTiers(slots, mover or SyncRecorder()))


def mk(slot: int, prompt: list[int], n_out: int = 2, salt: str | None = None) -> Sequence:
    return Sequence(slot, str(slot), prompt, SamplingParams(max_tokens=n_out, ignore_eos=True),
                    0, arrival=slot, cache_salt=salt)


def run_all(s: TieredScheduler, seqs: list[Sequence], land: Recorder | None = None) -> None:
    for q in seqs:
        s.add(q)
    for _ in range(1000):
        if not s.has_work():
            return
        if land is not None:
            land.land()
        batch = s.schedule()
        if batch is not None:
            s.update(batch, [7] * sum(c.sample for c in batch.chunks))
    raise AssertionError("did not finish")


def flood(s: TieredScheduler) -> None:
    """Distinct prompts that take every device page."""
    run_all(s, [mk(100 + i, [300 + 20 * i + j for j in range(s.pool.num_pages * PAGE - 3)])
                for i in range(2)])


def test_a_host_hit_reloads_into_device_pages_and_registers_them_again():
    mover = Recorder()
    s = make_sched(pages=8, slots=32, mover=mover)
    prompt = list(range(10, 10 + 4 * PAGE + 1))
    run_all(s, [mk(0, prompt)], land=mover)
    flood_with(s, mover)
    again = mk(1, prompt)
    s.add(again)
    assert s.schedule() is None and again.status is Status.LOADING  # its copy is in flight
    [reload] = mover.copies
    assert reload.kind == "in" and len(reload.pages) == 4
    assert s.has_work()
    run_all(s, [], land=mover)
    assert again.status is Status.FINISHED and again.cached_tokens == 4 * PAGE
    assert s.tiers.tiers.counters.hit_tokens["host"] == 4 * PAGE
    assert all(hh in s.pool.page_of for hh in again.known_hashes[:4])  # on the device again
    assert s.pool.num_free == 8 and s.tiers.tiers.host.pinned() == 0


def flood_with(s: TieredScheduler, mover: Recorder) -> None:
    run_all(s, [mk(100 + i, [300 + 40 * i + j for j in range(s.pool.num_pages * PAGE - 3)])
                for i in range(2)], land=mover)


def test_a_sequence_ended_while_loading_gives_its_pages_back_once_the_copy_landed():
    mover = Recorder()
    s = make_sched(pages=8, slots=32, mover=mover)
    prompt = list(range(10, 10 + 4 * PAGE + 1))
    run_all(s, [mk(0, prompt)], land=mover)
    flood_with(s, mover)
    gone = mk(1, prompt)
    s.add(gone)
    s.schedule()
    assert gone.status is Status.LOADING
    s.remove(gone)
    assert s.pool.num_free < 8  # the copy may still write its pages
    mover.land()
    s.schedule()
    assert s.pool.num_free == 8 and not s.has_work()


def test_a_failed_reload_computes_the_prefix_instead():
    mover = Recorder()
    s = make_sched(pages=8, slots=32, mover=mover)
    prompt = list(range(10, 10 + 4 * PAGE + 1))
    run_all(s, [mk(0, prompt)], land=mover)
    flood_with(s, mover)
    q = mk(1, prompt)
    hits = s.prefix_hit_tokens
    s.add(q)
    s.schedule()
    assert q.cached_tokens == 4 * PAGE and s.tiers.tiers.counters.hits["host"] == 1
    mover.land(ok=False)
    batch = s.schedule()
    assert batch is not None and batch.chunks[0].start == 0  # computed from the start
    assert q.status is Status.RUNNING and q.cached_tokens == 0  # its usage taken back
    assert s.prefix_hit_tokens == hits and s.tiers.tiers.counters.hits["host"] == 0


def test_pressure_keeps_the_host_tier_bounded_and_every_page_returns():
    """Conversations through 6 device pages and 10 host slots, growing past what the host
    tier holds: it evicts its least recently used entries, nothing leaks in either tier."""
    mover = Recorder()
    s = make_sched(pages=6, slots=10, mover=mover)
    histories = [[1000 * c + i for i in range(2 * PAGE + 1)] for c in range(3)]
    for turn in range(5):
        for c, hist in enumerate(histories):
            q = mk(10 * turn + c + 1, list(hist))
            run_all(s, [q], land=mover)
            hist += q.output_ids + [5 + turn]
    t = s.tiers.tiers
    for _ in range(3):  # the last turn's pages are copied out as they become evictable
        s.schedule()
        mover.land()
    s.schedule()
    assert t.host.num_used <= 10 and len(t.host) <= 10
    assert t.counters.hit_tokens["host"] > 0
    assert s.pool.num_free == 6 and t.host.pinned() == 0 and not t.busy()


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_conversations_larger_than_the_device_pool_are_token_exact_through_the_host_tier(
        tiny_models, kind):
    """Four conversations x three turns on a 12-page device pool (a turn alone needs up to
    9): the device cache keeps little, so the later turns hit the host tier; every output
    equals transformers' greedy one, and both tiers are whole at the end."""
    path = tiny_models[kind]
    model = load_model(path, "float32")
    llm = LLM(model, num_pages=12, page_size=PAGE, kv_host_cache_mb=1)
    assert llm.tiers is not None
    g = torch.Generator().manual_seed(5)
    histories = [torch.randint(3, 300, (2 * PAGE + 1,), generator=g).tolist() for _ in range(4)]
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    computed = [0] * 4  # tokens of each conversation whose KV its last turn left
    for turn in range(3):
        for c, hist in enumerate(histories):
            out = llm.generate([hist], params)[0]
            assert out.token_ids == hf_greedy(path, hist, 3), f"turn {turn} conversation {c}"
            # every full page the last turn computed is found again, in some tier
            assert out.cached_tokens == computed[c] // PAGE * PAGE
            computed[c] = len(hist) + 2  # its prompt and outputs but the last
            hist += out.token_ids + torch.randint(3, 300, (2,), generator=g).tolist()
    t = llm.tiers.counters
    assert t.hit_tokens["host"] > t.hit_tokens["device"]  # the host tier served most
    assert t.hits["host"] >= 4 and t.bytes_in > 0 and t.bytes_out >= t.bytes_in
    assert llm.pool.num_free == 12 and llm.tiers.host.pinned() == 0 and not llm.tiers.busy()


def test_a_host_tier_larger_than_the_machine_is_refused_with_the_numbers():
    with pytest.raises(ConfigError, match=r"--kv-host-cache-mb 1073741824 MiB is more than "
                                          r"this machine can hold: \d+ MiB available"):
        CacheConfig(kv_host_cache_mb=1 << 30).validate()
    with pytest.raises(ConfigError, match="needs a host tier"):
        CacheConfig(kv_disk_cache_dir="/tmp/kv").validate()
    CacheConfig(kv_host_cache_mb=1, kv_disk_cache_dir="/tmp/kv").validate()
    with pytest.raises(ConfigError, match="--kv-host-cache-mb .* needs the prefix cache"):
        CacheConfig(kv_host_cache_mb=1, prefix_caching=False).validate()


def test_slot_runs_and_the_host_layout_of_one_page():
    from disagg.engine.tier_copy import host_layout_pages, slot_runs

    assert slot_runs((0, 1, 7, 8, 9, 3)) == [(0, 0, 2), (2, 7, 3), (5, 3, 1)]
    assert slot_runs(()) == []
    # slot s, layer l of a slot-major pool sits at (l + s * layers) pages of one layer
    assert host_layout_pages([0, 2, 5], 3) == [0, 6, 15]


@pytest.mark.parametrize("device", [
    "cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs CUDA")])])
def test_the_thread_mover_copies_pages_out_and_back_byte_exact(device):
    """Pages out to scattered host slots and back into other pages, on the worker thread
    (CUDA: pinned host memory, a side stream); waiting for a copy; done reports each once."""
    from disagg.engine.tier_copy import HostPool, ThreadMover, page_views

    layers, pages, pb = 3, 16, 256
    kv = torch.randint(0, 255, (layers, pages, pb), dtype=torch.uint8, device=device)
    host = HostPool(1, layers, 8, pb, pin=device == "cuda")
    mover = ThreadMover(page_views([kv], layers, pages, pb), host)
    try:
        mover.submit(Copy(1, "out", (2, 3, 4, 9), (5, 6, 0, 1)))
        mover.wait(1)
        assert torch.equal(host.tensors[0][5].to(device), kv[:, 2])
        assert torch.equal(host.tensors[0][1].to(device), kv[:, 9])
        mover.submit(Copy(2, "in", (12, 13, 14, 15), (5, 6, 0, 1)))
        mover.wait(2)
        assert torch.equal(kv[:, 12:15], kv[:, 2:5]) and torch.equal(kv[:, 15], kv[:, 9])
        assert sorted(mover.done()) == [(1, True), (2, True)] and not mover.busy()
    finally:
        mover.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_host_tier_is_token_exact_on_cuda(tiny_models):
    path = tiny_models["qwen3"]
    llm = LLM(load_model(path, "float32", device="cuda"), num_pages=12, page_size=PAGE,
              kv_host_cache_mb=1)
    g = torch.Generator().manual_seed(5)
    histories = [torch.randint(3, 300, (2 * PAGE + 1,), generator=g).tolist() for _ in range(4)]
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    for _ in range(3):
        for hist in histories:
            out = llm.generate([hist], params)[0]
            assert out.token_ids == hf_greedy(path, hist, 3)
            hist += out.token_ids + torch.randint(3, 300, (2,), generator=g).tolist()
    assert llm.tiers is not None and llm.tiers.counters.hit_tokens["host"] > 0


def test_a_queued_copy_out_gives_up_a_page_and_reloads_go_before_copies_out(monkeypatch):
    """The worker runs a copy out; meanwhile a page of the next one is copied at once by the
    caller (the next one goes on without it) and a reload submitted after it runs before it."""
    import threading

    from disagg.engine import tier_copy
    from disagg.engine.tier_copy import HostPool, ThreadMover, page_views

    gate, order = threading.Event(), []
    real = tier_copy.run_copy

    def gated(copy, *args):
        order.append(copy.op)
        if copy.op == 1:
            gate.wait(10)
        return real(copy, *args)

    monkeypatch.setattr(tier_copy, "run_copy", gated)
    kv = torch.arange(2 * 8 * 4, dtype=torch.uint8).view(2, 8, 4).clone()
    host = HostPool(1, 2, 8, 4, pin=False)
    host.tensors[0].zero_()
    mover = ThreadMover(page_views([kv], 2, 8, 4), host)
    try:
        mover.submit(Copy(1, "out", (0,), (0,)))
        for _ in range(1000):  # until the worker runs it
            if order:
                break
            threading.Event().wait(0.01)
        mover.submit(Copy(2, "out", (1, 2), (1, 2)))
        mover.submit(Copy(3, "in", (7,), (0,)))  # reads slot 0 only: goes first
        assert mover.expedite(2, 2) and not mover.expedite(2, 5)
        assert torch.equal(host.tensors[0][2], kv[:, 2])  # in its slot already
        gate.set()
        mover.wait(2)
        mover.wait(3)
        assert order == [1, 3, 2]
        assert torch.equal(host.tensors[0][1], kv[:, 1])
        assert torch.equal(host.tensors[0][2], kv[:, 2])
        assert sorted(op for op, _ in mover.done()) == [1, 2, 3]
    finally:
        mover.close()


def test_promote_brings_a_prefix_back_into_the_device_cache_for_a_remote_prefill():
    """A decode node's remote prompt: its host-tier pages are reloaded into the device
    cache (not into the sequence), then found there by a plain lookup; per-tier counts."""
    mover = Recorder()
    s = make_sched(pages=8, slots=32, mover=mover)
    prompt = list(range(10, 10 + 4 * PAGE + 1))
    run_all(s, [mk(0, prompt)], land=mover)
    flood_with(s, mover)
    q = mk(1, prompt)
    hashes = s.prefix_hashes(q)
    assert s.pool.cached_run(hashes) == 0 and s.held_run(hashes) == 4
    assert s.tiers.promote(s, q, hashes) and q.status is Status.LOADING
    assert s.has_work() and s.tiers.take_promoted() == []
    mover.land()
    s.schedule()
    assert s.tiers.take_promoted() == [q] and q.status is Status.WAITING
    assert s.pool.cached_run(hashes) == 4 and s.pool.num_free == 8  # cached, evictable
    s.tiers.count_held(q, 4, PAGE)
    assert s.tiers.tiers.counters.hit_tokens["host"] == 4 * PAGE
    assert not s.has_work()


def test_a_page_is_not_copied_at_once_into_a_slot_whose_old_entry_is_still_to_spill(
        monkeypatch, tmp_path):
    """A host slot's old entry goes to disk before a copy out reuses the slot (the spill is
    queued first). Copying the new page at once (``expedite``) would overwrite the slot
    before the spill read it: the disk would hold the new page's bytes under the old page's
    hash, checksummed, and serve them as that page (wrong KV). The page waits instead."""
    import threading

    from disagg.engine import tier_copy
    from disagg.engine.kv_disk import DiskStore
    from disagg.engine.tier_copy import HostPool, ThreadMover, page_views

    gate, started = threading.Event(), threading.Event()
    real = tier_copy.run_copy

    def gated(copy, *args):
        if copy.op == 1:
            started.set()
            gate.wait(10)
        return real(copy, *args)

    monkeypatch.setattr(tier_copy, "run_copy", gated)
    kv = torch.arange(2 * 8 * 4, dtype=torch.uint8).view(2, 8, 4).clone()
    host = HostPool(1, 2, 8, 4, pin=False)
    host.tensors[0].fill_(200)  # slot 0: the old entry's bytes
    old = host.tensors[0][0].clone()
    store = DiskStore(tmp_path, b"i" * 32, 2 * 4)
    store.open()
    mover = ThreadMover(page_views([kv], 2, 8, 4), host, store)
    try:
        mover.submit(Copy(1, "out", (5,), (5,)))  # holds the worker
        assert started.wait(10)
        mover.submit(Copy(2, "spill", (), (0,), (h(9),)))  # the old entry of slot 0
        mover.submit(Copy(3, "out", (2,), (0,)))  # the new page into slot 0
        assert not mover.expedite(3, 2)  # its slot is still to spill
        gate.set()
        mover.wait(3)
        assert store.read(h(9)) == old.numpy().tobytes()
        assert torch.equal(host.tensors[0][0], kv[:, 2])
        # with no spill ahead of it, a page of a queued copy is copied at once
        gate.clear()
        started.clear()
        mover.submit(Copy(1, "out", (5,), (5,)))
        assert started.wait(10)
        mover.submit(Copy(4, "out", (3,), (1,)))
        assert mover.expedite(4, 3) and torch.equal(host.tensors[0][1], kv[:, 3])
        gate.set()
        mover.wait(4)
    finally:
        gate.set()
        mover.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_pinned_host_pool_is_page_locked_at_its_own_size_and_unlocked_when_it_goes():
    """Registered, not allocated by torch's pinned allocator (which would round 40 GiB up to
    64): exactly its slots' bytes, pinned, copies in and out of the device round-trip."""
    import gc

    from disagg.engine.tier_copy import HostPool

    pool = HostPool(2, 3, 5, 1000, pin=True)
    assert pool.nbytes == 2 * 3 * 5 * 1000 and all(t.is_pinned() for t in pool.tensors)
    dev = torch.arange(3 * 1000, device="cuda").to(torch.uint8).view(3, 1000)
    pool.tensors[1][4].copy_(dev, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(pool.tensors[1][4].cuda(), dev)
    t = pool.tensors[0]
    del pool
    gc.collect()
    assert not t.is_pinned()
