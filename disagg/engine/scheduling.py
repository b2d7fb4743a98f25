"""Batch formation: continuous batching with chunked prefill under a token budget.

Pure logic (no sockets, no asyncio, no torch): the Scheduler actor drives it and the tests drive
it directly. Each step holds, in order: one decode token for every running sequence whose prompt
is done, the next chunks of running prefills, then new sequences admitted from the waiting queue.
When pages run out, the latest arrived running sequence with pages on the rank short of them is
preempted (recompute, ``dp.preemption_victim``): freed, it rejoins the waiting queue's head.

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

Overlapped decoding's part (a step planned while its predecessor's tokens are still on the
device, and the pages that step still writes) is ``disagg.engine.overlapped``, a base class.
"""

from __future__ import annotations

import collections
from collections.abc import Callable

from disagg.engine import sequence as seqs
from disagg.engine.cache import PagePool, page_hashes, page_root, pages_needed
from disagg.engine.dp import StepBudget, preemption_victim
from disagg.engine.overlapped import OverlappedDecoding
from disagg.engine.sequence import Batch, ScheduledChunk, Sequence, SeqUpdate, Status
from disagg.protocol import TokenLogprobs

__all__ = ["Batch", "BatchScheduler", "ScheduledChunk", "SeqUpdate", "Sequence", "Status"]


