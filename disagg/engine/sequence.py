"""A request's token state (``Sequence``) and what a step is made of (``ScheduledChunk``,
``Batch``, ``SeqUpdate``): the data ``disagg.engine.scheduling.BatchScheduler`` works on."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import msgspec

from disagg.protocol import SamplingParams, TokenLogprobs
from disagg.protocol.executor import SeqChunk


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    REMOTE = "remote"  # decode side: waiting for a prefiller's KV (disagg.remote.decode)
    HELD = "held"  # prefill side: computed, pages held until their transfers complete
    LOADING = "loading"  # its prefix's pages are reloading from a lower KV tier (prefix_tiers)
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
    # the chained hashes of its leading full pages computed so far (BatchScheduler.page_hashes):
    # a page's hash never changes (tokens are only appended), so none is computed twice
    known_hashes: list[bytes] = field(default_factory=list)
    draft_computed: int = 0  # leading tokens whose KV the draft model has (draft_model mode)
    spec_state: Any = None  # the drafting method's own state (prompt lookup: a token array)
    prev_hidden: bytes = b""  # mtp after a remote prefill: the prefiller's last hidden row
    # prompt_ids as its client's frame carried them (msgpack), None when tokenized here: a
    # decoder sends these bytes on to its prefiller (disagg.protocol.inproc.drop_last_id)
    prompt_msgpack: memoryview | None = None
    # the request's cache salt (disagg.serving.salting): only sequences of the same salt share
    # cached pages; None = unsalted
    cache_salt: str | None = None
    # SamplingParams.prompt_logprobs: entry i is prompt token i + 1's, filled as the prompt's
    # chunks are computed (a recompute after preemption writes the same entries again)
    prompt_lps: list[TokenLogprobs] = field(default_factory=list)
    # the distinct prompt token ids (repetition_penalty), sorted; computed on first use
    seen_ids: list[int] | None = None
    # SamplingParams.structured: the request's matcher (disagg.engine.grammar.GrammarState),
    # attached when it is admitted on a node that samples; advanced by each output token
    grammar: Any = None
    # the executors' copy of its matcher started from its output so far (grammar_mirror,
    # the default); after a preemption it starts over
    grammar_synced: bool = False
    # its spans on this node (disagg.trace.Phases) while traces are exported; None otherwise
    trace: Any = None

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
    follow: bool = False  # overlapped decoding: its token is the one the step in flight samples

    @property
    def needs_mask(self) -> bool:
        """Its ``SeqChunk.allowed`` is filled with the plan: a constrained chunk that samples
        and whose token is known (a follow chunk's mask comes late)."""
        s = self.seq
        return s.grammar is not None and self.sample and not s.prefill_only and not self.follow

    def to_wire(self, allowed: bytes | None = None, late: bool = False) -> SeqChunk:
        """The chunk's wire form; ``allowed``: its mask when filled already (``needs_mask``
        rows filled together, ``EngineCore``), else filled here; ``late``: a constrained row's
        mask is the executor's to fill (``disagg.engine.grammar_mirror``), never filled here."""
        s, p = self.seq, self.seq.params
        n = self.count - self.spec
        chunk = SeqChunk(
            slot=s.slot,
            token_ids=[0] if self.follow else s.tokens(self.start, self.start + n) + list(
                self.drafts),
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
            output_index=len(s.output_ids) + self.follow,
            num_draft=len(self.drafts),
            draft_tokens=self.spec - len(self.drafts),
            draft_prefix=list(self.draft_prefix),
            prev_hidden=self.prev_hidden,
            follow=self.follow,
        )
        sampling = self.sample and not s.prefill_only
        if p.processed and sampling:
            chunk = msgspec.structs.replace(chunk, **processor_fields(s))
        if p.logprobs is not None and sampling:
            chunk = msgspec.structs.replace(chunk, logprobs=p.logprobs)
        if s.grammar is not None and sampling:
            # what its grammar admits next; a follow chunk's mask needs the token in flight,
            # so it follows the step (EngineCore.late_masks)
            chunk = msgspec.structs.replace(chunk, **(
                {"late_mask": True} if self.follow or late else
                {"allowed": s.grammar.mask() if allowed is None else allowed}))
        if p.prompt_logprobs is not None and self.start < len(s.prompt_ids) - 1:
            # rows predicting prompt tokens: positions start .. min(end, P - 1) - 1
            rows = min(self.start + n, len(s.prompt_ids) - 1) - self.start
            nxt = self.start + n
            chunk = msgspec.structs.replace(
                chunk, prompt_logprobs=p.prompt_logprobs, prompt_rows=rows,
                prompt_next=s.prompt_ids[nxt] if nxt < len(s.prompt_ids) else -1)
        return chunk


def processor_fields(s: Sequence) -> dict[str, Any]:
    """The ``SeqChunk`` fields of ``s``'s logits processors (its penalties' token counts)."""
    p = s.params
    out: dict[str, Any] = {"presence_penalty": p.presence_penalty,
                           "frequency_penalty": p.frequency_penalty,
                           "repetition_penalty": p.repetition_penalty,
                           "logit_bias": list(p.logit_bias.items())}
    if p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0:
        out["penalty_ids"] = list(s.output_ids)
    if p.repetition_penalty != 1.0:
        if s.seen_ids is None:
            s.seen_ids = sorted(set(s.prompt_ids))
        out["seen_ids"] = s.seen_ids
    return out


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
    # SamplingParams.logprobs: one entry per new token; None otherwise
    logprobs: list[TokenLogprobs] | None = None


def store_prompt_logprobs(batch: Batch, got: dict[int, list[TokenLogprobs]]) -> None:
    """Store the prompt logprobs a step computed, by slot (entry i: prompt token i + 1's)."""
    for chunk in batch.chunks:
        seq = chunk.seq
        entries = got.get(seq.slot)
        if entries is None or seq.status is not Status.RUNNING:
            continue
        end = chunk.start + len(entries)
        if end > len(seq.prompt_ids) - 1 or chunk.start > len(seq.prompt_lps):
            continue  # not what this chunk asked (an untrusted result)
        seq.prompt_lps[chunk.start:end] = entries


def logprobs_of(seq: Sequence, new: list[int], got: dict[int, TokenLogprobs] | None
                ) -> list[TokenLogprobs] | None:
    """``SeqUpdate.logprobs`` of ``seq``'s ``new`` tokens from a step's logprobs by slot."""
    one = got.get(seq.slot) if got is not None and new else None
    return [one] if one is not None and one.token_id == new[0] else None
