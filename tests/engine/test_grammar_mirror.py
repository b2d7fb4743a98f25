"""The executor's copies of constrained requests' matchers (``disagg.engine.grammar_mirror``,
the default): driven the way the scheduler and an executor drive them (plans
marked and tracked, steps answered in order, follow steps filled once the step before is
answered, others at launch), every mask the executor fills equals the scheduler's own
matcher's after the same tokens: across overlapped runs, plain steps between them,
a preemption (the copy starts over from a replay, a stale token recorded before it), a
request that ended (its copy goes), a grammar key evicted and defined again, and a copy out of
step (dropped, said, its row picked unconstrained)."""

from __future__ import annotations

import logging
import random

import pytest
import torch

from disagg.engine.constraints import unpack
from disagg.engine.grammar import Grammars
from disagg.engine.grammar_mirror import GrammarMirror, MirrorBook
from disagg.engine.sequence import ScheduledChunk, Sequence, Status
from disagg.model.tokenizer import Tokenizer
from disagg.protocol import SamplingParams
from disagg.protocol.executor import StepPlan
from disagg.protocol.structured import StructuredOutput
from tinymodels import add_byte_bpe_tokenizer, make_tiny_model

pytest.importorskip("xgrammar")

VOCAB = 300
# two grammars that end only on x or yz, which no test samples, and whose masks depend on how
# many characters came before
REGEX = StructuredOutput("regex", "(abcd0123)+(x|yz)")
OTHER = StructuredOutput("regex", "(efgh4567)+(x|yz)")
FREE = StructuredOutput("regex", "[a-d]+(x|yz)")  # any of a-d at every step


@pytest.fixture(scope="module")
def grammars(tmp_path_factory):
    path = make_tiny_model("llama", tmp_path_factory.mktemp("bpe") / "llama")
    add_byte_bpe_tokenizer(path)
    return Grammars(Tokenizer.from_dir(path), VOCAB, (2,))


class Pair:
    """A scheduler (sequences, a ``MirrorBook``) and an executor (a ``GrammarMirror``)."""

    def __init__(self, grammars: Grammars, capacity: int = 256):
        self.book = MirrorBook(grammars.vocab_json, capacity)
        self.mirror = GrammarMirror(2)
        self.grammars = grammars
        self.rng = random.Random(3)
        self.step_id = 0

    def seq(self, slot: int, so: StructuredOutput) -> Sequence:
        s = Sequence(slot, str(slot), [5, 6, 7], SamplingParams(max_tokens=64), 0, slot,
                     grammar=self.grammars.compile(so))
        s.status = Status.RUNNING
        return s

    def plan(self, seqs: list[Sequence], follow: bool) -> StepPlan:
        """One step's plan over ``seqs`` (follow chunks: their token in flight), sent and
        launched; one with no follow chunk has its masks filled at once, checked against the
        scheduler's matchers (``self.masks``)."""
        chunks = [ScheduledChunk(s, s.num_tokens - 1 + follow, 1, True, follow=follow)
                  for s in seqs]
        wires = self.book.mark(chunks, [c.to_wire(late=True) for c in chunks])
        assert all(w.late_mask and not w.allowed for w in wires)  # none filled here
        defs, gone = self.book.take()
        for d in defs:
            self.mirror.define(d)
        plan = StepPlan(self.step_id, wires, len(wires), grammar_gone=gone)
        self.step_id += 1
        self.mirror.track(plan)
        assert self.mirror.ready_at_launch(plan.step_id) is not follow
        self.masks: dict[int, bytes] = {}
        if not follow:
            block = self.mirror.fill(plan.step_id)
            self.masks = {s: bytes(m) for s, m in block.by_slot().items()}
            assert sorted(self.masks) == sorted(s.slot for s in seqs)
            for s in seqs:
                assert self.masks[s.slot] == s.grammar.mask(), s.slot
        return plan

    def sample(self, seqs: list[Sequence], masks: dict[int, bytes] | None = None
               ) -> list[int]:
        """A token each row's mask admits (the scheduler's own mask where none is given), one
        that does not end its grammar (no stop, no x or y)."""
        out = []
        for s in seqs:
            mask = (masks or {}).get(s.slot) or s.grammar.mask()
            words = torch.frombuffer(bytearray(mask), dtype=torch.int32)
            admitted = unpack(words[None], VOCAB)[0].nonzero().flatten().tolist()
            out.append(self.rng.choice([t for t in admitted if t != 2 and not set(
                self.grammars.tok.decode([t], skip_special_tokens=False)) & set("xy")]))
        return out


