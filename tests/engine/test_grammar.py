"""Grammar-constrained decoding (disagg.engine.grammar, .constraints) in the in-process engine
on a tiny random llama with a byte-level BPE tokenizer: greedy token-exact with transformers
where the constraint admits the greedy tokens, 100 schema-constrained outputs that all parse
and validate, the same tokens with overlapped decoding, and constraints refused by name."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest
import torch

from disagg.engine.constraints import apply_masks, unpack
from disagg.engine.grammar import GrammarError, Grammars
from disagg.llm import LLM
from disagg.model.loader import load_model
from disagg.model.tokenizer import Tokenizer
from disagg.protocol import SamplingParams
from disagg.protocol.executor import SeqChunk
from disagg.protocol.structured import StructuredOutput
from tinymodels import add_byte_bpe_tokenizer, hf_greedy, make_tiny_model

pytest.importorskip("xgrammar")


@pytest.fixture(scope="module")
def bpe_llama(tmp_path_factory):
    path = make_tiny_model("llama", tmp_path_factory.mktemp("bpe") / "llama")
    add_byte_bpe_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def tok(bpe_llama):
    return Tokenizer.from_dir(bpe_llama)


@pytest.fixture(scope="module")
def model(bpe_llama):
    return load_model(bpe_llama)


def test_unpack_and_masks_on_logits():
    words = torch.tensor([[0b101, 0], [-1, 1]], dtype=torch.int32)
    bits = unpack(words, 40)
    assert bits[0].nonzero().flatten().tolist() == [0, 2]
    assert bits[1].nonzero().flatten().tolist() == list(range(33))
    logits = torch.zeros(2, 40)
    mask = torch.tensor([1 << 7, 0], dtype=torch.int32).numpy().tobytes()
    chunks = [SeqChunk(0, [1], 0, [0], True), SeqChunk(1, [1], 0, [0], True, allowed=mask)]
    assert apply_masks(logits, chunks)
    assert torch.isfinite(logits[0]).all()
    assert torch.isfinite(logits[1]).nonzero().flatten().tolist() == [7]
    with pytest.raises(ValueError, match="grammar mask"):
        apply_masks(logits, [SeqChunk(1, [1], 0, [0], True, allowed=b"\0" * 4)])


def test_greedy_parity_when_the_constraint_admits_the_greedy_tokens(bpe_llama, model, tok):
    llm = LLM(model, tokenizer=tok)
    prompts = [[p, p + 1, 7] for p in range(3, 300)]
    free = llm.generate(prompts, SamplingParams(max_tokens=6, ignore_eos=True))

    def printable(ids):
        text = tok.decode(ids, skip_special_tokens=False)
        return text.isascii() and text.isprintable() and tok.encode(text) == ids

    # a prompt whose greedy output is printable text (random weights mostly emit odd bytes)
    i = next(i for i, o in enumerate(free) if printable(o.token_ids))
    prompt, want = prompts[i], free[i].token_ids
    assert hf_greedy(bpe_llama, prompt, 6) == want
    text = tok.decode(want)
    # a choice admitting exactly the greedy text (and a longer one, so it cannot end there)
    so = StructuredOutput("choice", choices=[text, text + "zz"], param="guided_choice")
    got = llm.generate([prompt], SamplingParams(max_tokens=6, structured=so))[0]
    assert got.token_ids == want
    # a constraint excluding the greedy first token changes it, and ends with its grammar
    other = "q" if not text.startswith("q") else "w"
    so = StructuredOutput("choice", choices=[other * 3], param="guided_choice")
    got = llm.generate([prompt], SamplingParams(max_tokens=12, structured=so))[0]
    assert tok.decode(got.token_ids) == other * 3 and got.finish_reason == "stop"


def _schema(rng: random.Random, depth: int = 0) -> dict:
    """A finite JSON schema: nested objects, enums, bounded integers, patterned strings,
    bounded arrays, booleans; every object closed (additionalProperties false)."""
    kinds = ["enum", "int", "str", "bool", "array"] + (["object"] if depth < 2 else [])
    props = {}
    for i in range(rng.randint(1, 3)):
        k = rng.choice(kinds)
        if k == "enum":
            props[f"e{i}"] = {"enum": rng.sample(["red", "green", "blue", 1, None, True], 3)}
        elif k == "int":
            props[f"i{i}"] = {"type": "integer", "minimum": -5, "maximum": rng.randint(0, 300)}
        elif k == "str":
            props[f"s{i}"] = {"type": "string", "pattern": "^[a-z]{1,6}$"}
        elif k == "bool":
            props[f"b{i}"] = {"type": "boolean"}
        elif k == "array":
            props[f"a{i}"] = {"type": "array", "items": {"enum": ["x", "y", 3]},
                              "minItems": 1, "maxItems": 3}
        else:
            props[f"o{i}"] = _schema(rng, depth + 1)
    return {"type": "object", "properties": props, "required": sorted(props),
            "additionalProperties": False}


def test_100_schema_constrained_outputs_parse_and_validate(model, tok):
    rng = random.Random(0)
    schemas = [_schema(rng) for _ in range(100)]
    params = [SamplingParams(max_tokens=400, temperature=(0.0 if i % 4 == 0 else 1.0), seed=i,
                             structured=StructuredOutput("json", json.dumps(s)))
              for i, s in enumerate(schemas)]
    prompts = [[3 + i % 50, 7, 9 + i % 13] for i in range(100)]
    outs = LLM(model, num_pages=1024, tokenizer=tok).generate(prompts, params)
    for schema, out in zip(schemas, outs, strict=True):
        assert out.finish_reason == "stop", tok.decode(out.token_ids)
        value = json.loads(tok.decode(out.token_ids))
        jsonschema.validate(value, schema)


def test_overlapped_decoding_gives_the_same_tokens(model, tok):
    so = StructuredOutput("regex", "[a-c]{3,9}x")
    params = [SamplingParams(max_tokens=20, temperature=1.0, seed=1, structured=so),
              SamplingParams(max_tokens=20, ignore_eos=True),
              SamplingParams(max_tokens=20, seed=2, temperature=1.0, ignore_eos=True),
              SamplingParams(max_tokens=20, structured=StructuredOutput("json_object"))]
    prompts = [[5, 6], [7, 8, 9], [10], [11, 12]]
    plain = LLM(model, tokenizer=tok).generate(prompts, params)
    over = LLM(model, tokenizer=tok, overlap=True)
    got = over.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in plain]
    assert over.core.steps_ahead > 0
    text = tok.decode(got[0].token_ids)
    assert text.endswith("x") and set(text[:-1]) <= set("abc")


def test_a_batch_of_constrained_rows_only_overlaps_with_late_masks(model, tok):
    """Every row constrained (greedy, sampled, with a penalty): each step is launched before
    the tokens its masks need are back, the masks follow it (``SeqChunk.late_mask``), and the
    tokens are those of the plain schedule."""
    params = [SamplingParams(max_tokens=30, temperature=1.0, seed=7,
                             structured=StructuredOutput("regex", "[a-z]{5,25}\\.")),
              SamplingParams(max_tokens=30, structured=StructuredOutput("json_object")),
              SamplingParams(max_tokens=30, temperature=0.8, seed=8, presence_penalty=1.5,
                             structured=StructuredOutput("choice", choices=["yes", "no"]))]
    prompts = [[5, 6], [7, 8, 9], [10]]
    plain = LLM(model, tokenizer=tok).generate(prompts, params)
    over = LLM(model, tokenizer=tok, overlap=True)
    got = over.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in plain]
    assert over.core.steps_ahead >= 5  # not one step ahead of a constrained row before
    text = tok.decode(got[0].token_ids)
    assert text.endswith(".") and text[:-1].isalpha()
    assert tok.decode(got[2].token_ids) in ("yes", "no")


@pytest.mark.parametrize("so, needle", [
    (StructuredOutput("json", '{"type": "nonsense"}', param="response_format"),
     "response_format: invalid JSON schema"),
    (StructuredOutput("json", "{not json", param="guided_json"), "guided_json: the JSON schema"),
    (StructuredOutput("regex", "(((", param="guided_regex"), "guided_regex: invalid regex"),
    (StructuredOutput("grammar", "root ::= foo", param="guided_grammar"),
     "guided_grammar: invalid grammar"),
    (StructuredOutput("choice", choices=[], param="guided_choice"), "guided_choice"),
    # valid, but admitting no output at all: refused, not run to max_tokens
    (StructuredOutput("regex", r"[^\s\S]", param="guided_regex"),
     "guided_regex: the regex constraint admits no output"),
    (StructuredOutput("grammar", r"root ::= [^\x00-\U0010FFFF]", param="guided_grammar"),
     "guided_grammar: the grammar constraint admits no output"),
    (StructuredOutput("xml", "x", param="structured_outputs"), "structured_outputs"),
])
def test_bad_constraints_are_refused_by_name(tok, so, needle):
    grammars = Grammars(tok, 320, (2,))
    with pytest.raises(GrammarError, match=needle):
        grammars.compile(so)
    good = grammars.compile(StructuredOutput("json_object"))  # still serving
    assert good.mask()


def test_unavailable_is_said_by_name(tok):
    assert "speculative" in Grammars(tok, 320, (2,), refuse="not with speculative decoding"
                                     ).unavailable("response_format")
    assert "no tokenizer" in Grammars(None, 320, (2,)).unavailable("guided_json")
    assert Grammars(tok, 320, (2,)).unavailable("guided_json") is None


def test_compiled_grammars_are_cached(tok):
    grammars = Grammars(tok, 320, (2,))
    so = StructuredOutput("json", '{"type": "integer"}')
    a, b = grammars.compile(so), grammars.compile(so)
    assert a is not b and len(grammars._cache) == 1
    assert a.mask() == b.mask()


@pytest.mark.parametrize("threads, inline", [(1, False), (1, True), (3, False), (3, True)])
def test_grammar_pass_accepts_and_fills_each_rows_own_mask(tok, threads, inline):
    """``GrammarPass`` (the late masks of a decode step, on threads): each row's token is
    accepted as ``accept`` would, the masks asked for are each matcher's own after it, in one
    block by slot, a row whose grammar ended with its token has none, and the update's
    ``accept`` of that token then takes it without feeding it again. ``inline`` (``run``):
    the calling thread takes a share of the rows too."""
    from disagg.engine.grammar_pass import GrammarPass, Row

    g = Grammars(tok, 300, (2,))
    sos = [StructuredOutput("regex", "[a-d]{2,6}(x|yz)")] * 5 + [StructuredOutput("json_object")] * 3
    ahead, step = [g.compile(so) for so in sos], [g.compile(so) for so in sos]
    gp = GrammarPass(threads)
    rng, ended = random.Random(4), 0
    for _ in range(12):
        live = [i for i, s in enumerate(step) if not s.terminated]
        if not live:
            break
        picks = {}
        for i in live:
            words = torch.frombuffer(bytearray(step[i].mask()), dtype=torch.int32)
            admitted = unpack(words[None], 300)[0].nonzero().flatten().tolist()
            picks[i] = 2 if 2 in admitted and rng.random() < 0.3 else rng.choice(admitted)
        rows = [Row(ahead[i], picks[i], 10 + i, mask=i % 4 != 1) for i in live]
        block = gp.run(rows) if inline else gp.submit(rows).masks.result(timeout=10)
        for i in live:  # the reference: one by one
            assert step[i].accept(picks[i])
        want = [i for i in live if i % 4 != 1 and not step[i].terminated]
        ended += sum(i % 4 != 1 and step[i].terminated for i in live)
        assert block.slots == [10 + i for i in want]
        masks = block.by_slot()
        for i in want:
            assert bytes(masks[10 + i]) == step[i].mask()
        for i in live:
            assert ahead[i]._ahead == (picks[i], True)
            assert ahead[i].terminated == step[i].terminated  # as the pass's thread saw it
            assert ahead[i].accept(picks[i]) and ahead[i]._ahead is None  # taken, not fed
            assert ahead[i].terminated == step[i].terminated
    assert ended  # some row asking for a mask ended with its token (EOS)
    s = g.compile(sos[0])  # the pass says the tokens are accepted before the masks are filled
    words = torch.frombuffer(bytearray(s.mask()), dtype=torch.int32)
    first = unpack(words[None], 300)[0].nonzero().flatten().tolist()[0]
    p = gp.submit([Row(s, first, 0, mask=True)])
    p.masks.result(timeout=10)
    assert p.accepted.done() and s._ahead == (first, True) and not s.terminated
    with pytest.raises(RuntimeError, match="accepted ahead"):
        s = g.compile(sos[-1])
        s.accepted_ahead(ord("{"), True)
        s.accept(ord("["))
    gp.close()


def test_grammar_pass_run_takes_a_share_in_the_calling_thread(tok, monkeypatch):
    """``run`` (an executor waiting for its own masks): the waiting thread fills one of the
    shares, the pool's threads the others (as many shares as threads in all)."""
    import threading

    from disagg.engine.grammar_pass import GrammarPass, Row

    g = Grammars(tok, 300, (2,))
    gp = GrammarPass(3)
    seen: list[tuple[str, int]] = []
    work = GrammarPass._work
    monkeypatch.setattr(GrammarPass, "_work", lambda self, share, *a: (
        seen.append((threading.current_thread().name, len(share))), work(self, share, *a))[1])
    states = [g.compile(StructuredOutput("regex", "[a-d]{2,6}x")) for _ in range(6)]
    block = gp.run([Row(s, -1, i, mask=True) for i, s in enumerate(states)])  # masks alone
    assert block.slots == list(range(6))
    assert sorted(n for _, n in seen) == [2, 2, 2]
    assert threading.current_thread().name in [name for name, _ in seen]
    gp.close()


