"""Grammar masks filled on the executor (the default; ``DISAGG_EXECUTOR_MASKS=0``: by the
scheduler).

Overlapped decoding sends a constrained row's follow chunk before the token it follows is
back (``SeqChunk.late_mask``): its mask needs that token. By default the scheduler accepts the
token and fills the mask (``disagg.engine.grammar_pass``) and sends it (``Masks``): the
token's trip to the scheduler, the pass on threads that share the scheduler's interpreter
with the event loop, and the mask's trip back are the chain that bounds such a step (docs/
BENCHMARKS.md, "late masks"). Here the executor, which sampled the token, keeps its own copy
of each constrained request's matcher and fills the mask itself, on threads of its own
process, as soon as the token is on the host; the scheduler's matchers only accept (what
ends an output), off that chain. Every constrained row goes ``late_mask`` in this mode: a
step none of whose rows follows a token in flight (a request's first, one after a collected
step, every step without overlapped decoding) has its masks filled right after its forward
pass is launched, overlapping it, and no plan carries masks.

``MirrorBook`` is the scheduler's side: it names each compiled grammar by a key and sends it
once (``GrammarDef``, the tokenizer's vocabulary with the first), and marks every
constrained sampling chunk with its key (``SeqChunk.grammar``); a request's first such chunk
carries the output so far (``grammar_replay``, empty: a decoder's request after a remote
prefill too) and the copy starts from it, as does its first after a preemption (defensive:
a preemption never comes with a token in flight, ``schedule_ahead`` declines instead). The
others carry the last token the scheduler applied (``grammar_prev``) for the copy to check
itself against. Requests that ended are named in the next plan (``StepPlan.grammar_gone``).

``GrammarMirror`` is the executor's: every token a marked chunk samples is recorded by its
output index as the step is answered; a step's masks are filled once every token before the
ones it samples is answered (the executor answers in step order). Slots are never reused on
a node and the executors restart only with their scheduler, so nothing else can put a copy
out of step; a copy that still is (a bug) is dropped with an error, its row picked
unconstrained (the scheduler's matcher then rejects the token and ends the request).
"""

from __future__ import annotations

import collections
import concurrent.futures
import importlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec

from disagg.config import env
from disagg.engine.grammar import CACHE_ENTRIES, GrammarState, bitmask_words
from disagg.engine.grammar_pass import PASS_TIMEOUT_S, GrammarPass, MaskBlock, Row
from disagg.engine.sequence import Status
from disagg.protocol.executor import GrammarDef, SeqChunk, StepPlan

if TYPE_CHECKING:
    from disagg.engine.sequence import ScheduledChunk

log = logging.getLogger(__name__)

# the executors fill the late masks themselves (the default since 2026-12-08: JSON-schema TPOT
# 1.01-1.07x plain against 1.29-1.37x with the scheduler's pass, docs/BENCHMARKS.md);
# DISAGG_EXECUTOR_MASKS=0: the scheduler's pass fills them and sends them (bench/gpu_round.sh
# surface_sched)
EXECUTOR_MASKS = env("EXECUTOR_MASKS", "1") != "0"


class MirrorBook:
    """The scheduler's record of what the executors' copies hold. ``vocab``: the serialized
    ``TokenizerInfo`` (``Grammars.vocab_json``), asked for with the first definition."""

    def __init__(self, vocab: Callable[[], bytes], capacity: int = CACHE_ENTRIES):
        self._vocab, self._capacity = vocab, capacity
        self._vocab_sent = False
        # id(compiled) -> (key, compiled): the compiled object is kept so its id stays its own
        self._keys: collections.OrderedDict[int, tuple[int, Any]] = collections.OrderedDict()
        self._next_key = 0
        self._defs: list[GrammarDef] = []
        # keys evicted while marking the plan under way (its own chunks may still name them),
        # then keys to drop with the next definition (after that plan)
        self._evicted: list[int] = []
        self._dropped: list[int] = []
        # slot -> (its Sequence, the key its copy started from), once a replay was sent
        self._live: dict[int, tuple[Any, int]] = {}

    def mark(self, chunks: list[ScheduledChunk], wires: list[SeqChunk]) -> list[SeqChunk]:
        """``wires`` (the plan's chunks, built from ``chunks``) with their grammar fields."""
        out = []
        for c, w in zip(chunks, wires, strict=True):
            seq = c.seq
            if seq.grammar is None or not w.sample:
                out.append(w)
                continue
            fields: dict[str, Any] = {}
            if seq.grammar_synced:  # (the key its copy started from: no lookup)
                fields["grammar"] = self._live[seq.slot][1]
                if seq.output_ids:  # the last token applied (a follow chunk's in flight is not)
                    fields["grammar_prev"] = seq.output_ids[-1]
            else:
                if w.follow:  # its token in flight was sampled for a synced copy
                    raise RuntimeError(f"slot {seq.slot}: a follow chunk before its replay")
                key = self._key(seq.grammar.compiled)
                fields.update(grammar=key, grammar_replay=seq.output_ids[:w.output_index])
                seq.grammar_synced = True
                self._live[seq.slot] = (seq, key)
            out.append(msgspec.structs.replace(w, **fields))
        return out

    def take(self) -> tuple[list[GrammarDef], list[int]]:
        """The definitions to send before the plan just marked, and the slots of requests
        that ended (``StepPlan.grammar_gone``)."""
        gone = [slot for slot, (seq, _) in self._live.items() if seq.status is Status.FINISHED]
        for slot in gone:
            del self._live[slot]
        defs, self._defs = self._defs, []
        self._dropped += self._evicted
        self._evicted = []
        return defs, gone

    def _key(self, compiled: Any) -> int:
        got = self._keys.get(id(compiled))
        if got is not None:
            self._keys.move_to_end(id(compiled))
            return got[0]
        key, self._next_key = self._next_key, self._next_key + 1
        self._keys[id(compiled)] = (key, compiled)
        while len(self._keys) > self._capacity:
            self._evicted.append(self._keys.popitem(last=False)[1][0])
        vocab = b"" if self._vocab_sent else self._vocab()
        self._vocab_sent = True
        self._defs.append(GrammarDef(key, str(compiled.serialize_json()).encode(), vocab,
                                     self._dropped))
        self._dropped = []
        return key