def apply(seqs: list[Sequence], tokens: list[int]) -> None:
    """The scheduler's update: each matcher accepts its token."""
    for s, t in zip(seqs, tokens, strict=True):
        assert s.grammar.accept(t) and not s.grammar.terminated
        s.output_ids.append(t)


def run_overlapped(p: Pair, seqs: list[Sequence], steps: int, first: StepPlan,
                   first_tokens: list[int]) -> tuple[StepPlan, list[int]]:
    """``steps`` overlapped steps after ``first`` (in flight, its tokens ``first_tokens``):
    each late step is launched, the step before answered, its masks filled and checked
    against the scheduler's matchers after the same tokens, its tokens drawn from them."""
    prev, prev_tokens = first, first_tokens
    for _ in range(steps):
        late = p.plan(seqs, follow=True)  # planned before prev's tokens are applied
        p.mirror.record(prev.step_id, prev_tokens)  # prev answered
        assert p.mirror.owns(late.step_id)
        block = p.mirror.fill(late.step_id)
        apply(seqs, prev_tokens)
        masks = {s: bytes(m) for s, m in block.by_slot().items()}
        assert sorted(masks) == sorted(s.slot for s in seqs)
        for s in seqs:
            assert masks[s.slot] == s.grammar.mask(), s.slot
        prev, prev_tokens = late, p.sample(seqs, masks)
    return prev, prev_tokens


def test_executor_masks_equal_the_schedulers_across_overlap_plain_steps_and_preemption(
        grammars):
    p = Pair(grammars)
    seqs = [p.seq(10, REGEX), p.seq(11, OTHER), p.seq(12, REGEX)]
    first = p.plan(seqs, follow=False)  # the first chunks: replays of nothing
    assert all(c.grammar_replay == [] and c.grammar >= 0 for c in first.chunks)
    assert len({c.grammar for c in first.chunks}) == 2  # one key per compiled grammar
    tokens = p.sample(seqs, p.masks)
    last, tokens = run_overlapped(p, seqs, 5, first, tokens)
    # the overlap breaks: the in-flight step collected, plain steps (filled at launch), then
    # overlapped again
    p.mirror.record(last.step_id, tokens)
    apply(seqs, tokens)
    for _ in range(2):
        plain = p.plan(seqs, follow=False)
        assert all(c.grammar_replay is None and c.grammar_prev == s.output_ids[-1]
                   for c, s in zip(plain.chunks, seqs, strict=True))
        tokens = p.sample(seqs, p.masks)
        p.mirror.record(plain.step_id, tokens)
        apply(seqs, tokens)
    plain = p.plan(seqs, follow=False)
    tokens = p.sample(seqs, p.masks)
    last, tokens = run_overlapped(p, seqs, 3, plain, tokens)
    # (planned before the token then in flight was applied: the one before it)
    assert all(c.grammar_prev == s.output_ids[-2] for c, s in zip(last.chunks, seqs, strict=True))
    # slot 11 is preempted with its token in flight (dropped), slot 12 ends
    p.mirror.record(last.step_id, tokens)
    apply([seqs[0]], [tokens[0]])
    seqs[1].grammar_synced = False  # (BatchScheduler._preempt)
    seqs[2].status = Status.FINISHED
    back = p.plan(seqs[:2], follow=False)
    assert back.grammar_gone == [12] and 12 not in p.mirror._copies
    assert back.chunks[0].grammar_replay is None
    assert back.chunks[1].grammar_replay == seqs[1].output_ids  # without the dropped token
    tokens = p.sample(seqs[:2], {})
    run_overlapped(p, seqs[:2], 4, back, tokens)