@pytest.mark.parametrize("threads", [1, 3])
def test_grammar_pass_fill_gives_each_states_own_mask(tok, threads):
    """``GrammarPass.fill`` (a step with no token in flight): row ``i`` of the block is what
    ``states[i]`` admits next, as ``GrammarState.mask`` one by one, matchers left where they
    were."""
    from disagg.engine.grammar_pass import GrammarPass

    g = Grammars(tok, 300, (2,))
    sos = [StructuredOutput("regex", "[a-d]{2,6}(x|yz)"), StructuredOutput("json_object"),
           StructuredOutput("regex", "(yes|no)"), StructuredOutput("json", '{"type": "integer"}')]
    states = [g.compile(sos[i % 4]) for i in range(7)]
    [a], [y] = tok.encode("a"), tok.encode("y")
    assert states[0].accept(a) and states[2].accept(y) and states[4].accept(a)
    gp = GrammarPass(threads)
    want = [st.mask() for st in states]
    assert len(set(want)) > 3  # rows differ: a row's mask in another's place would show
    block = gp.fill(states)
    assert block.slots == list(range(7)) and block.row_bytes == len(want[0])
    masks = block.by_slot()
    assert [bytes(masks[i]) for i in range(7)] == want
    assert [st.mask() for st in states] == want  # filling did not advance them
    assert gp.fill([]).slots == []
    gp.close()


