"""The intake's side of constrained decoding (``ClientIntake`` with ``Grammars``): a request's
constraint is compiled off the event loop before the request goes live with its matcher; a
constraint that fails, compiles too slowly or cannot be served here is refused naming its
parameter, and the intake keeps admitting."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading

import pytest

import disagg.actors.scheduler.intake as intake_mod
from disagg.engine.grammar import GrammarError
from disagg.protocol import Error, GenerateRequest, SamplingParams
from disagg.protocol.inproc import FromClient
from disagg.protocol.structured import StructuredOutput

from .test_intake import FakeScheduler

GOOD = StructuredOutput("regex", "a+", param="guided_regex")
BAD = StructuredOutput("regex", "(((", param="guided_regex")
SLOW = StructuredOutput("regex", "b+", param="response_format")


class FakeGrammars:
    """Compiles GOOD to a token, raises for BAD, blocks on ``gate`` for SLOW."""

    def __init__(self, refuse: str | None = None):
        self.threads = concurrent.futures.ThreadPoolExecutor(2)
        self.gate = threading.Event()
        self.refuse = refuse

    def unavailable(self, param: str) -> str | None:
        return None if self.refuse is None else f"{param}: {self.refuse}"

    def compile(self, so: StructuredOutput) -> object:
        if so == BAD:
            raise GrammarError(f"{so.param}: invalid regex: the parenthesis is not closed")
        if so == SLOW:
            self.gate.wait(10)
        return ("matcher", so.spec)


def scheduler(grammars) -> FakeScheduler:
    s = FakeScheduler()
    s.intake.grammars = grammars
    return s


async def constrained(s: FakeScheduler, rid: str, so: StructuredOutput) -> None:
    req = GenerateRequest(rid, prompt_token_ids=[1, 2], sampling=SamplingParams(structured=so))
    await s.intake.handle(FromClient.of(b"a", req))
    await asyncio.gather(*s.tasks)


async def test_compiled_then_live_with_its_matcher_and_bad_ones_named() -> None:
    s = scheduler(FakeGrammars())
    await constrained(s, "ok", GOOD)
    assert s.live[(b"a", "ok")].grammar == ("matcher", "a+")
    await constrained(s, "bad", BAD)
    (err,) = s.replies(b"a")
    assert isinstance(err, Error) and err.code == "bad_request"
    assert err.message.startswith("guided_regex: invalid regex")
    assert (b"a", "bad") not in s.live and not s.intake.tokenizing
    assert s.counters.errored == 1 and s.counters.started == 2
    await constrained(s, "ok2", GOOD)  # still admitting
    assert (b"a", "ok2") in s.live


async def test_a_slow_compile_is_refused_and_the_loop_never_waited(monkeypatch) -> None:
    monkeypatch.setattr(intake_mod, "COMPILE_TIMEOUT_S", 0.05)
    g = FakeGrammars()
    s = scheduler(g)
    await constrained(s, "slow", SLOW)
    g.gate.set()
    (err,) = s.replies(b"a")
    assert isinstance(err, Error) and err.code == "bad_request"
    assert "response_format: compiling" in err.message and (b"a", "slow") not in s.live


@pytest.mark.parametrize("grammars, needle", [
    (None, "does not sample"),
    (FakeGrammars(refuse="not served with speculative decoding"), "speculative"),
])
async def test_unservable_constraints_are_refused_by_name(grammars, needle) -> None:
    s = scheduler(grammars)
    await constrained(s, "r", GOOD)
    (err,) = s.replies(b"a")
    assert isinstance(err, Error) and err.code == "bad_request"
    assert err.message.startswith("guided_regex:") and needle in err.message
    assert s.counters.rejected == 1 and not s.live
