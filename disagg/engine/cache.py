"""Page pool and slot arithmetic for the paged KV cache (pure: no torch, no sockets).

Page ids are node-local integers in ``[0, num_pages)``. A request's page list is its block
table. The pool hands out contiguous runs when it can, so adjacent pages of one request can be
coalesced into one transfer write.
"""

from __future__ import annotations

import bisect


class PagePool:
    """Free-list allocator with reference counts that prefers contiguous runs."""

    def __init__(self, num_pages: int):
        if num_pages <= 0:
            raise ValueError(f"a page pool needs at least one page, got {num_pages}")
        self.num_pages = num_pages
        self._free: list[int] = list(range(num_pages))  # sorted
        self._refs = [0] * num_pages

    @property
    def num_free(self) -> int:
        return len(self._free)

    def refcount(self, page: int) -> int:
        return self._refs[page]

    def allocate(self, n: int, after: int | None = None) -> list[int] | None:
        """Take ``n`` pages, or None (taking nothing) when fewer than ``n`` are free.

        Order of preference: the run starting at ``after + 1`` (extends a block table in place),
        then the first contiguous run of length ``n``, then the lowest free pages."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        if n > len(self._free):
            return None
        if n == 0:
            return []
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
                bisect.insort(self._free, p)


def pages_needed(num_tokens: int, page_size: int) -> int:
    return (num_tokens + page_size - 1) // page_size


def slot_mapping(block_table: list[int], start: int, count: int, page_size: int) -> list[int]:
    """Cache slots (``page * page_size + offset``) of positions ``start .. start+count-1``."""
    return [block_table[p // page_size] * page_size + p % page_size for p in range(start, start + count)]
