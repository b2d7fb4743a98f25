"""The intake's side of constrained decoding (``ClientIntake`` with ``Grammars``): a request's
constraint is compiled off the event loop before the request goes live with its matcher; a
constraint that fails, compiles too slowly or cannot be served here is refused naming its
parameter, and the intake keeps admitting. Compiles are shared by identical constraints, fair
between tenants, and one past its time neither holds a slot nor is lost (``compile_bounded``);
a slow compile here is one ``Grammars._compile`` holds on an event, never a slow schema."""

from __future__ import annotations

import asyncio
import collections
import threading
from collections.abc import Callable, Iterator

import pytest

import disagg.engine.grammar as grammar_mod
from disagg.engine.grammar import Grammars, GrammarState
from disagg.model.tokenizer import Tokenizer
from disagg.protocol import Error, GenerateRequest, SamplingParams
from disagg.protocol.inproc import FromClient
from disagg.protocol.structured import StructuredOutput
from tinymodels import add_byte_bpe_tokenizer

from .test_intake import FakeScheduler

pytest.importorskip("xgrammar")

GOOD = StructuredOutput("regex", "a+", param="guided_regex")
BAD = StructuredOutput("regex", "(((", param="guided_regex")
SLOW = StructuredOutput("regex", "b+", param="response_format")
LONG = 30.0  # a compile time bound no test reaches


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Tokenizer:
    path = tmp_path_factory.mktemp("tok")
    add_byte_bpe_tokenizer(path)
    return Tokenizer.from_dir(path)


class Gate:
    """``Grammars._compile`` patched: it counts compiles by spec and holds those of ``slow``
    until ``open`` is set."""

    def __init__(self) -> None:
        self.slow: set[str] = set()
        self.open = threading.Event()
        self.compiles: collections.Counter[str] = collections.Counter()


@pytest.fixture
def gate(monkeypatch) -> Iterator[Gate]:
    gate, real = Gate(), Grammars._compile

    def compile(self, compiler, so):
        gate.compiles[so.spec] += 1
        if so.spec in gate.slow:
            gate.open.wait(LONG)
        return real(self, compiler, so)

    monkeypatch.setattr(Grammars, "_compile", compile)
    yield gate
    gate.open.set()  # no thread left held


def scheduler(grammars: Grammars | None) -> FakeScheduler:
    s = FakeScheduler()
    s.intake.grammars = grammars
    return s


async def send(s: FakeScheduler, who: bytes, rid: str, so: StructuredOutput,
               wait: bool = True, salt: str | None = None) -> None:
    """``who``'s request (its own tenant) constrained by ``so``, with cache salt ``salt``;
    ``wait``: until it is live or refused."""
    req = GenerateRequest(rid, prompt_token_ids=[1, 2], sampling=SamplingParams(structured=so),
                          cache_salt=salt)
    spawned = len(s.tasks)
    await s.intake.handle(FromClient.of(who, req))
    if wait and len(s.tasks) > spawned:  # its compile is under way
        await s.tasks[-1]


async def until(cond: Callable[[], bool]) -> None:
    for _ in range(int(LONG / 0.01)):
        if cond():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("never came")


async def settled(s: FakeScheduler, g: Grammars, gate: Gate) -> None:
    """Every request answered and every compile ended (none left to a closed loop)."""
    gate.open.set()
    await asyncio.gather(*s.tasks)
    await until(lambda: not g._running)


def refusal(s: FakeScheduler, who: bytes) -> Error:
    """``who``'s last reply, an Error."""
    err = s.replies(who)[-1]
    assert isinstance(err, Error)
    return err


async def test_compiled_then_live_with_its_matcher_and_bad_ones_named(tok, gate) -> None:
    g = Grammars(tok, 320, (2,))
    s = scheduler(g)
    await send(s, b"a", "ok", GOOD)
    assert isinstance(s.live[(b"a", "ok")].grammar, GrammarState)
    await send(s, b"a", "bad", BAD)
    err = refusal(s, b"a")
    assert err.code == "bad_request" and err.message.startswith("guided_regex: invalid regex")
    assert (b"a", "bad") not in s.live and not s.intake.tokenizing
    assert s.counters.errored == 1 and s.counters.started == 2
    await send(s, b"a", "ok2", GOOD)  # still admitting
    assert (b"a", "ok2") in s.live


async def test_a_slow_compile_is_refused_and_its_result_cached_when_it_ends(tok, gate,
                                                                             monkeypatch) -> None:
    monkeypatch.setattr(grammar_mod, "COMPILE_TIMEOUT_S", 0.05)
    g = Grammars(tok, 320, (2,))
    s = scheduler(g)
    gate.slow.add(SLOW.spec)
    await send(s, b"a", "slow", SLOW)  # its own timeout: the compile goes on
    err = refusal(s, b"a")
    assert err.code == "bad_request" and (b"a", "slow") not in s.live
    assert err.message.startswith("response_format: compiling the regex constraint took")
    await settled(s, g, gate)
    assert ("", SLOW.key()) in g._cache and not g._past and not g._within
    monkeypatch.setattr(grammar_mod, "COMPILE_TIMEOUT_S", LONG)
    await send(s, b"a", "again", SLOW)  # from the cache
    assert (b"a", "again") in s.live and gate.compiles[SLOW.spec] == 1


