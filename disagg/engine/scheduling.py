"""Batch formation: continuous batching with chunked prefill under a token budget.

Pure logic (no sockets, no asyncio, no torch): the Scheduler actor drives it and the tests drive
it directly. Each step holds, in order: one decode token for every running sequence whose prompt
is done, the next chunks of running prefills, then new sequences admitted from the waiting queue.
When pages run out, the most recently arrived running sequence is preempted (recompute): its
pages are freed and it goes back to the head of the waiting queue with prompt + outputs so far.

With prefix caching, a sequence about to start takes the cached pages of its longest cached
prefix (whole pages, never its last token) and computes from the first uncached token; every
full page a step completes is registered in the cache (prompt and generated tokens alike).
A prefill node's jobs (prefill-only sequences) do the same; its messenger ships a job's cached
pages at once when the job's first chunk starts after them.

Speculative decoding (``spec_tokens`` > 0): a decode chunk carries up to ``spec_tokens`` drafted
positions after its one new token (within the step's token budget, the request's
``max_tokens`` and the context limit); pages are reserved for every drafted position. With
``propose`` (prompt lookup) the scheduler drafts the tokens; with ``draft_model`` the executor's
draft model does, and the scheduler tracks what that model has computed (``draft_computed``)
so each chunk carries the tokens it has not seen yet (``draft_prefix``; a remote prefill and a
cached page bring the draft's KV with the model's). The step verifies the drafts (``disagg.engine.speculative``) and returns
1 .. k + 1 tokens for the chunk: the sequence's computed length grows by the tokens it keeps,
so the KV of rejected drafts is never counted.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from disagg.engine.cache import PagePool, page_hashes, pages_needed
from disagg.protocol import SamplingParams
from disagg.protocol.executor import SeqChunk


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    REMOTE = "remote"  # decode side: waiting for a prefiller's KV (disagg.remote.decode)
    HELD = "held"  # prefill side: computed, pages held until their transfers complete
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """One request's token state. ``block_table`` pages belong to the scheduler's pool."""

    slot: int
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    arrival: int
    output_ids: list[int] = field(default_factory=list)
    num_computed: int = 0  # leading tokens of all_ids whose KV is in the cache
    block_table: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    finish_reason: str | None = None
    prefill_only: bool = False  # prefill role: never sample; hold pages when computed
    hashes: list[bytes] = field(default_factory=list)  # chained hashes of its full pages
    cached_tokens: int = 0  # prompt tokens taken from the prefix cache at its first start
    matched: bool = False  # its first start looked the cache up (counted in the statistics)
    lookup: tuple[int, list[bytes]] | None = None  # (num_tokens, prefix_hashes) last computed
    draft_computed: int = 0  # leading tokens whose KV the draft model has (draft_model mode)
    spec_state: Any = None  # the drafting method's own state (prompt lookup: a token array)
    prev_hidden: bytes = b""  # mtp after a remote prefill: the prefiller's last hidden row

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def token(self, index: int) -> int:
        p = len(self.prompt_ids)
        return self.prompt_ids[index] if index < p else self.output_ids[index - p]

    def tokens(self, start: int, end: int) -> list[int]:
        p = len(self.prompt_ids)
        if end <= p:
            return self.prompt_ids[start:end]
        return (self.prompt_ids + self.output_ids)[start:end]

    @property
    def is_decode(self) -> bool:
        return self.num_tokens - self.num_computed == 1 and self.num_computed > 0


@dataclass(frozen=True)
class ScheduledChunk:
    seq: Sequence
    start: int  # first position computed in this step
    count: int  # tokens computed in this step (drafted positions included)
    sample: bool  # this chunk reaches the end of the sequence's tokens
    spec: int = 0  # drafted positions after the sequence's last token
    drafts: tuple[int, ...] = ()  # their tokens, when the scheduler drafted them
    draft_prefix: tuple[int, ...] = ()  # draft model: tokens before ``start`` it has not seen
    next_known: bool = False  # mtp: send the token after the chunk (``SeqChunk.next_token``)
    prev_hidden: bytes = b""  # mtp: ``SeqChunk.prev_hidden``

    def to_wire(self) -> SeqChunk:
        s, p = self.seq, self.seq.params
        n = self.count - self.spec
        return SeqChunk(
            slot=s.slot,
            token_ids=s.tokens(self.start, self.start + n) + list(self.drafts),
            next_token=(s.token(self.start + n) if self.next_known and self.start + n < s.num_tokens
                        else -1),
            start_pos=self.start,
            block_table=list(s.block_table),
            sample=self.sample and not s.prefill_only,
            want_hidden=self.sample and s.prefill_only,
            temperature=p.temperature,
            top_k=p.top_k,
            top_p=p.top_p,
            seed=s.seed,
            output_index=len(s.output_ids),
            num_draft=len(self.drafts),
            draft_tokens=self.spec - len(self.drafts),
            draft_prefix=list(self.draft_prefix),
            prev_hidden=self.prev_hidden,
        )


@dataclass(frozen=True)
class Batch:
    chunks: list[ScheduledChunk]  # decodes first
    num_decodes: int

    @property
    def num_tokens(self) -> int:
        return sum(c.count for c in self.chunks)


@dataclass(frozen=True)
class SeqUpdate:
    seq: Sequence
    new_token_ids: list[int]
    finish_reason: str | None  # "stop" | "length" | None while running


class BatchScheduler:
    def __init__(
        self,
        pool: PagePool,
        page_size: int,
        max_batch_tokens: int,
        max_running: int,
        max_model_len: int,
        eos_token_ids: tuple[int, ...] = (),
        prefix_caching: bool = False,
        cache_salt: bytes = b"",
        spec_tokens: int = 0,
        propose: Callable[[Sequence, int], list[int]] | None = None,
        draft_model: bool = False,
        mtp: bool = False,
    ):
        """``prefix_caching``: reuse cached full pages; ``cache_salt``: the model's identity,
        the parent of every prompt's first page hash; ``propose(seq, k)``: up to ``k`` drafted
        tokens to follow ``seq`` (speculative decoding, at most ``spec_tokens`` per step);
        ``draft_model``: the executor drafts them with its draft model instead; ``mtp``: the
        executor's MTP layer drafts after each step (``propose`` offers those drafts) and every
        chunk reserves the page of the position after it (the MTP layer computes it)."""
        self.pool = pool
        self.page_size = page_size
        self.max_batch_tokens = max_batch_tokens
        self.max_running = max_running
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: list[Sequence] = []  # by arrival, preempted ones re-inserted in order
        self.running: list[Sequence] = []  # by arrival
        self.num_preemptions = 0
        self.prefix_caching = prefix_caching
        self.cache_root = cache_salt
        self.prefix_query_tokens = 0  # prompt tokens of sequences that looked the cache up
        self.prefix_hit_tokens = 0  # ... of which served from the cache
        self.draft_model = draft_model and propose is None
        self.mtp = mtp
        self.spec_tokens = spec_tokens if propose is not None or self.draft_model else 0
        self.propose = propose
        self.spec_draft_tokens = 0  # drafted tokens verified
        self.spec_accepted_tokens = 0  # ... of which accepted

    # ---------------------------------------------------------------- admission

    def add(self, seq: Sequence) -> None:
        seq.status = Status.WAITING
        self._insert_waiting(seq)

    def _insert_waiting(self, seq: Sequence) -> None:
        i = len(self.waiting)
        while i > 0 and self.waiting[i - 1].arrival > seq.arrival:
            i -= 1
        self.waiting.insert(i, seq)

    def remove(self, seq: Sequence) -> None:
        """Take a sequence out (abort, error, transfers done) and free its pages."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._release(seq)
        seq.status = Status.FINISHED

    def detach(self, seq: Sequence) -> list[int]:
        """Take a sequence out WITHOUT freeing its pages; the caller owns them now (writes may
        still land in them) and frees them with ``free_pages`` when it is safe."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        pages, seq.block_table = seq.block_table, []
        seq.num_computed = 0
        seq.hashes = []
        seq.draft_computed = 0
        seq.status = Status.FINISHED
        return pages

    def free_pages(self, pages: list[int]) -> None:
        if pages:
            self.pool.free(pages)

    # ---------------------------------------------------------------- remote prefill (decode)

    def kv_arrived(self, seq: Sequence, pages: list[int], context: bytes = b"") -> None:
        """A prefiller's KV for all but the last prompt token has landed in ``pages`` (held by
        the remote-prefill machine until now): decode from here; the next step runs the last
        prompt token as an ordinary decode. ``context``: the prefiller's last hidden row (for
        MTP, which needs it at the last prompt token's position)."""
        seq.block_table = list(pages)
        seq.num_computed = seq.num_tokens - 1
        if self.mtp:
            seq.prev_hidden = context
        if self.draft_model:  # the prefiller shipped the draft's KV too (KVLayoutDesc.spec)
            seq.draft_computed = seq.num_computed
        seq.status = Status.RUNNING
        self.running.append(seq)

    def counters(self) -> dict[str, int]:
        """The cumulative counters a node's Stats report."""
        return {"preemptions": self.num_preemptions,
                "prefix_query_tokens": self.prefix_query_tokens,
                "prefix_hit_tokens": self.prefix_hit_tokens,
                "spec_draft_tokens": self.spec_draft_tokens,
                "spec_accepted_tokens": self.spec_accepted_tokens}

    def has_work(self) -> bool:
        """Something to compute now (REMOTE sequences wait for their KV, not for a step)."""
        return bool(self.running or self.waiting)

    # ---------------------------------------------------------------- one step

    def schedule(self) -> Batch | None:
        budget = self.max_batch_tokens
        decodes: list[ScheduledChunk] = []
        drafted: list[ScheduledChunk] = []  # decodes with drafts: several queries each
        prefills: list[ScheduledChunk] = []
        scheduled: set[int] = set()
        for seq in sorted(self.running, key=lambda s: (not s.is_decode, s.arrival)):
            if budget == 0:
                break
            if seq.status is not Status.RUNNING:  # preempted earlier in this loop
                continue
            count = min(seq.num_tokens - seq.num_computed, budget)
            spec, drafts = self._drafts(seq, budget - count) if seq.is_decode else (0, [])
            if not self._reserve(seq, count + spec + self._ahead(seq, count + spec), scheduled):
                continue  # preempted itself
            chunk = self._chunk(seq, count, spec, drafts)
            (drafted if spec else decodes if seq.is_decode else prefills).append(chunk)
            scheduled.add(seq.slot)
            budget -= chunk.count
        while budget > 0 and self.waiting and len(self.running) < self.max_running:
            seq = self.waiting[0]
            if self.prefix_caching and not seq.block_table:
                self._match(seq)
            count = min(seq.num_tokens - seq.num_computed, budget)
            need = pages_needed(seq.num_computed + count + self._ahead(seq, count),
                                self.page_size) - len(seq.block_table)
            pages = self.pool.allocate(need, seq.block_table[-1] if seq.block_table else None)
            if pages is None:
                # a waiting sequence holds no pages between steps: its cached ones go back
                # (still cached) so that several waiting ones cannot starve the pool
                self._release(seq)
                seq.num_computed = 0
                break
            seq.block_table.extend(pages)
            self.waiting.pop(0)
            seq.status = Status.RUNNING
            self.running.append(seq)
            prefills.append(self._chunk(seq, count))
            budget -= count
        if not decodes and not drafted and not prefills:
            return None
        return Batch(decodes + drafted + prefills, len(decodes))

    def _ahead(self, seq: Sequence, count: int) -> int:
        """Positions past a chunk of ``count`` tokens to reserve now: with MTP, the next one
        (within the context limit)."""
        limit = seq.num_tokens if seq.prefill_only else self.max_model_len  # a next token
        return int(self.mtp and seq.num_computed + count < limit)

    def _drafts(self, seq: Sequence, room: int) -> tuple[int, list[int]]:
        """Drafted positions for decode ``seq`` and their tokens (empty when the executor's
        draft model proposes them): within ``room`` more tokens this step, and never past what
        it may still emit (``max_tokens``, the context limit)."""
        if not self.spec_tokens or seq.prefill_only:
            return 0, []
        k = min(self.spec_tokens, room, seq.params.max_tokens - len(seq.output_ids) - 1,
                self.max_model_len - seq.num_tokens)
        if k <= 0:
            return 0, []
        if self.propose is None:
            return k, []
        drafts = self.propose(seq, k)[:k]
        return len(drafts), drafts

    def prefix_hashes(self, seq: Sequence) -> list[bytes]:
        """The chained hashes of ``seq``'s full pages before its last token (which is always
        computed, for its logits): what a lookup matches. Kept on the sequence while its
        tokens do not change (a waiting head looks up again at every step)."""
        if seq.lookup is None or seq.lookup[0] != seq.num_tokens:
            ps = self.page_size
            full = (seq.num_tokens - 1) // ps
            seq.lookup = (seq.num_tokens,
                          page_hashes(seq.tokens(0, full * ps), ps, self.cache_root, full))
        return seq.lookup[1]

    def _match(self, seq: Sequence) -> None:
        """Start ``seq`` on the cached pages of its longest cached prefix (whole pages)."""
        ps = self.page_size
        hashes = self.prefix_hashes(seq)
        seq.block_table = self.pool.match(hashes)
        seq.hashes = hashes[:len(seq.block_table)]
        seq.num_computed = len(seq.block_table) * ps
        if self.draft_model:  # cached pages hold the draft's KV too (``_register``)
            seq.draft_computed = seq.num_computed
        self.count_lookup(seq, seq.num_computed)

    def count_lookup(self, seq: Sequence, cached: int) -> None:
        """Statistics and usage of a sequence's first prefix-cache lookup (``cached``: tokens
        found)."""
        if self.prefix_caching and not seq.matched:
            seq.matched = True
            seq.cached_tokens = min(cached, len(seq.prompt_ids))
            self.prefix_query_tokens += len(seq.prompt_ids)
            self.prefix_hit_tokens += seq.cached_tokens

    def _register(self, seq: Sequence) -> None:
        """Cache the full pages of ``seq`` whose KV this step completed (with a draft model:
        both models' KV, so a hit serves the draft too)."""
        ps = self.page_size
        done = (min(seq.num_computed, seq.draft_computed) if self.draft_model
                else seq.num_computed) // ps
        start = len(seq.hashes)
        if done <= start:
            return
        parent = seq.hashes[-1] if seq.hashes else self.cache_root
        new = page_hashes(seq.tokens(start * ps, done * ps), ps, parent, done - start)
        for page, h in zip(seq.block_table[start:done], new, strict=True):
            self.pool.cache_page(page, h)
        seq.hashes.extend(new)

    def _chunk(self, seq: Sequence, count: int, spec: int = 0,
               drafts: list[int] | None = None) -> ScheduledChunk:
        start = seq.num_computed
        prefix = (tuple(seq.tokens(seq.draft_computed, start))
                  if self.draft_model and not seq.prefill_only and seq.draft_computed < start
                  else ())
        prev, seq.prev_hidden = seq.prev_hidden, b""  # used once: its step computes the position
        return ScheduledChunk(seq, start, count + spec, start + count == seq.num_tokens, spec,
                              tuple(drafts or ()), prefix, self.mtp, prev)

    def _reserve(self, seq: Sequence, count: int, scheduled: set[int]) -> bool:
        """Give ``seq`` pages for ``count`` more tokens, preempting others if needed (it may
        hold more already: pages reserved for drafts that were rejected)."""
        need = max(0, pages_needed(seq.num_computed + count, self.page_size)
                   - len(seq.block_table))
        while True:
            pages = self.pool.allocate(need, seq.block_table[-1] if seq.block_table else None)
            if pages is not None:
                seq.block_table.extend(pages)
                return True
            victims = [s for s in self.running if s.slot not in scheduled and s is not seq]
            victim = max(victims, key=lambda s: s.arrival) if victims else seq
            self._preempt(victim)
            if victim is seq:
                return False

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._release(seq)
        seq.num_computed = 0
        seq.status = Status.WAITING
        self._insert_waiting(seq)
        self.num_preemptions += 1

    def _release(self, seq: Sequence) -> None:
        if seq.block_table:
            self.pool.free(seq.block_table)
            seq.block_table = []
        seq.hashes = []
        seq.draft_computed = 0
        seq.prev_hidden = b""

    # ---------------------------------------------------------------- results

    def update(self, batch: Batch, sampled: list[int], counts: list[int] | None = None,
               drafts: list[list[int]] | None = None) -> list[SeqUpdate]:
        """Apply a step's sampled tokens: per sampling chunk, in order, one token or
        ``counts[i]`` of them (speculative decoding: accepted drafts and the target's token);
        ``drafts`` (mtp): per sampling chunk, the drafts for its next step."""
        updates: list[SeqUpdate] = []
        pos = 0
        nth = iter(counts) if counts is not None else None
        nxt = iter(drafts) if drafts is not None else None
        for chunk in batch.chunks:
            seq = chunk.seq
            tokens: list[int] = []
            if chunk.sample and not seq.prefill_only:
                n = next(nth) if nth is not None else 1
                tokens, pos = sampled[pos:pos + n], pos + n
                if nxt is not None:
                    seq.spec_state = list(next(nxt, []))
            if seq.status is not Status.RUNNING:
                continue  # removed (aborted) while the step ran
            if chunk.spec:
                # accepted drafts and the target's token (never more: a result is not trusted)
                tokens = tokens[:chunk.spec + 1]
                if not tokens:
                    continue  # nothing emitted: the step's KV is recomputed by the next one
                self.spec_draft_tokens += chunk.spec
                self.spec_accepted_tokens += len(tokens) - 1
                # the draft model computed every position of the chunk; those kept
                seq.draft_computed = chunk.start + len(tokens)
            elif self.draft_model:  # it computed the chunk's tokens with the target
                seq.draft_computed = chunk.start + chunk.count
            if not chunk.spec and (seq.prefill_only or not tokens):
                seq.num_computed = chunk.start + chunk.count
                if self.prefix_caching:
                    self._register(seq)
                if seq.prefill_only and seq.num_computed == seq.num_tokens:
                    self.running.remove(seq)
                    seq.status = Status.HELD  # pages stay until the transfers complete
                    seq.finish_reason = "prefilled"
                    updates.append(SeqUpdate(seq, [], "prefilled"))
                continue
            new: list[int] = []
            reason = None
            for token in tokens:  # a stop or the length limit may fall inside an accepted run
                seq.output_ids.append(token)
                new.append(token)
                reason = self._finish_reason(seq, token)
                if reason is not None:
                    break
            # computed: the chunk's positions whose tokens were kept (a rejected draft's KV lies
            # past this); the last emitted token is not computed yet
            seq.num_computed = min(chunk.start + (len(tokens) if chunk.spec else chunk.count),
                                   seq.num_tokens - 1)
            if self.prefix_caching:
                self._register(seq)
            if reason is not None:
                seq.finish_reason = reason
                self.running.remove(seq)
                self._release(seq)
                seq.status = Status.FINISHED
            updates.append(SeqUpdate(seq, new, reason))
        return updates

    def _finish_reason(self, seq: Sequence, token: int) -> str | None:
        p = seq.params
        n = len(seq.output_ids)
        if n >= p.min_tokens:
            if token in p.stop_token_ids:
                return "stop"
            if not p.ignore_eos and token in self.eos_token_ids:
                return "stop"
        if n >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None
