"""Page pool and slot arithmetic for the paged KV cache (pure: no torch, no sockets).

Page ids are node-local integers in ``[0, num_pages)``. A request's page list is its block
table. The pool hands out contiguous runs when it can, so adjacent pages of one request can be
coalesced into one transfer write.

Prefix cache: a full page whose KV is complete can be registered under the hash of its tokens
chained from its parent page's (``page_hashes``). When its last reference goes it stays cached
and evictable (least recently used first) instead of going back to the free list; a request
whose leading pages hash the same takes references on them (``match``) and computes only the
rest. Evictable cached pages count as free: ``num_free`` still means "not in use".

KV tiers (``disagg.engine.kv_tiers``) listen through ``tiers``: a cached page becoming
evictable (``noticed``: copy it to the host tier) and one leaving the cache (``evicted``);
eviction takes the least recently used page whose copy is not in flight, when there is one.
"""

from __future__ import annotations

import bisect
import collections
import hashlib
import itertools
from array import array
from typing import Protocol


class TierHooks(Protocol):
    """What the pool tells the tiers behind it (``disagg.engine.kv_tiers.KVTiers``)."""

    def noticed(self, page: int, h: bytes) -> None: ...

    def evicted(self, page: int, h: bytes) -> None: ...

    def copying(self, page: int) -> bool: ...


