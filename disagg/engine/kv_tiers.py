"""KV tiers behind the prefix cache: the bookkeeping (pure: no torch, no sockets, no threads).

The device page pool (``disagg.engine.cache.PagePool``) is the first tier. Behind it, a host
tier (pinned host memory, ``--kv-host-cache-mb``) and optionally a disk tier under it
(``disagg.engine.kv_disk``) hold pages the device cache let go, keyed by the same chained
block hashes (``page_hashes``): a hash covers the model's identity and the request's cache
salt (``page_root``), so a tenant's pages are found only by that tenant's hashes, in every
tier, and nothing here is keyed by anything else.

- ``TierIndex``: one bounded tier's index, LRU over its slots; an entry is *pending* (its copy
  in flight: never found) until ``commit``; slots being read are pinned (never reused).
- ``KVTiers``: what the batch scheduler holds. A cached device page that becomes evictable is
  copied to the host tier (``noticed`` -> the next ``flush`` hands the copy to the mover),
  unless the host tier has it already (then it is only touched: LRU across tiers, a page in
  both tiers counted once), so evicting it later costs nothing. Eviction takes pages whose
  copy landed first; evicting one whose copy is still in flight takes it out of that copy
  if it has not started (``expedite``: copied at once) or waits for it (``wait``), only when the
  pool holds nothing else (a device pool smaller than what runs), so a slot never holds a
  torn page. A lookup (``find``) walks a prefix's
  hashes through the tiers; the scheduler reloads the host-tier pages into new device pages
  (``reload``) and registers them again once the copy landed (``poll``).

The copies themselves are a ``Mover``'s (``disagg.engine.tier_copy``: synchronous on the CPU
in-process engine; a worker thread or a CUDA side stream in a node).
"""

from __future__ import annotations

import collections
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

TIERS = ("device", "host", "disk")
OUT_BATCH_PAGES = 64  # pages per copy out (what a reload may wait behind)


class TierIndex:
    """Block hash -> slot for a tier of ``num_slots`` slots, least recently used first."""

    def __init__(self, num_slots: int):
        if num_slots < 0:
            raise ValueError(f"a tier needs a slot count >= 0, got {num_slots}")
        self.num_slots = num_slots
        self._slot: collections.OrderedDict[bytes, int] = collections.OrderedDict()  # LRU
        self._pending: dict[bytes, int] = {}  # copies in flight into their slot
        self._free = list(range(num_slots - 1, -1, -1))  # popped from the end: lowest first
        self._pins: collections.Counter[int] = collections.Counter()

    def __len__(self) -> int:
        """Entries found by a lookup (committed)."""
        return len(self._slot)

    def __contains__(self, h: object) -> bool:
        return h in self._slot

    @property
    def num_used(self) -> int:
        """Slots holding an entry or a copy in flight."""
        return self.num_slots - len(self._free)

    def known(self, h: bytes) -> bool:
        """Held or on its way (no new copy needed)."""
        return h in self._slot or h in self._pending

    def get(self, h: bytes) -> int | None:
        return self._slot.get(h)

    def run(self, hashes: Iterable[bytes]) -> int:
        """How many leading ``hashes`` this tier holds."""
        n = 0
        for h in hashes:
            if h not in self._slot:
                break
            n += 1
        return n

    def touch(self, h: bytes) -> None:
        """Most recently used now."""
        if h in self._slot:
            self._slot.move_to_end(h)

    def reserve(self, h: bytes) -> tuple[int, bytes | None] | None:
        """A slot for ``h``'s copy (pending until ``commit``): a free one, else the least
        recently used unpinned entry's (returned as the second item: it is gone). None when
        every slot is pinned or pending (the copy is skipped), or ``h`` is known already."""
        if self.known(h) or self.num_slots == 0:
            return None
        if self._free:
            slot = self._free.pop()
            self._pending[h] = slot
            return slot, None
        for old, slot in self._slot.items():
            if not self._pins[slot]:
                del self._slot[old]
                self._pending[h] = slot
                return slot, old
        return None

    def commit(self, h: bytes) -> int | None:
        """``h``'s copy landed: found from now on (most recently used). Its slot, or None if
        it was not pending."""
        slot = self._pending.pop(h, None)
        if slot is not None:
            self._slot[h] = slot
        return slot

    def abort(self, h: bytes) -> None:
        """``h``'s copy failed or was voided: its slot is free again."""
        slot = self._pending.pop(h, None)
        if slot is not None:
            self._free.append(slot)

    def drop(self, h: bytes) -> None:
        """Forget a committed entry (a lower tier found it corrupt, say); its slot is free
        once unpinned (it is never pinned here: callers drop only what they do not read)."""
        slot = self._slot.pop(h, None)
        if slot is not None:
            self._free.append(slot)

    def pin(self, slot: int) -> None:
        self._pins[slot] += 1

    def unpin(self, slot: int) -> None:
        self._pins[slot] -= 1
        if self._pins[slot] <= 0:
            del self._pins[slot]

    def pinned(self) -> int:
        return len(self._pins)