async def test_identical_constraints_at_once_compile_once(tok, gate) -> None:
    g = Grammars(tok, 320, (2,))
    s = scheduler(g)
    gate.slow.add(SLOW.spec)
    for who, rid in [(b"a", "0"), (b"a", "1"), (b"b", "0"), (b"c", "0")]:  # n = 2, and others
        await send(s, who, rid, SLOW, wait=False)
    await until(lambda: gate.compiles[SLOW.spec] == 1 and len(s.intake.tokenizing) == 4)
    await settled(s, g, gate)
    assert len(s.live) == 4 and gate.compiles[SLOW.spec] == 1


async def test_differently_salted_requests_share_no_compile(tok, gate, monkeypatch) -> None:
    """A constraint found compiled (or compiling, or refused as slow) would tell a request
    that another client sent it: salted like the prefix cache, only the same salt shares."""
    g = Grammars(tok, 320, (2,))
    s = scheduler(g)
    await send(s, b"a", "0", GOOD, salt="tenant:a")
    await send(s, b"b", "0", GOOD, salt="tenant:b")  # the same constraint: compiled afresh
    await send(s, b"c", "0", GOOD, salt="tenant:a")  # a's salt: a's compile
    await send(s, b"d", "0", GOOD)  # unsalted: its own
    await send(s, b"e", "0", GOOD)
    assert gate.compiles[GOOD.spec] == 3 and len(s.live) == 5
    assert set(g._cache) == {("tenant:a", GOOD.key()), ("tenant:b", GOOD.key()), ("", GOOD.key())}
    # one salt's slow compile past its time neither refuses nor serves another salt's
    monkeypatch.setattr(grammar_mod, "COMPILE_TIMEOUT_S", 0.05)
    gate.slow.add(SLOW.spec)
    await send(s, b"a", "slow", SLOW, salt="tenant:a")
    assert refusal(s, b"a").message.startswith("response_format: compiling")
    # (the compile's own timer, started after the request's, marks it past a moment later)
    await until(lambda: g._past == {("tenant:a", SLOW.key())})
    monkeypatch.setattr(grammar_mod, "COMPILE_TIMEOUT_S", LONG)
    await send(s, b"b", "slow", SLOW, salt="tenant:b", wait=False)
    await until(lambda: gate.compiles[SLOW.spec] == 2)  # b's own compile, not a's refusal
    await settled(s, g, gate)
    assert (b"b", "slow") in s.live and (b"a", "slow") not in s.live


async def test_one_tenants_slow_compiles_do_not_starve_another_tenant(tok, gate,
                                                                      monkeypatch) -> None:
    monkeypatch.setattr(grammar_mod, "MAX_STUCK", 3)
    monkeypatch.setattr(grammar_mod, "COMPILE_TIMEOUT_S", 0.01)
    g = Grammars(tok, 320, (2,))
    s = scheduler(g)
    slow = [StructuredOutput("regex", f"{c}+", param="guided_regex") for c in "bcde"]
    gate.slow.update(so.spec for so in slow)
    for n, so in enumerate(slow[:2]):  # two past their time, still compiling
        await send(s, b"a", f"stuck{n}", so)
        await until(lambda n=n: len(g._past) == n + 1)
    monkeypatch.setattr(grammar_mod, "COMPILE_TIMEOUT_S", LONG)
    await send(s, b"a", "slow2", slow[2], wait=False)  # holds a's slot
    await send(s, b"a", "slow3", slow[3], wait=False)  # waits: a has its share
    await until(lambda: g._within[b"a"] == 1 and len(g._waiting) == 1)
    await send(s, b"b", "ok", GOOD)  # another tenant's compiles at once, served
    assert isinstance(s.live[(b"b", "ok")].grammar, GrammarState)
    assert not gate.open.is_set() and len(g._past) == 2
    await settled(s, g, gate)
    assert {(b"a", "slow2"), (b"a", "slow3")} <= set(s.live)
    assert all(("", so.key()) in g._cache for so in slow)


async def test_past_max_stuck_an_uncached_constraint_is_refused_at_once(tok, gate,
                                                                        monkeypatch) -> None:
    monkeypatch.setattr(grammar_mod, "MAX_STUCK", 1)
    g = Grammars(tok, 320, (2,))
    s = scheduler(g)
    await send(s, b"b", "warm", GOOD)  # cached
    gate.slow.add(SLOW.spec)
    monkeypatch.setattr(grammar_mod, "COMPILE_TIMEOUT_S", 0.01)
    await send(s, b"a", "stuck", SLOW)
    await until(lambda: len(g._past) == 1)
    monkeypatch.setattr(grammar_mod, "COMPILE_TIMEOUT_S", LONG)
    await send(s, b"b", "new", BAD)  # any uncached one: refused before compiling
    err = refusal(s, b"b")
    assert err.code == "overloaded" and err.message.startswith("guided_regex: not compiled")
    assert "busy compiling slow constraints (1 past 30 s); try again later" in err.message
    await send(s, b"a", "same", SLOW)  # the stuck one itself: too slow, at once
    assert "took longer than" in refusal(s, b"a").message
    await send(s, b"b", "cached", GOOD)  # still served
    assert (b"b", "cached") in s.live and not gate.open.is_set()
    assert gate.compiles[BAD.spec] == 0
    await settled(s, g, gate)


@pytest.mark.parametrize("refuse, needle", [
    (None, "does not sample"),
    ("not served with speculative decoding", "speculative"),
])
async def test_unservable_constraints_are_refused_by_name(tok, refuse, needle) -> None:
    s = scheduler(None if refuse is None else Grammars(tok, 320, (2,), refuse=refuse))
    await send(s, b"a", "r", GOOD)
    err = refusal(s, b"a")
    assert err.code == "bad_request"
    assert err.message.startswith("guided_regex:") and needle in err.message
    assert s.counters.rejected == 1 and not s.live