class PagePool:
    """Free-list allocator with reference counts that prefers contiguous runs."""

    def __init__(self, num_pages: int):
        if num_pages <= 0:
            raise ValueError(f"a page pool needs at least one page, got {num_pages}")
        self.num_pages = num_pages
        self._free: list[int] = list(range(num_pages))  # sorted
        self._refs = [0] * num_pages
        self._hash_of: dict[int, bytes] = {}  # cached page -> its chained hash
        self._page_of: dict[bytes, int] = {}
        self._evictable: collections.OrderedDict[int, None] = collections.OrderedDict()  # LRU
        self.tiers: TierHooks | None = None

    @property
    def page_of(self) -> dict[bytes, int]:
        """Cached hash -> page (read only)."""
        return self._page_of

    @property
    def num_free(self) -> int:
        """Pages not in use: free, or cached and evictable."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached(self) -> int:
        """Free pages that hold a cached prefix (evictable)."""
        return len(self._evictable)

    def rank_of(self, page: int) -> int:
        """The DP rank a page lies on: one pool is one rank (``engine.dp.DPPagePool``)."""
        return 0

    def cache_page(self, page: int, h: bytes) -> None:
        """Register a full page in use whose KV is complete under its chained hash (a page
        with the same hash already cached keeps the entry)."""
        if self._refs[page] <= 0:
            raise ValueError(f"page {page} is not allocated")
        if h not in self._page_of and page not in self._hash_of:
            self._page_of[h] = page
            self._hash_of[page] = h

    def cached_run(self, hashes: list[bytes]) -> int:
        """How many leading ``hashes`` are cached (no reference taken)."""
        n = 0
        for h in hashes:
            if h not in self._page_of:
                break
            n += 1
        return n

    def match(self, hashes: list[bytes]) -> list[int]:
        """The cached pages of the longest leading run of ``hashes``, each with one more
        reference (the caller's)."""
        pages: list[int] = []
        for h in hashes:
            p = self._page_of.get(h)
            if p is None:
                break
            if self._refs[p] == 0:
                del self._evictable[p]
            self._refs[p] += 1
            pages.append(p)
        return pages

    def take(self, h: bytes) -> int:
        """One more reference to the page cached under ``h`` (it must be cached)."""
        p = self._page_of[h]
        if self._refs[p] == 0:
            del self._evictable[p]
        self._refs[p] += 1
        return p

    def _evict(self, n: int) -> None:
        """Return the ``n`` least recently used cached pages to the free list (those whose
        copy to a lower tier is not in flight first)."""
        tiers = self.tiers
        if tiers is None:
            victims = list(itertools.islice(self._evictable, n))
        else:
            victims = list(itertools.islice(
                (p for p in self._evictable if not tiers.copying(p)), n))
            if len(victims) < n:
                chosen = set(victims)
                victims += list(itertools.islice(
                    (p for p in self._evictable if p not in chosen), n - len(victims)))
        for p in victims:
            del self._evictable[p]
            h = self._hash_of.pop(p)
            del self._page_of[h]
            bisect.insort(self._free, p)
            if tiers is not None:
                tiers.evicted(p, h)

    def refcount(self, page: int) -> int:
        return self._refs[page]

    def allocate(self, n: int, after: int | None = None) -> list[int] | None:
        """Take ``n`` pages, or None (taking nothing) when fewer than ``n`` are free.

        Order of preference: the run starting at ``after + 1`` (extends a block table in place),
        then the first contiguous run of length ``n``, then the lowest free pages."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        if n > self.num_free:
            return None
        if n == 0:
            return []
        if n > len(self._free):
            self._evict(n - len(self._free))
        start = self._find_run(n, after)
        if start is not None:
            i = bisect.bisect_left(self._free, start)
            pages = self._free[i : i + n]
            del self._free[i : i + n]
        else:
            pages = self._free[:n]
            del self._free[:n]
        for p in pages:
            self._refs[p] = 1
        return pages

    def _find_run(self, n: int, after: int | None) -> int | None:
        free = self._free
        if after is not None:
            i = bisect.bisect_left(free, after + 1)
            if i + n <= len(free) and free[i] == after + 1 and free[i + n - 1] == after + n:
                return after + 1
        run_start, run_len = None, 0
        prev = -2
        for p in free:
            if p == prev + 1:
                run_len += 1
            else:
                run_start, run_len = p, 1
            if run_len == n:
                return run_start
            prev = p
        return None

    def incref(self, pages: list[int]) -> None:
        for p in pages:
            if self._refs[p] <= 0:
                raise ValueError(f"page {p} is not allocated")
            self._refs[p] += 1

    def free(self, pages: list[int]) -> None:
        """Drop one reference to each page; pages reaching zero return to the pool."""
        for p in pages:
            if not 0 <= p < self.num_pages or self._refs[p] <= 0:
                raise ValueError(f"page {p} is not allocated")
            self._refs[p] -= 1
            if self._refs[p] == 0:
                if (h := self._hash_of.get(p)) is not None:
                    self._evictable[p] = None  # most recently used last
                    if self.tiers is not None:
                        self.tiers.noticed(p, h)
                else:
                    bisect.insort(self._free, p)


def pages_needed(num_tokens: int, page_size: int) -> int:
    return (num_tokens + page_size - 1) // page_size


def slot_mapping(block_table: list[int], start: int, count: int, page_size: int) -> list[int]:
    """Cache slots (``page * page_size + offset``) of positions ``start .. start+count-1``."""
    return [block_table[p // page_size] * page_size + p % page_size for p in range(start, start + count)]


def page_root(model_root: bytes, salt: str | None) -> bytes:
    """The parent hash of a sequence's first page: the model's identity, keyed by the
    request's cache salt (``disagg.serving.salting``; None: unsalted, as before). 32 bytes
    when salted (page hashes are 16), so a salted root is never an unsalted chain's hash."""
    if salt is None:
        return model_root
    return hashlib.blake2b(model_root + b"\0" + salt.encode(), digest_size=32,
                           person=b"disagg.page.salt").digest()


def page_hashes(tokens: list[int], page_size: int, parent: bytes, count: int) -> list[bytes]:
    """The chained hashes of the first ``count`` full pages of ``tokens``: each covers its
    page's token ids and its parent's hash (``parent`` for the first: the model's identity)."""
    out: list[bytes] = []
    for i in range(count):
        chunk = array("q", tokens[i * page_size:(i + 1) * page_size]).tobytes()
        parent = hashlib.blake2b(parent + chunk, digest_size=16).digest()
        out.append(parent)
    return out
