"""Data-parallel attention ranks (``--dp N``) under one scheduler: the pages of every rank in
one pool, and each step split by rank and put back together (pure: no torch, no sockets).

The node's ``--dp`` ranks each hold their own KV pool (each rank's executors: ``--tp`` of
them). The scheduler keeps one ``BatchScheduler`` over a ``DPPagePool``: rank ``r``'s pages
are the global ids ``[r * P, (r + 1) * P)`` (``P`` pages a rank), a sequence's pages all lie
on one rank, and the rank is chosen when a sequence takes its first pages (``choose_rank``:
the fewest pending tokens, then the most free pages, among the ranks with room). Each step
goes to every rank (``split_plan``: the rank's chunks with its local page ids; a rank without
any gets an empty plan, which under expert parallelism still joins every MoE layer's
all-to-all), and the ranks' results are put back in the step's chunk order
(``merge_results``). Prefix caching works per rank: a prefix is matched on the rank holding
its longest cached run. A preemption frees pages on the rank short of them
(``preemption_victim``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Protocol, TypeVar, cast

import msgspec

from disagg.engine.cache import PagePool
from disagg.protocol import DPRankStats
from disagg.protocol.executor import StepPlan, StepResult


def choose_rank(pending: list[int], free: list[int], need: int,
                started: list[int] | None = None, budget: list[int] | None = None) -> int | None:
    """The rank a new sequence needing ``need`` pages starts on: among those with ``need``
    free pages (and step ``budget`` tokens left, when given), the fewest ``pending`` tokens,
    then the most free pages, then the fewest sequences ``started`` there (one after another,
    requests alternate), then the lowest; None when no rank has room."""
    fits = [r for r in range(len(free)) if free[r] >= need and (budget is None or budget[r] > 0)]
    if not fits:
        return None
    return min(fits, key=lambda r: (pending[r], -free[r], started[r] if started else 0, r))


class DPPagePool:
    """``PagePool``'s interface over one pool per DP rank (global page ids, see the module
    docstring). ``loads``, when set, gives each rank's pending tokens for ``choose_rank``."""

    def __init__(self, pages_per_rank: int, ranks: int):
        self.pages_per_rank = pages_per_rank
        self.pools = [PagePool(pages_per_rank) for _ in range(ranks)]
        self.num_pages = pages_per_rank * ranks
        self.loads: Callable[[], list[int]] | None = None
        self.budget: list[int] | None = None  # this step's tokens left per rank (StepBudget)
        self.started = [0] * ranks  # sequences that took their first pages, per rank

    def rank_of(self, page: int) -> int:
        return page // self.pages_per_rank

    def _local(self, pages: Iterable[int]) -> dict[int, list[int]]:
        by: dict[int, list[int]] = {}
        for p in pages:
            if not 0 <= p < self.num_pages:
                raise ValueError(f"page {p} is not allocated")
            by.setdefault(p // self.pages_per_rank, []).append(p % self.pages_per_rank)
        return by

    @property
    def num_free(self) -> int:
        return sum(p.num_free for p in self.pools)

    @property
    def num_cached(self) -> int:
        return sum(p.num_cached for p in self.pools)

    def free_on(self, rank: int) -> int:
        return self.pools[rank].num_free

    def allocate(self, n: int, after: int | None = None) -> list[int] | None:
        """``n`` pages on the rank of ``after`` (a sequence's last page), or for a sequence
        without pages on the rank ``choose_rank`` picks."""
        if after is None:
            free = [p.num_free for p in self.pools]
            pending = self.loads() if self.loads is not None else [0] * len(self.pools)
            rank = choose_rank(pending, free, n, self.started, self.budget)
            if rank is None:
                return None
            local = None
        else:
            rank, local = divmod(after, self.pages_per_rank)
        pages = self.pools[rank].allocate(n, local)
        if pages is None:
            return None
        if after is None:
            self.started[rank] += 1
        base = rank * self.pages_per_rank
        return [base + p for p in pages]

    def free(self, pages: list[int]) -> None:
        for rank, local in self._local(pages).items():
            self.pools[rank].free(local)

    def incref(self, pages: list[int]) -> None:
        for rank, local in self._local(pages).items():
            self.pools[rank].incref(local)

    def refcount(self, page: int) -> int:
        return self.pools[self.rank_of(page)].refcount(page % self.pages_per_rank)

    def cache_page(self, page: int, h: bytes) -> None:
        self.pools[self.rank_of(page)].cache_page(page % self.pages_per_rank, h)

    def cached_run(self, hashes: list[bytes]) -> int:
        """The longest leading run of ``hashes`` any one rank has cached."""
        return max(p.cached_run(hashes) for p in self.pools)

    def match(self, hashes: list[bytes]) -> list[int]:
        """The cached pages of the longest leading run, on the rank holding it (ties: the
        rank ``choose_rank`` would pick among them), each with one more reference."""
        runs = [p.cached_run(hashes) for p in self.pools]
        best = max(runs)
        if best == 0:
            return []
        ranks = [r for r in range(len(runs)) if runs[r] == best]
        pending = self.loads() if self.loads is not None else [0] * len(self.pools)
        rank = min(ranks, key=lambda r: (pending[r], -self.pools[r].num_free, r))
        base = rank * self.pages_per_rank
        self.started[rank] += 1
        return [base + p for p in self.pools[rank].match(hashes[:best])]


class _Paged(Protocol):
    @property
    def block_table(self) -> list[int]: ...


class StepBudget:
    """One step's token budget (``--max-batch-tokens``) per DP rank, as vLLM's per-rank
    engines count it: each rank's chunks add up to at most ``tokens`` (one budget for a
    one-rank ``PagePool``). A sequence's rank is its pages'; one without pages yet may take
    the most any rank has left, and the pool starts it on a rank with some left while the
    budget is entered (``with``: only the step's own allocations heed it)."""

    def __init__(self, pool: PagePool, tokens: int) -> None:
        self.pool = pool
        self.left = [tokens] * (len(pool.pools) if isinstance(pool, DPPagePool) else 1)

    def __enter__(self) -> StepBudget:
        if isinstance(self.pool, DPPagePool):
            self.pool.budget = self.left  # the rank choice skips ranks with nothing left
        return self

    def __exit__(self, *exc: object) -> None:
        if isinstance(self.pool, DPPagePool):
            self.pool.budget = None

    def of(self, seq: _Paged) -> int:
        """Tokens ``seq``'s rank may still take in this step."""
        if not seq.block_table:
            return max(self.left)
        return self.left[self.pool.rank_of(seq.block_table[0])]

    def take(self, seq: _Paged, tokens: int) -> int:
        """Spend up to ``tokens`` of ``seq``'s rank (it holds pages); what was taken."""
        rank = self.pool.rank_of(seq.block_table[0])
        got = min(tokens, self.left[rank])
        self.left[rank] -= got
        return got

    def __bool__(self) -> bool:
        return any(n > 0 for n in self.left)


def pending_by_rank(block_tables: Iterable[tuple[list[int], int]], pages_per_rank: int,
                    ranks: int) -> list[int]:
    """Tokens still to run per rank: ``(block table, tokens left)`` of each running
    sequence (a sequence without pages counts nowhere)."""
    out = [0] * ranks
    for table, left in block_tables:
        if table:
            out[table[0] // pages_per_rank] += left
    return out


def split_plan(plan: StepPlan, pages_per_rank: int, ranks: int) -> list[StepPlan]:
    """One plan per rank: its chunks in the step's order (decodes first, as given) with local
    page ids; a rank with none gets an empty plan of the same step."""
    chunks: list[list] = [[] for _ in range(ranks)]
    decodes = [0] * ranks
    for i, c in enumerate(plan.chunks):
        if not c.block_table:
            raise ValueError(f"step {plan.step_id}: chunk of slot {c.slot} has no pages")
        rank = c.block_table[0] // pages_per_rank
        base = rank * pages_per_rank
        local = [p - base for p in c.block_table]
        if any(not 0 <= p < pages_per_rank for p in local):
            raise ValueError(f"step {plan.step_id}: slot {c.slot}'s pages span DP ranks")
        chunks[rank].append(msgspec.structs.replace(c, block_table=local))
        if i < plan.num_decodes:
            decodes[rank] += 1
    return [msgspec.structs.replace(plan, chunks=chunks[r], num_decodes=decodes[r])
            for r in range(ranks)]


def merge_results(plan: StepPlan, results: list[StepResult], pages_per_rank: int
                  ) -> StepResult:
    """The step's result from its ranks' (``split_plan``'s order): sampled tokens back in the
    step's chunk order, logprobs by slot; the first error fails the step."""
    for r in results:
        if r.error is not None:
            return StepResult(plan.step_id, [], error=r.error)
    if any(r.counts is not None or r.drafts is not None for r in results):
        return StepResult(plan.step_id, [], error="speculative counts or drafts are not "
                          "merged over DP ranks")
    taken = [iter(r.token_ids) for r in results]
    tokens: list[int] = []
    try:
        for c in plan.chunks:
            if c.sample:
                tokens.append(next(taken[c.block_table[0] // pages_per_rank]))
    except StopIteration:
        return StepResult(plan.step_id, [], error="a DP rank returned too few tokens")
    logprobs = {k: v for r in results for k, v in (r.logprobs or {}).items()} or None
    prompt = {k: v for r in results for k, v in (r.prompt_logprobs or {}).items()} or None
    return StepResult(plan.step_id, tokens, logprobs=logprobs, prompt_logprobs=prompt,
                      hidden_rows=sum(r.hidden_rows for r in results))


def merge_hidden(plan: StepPlan, results: list[StepResult], frames: list[bytes | None],
                 pages_per_rank: int) -> bytes | None:
    """The step's hidden-row frame from its ranks' (``want_hidden`` chunks' rows, each rank's
    in its chunk order): the rows back in the step's chunk order; None when there are none."""
    rows: list[list[bytes]] = []
    for r, frame in zip(results, frames, strict=True):
        n = r.hidden_rows
        if n and (frame is None or len(frame) % n):
            raise ValueError(f"step {plan.step_id}: a rank's hidden rows do not match its frame")
        size = len(frame) // n if n and frame is not None else 0
        rows.append([frame[i * size:(i + 1) * size] for i in range(n)] if frame else [])
    if not any(rows):
        return None
    taken = [iter(r) for r in rows]
    out = []
    for c in plan.chunks:
        if c.want_hidden:
            row = next(taken[c.block_table[0] // pages_per_rank], None)
            if row is None:
                raise ValueError(f"step {plan.step_id}: a rank returned too few hidden rows")
            out.append(row)
    return b"".join(out)


class _Victim(Protocol):
    """What ``preemption_victim`` reads of a running sequence."""

    @property
    def slot(self) -> int: ...

    @property
    def arrival(self) -> float: ...

    @property
    def block_table(self) -> list[int]: ...


V = TypeVar("V", bound=_Victim)


def preemption_victim(pool: PagePool, seq: V, running: Iterable[V], scheduled: set[int]) -> V:
    """The sequence to preempt so that ``seq`` gets pages: the latest arrived of ``running``
    (``seq`` and the step's ``scheduled`` slots left out) that holds pages on the rank
    ``seq``'s pages lie on (they never leave it: another rank's pages would not help), on any
    rank when ``seq`` holds none yet; ``seq`` itself when there is none."""
    rank = pool.rank_of(seq.block_table[0]) if seq.block_table else None
    victims = [s for s in running if s is not seq and s.slot not in scheduled and s.block_table
               and (rank is None or pool.rank_of(s.block_table[0]) == rank)]
    return max(victims, key=lambda s: s.arrival) if victims else seq


class _Running(Protocol):
    """What ``pending_by_rank`` reads of a running sequence."""

    @property
    def block_table(self) -> list[int]: ...

    @property
    def num_tokens(self) -> int: ...

    @property
    def num_computed(self) -> int: ...


def make_pool(pages_per_rank: int, ranks: int,
              running: Callable[[], Iterable[_Running]]) -> PagePool:
    """The scheduler's page pool: a plain ``PagePool`` for one rank (today's path), else a
    ``DPPagePool`` whose rank choice counts the pending tokens of ``running()``. (Typed as
    ``PagePool``: it has the interface ``BatchScheduler`` uses.)"""
    if ranks == 1:
        return PagePool(pages_per_rank)
    pool = DPPagePool(pages_per_rank, ranks)
    pool.loads = lambda: pending_by_rank(((s.block_table, s.num_tokens - s.num_computed)
                                          for s in running()), pages_per_rank, ranks)
    return cast(PagePool, pool)


def rank_stats(pool: PagePool, running: Iterable[_Running],
               all_to_all_s: list[float]) -> list[DPRankStats]:
    """Each rank's load for ``Stats.dp_ranks`` (empty for a one-rank ``PagePool``)."""
    if not isinstance(pool, DPPagePool):
        return []
    counts = [0] * len(pool.pools)
    for s in running:
        if s.block_table:
            counts[pool.rank_of(s.block_table[0])] += 1
    return [DPRankStats(r, counts[r], pool.pages_per_rank, pool.free_on(r), pool.started[r],
                        all_to_all_s[r] if r < len(all_to_all_s) else 0.0)
            for r in range(len(pool.pools))]


def rank_pages(pages: list[int], pages_per_rank: int) -> tuple[int, list[int]]:
    """The DP rank holding ``pages`` (global ids, one rank's: a sequence's) and their local
    ids there: what a decoder's transfer names (that rank's executors and its pages)."""
    if not pages:
        raise ValueError("no pages")
    rank = pages[0] // pages_per_rank
    base = rank * pages_per_rank
    local = [p - base for p in pages]
    if any(not 0 <= p < pages_per_rank for p in local):
        raise ValueError("the pages span DP ranks")
    return rank, local