class BatchScheduler(OverlappedDecoding):
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
        # overlapped decoding (``OverlappedDecoding``: ``can_defer``, ``schedule_ahead``,
        # ``late_masks``, ``launched``, ``landed``): in-flight deferred steps writing each
        # slot's pages, and the pages of slots released meanwhile (freed when the last lands)
        self._writing: collections.Counter[int] = collections.Counter()
        self._parked: dict[int, list[int]] = {}

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
        with StepBudget(self.pool, self.max_batch_tokens) as budget:  # per DP rank, this step
            return self._form(budget)

    def _form(self, budget: StepBudget) -> Batch | None:
        decodes: list[ScheduledChunk] = []
        drafted: list[ScheduledChunk] = []  # decodes with drafts: several queries each
        prefills: list[ScheduledChunk] = []
        scheduled: set[int] = set()
        for seq in sorted(self.running, key=lambda s: (not s.is_decode, s.arrival)):
            if not budget.of(seq) or seq.status is not Status.RUNNING:  # no tokens left on
                continue  # its rank, or preempted earlier in this loop
            count = min(seq.num_tokens - seq.num_computed, budget.of(seq))
            spec, drafts = self._drafts(seq, budget.of(seq) - count) if seq.is_decode else (0, [])
            if not self._reserve(seq, count + spec + self._ahead(seq, count + spec), scheduled):
                continue  # preempted itself
            chunk = self._chunk(seq, count, spec, drafts)
            (drafted if spec else decodes if seq.is_decode else prefills).append(chunk)
            scheduled.add(seq.slot)
            budget.take(seq, chunk.count)
        while budget and self.waiting and len(self.running) < self.max_running:
            seq = self.waiting[0]
            if self.prefix_caching and not seq.block_table and seq.params.prompt_logprobs is None:
                if self._match(seq):  # prompt logprobs: every prompt position is computed
                    self.waiting.pop(0)  # loading from a lower KV tier (prefix_tiers)
                    continue
            count = min(seq.num_tokens - seq.num_computed, budget.of(seq))
            need = pages_needed(seq.num_computed + count + self._ahead(seq, count),
                                self.page_size) - len(seq.block_table)
            pages = self.pool.allocate(need, seq.block_table[-1] if seq.block_table else None)
            if pages is not None:
                seq.block_table.extend(pages)
                count = budget.take(seq, count)  # its rank may have less left than the most
            if pages is None or not count:  # a waiting sequence holds no pages between steps:
                self._release(seq)  # its cached ones go back (still cached), none starve
                seq.num_computed = 0
                break
            self.waiting.pop(0)
            seq.status = Status.RUNNING
            self.running.append(seq)
            prefills.append(self._chunk(seq, count))
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
        if not self.spec_tokens or seq.prefill_only or seq.params.processed or (
                seq.params.logprobs is not None):
            return 0, []  # logits processors and logprobs: plain decodes (README)
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
        computed, for its logits) as far as this node's cache holds them, and the first one
        it does not: what a lookup matches. Hashed page by page up to that miss, so a new
        prompt costs one hash here; its other pages are hashed once, as they complete
        (``_register``). A waiting head looks up again at every step: the pages hashed
        before are not hashed again (``Sequence.known_hashes``)."""
        full = (seq.num_tokens - 1) // self.page_size
        known = seq.known_hashes
        hit = self.held_run(known[:full])
        if hit < min(len(known), full):
            return known[:hit + 1]
        while len(known) < full:  # every known hash is cached: go on while they are
            self.page_hashes(seq, len(known) + 1)
            if not self.held_run(known[-1:]):
                break
        return known[:full]

    def page_hashes(self, seq: Sequence, pages: int) -> list[bytes]:
        """The chained hashes of ``seq``'s first ``pages`` full pages, hashing only those not
        hashed before (kept in ``seq.known_hashes``); its first page's parent is the model's
        identity keyed by its cache salt (``page_root``)."""
        known = seq.known_hashes
        if len(known) < pages:
            ps, n = self.page_size, len(known)
            root = known[-1] if known else page_root(self.cache_root, seq.cache_salt)
            known.extend(page_hashes(seq.tokens(n * ps, pages * ps), ps, root, pages - n))
        return known[:pages]

    def reload_pending(self) -> bool:
        """A lower KV tier's reload that a step must wait on, layer by layer, is in flight
        (``prefix_tiers``)."""
        return False

    def held_run(self, hashes: list[bytes]) -> int:
        """How many leading ``hashes`` the cache holds (with KV tiers: any tier)."""
        return self.pool.cached_run(hashes)

    def _match(self, seq: Sequence) -> bool:
        """Start ``seq`` on the cached pages of its longest cached prefix (whole pages); True
        when it waits for some from a lower KV tier instead (``prefix_tiers``)."""
        ps = self.page_size
        hashes = self.prefix_hashes(seq)
        seq.block_table = self.pool.match(hashes)
        seq.hashes = hashes[:len(seq.block_table)]
        seq.num_computed = len(seq.block_table) * ps
        if self.draft_model:  # cached pages hold the draft's KV too (``_register``)
            seq.draft_computed = seq.num_computed
        self.count_lookup(seq, seq.num_computed)
        return False

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
        new = self.page_hashes(seq, done)[start:]
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
            victim = preemption_victim(self.pool, seq, self.running, scheduled)
            self._preempt(victim)
            if victim is seq:
                return False

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._release(seq)
        seq.num_computed = 0
        seq.grammar_synced = False
        seq.status = Status.WAITING
        self._insert_waiting(seq)
        self.num_preemptions += 1

    def _release(self, seq: Sequence) -> None:
        if seq.block_table:
            if self._writing[seq.slot]:  # a step in flight still writes them
                self._parked.setdefault(seq.slot, []).extend(seq.block_table)
            else:
                self.pool.free(seq.block_table)
            seq.block_table = []
        seq.hashes = []
        seq.draft_computed = 0
        seq.prev_hidden = b""

    # ---------------------------------------------------------------- results

    def update(self, batch: Batch, sampled: list[int], counts: list[int] | None = None,
               drafts: list[list[int]] | None = None,
               logprobs: dict[int, TokenLogprobs] | None = None,
               prompt_logprobs: dict[int, list[TokenLogprobs]] | None = None
               ) -> list[SeqUpdate]:
        """Apply a step's sampled tokens: per sampling chunk, in order, one token or
        ``counts[i]`` of them (speculative decoding: accepted drafts and the target's token);
        ``drafts`` (mtp): per sampling chunk, the drafts for its next step; ``logprobs`` /
        ``prompt_logprobs`` by slot (``StepResult``'s)."""
        if prompt_logprobs:
            seqs.store_prompt_logprobs(batch, prompt_logprobs)
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
            updates.append(SeqUpdate(seq, new, reason, seqs.logprobs_of(seq, new, logprobs)))
        return updates

    def _finish_reason(self, seq: Sequence, token: int) -> str | None:
        if seq.grammar is not None:  # advance its matcher; a complete output stops
            seq.grammar.accept(token)
            if seq.grammar.terminated:
                return "stop"
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