# ---------------------------------------------------------------------------- the copies


@dataclass(frozen=True)
class Copy:
    """One batch of page copies for the mover, carried out in submission order. ``kind``:
    ``out`` (device ``pages[i]`` -> host ``slots[i]``), ``in`` (host ``slots[i]`` -> device
    ``pages[i]``, each slot whose ``hashes[i]`` is not empty first read from that page's disk
    file), ``spill`` (host ``slots[i]`` -> the disk file of ``hashes[i]``; ``drop``: files to
    remove first, pages the disk tier let go)."""

    op: int  # the id ``Mover.done`` reports
    kind: str
    pages: tuple[int, ...]
    slots: tuple[int, ...]
    hashes: tuple[bytes, ...] = ()
    drop: tuple[bytes, ...] = ()


class Mover(Protocol):
    """What moves the bytes (``disagg.engine.tier_copy``)."""

    page_bytes: int  # bytes of one page, every layer and rank (what a slot holds)

    def submit(self, copy: Copy) -> None: ...

    def done(self) -> list[tuple[int, bool]]:
        """Copies finished since the last call: (op, ok)."""
        ...

    def busy(self) -> bool:
        """Copies submitted and not reported yet."""
        ...

    def wait(self, op: int) -> bool:
        """Until copy ``op`` is done (``done`` still reports it), within a bound: False when
        the bound passed first (the copy still runs)."""
        ...

    def expedite(self, op: int, page: int) -> bool:
        """Copy ``page`` of copy out ``op`` now if that copy has not started (True: done)."""
        ...

    def overlap(self, copy: Copy) -> bool:
        """Issue reload ``copy`` (host slots only) layer by layer now, so a step may start
        on it at once and wait per layer (``disagg.engine.tier_reload``); ``done`` reports it
        once every layer landed. False: not issued (submit it instead)."""
        ...


@dataclass
class Reload:
    """A sequence's host-tier pages on their way into device pages (``KVTiers.reload``)."""

    op: int
    owner: object  # the scheduler's handle (its sequence)
    pages: tuple[int, ...]
    hashes: tuple[bytes, ...]
    ok: bool = True
    overlapped: bool = False  # issued layer by layer: a step may use its pages at once


@dataclass
class TierCounters:
    """Cumulative per-tier counters (Stats: ``tier_*``)."""

    hits: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))
    hit_tokens: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))
    bytes_out: int = 0  # device -> host
    bytes_in: int = 0  # host -> device
    bytes_to_disk: int = 0
    bytes_from_disk: int = 0
    copies_waited: int = 0  # evictions that waited for their page's copy out
    copies_expedited: int = 0  # ... that copied their page at once (its copy not started)
    copies_skipped: int = 0  # not kept: no host slot free of pins, or evicted unsent
    copies_voided: int = 0  # evictions that outwaited their page's copy (its entry dropped)


@dataclass(frozen=True)
class Found:
    """A prefix lookup across tiers: per leading page, in order, (tier, its hash, its slot
    in that tier: -1 on the device)."""

    where: tuple[tuple[str, bytes, int], ...]

    def pages(self, tier: str) -> int:
        return sum(1 for t, _, _ in self.where if t == tier)