def test_a_step_fills_its_constrained_rows_masks_in_one_pass(tok):
    """A step that is not overlapped (new constrained requests' first step) fills the masks of
    its constrained rows together through the core's grammar pass, each chunk getting the
    same ``allowed`` bytes it would have filled alone; a step with one such row fills it
    itself."""
    from disagg.engine.cache import PagePool
    from disagg.engine.core import EngineCore, Run
    from disagg.engine.grammar_pass import GrammarPass
    from disagg.engine.scheduling import BatchScheduler, Sequence

    class Counting(GrammarPass):
        def __init__(self) -> None:
            super().__init__(3)
            self.filled: list[int] = []

        def fill(self, states):
            self.filled.append(len(states))
            return super().fill(states)

    g = Grammars(tok, 300, (2,))
    sos = [StructuredOutput("regex", "[a-d]{2,6}(x|yz)"), None, StructuredOutput("json_object"),
           StructuredOutput("regex", "(yes|no)"), StructuredOutput("json", '{"type": "integer"}')]

    def step_of(kinds: list) -> list:
        sched = BatchScheduler(PagePool(64), 4, 64, 8, 256, (2,))
        for i, so in enumerate(kinds):
            q = Sequence(i, f"r{i}", [10 + i, 11, 12], SamplingParams(max_tokens=8, structured=so),
                         seed=i, arrival=i)
            q.grammar = g.compile(so) if so is not None else None
            sched.add(q)
        core = EngineCore(sched, grammar=Counting())
        cmd = core.next()
        assert isinstance(cmd, Run)
        return [cmd.step.plan.chunks, core.grammar.filled]

    chunks, filled = step_of(sos)
    assert filled == [4]  # the four constrained rows, in one pass
    assert [c.allowed for c in chunks] == [g.compile(so).mask() if so else b"" for so in sos]
    chunks, filled = step_of(sos[:2])
    assert filled == [] and chunks[0].allowed == g.compile(sos[0]).mask()


