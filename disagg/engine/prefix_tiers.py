"""The batch scheduler with KV tiers behind its prefix cache (pure: no torch, no sockets).

``TieredScheduler`` is a ``BatchScheduler`` over ``PrefixTiers``, which sits between it and
``disagg.engine.kv_tiers.KVTiers``: a
waiting sequence's prefix is looked up through every tier (``match``: the device pool's
cached pages by reference, the host tier's by a reload into pages allocated here); a
sequence whose reload is in flight is *loading*: out of the waiting queue, holding its pages,
until ``poll`` sees the copy land, registers the reloaded pages in the device cache again and
puts it back in the queue (by arrival) to start from its first uncached token. A sequence
ended while loading keeps its pages out of the pool until the copy into them has landed.

A reload of host slots only is issued layer by layer where the mover can
(``Reload.overlapped``, ``disagg.engine.tier_reload``): the sequence is not loading but
scheduled in this very step, whose plan waits per layer on the reload (``reload_pending``:
``StepPlan.reload_wait``); the copy holds a reference to its pages until it landed, when they
are registered in the device cache.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from disagg.engine.cache import PagePool
from disagg.engine.kv_tiers import TIERS, Found, KVTiers, Reload
from disagg.engine.scheduling import Batch, BatchScheduler
from disagg.engine.sequence import Sequence, Status


class PrefixTiers:
    def __init__(self, tiers: KVTiers):
        self.tiers = tiers
        self.loading: dict[int, Sequence] = {}  # reload op -> its sequence
        self.overlap = True  # issue host-only reloads layer by layer when the mover can
        self.overlapping: set[int] = set()  # such reload ops not landed yet
        self._op_of: dict[int, int] = {}  # slot -> reload op
        self._failed: set[int] = set()  # slots whose reload failed: they compute instead
        self._counted: dict[int, dict[str, int]] = {}  # slot -> pages per tier, while loading
        # a prefill node: told the host-tier pages of a job as it starts loading them (so its
        # messenger ships them from host memory); their slots stay pinned until ``unhold``
        self.on_host_pages: Callable[[Sequence, list[tuple[int, int]]], None] | None = None
        self._held: dict[int, list[int]] = {}  # slot -> host slots held for its writes
        # a decode node: prefixes reloaded into the device cache ahead of a remote prefill
        # (``promote``), by reload op; the sequences whose copy landed (``take_promoted``)
        self.promoting: dict[int, Sequence] = {}
        self._promoted: list[Sequence] = []
        self._lower: dict[int, dict[str, int]] = {}  # slot -> pages promoted, per tier

    def attach(self, pool: PagePool) -> None:
        pool.tiers = self.tiers

    def held_run(self, pool: PagePool, hashes: list[bytes]) -> int:
        """Leading ``hashes`` some tier holds."""
        return self.tiers.held_run(hashes, pool.page_of)

    def match(self, sched: TieredScheduler, seq: Sequence, hashes: list[bytes]) -> bool:
        """Start ``seq`` on its prefix across tiers. False: only device pages (or none) were
        found and taken, as the plain cache does; True: host-tier pages are reloading into
        pages allocated for them and ``seq`` is loading (out of the queue until ``poll``).
        When the pages for a reload cannot be had, ``seq`` keeps the device pages before the
        first host one."""
        pool, ps = sched.pool, sched.page_size
        found = self.tiers.find(hashes, pool.page_of)
        if seq.slot in self._failed:  # a reload of it failed: the device cache only
            found = Found(found.where[:next((i for i, (t, _, _) in enumerate(found.where)
                                             if t != "device"), len(found.where))])
        found = self.tiers.stage(found)  # host slots for its disk pages (pending)
        # device references first: allocating the reload's pages may evict cached ones
        table = [pool.take(h) if tier == "device" else -1 for tier, h, _ in found.where]
        loads = [(slot, h if tier == "disk" else b"") for tier, h, slot in found.where
                 if tier != "device"]
        fresh = pool.allocate(len(loads)) if loads else None
        if loads and fresh is None:  # keep the device run before the first lower-tier page
            first = table.index(-1)
            pool.free([p for p in table[first + 1:] if p >= 0])
            table = table[:first]
            for _, h in loads:
                if h:
                    self.tiers.host.abort(h)  # its staged slot
            loads = []
        new = iter(fresh or ())
        table = [p if p >= 0 else next(new) for p in table]
        seq.block_table = table
        seq.hashes = hashes[:len(table)]
        seq.num_computed = len(table) * ps
        if sched.draft_model:
            seq.draft_computed = seq.num_computed
        first_lookup = not seq.matched
        sched.count_lookup(seq, seq.num_computed)
        if first_lookup and seq.matched:
            tiers = [t for t, _, _ in found.where[:len(table)]]
            counted = {tier: tiers.count(tier) for tier in TIERS}
            for tier, n in counted.items():
                self.tiers.count_hit(tier, n, n * ps)
            if len(tiers) > counted["device"]:
                self._counted[seq.slot] = counted  # taken back if its reload fails
        if not loads:
            return False
        pages = [p for (tier, _, _), p in zip(found.where, table, strict=True)
                 if tier != "device"]
        hashes_in = [h for tier, h, _ in found.where if tier != "device"]
        r = self.tiers.reload(seq, [s for s, _ in loads], pages, hashes_in,
                              [f for _, f in loads], overlap=self.overlap)
        if seq.prefill_only and self.on_host_pages is not None:
            held = [(i, slot) for i, (tier, _, slot) in enumerate(found.where) if tier == "host"]
            if held:
                self.hold(seq, [slot for _, slot in held])
                self.on_host_pages(seq, held)
        if r.overlapped:  # scheduled now; the step waits per layer; pages the copy's too
            sched.pool.incref(pages)
            self.overlapping.add(r.op)
            self._counted.pop(seq.slot, None)
            return False
        self.loading[r.op] = seq
        self._op_of[seq.slot] = r.op
        seq.status = Status.LOADING
        return True

    def poll(self, sched: TieredScheduler) -> None:
        """Apply finished copies: loaded sequences go back to the queue, their reloaded pages
        cached on the device again (a failed reload: they start over, computing)."""
        self.tiers.flush()  # the pages made evictable since (a synchronous mover: copied)
        for r in self.tiers.poll():
            self._landed(sched, r)

    def promote(self, sched: TieredScheduler, seq: Sequence, hashes: list[bytes]) -> bool:
        """Reload the lower tiers' pages of ``seq``'s prefix into the device cache, not into
        ``seq``: registered there once the copy landed and left evictable (most recently
        used), so the lookup of its remote prefill (a decode node's ``skip_pages``) finds
        them. True when a copy went out: ``seq`` waits (``LOADING``) for ``take_promoted``."""
        pool = sched.pool
        found = self.tiers.stage(self.tiers.find(hashes, pool.page_of))
        lower = [(tier, h, slot) for tier, h, slot in found.where if tier != "device"]
        if not lower:
            return False
        held = [pool.take(h) for tier, h, _ in found.where if tier == "device"]
        fresh = pool.allocate(len(lower))  # with the run's device pages held: not evicted
        pool.free(held)
        if fresh is None:
            for tier, h, _ in lower:
                if tier == "disk":
                    self.tiers.host.abort(h)  # its staged slot
            return False
        r = self.tiers.reload(seq, [slot for _, _, slot in lower], fresh,
                              [h for _, h, _ in lower],
                              [h if tier == "disk" else b"" for tier, h, _ in lower])
        self.promoting[r.op] = seq
        self._lower[seq.slot] = {t: sum(1 for x, _, _ in lower if x == t) for t in TIERS}
        seq.status = Status.LOADING
        return True

    def take_promoted(self) -> list[Sequence]:
        """The sequences whose prefix ``promote`` brought into the device cache since."""
        out, self._promoted = self._promoted, []
        return out

    def count_held(self, seq: Sequence, pages: int, page_size: int) -> None:
        """Per-tier counts of a decode node's first lookup for a remote prefill: ``pages``
        held on the device, of which those ``promote`` brought from a lower tier."""
        lower = self._lower.pop(seq.slot, {})
        for tier in TIERS:
            n = pages - sum(lower.values()) if tier == "device" else lower.get(tier, 0)
            self.tiers.count_hit(tier, max(0, min(n, pages)), max(0, min(n, pages)) * page_size)

    def _landed(self, sched: TieredScheduler, r: Reload) -> None:
        if r.op in self.overlapping:  # issued at once (a failure there is a CUDA error)
            self.overlapping.discard(r.op)
            for page, h in zip(r.pages, r.hashes, strict=True):
                sched.pool.cache_page(page, h)
            sched.pool.free(list(r.pages))  # the copy's reference
            return
        if r.op in self.promoting:
            seq = self.promoting.pop(r.op)
            for page, h in zip(r.pages, r.hashes, strict=True) if r.ok else ():
                sched.pool.cache_page(page, h)
            sched.pool.free(list(r.pages))  # cached and evictable (a failed copy: free)
            if not r.ok:
                self._lower.pop(seq.slot, None)
            if seq.status is Status.LOADING:
                seq.status = Status.WAITING
                self._promoted.append(seq)
            return
        seq = self.loading.pop(r.op)
        self._op_of.pop(seq.slot, None)
        if seq.status is not Status.LOADING:  # ended meanwhile: no copy writes its pages now
            sched.pool.free(seq.block_table)
            seq.block_table = []
            self._failed.discard(seq.slot)
            return
        if r.ok:
            self._counted.pop(seq.slot, None)
            for page, h in zip(r.pages, r.hashes, strict=True):
                sched.pool.cache_page(page, h)
        else:  # computed instead (a bad disk file is gone from its tier already)
            self._failed.add(seq.slot)
            self._uncount(sched, seq)
            sched.pool.free(seq.block_table)
            seq.block_table, seq.hashes = [], []
            seq.num_computed = seq.draft_computed = 0
        seq.status = Status.WAITING
        sched.requeue(seq)

    def _uncount(self, sched: TieredScheduler, seq: Sequence) -> None:
        """Take back the statistics and usage of ``seq``'s failed lookup: it looks up again
        (the device cache only) and is counted then."""
        counted = self._counted.pop(seq.slot, None)
        if counted is None or not seq.matched:
            return
        for tier, n in counted.items():
            self.tiers.count_hit(tier, -n, -n * sched.page_size)
        sched.prefix_query_tokens -= len(seq.prompt_ids)
        sched.prefix_hit_tokens -= seq.cached_tokens
        seq.matched, seq.cached_tokens = False, 0

    def end(self, seq: Sequence) -> bool:
        """``seq`` ends (abort, error) while loading: its pages are freed once the copy into
        them landed. False if it was not loading."""
        self._failed.discard(seq.slot)
        self._counted.pop(seq.slot, None)
        self._lower.pop(seq.slot, None)
        if seq.status is Status.LOADING and seq in self.promoting.values():
            seq.status = Status.FINISHED  # its copy lands into the cache alone
            return True
        if seq.slot not in self._op_of:
            return False
        seq.status = Status.FINISHED
        return True

    def busy(self) -> bool:
        """Copies in flight, or promoted sequences not taken yet (a driver keeps going)."""
        return bool(self.loading or self.promoting or self._promoted or self.overlapping)

    def hold(self, seq: Sequence, slots: list[int]) -> None:
        for s in slots:
            self.tiers.host.pin(s)
        self._held.setdefault(seq.slot, []).extend(slots)

    def unhold(self, seq: Sequence) -> None:
        """No write reads the host slots held for ``seq`` any more."""
        for s in self._held.pop(seq.slot, ()):
            self.tiers.host.unpin(s)


class TieredScheduler(BatchScheduler):
    """``BatchScheduler`` whose prefix lookups and registrations span the KV tiers: every
    ``schedule`` first applies the copies that finished (``PrefixTiers.poll``) and ends by
    handing the new ones to the mover."""

    def __init__(self, *args: Any, tiers: KVTiers, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.tiers = PrefixTiers(tiers)
        self.tiers.attach(self.pool)

    def held_run(self, hashes: list[bytes]) -> int:
        return self.tiers.held_run(self.pool, hashes)

    def _match(self, seq: Sequence) -> bool:
        return self.tiers.match(self, seq, self.prefix_hashes(seq))

    def requeue(self, seq: Sequence) -> None:
        """Back in the queue by arrival, keeping its pages (a tier reloaded them)."""
        self._insert_waiting(seq)

    def reload_pending(self) -> bool:
        """A reload issued layer by layer has not landed: a step waits on it per layer."""
        return bool(self.tiers.overlapping)

    def has_work(self) -> bool:
        """Also while a sequence loads (``schedule`` polls its copy)."""
        return super().has_work() or self.tiers.busy()

    def schedule(self) -> Batch | None:
        self.tiers.poll(self)
        batch = super().schedule()
        if batch is None and self.tiers.busy():  # a reload it started may have landed
            self.tiers.poll(self)
            batch = super().schedule()
        self.tiers.tiers.flush()  # copies of the pages preemption made evictable
        return batch

    def settle(self) -> None:
        """Hand out the copies of pages made evictable since the last step and apply those
        done (an engine going idle: ``LLM.generate`` after its last step)."""
        self.tiers.poll(self)

    def remove(self, seq: Sequence) -> None:
        if not self.tiers.end(seq):  # loading: its pages are freed once the copy landed
            super().remove(seq)

    def detach(self, seq: Sequence) -> list[int]:
        """As ``BatchScheduler.detach``; a loading sequence's pages are none of the
        caller's (freed once the copy into them landed)."""
        return [] if self.tiers.end(seq) else super().detach(seq)