@dataclass
class _Copy:
    """One request's matcher on the executor: output tokens ``0 .. count - 1`` accepted."""

    state: GrammarState | None  # None until first needed (``load``)
    count: int
    last: int  # the token at index count - 1 (-1: none)
    seen: dict[int, int] = field(default_factory=dict)  # sampled, not accepted: index -> token
    # the grammar being deserialized and the replay the state starts from, until it is made
    load: tuple[concurrent.futures.Future[Any], list[int]] | None = None


class GrammarMirror:
    """The executor's copies of its constrained requests' matchers, filling late masks on
    ``threads`` threads of this process."""

    def __init__(self, threads: int | None = None):
        self._pass = GrammarPass(threads)
        self._info: Any = None  # written by the loader's thread only
        # key -> the compiled grammar, deserialized on the loader's thread (``define``)
        self._compiled: dict[int, concurrent.futures.Future[Any]] = {}
        self._loader: concurrent.futures.ThreadPoolExecutor | None = None
        self._copies: dict[int, _Copy] = {}  # by slot
        # step id -> (position among its sampled tokens, slot, output index) of marked chunks
        self._sampled: dict[int, list[tuple[int, int, int]]] = {}
        self._late: dict[int, list[SeqChunk]] = {}  # step id -> its marked late chunks

    def warm(self) -> concurrent.futures.Future[Any]:
        """Import xgrammar on the loader's thread (0.5-1 s with transformers) ahead of the
        first definition, which would otherwise wait for it; failing is no error here (no
        grammar comes, or its definition fails then)."""
        return self._loads().submit(importlib.import_module, "xgrammar")

    def define(self, d: GrammarDef) -> None:
        """Deserialize ``d`` on the loader's thread, in the order defined (the vocabulary
        comes with the first): ~6 ms a grammar and ~70 ms the vocabulary that would hold up
        the step loop; the first copy that needs it waits for it (``_made``), by then
        usually while a forward pass runs."""
        for key in d.drop:
            self._compiled.pop(key, None)
        self._compiled[d.key] = self._loads().submit(self._load, d)

    def _loads(self) -> concurrent.futures.ThreadPoolExecutor:
        if self._loader is None:
            self._loader = concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix="grammar-define")
        return self._loader

    def _load(self, d: GrammarDef) -> Any:
        import xgrammar as xgr

        if d.vocab:
            self._info = xgr.TokenizerInfo.deserialize_json(d.vocab.decode())
        if self._info is None:
            raise ValueError(f"grammar {d.key} defined before the vocabulary")
        return xgr.CompiledGrammar.deserialize_json(d.compiled.decode(), self._info)

    def track(self, plan: StepPlan) -> None:
        """A plan about to be launched: copies start over from replays; its marked chunks'
        tokens are recorded when it is answered, its late chunks filled by ``fill``."""
        for slot in plan.grammar_gone:
            self._copies.pop(slot, None)
        sampled, late, pos = [], [], 0
        for c in plan.chunks:
            if not c.sample:
                continue
            if c.grammar >= 0:
                if c.grammar_replay is not None:
                    self._start(c)
                sampled.append((pos, c.slot, c.output_index))
                if c.late_mask:
                    late.append(c)
            pos += 1
        if sampled:
            self._sampled[plan.step_id] = sampled
        if late:
            self._late[plan.step_id] = late

    def owns(self, step_id: int) -> bool:
        """``step_id`` has late chunks this executor fills the masks of."""
        return step_id in self._late

    def ready_at_launch(self, step_id: int) -> bool:
        """``step_id``'s masks can be filled as soon as it is launched: none of its late
        chunks follows a token still in flight (a step after a collected one, or the first
        of a request: every token before theirs is answered)."""
        return step_id in self._late and not any(c.follow for c in self._late[step_id])

    def late_rows(self, step_id: int) -> int:
        return len(self._late.get(step_id, ()))

    def record(self, step_id: int, tokens: list[int] | None) -> None:
        """Step ``step_id`` answered with ``tokens`` (None: it failed)."""
        self._late.pop(step_id, None)  # (a failed step's late chunks are never filled)
        for pos, slot, index in self._sampled.pop(step_id, ()):
            copy = self._copies.get(slot)
            if copy is not None and tokens is not None and pos < len(tokens) \
                    and index >= copy.count:
                copy.seen[index] = tokens[pos]

    def fill(self, step_id: int) -> MaskBlock:
        """The late masks of ``step_id`` (every token before its own answered): each copy
        accepts the tokens up to the one its chunk samples, then fills what it admits next."""
        rows = [r for c in self._late.pop(step_id, ()) if (r := self._row(c)) is not None]
        if not rows:
            return MaskBlock([], bytearray(), bitmask_words(self._info.vocab_size
                                                            if self._info else 0) * 4)
        block = self._pass.run(rows)
        for r in rows:
            if r.token < 0:  # (nothing accepted: the mask alone)
                continue
            copy = self._copies[r.slot]
            r.state.accept(r.token)  # takes the token the pass accepted ahead
            index = copy.count
            copy.count, copy.last = index + 1, r.token
            copy.seen = {i: t for i, t in copy.seen.items() if i > index}
        return block

    def close(self) -> None:
        self._pass.close()
        if self._loader is not None:
            self._loader.shutdown(wait=False, cancel_futures=True)
            self._loader = None

    def _start(self, c: SeqChunk) -> None:
        """A copy of ``c``'s request starting over from its replay; its state is made when
        first needed (``_made``), its grammar perhaps still being deserialized."""
        compiled = self._compiled.get(c.grammar)
        if compiled is None:
            log.error("slot %d: grammar %d was never defined", c.slot, c.grammar)
            self._copies.pop(c.slot, None)
            return
        replay = c.grammar_replay or []
        self._copies[c.slot] = _Copy(None, len(replay), replay[-1] if replay else -1,
                                     load=(compiled, replay))

    def _made(self, slot: int, copy: _Copy) -> GrammarState | None:
        """``copy``'s state, made now from its grammar and replay if not yet; None (said,
        the copy goes) when its grammar could not be loaded."""
        if copy.state is not None or copy.load is None:
            return copy.state
        compiled, replay = copy.load
        try:
            state = GrammarState(compiled.result(timeout=PASS_TIMEOUT_S), self._info.vocab_size)
        except Exception:  # noqa: BLE001 (its rows are then picked unconstrained)
            log.exception("slot %d: its grammar could not be loaded", slot)
            del self._copies[slot]
            return None
        for t in replay:
            state.accept(t)
        copy.state, copy.load = state, None
        return state

    def _row(self, c: SeqChunk) -> Row | None:
        """The pass's row of late chunk ``c``, which samples output token ``j``: its copy has
        accepted tokens up to ``j - 2`` and the pass accepts ``j - 1`` (recorded when its step
        was answered), or it has ``j - 1`` already (its replay) and the mask is all; None
        when it has no copy in step (an error, said once: the copy goes). Every marked chunk
        is filled, so a copy is never more than one token behind."""
        copy = self._copies.get(c.slot)
        if copy is None or (state := self._made(c.slot, copy)) is None:
            return None
        j = c.output_index
        at = j - 2 if c.follow else j - 1  # the last token the scheduler had applied
        prev = copy.seen.get(at, copy.last if at == copy.count - 1 else -2)
        behind = copy.count == j - 1 and j - 1 in copy.seen
        if not (behind or copy.count == j) or (c.grammar_prev >= 0 and prev != c.grammar_prev):
            log.error("slot %d: the executor's grammar copy is out of step (at %d for token %d, "
                      "the scheduler's last %d, the copy's %d); picked unconstrained", c.slot,
                      copy.count, j, c.grammar_prev, prev)
            del self._copies[c.slot]
            return None
        return Row(state, copy.seen[j - 1] if behind else -1, c.slot, True)