def test_an_evicted_grammar_is_dropped_after_its_plan_and_defined_again(grammars):
    """With room for one grammar, a plan naming two keeps both for its own chunks (the first
    is dropped with the next definition); a request whose grammar was evicted gets a new key,
    defined again, when its copy starts over."""
    p = Pair(grammars, capacity=1)
    a, b = p.seq(1, REGEX), p.seq(2, OTHER)
    first = p.plan([a, b], follow=False)
    key_a, key_b = (c.grammar for c in first.chunks)
    assert {key_a, key_b} <= set(p.mirror._compiled) and {1, 2} <= set(p.mirror._copies)
    tokens = p.sample([a, b], {})
    last, tokens = run_overlapped(p, [a, b], 2, first, tokens)
    p.mirror.record(last.step_id, tokens)
    apply([a, b], tokens)
    a.grammar_synced = False
    again = p.plan([a, b], follow=False)
    assert again.chunks[0].grammar not in (key_a, key_b)  # a new key, defined again
    assert again.chunks[1].grammar == key_b
    assert key_a not in p.mirror._compiled  # dropped with that definition
    assert {again.chunks[0].grammar, key_b} <= set(p.mirror._compiled)
    tokens = p.sample([a, b], {})
    run_overlapped(p, [a, b], 2, again, tokens)


def test_a_copy_out_of_step_is_dropped_and_its_row_left_unconstrained(grammars, caplog):
    p = Pair(grammars)
    seqs = [p.seq(20, FREE), p.seq(21, FREE)]
    first = p.plan(seqs, follow=False)
    tokens = p.sample(seqs, {})
    last, tokens = run_overlapped(p, seqs, 2, first, tokens)
    late = p.plan(seqs, follow=True)
    c, d, a = (grammars.tok.encode(ch)[0] for ch in "cda")
    wrong = list(tokens)
    wrong[1] = c if tokens[1] != c else d
    p.mirror.record(last.step_id, wrong)  # not what the scheduler will apply
    p.mirror.fill(late.step_id)
    apply(seqs, tokens)
    nxt = p.plan(seqs, follow=True)
    p.mirror.record(late.step_id, [a, a])
    with caplog.at_level(logging.ERROR):
        block = p.mirror.fill(nxt.step_id)
    assert block.slots == [20] and "slot 21" in caplog.text and "out of step" in caplog.text
    assert 21 not in p.mirror._copies


def test_definitions_load_off_the_step_loop_and_a_bad_one_leaves_its_rows_free(
        grammars, monkeypatch, caplog):
    """A grammar's definition is deserialized on the mirror's loader thread: defining it and
    launching the plan that starts its copies return while it still loads, and the first
    fill waits for it (the masks as the scheduler's). A definition that cannot be loaded
    leaves its requests' rows unconstrained (said), the others filled."""
    import threading

    import msgspec

    gate, loaded = threading.Event(), []
    load = GrammarMirror._load

    def slow(self, d):
        gate.wait(10)
        loaded.append(threading.current_thread().name)
        return load(self, d)

    monkeypatch.setattr(GrammarMirror, "_load", slow)
    p = Pair(grammars)
    a, b = p.seq(30, REGEX), p.seq(31, OTHER)
    chunks = [ScheduledChunk(s, s.num_tokens - 1, 1, True) for s in (a, b)]
    wires = p.book.mark(chunks, [c.to_wire(late=True) for c in chunks])
    defs, _ = p.book.take()
    defs[1] = msgspec.structs.replace(defs[1], compiled=b"{not a grammar")
    for d in defs:
        p.mirror.define(d)
    plan = StepPlan(0, wires, len(wires))
    p.mirror.track(plan)
    assert loaded == []  # both still loading: nothing waited for them
    gate.set()
    with caplog.at_level(logging.ERROR):
        block = p.mirror.fill(plan.step_id)
    assert loaded and all(n.startswith("grammar-define") for n in loaded)
    assert block.slots == [30] and bytes(block.by_slot()[30]) == a.grammar.mask()
    assert "slot 31: its grammar could not be loaded" in caplog.text
    assert 31 not in p.mirror._copies
    p.mirror.close()