def test_late_masks_cover_the_constrained_follow_rows_still_running(tok):
    """The step built ahead gives every row a follow chunk; constrained ones go ``late_mask``
    and get their mask once the token before is back (its grammar pass), except a row whose
    request ended in the meantime (aborted here): it has none (picked unconstrained, its token
    dropped)."""
    from disagg.engine.cache import PagePool
    from disagg.engine.grammar_pass import GrammarPass
    from disagg.engine.scheduling import BatchScheduler, Sequence, Status

    s = BatchScheduler(PagePool(64), 4, 16, 8, 256, (2,))
    g = Grammars(tok, 300, (2,))
    so = StructuredOutput("regex", "[a-d]{4,12}")
    seqs = [Sequence(i, f"r{i}", [10 + i, 11, 12], SamplingParams(max_tokens=20, structured=so
                                                                  if i < 2 else None),
                     seed=i, arrival=i) for i in range(3)]
    for q in seqs:
        q.grammar = g.compile(so) if q.params.structured else None
        s.add(q)
    first = s.schedule()
    assert first is not None
    [a], [b] = tok.encode("a"), tok.encode("b")
    s.update(first, [a for _ in first.chunks])
    batch = s.schedule()
    assert batch is not None and s.can_defer(batch)  # constrained rows only or not: deferred
    ahead = s.schedule_ahead(batch)
    assert ahead is not None
    wires = {c.seq.slot: c.to_wire() for c in ahead.chunks}
    assert wires[0].late_mask and wires[1].late_mask and not wires[2].late_mask
    assert not any(w.allowed for w in wires.values())
    assert s.grammar_rows(first, batch, [a, a, a]) is None  # not a step built ahead
    seqs[1].status = Status.FINISHED  # its request ended while the step was in flight
    rows = s.grammar_rows(batch, ahead, [b, b, 50])
    assert rows is not None and [(r.slot, r.token, r.mask) for r in rows] == [(0, b, True)]
    block = GrammarPass(2).run(rows)
    assert block.slots == [0]
    s.update(batch, [b, b, 50])  # the token accepted ahead is taken, not fed again
    assert seqs[0].output_ids == [a, b] and not seqs[0].grammar.terminated
    ref = g.compile(so)
    assert ref.accept(a) and ref.accept(b)
    assert bytes(block.by_slot()[0]) == ref.mask() == seqs[0].grammar.mask()


def test_grammar_threads_flag_sizes_the_pass():
    from disagg.cli.node import build_parser, config_from_args
    from disagg.config import ConfigError
    from disagg.engine.grammar_pass import GrammarPass, default_threads

    cfg = config_from_args(build_parser().parse_args(["--grammar-threads", "3"]))
    assert cfg.scheduler.grammar_threads == 3
    assert GrammarPass(cfg.scheduler.grammar_threads).threads == 3
    assert GrammarPass(0).threads == default_threads() >= 1
    with pytest.raises(ConfigError, match="--grammar-threads"):
        config_from_args(build_parser().parse_args(["--grammar-threads", "-1"]))