class KVTiers:
    """The host tier behind a device pool: index, copies in flight, counters."""

    def __init__(self, host_slots: int, mover: Mover, disk_slots: int = 0,
                 on_disk: Iterable[bytes] = ()):
        """``disk_slots``: the disk tier's bound in pages (0: no disk tier); ``on_disk``: the
        pages its directory holds already, oldest first (at most ``disk_slots``)."""
        self.host = TierIndex(host_slots)
        self.disk = TierIndex(disk_slots) if disk_slots else None
        for h in on_disk:
            if self.disk is not None and self.disk.reserve(h) is not None:
                self.disk.commit(h)
        self._spill: list[tuple[int, bytes]] = []  # (host slot, hash) to disk before reuse
        self._drop: list[bytes] = []  # disk files to remove
        self._fills: dict[int, tuple[bytes, ...]] = {}  # reload op -> hashes read from disk
        self.mover = mover
        self.counters = TierCounters()
        self._ops = iter(range(1 << 62))
        self._out: dict[int, list[tuple[int, bytes, int]]] = {}  # op -> (page, hash, slot)
        self._out_page: dict[int, tuple[int, bytes]] = {}  # page -> (op, hash): copy reads it
        self._reloads: dict[int, Reload] = {}
        self._slots_of: dict[int, tuple[int, ...]] = {}  # reload op -> the host slots it reads
        self._spilling: dict[int, tuple[bytes, ...]] = {}  # spill op -> its hashes
        self._queued: dict[int, bytes] = {}  # evictable pages noticed, not copied yet
        self._void: set[tuple[int, bytes]] = set()  # (op, hash): copies out never committed

    # ---------------------------------------------------------------- device -> host

    def noticed(self, page: int, h: bytes) -> None:
        """The device pool's hook: cached ``page`` (hash ``h``) became evictable."""
        if self.host.known(h):
            self.host.touch(h)
        elif page not in self._out_page:
            self._queued[page] = h

    def evicted(self, page: int, h: bytes) -> None:
        """The device pool's hook: ``page`` left the device cache (reused from now on)."""
        if self._queued.pop(page, None) is not None:
            self.counters.copies_skipped += 1  # never sent: nothing reads it
            return
        inflight = self._out_page.pop(page, None)
        if inflight is None:
            return
        op, h = inflight
        if self.mover.expedite(op, page):  # not started: copied now, by itself
            self._out[op] = [r for r in self._out[op] if r[0] != page]
            self.host.commit(h)
            self.counters.bytes_out += self.mover.page_bytes
            self.counters.copies_expedited += 1
        else:  # the copy must have read it before it is written again
            self.counters.copies_waited += 1
            if not self.mover.wait(op):
                # the copy outlived its bound: the page is written again while the copy may
                # still read it, so that slot may hold a torn page: never found (voided).
                self._void.add((op, h))
                self.counters.copies_voided += 1

    def copying(self, page: int) -> bool:
        """A copy out of ``page`` is queued or in flight (the pool evicts others first)."""
        return page in self._queued or page in self._out_page

    def flush(self) -> None:
        """Hand the queued copies out of the device to the mover, in batches of at most
        ``OUT_BATCH_PAGES`` (a reload the mover puts first waits for one batch at most)."""
        if not self._queued:
            return
        rows: list[tuple[int, bytes, int]] = []
        for page, h in self._queued.items():
            slot = self._host_slot(h)
            if slot is None:
                self.counters.copies_skipped += int(not self.host.known(h))
                continue
            rows.append((page, h, slot))
        self._queued.clear()
        self._send_spills()  # before the copies that reuse those slots
        for i in range(0, len(rows), OUT_BATCH_PAGES):
            batch = rows[i:i + OUT_BATCH_PAGES]
            op = next(self._ops)
            self._out[op] = batch
            for page, h, _ in batch:
                self._out_page[page] = (op, h)
            self.mover.submit(Copy(op, "out", tuple(r[0] for r in batch),
                                   tuple(r[2] for r in batch)))

    def _host_slot(self, h: bytes) -> int | None:
        """A host slot for ``h`` (pending); the entry it evicts goes to the disk tier."""
        got = self.host.reserve(h)
        if got is None:
            return None
        slot, old = got
        if old is not None and self.disk is not None:
            self._spill.append((slot, old))
        return slot

    def _send_spills(self) -> None:
        """Hand the host entries evicted since to the mover, for the disk tier."""
        if not self._spill and not self._drop:
            return
        assert self.disk is not None
        slots, hashes = [], []
        for slot, h in self._spill:
            got = self.disk.reserve(h)
            if got is None:
                continue
            if got[1] is not None:
                self._drop.append(got[1])
            slots.append(slot)
            hashes.append(h)
        op = next(self._ops)
        self._spilling[op] = tuple(hashes)
        self.mover.submit(Copy(op, "spill", (), tuple(slots), tuple(hashes), tuple(self._drop)))
        self._spill.clear()
        self._drop.clear()

    # ---------------------------------------------------------------- lookups

    def find(self, hashes: list[bytes], on_device: dict[bytes, int]) -> Found:
        """The leading run of ``hashes`` held by some tier, the device first."""
        where: list[tuple[str, bytes, int]] = []
        for h in hashes:
            if h in on_device:
                where.append(("device", h, -1))
            elif (slot := self.host.get(h)) is not None:
                where.append(("host", h, slot))
            elif self.disk is not None and h in self.disk:
                where.append(("disk", h, -1))
            else:
                break
        return Found(tuple(where))

    def stage(self, found: Found) -> Found:
        """``found`` with a host slot (pending) reserved for each disk page, up to the first
        that cannot have one (where it is cut)."""
        where: list[tuple[str, bytes, int]] = []
        for tier, h, slot in found.where:
            if tier == "disk":
                staged = self._host_slot(h)
                if staged is None:
                    break
                slot = staged
            where.append((tier, h, slot))
        return Found(tuple(where))

    def held_run(self, hashes: list[bytes], on_device: dict[bytes, int]) -> int:
        return len(self.find(hashes, on_device).where)

    def reload(self, owner: object, slots: list[int], pages: list[int],
               hashes: list[bytes], fills: list[bytes] | None = None,
               overlap: bool = False) -> Reload:
        """Copy host ``slots`` into device ``pages`` (the caller's, just allocated), each
        slot whose ``fills`` entry is a hash first read from the disk tier (``stage``); the
        slots stay pinned until it lands. ``overlap``: issued layer by layer now when it
        reads host slots only and the mover can (``Reload.overlapped``)."""
        self._send_spills()  # the slots ``stage`` took from host entries: theirs go first
        op = next(self._ops)
        fills = fills or [b""] * len(slots)
        if any(fills):
            self._fills[op] = tuple(f for f in fills if f)
        for s in slots:
            self.host.pin(s)
        for h in hashes:
            self.host.touch(h)
        r = Reload(op, owner, tuple(pages), tuple(hashes))
        self._reloads[op] = r
        self._slots_of[op] = tuple(slots)
        copy = Copy(op, "in", tuple(pages), tuple(slots), tuple(fills))
        r.overlapped = overlap and not any(fills) and self.mover.overlap(copy)
        if not r.overlapped:
            self.mover.submit(copy)
        return r

    def count_hit(self, tier: str, pages: int, tokens: int) -> None:
        """A lookup found ``pages`` in ``tier`` (negative: one taken back)."""
        if pages:
            self.counters.hits[tier] += 1 if pages > 0 else -1
            self.counters.hit_tokens[tier] += tokens

    # ---------------------------------------------------------------- completions

    def poll(self) -> list[Reload]:
        """Apply the mover's finished copies: host entries of landed copies out become found;
        returns the reloads that finished (``ok`` False: the copy failed, the pages hold
        nothing)."""
        landed: list[Reload] = []
        pb = self.mover.page_bytes
        for op, ok in self.mover.done():
            rows = self._out.pop(op, None)
            if rows is not None:
                for page, h, _slot in rows:
                    if self._out_page.get(page) == (op, h):
                        del self._out_page[page]
                    if ok and (op, h) not in self._void:
                        self.host.commit(h)
                        self.counters.bytes_out += pb
                    else:
                        self._void.discard((op, h))
                        self.host.abort(h)
                continue
            spilled = self._spilling.pop(op, None)
            if spilled is not None:
                assert self.disk is not None
                for h in spilled:
                    (self.disk.commit if ok else self.disk.abort)(h)
                if ok:
                    self.counters.bytes_to_disk += pb * len(spilled)
                continue
            r = self._reloads.pop(op, None)
            if r is None:
                continue
            for h in self._fills.pop(op, ()):
                if ok:
                    self.host.commit(h)
                    self.counters.bytes_from_disk += pb
                else:  # a file failed its check (removed) or could not be read: a miss
                    self.host.abort(h)
                    assert self.disk is not None
                    self.disk.drop(h)
                    self._drop.append(h)
            for s in self._slots_of.pop(op, ()):
                self.host.unpin(s)
            r.ok = ok
            if ok:
                self.counters.bytes_in += pb * len(r.pages)
            landed.append(r)
        return landed

    def stats(self) -> dict[str, int]:
        """The ``Stats`` fields of the tiers."""
        c = self.counters
        out = {f"tier_hits_{t}": c.hits[t] for t in TIERS}
        out |= {f"tier_hit_tokens_{t}": c.hit_tokens[t] for t in TIERS}
        out |= {"kv_bytes_to_host": c.bytes_out, "kv_bytes_from_host": c.bytes_in,
                "kv_bytes_to_disk": c.bytes_to_disk, "kv_bytes_from_disk": c.bytes_from_disk,
                "host_cache_pages_total": self.host.num_slots,
                "host_cache_pages_used": self.host.num_used,
                "tier_copies_waited": c.copies_waited, "tier_copies_expedited": c.copies_expedited,
                "tier_copies_skipped": c.copies_skipped, "tier_copies_voided": c.copies_voided}
        if self.disk is not None:
            fb = self.mover.page_bytes  # and a header per file: ~100 bytes, not counted
            out |= {"disk_cache_bytes_total": self.disk.num_slots * fb,
                    "disk_cache_bytes_used": self.disk.num_used * fb}
        return out

    def busy(self) -> bool:
        """Copies queued or in flight (a driver keeps polling)."""
        return bool(self._queued or self._out or self._reloads or self._spilling)

    def loading(self) -> int:
        return len(self._reloads)
