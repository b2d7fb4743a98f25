"""Overlapped decoding's part of batch formation (``OverlappedDecoding``, a base of
``disagg.engine.scheduling.BatchScheduler``): whether a decode step may run deferred, the step
planned after one whose tokens are not back yet (follow chunks the executor fills in on the
device), the constrained rows whose late grammar masks it waits for, and the pages released while a
deferred step still writes them (kept out of the pool until it lands). Pure logic, as the rest
of the scheduler."""

from __future__ import annotations

import collections

from disagg.engine.cache import PagePool, pages_needed
from disagg.engine.grammar_pass import Row
from disagg.engine.sequence import Batch, ScheduledChunk, Sequence, Status


class OverlappedDecoding:
    """The scheduler's state this part works on is declared here and set up by
    ``BatchScheduler``."""

    pool: PagePool
    page_size: int
    max_model_len: int
    spec_tokens: int
    mtp: bool
    waiting: list[Sequence]
    running: list[Sequence]
    # in-flight deferred steps writing each slot's pages, and the pages of slots released
    # meanwhile (freed when the last such step lands; ``BatchScheduler._release``)
    _writing: collections.Counter[int]
    _parked: dict[int, list[int]]


    def can_defer(self, batch: Batch) -> bool:
        """``batch`` may run deferred, its successor launched before its tokens are back
        (``schedule_ahead``): decode-only, no speculative decoding, every running sequence in
        it and none waiting."""
        return (not (self.spec_tokens or self.mtp or self.waiting)
                and batch.num_decodes == len(batch.chunks) == len(self.running))

    def schedule_ahead(self, batch: Batch) -> Batch | None:
        """The step after ``batch``, which is in flight with its tokens not back yet, when it
        needs none of them: every sequence ``batch``'s token cannot finish by length gets one
        follow chunk at its next position (its token: the one ``batch`` samples, which the
        executor fills in on the device), with a page reserved for it. A stop sampled in flight
        wastes that row (``update`` skips a finished sequence). None when ``can_defer`` no
        longer holds (new work: the caller steps normally) or a page is missing (no
        preemption ahead).

        A constrained sequence (``Sequence.grammar``) gets its follow chunk too; its mask needs
        the token in flight, so the chunk is sent ``late_mask`` and its mask follows once that
        token is back (``grammar_rows``; docs/ARCHITECTURE.md, grammar-constrained decoding)."""
        live = [c for c in batch.chunks if c.seq.status is Status.RUNNING]
        flying = {c.seq.slot for c in live}
        if (batch.num_decodes != len(batch.chunks) or self.spec_tokens or self.mtp
                or self.waiting or any(s.slot not in flying for s in self.running)):
            return None
        chunks: list[ScheduledChunk] = []
        for c in live:
            seq = c.seq
            if seq.num_computed != c.start or seq.num_tokens != c.start + 1:
                return None
            if (len(seq.output_ids) + 1 >= seq.params.max_tokens
                    or seq.num_tokens + 1 >= self.max_model_len):
                continue  # the token in flight is its last
            need = pages_needed(c.start + 2, self.page_size) - len(seq.block_table)
            if need > 0:
                pages = self.pool.allocate(need, seq.block_table[-1])
                if pages is None:
                    return None
                seq.block_table.extend(pages)
            chunks.append(ScheduledChunk(seq, c.start + 1, 1, True, follow=True))
        return Batch(chunks, len(chunks)) if chunks else None

    def grammar_rows(self, batch: Batch, ahead: Batch, sampled: list[int],
                     masks: bool = True) -> list[Row] | None:
        """The constrained rows of the deferred ``batch``, whose tokens ``sampled`` just came
        back (none: it failed), for a ``GrammarPass`` to accept and fill the masks of before
        the update applies them: each running row's token, and whether its follow chunk in
        ``ahead`` (launched after ``batch``, sent ``late_mask``) waits for its next mask. A
        sequence that ended meanwhile (aborted, its grammar complete) has no row, so its late
        chunk gets no mask (picked unconstrained, its token dropped). None when ``ahead`` has
        no late chunk: nothing waits, the update accepts the tokens. ``masks`` False: the
        executors fill them (``disagg.engine.grammar_mirror``), the rows only accept."""
        late = {c.seq.slot for c in ahead.chunks if c.follow and c.seq.grammar is not None}
        if not late:
            return None
        rows: list[Row] = []
        pos = 0
        for c in batch.chunks:
            seq = c.seq
            if not c.sample or seq.prefill_only:
                continue
            if pos >= len(sampled):
                break
            token, pos = sampled[pos], pos + 1
            if (seq.grammar is not None and seq.status is Status.RUNNING
                    and not seq.grammar.terminated):
                rows.append(Row(seq.grammar, token, seq.slot, masks and seq.slot in late))
        return rows

    def launched(self, batch: Batch) -> None:
        """``batch`` went to the executors deferred: pages its sequences release before it
        lands stay out of the pool until then."""
        self._writing.update(c.seq.slot for c in batch.chunks)

    def landed(self, batch: Batch) -> None:
        """A deferred ``batch`` is done on the device (its result came back, or failed)."""
        for c in batch.chunks:
            slot = c.seq.slot
            self._writing[slot] -= 1
            if self._writing[slot] <= 0:
                del self._writing[slot]
                if pages := self._parked.pop(slot, None):
                    self.pool.free(pages)
