"""Constrained output under churn, over the client protocol: 24 clients at once on a small pool
(preemptions), greedy and seeded-sampled rows, JSON schemas, regexes and choices side by side
with unconstrained ones, a quarter of the requests aborted after their first tokens, clients
that vanish mid-stream, invalid constraints among them. Every constrained output that ends is
what its constraint admits; the invalid ones are refused by name; nothing leaks (the pool is
whole, every request accounted for) and the node serves a constrained request afterwards."""

from __future__ import annotations

import asyncio
import json
import random
import re
from pathlib import Path

import jsonschema
import pytest

from disagg.client import AsyncClient, ClientClosed, RequestError
from disagg.protocol import Finished, SamplingParams, TokenChunk
from disagg.protocol.structured import StructuredOutput
from nodes import node, pools_full, running, stats, wait_for
from tinymodels import NodeProcess, add_byte_bpe_tokenizer, make_tiny_model

pytest.importorskip("xgrammar")

SCHEMA = {"type": "object", "properties": {
    "kind": {"enum": ["cat", "dog"]}, "legs": {"type": "integer", "minimum": 0, "maximum": 8},
    "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}},
    "required": ["kind", "legs"], "additionalProperties": False}
REGEX = "[0-9]{3}-[a-z]{2}"
CHOICES = ["alpha", "beta", "gamma"]
CONSTRAINTS = {
    "json": StructuredOutput("json", json.dumps(SCHEMA), param="guided_json"),
    "regex": StructuredOutput("regex", REGEX, param="guided_regex"),
    "choice": StructuredOutput("choice", choices=CHOICES, param="guided_choice"),
    "bad": StructuredOutput("regex", "(((", param="guided_regex"),
}
CLIENTS, PER_CLIENT = 24, 3


def admitted(kind: str, text: str) -> bool:
    if kind == "json":
        jsonschema.validate(json.loads(text), SCHEMA)
        return True
    if kind == "regex":
        return re.fullmatch(REGEX, text) is not None
    return text in CHOICES


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = make_tiny_model("llama", tmp_path_factory.mktemp("churn") / "llama")
    add_byte_bpe_tokenizer(path)
    return path


def small_node(model, tmp: Path, env: dict[str, str] | None = None):
    return node("mixed", model, tmp, "--num-pages", "48", "--max-model-len", "256",
                "--overlap-schedule", "on", env=env)


@pytest.fixture(scope="module")
def served(model, tmp_path_factory):
    a, proc = small_node(model, tmp_path_factory.mktemp("churn-node"))
    with running([proc]):
        yield a, proc


@pytest.fixture
def addr(served):
    return served[0]


def test_constrained_requests_under_churn(served):
    """The executor's copies of the matchers (the default) stay in step through preemptions
    (replays), aborts and vanished clients."""
    churn(served[0])
    assert stats(served[0]).steps_overlapped > 0
    assert "out of step" not in served[1].log_path.read_text()


def test_constrained_requests_under_churn_with_the_scheduler_filling_late_masks(model, tmp_path):
    """The same churn with ``DISAGG_EXECUTOR_MASKS=0``: the scheduler's pass fills the late
    masks and sends them."""
    addr, proc = small_node(model, tmp_path, {"DISAGG_EXECUTOR_MASKS": "0"})
    with running([proc]):
        churn(addr)
        assert stats(addr).steps_overlapped > 0


def churn(addr: str) -> None:
    rng = random.Random(7)
    plan = []  # (client, request id, kind, aborted, sampled)
    for c in range(CLIENTS):
        for r in range(PER_CLIENT):
            kind = rng.choice(["json", "json", "regex", "choice", "plain", "bad"])
            plan.append((c, f"c{c}-r{r}", kind, rng.random() < 0.25, rng.random() < 0.5))
    vanish = {3, 11, 19}  # these clients close their socket mid-stream
    outcome: dict[str, tuple[str, str]] = {}  # rid -> (finish reason or error code, text)

    async def one(client: AsyncClient, rid: str, kind: str, abort: bool, sampled: bool) -> None:
        sp = SamplingParams(max_tokens=48, temperature=0.8 if sampled else 0.0, seed=11,
                            structured=CONSTRAINTS.get(kind), ignore_eos=kind == "plain")
        prompt = [rng.randrange(3, 250) for _ in range(rng.randrange(4, 40))]
        text: list[str] = []
        try:
            async for msg in client.generate(prompt_token_ids=prompt, sampling=sp,
                                             request_id=rid, timeout=120):
                if isinstance(msg, TokenChunk):
                    text.append(msg.text)
                    if abort and len(text) >= 2:
                        outcome[rid] = ("aborted", "")
                        return  # leaving the stream aborts it
                elif isinstance(msg, Finished):
                    outcome[rid] = (msg.reason, "".join(text))
        except RequestError as e:
            outcome[rid] = (e.error.code, e.error.message)

    async def client_run(c: int) -> None:
        client = AsyncClient(addr)
        mine = [one(client, rid, kind, ab, sa) for cc, rid, kind, ab, sa in plan if cc == c]
        try:
            if c in vanish:
                tasks = [asyncio.ensure_future(t) for t in mine]
                await asyncio.sleep(0.3)
                await client.close()  # gone mid-stream: the node must clean up after it
                ends = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 10)
                assert all(e is None or isinstance(e, ClientClosed) for e in ends), ends
            else:
                await asyncio.gather(*mine)
        finally:
            await client.close()

    async def run() -> None:
        await asyncio.gather(*[client_run(c) for c in range(CLIENTS)])

    asyncio.run(run())
    ended = 0
    for c, rid, kind, abort, _ in plan:
        if c in vanish:
            continue
        reason, text = outcome[rid]
        if kind == "bad":
            assert reason == "bad_request" and text.startswith("guided_regex: invalid regex"), \
                (rid, reason, text)
        elif kind != "plain" and reason == "stop":  # the grammar ended it: the whole output
            assert admitted(kind, text), (rid, kind, text)
            ended += 1
        elif not abort:
            assert reason in ("stop", "length"), (rid, reason, text)
    assert ended >= 10, f"only {ended} constrained outputs ran to their end"
    wait_for(lambda: pools_full(addr), what="the pool whole after the churn")
    s = stats(addr)
    assert s.started == s.finished + s.aborted + s.errored, s
    assert s.preemptions > 0, "the pool should have been too small for every request at once"
    # the node still serves constrained requests
    out, text, fin = complete(addr, [5, 6, 7], SamplingParams(max_tokens=32,
                                                               structured=CONSTRAINTS["choice"]))
    assert fin.reason == "stop" and text in CHOICES


def complete(addr: str, prompt: list[int], sp: SamplingParams):
    """One request to the end from a fresh client: (token ids, text, Finished)."""
    async def run():
        client = AsyncClient(addr)
        try:
            return await client.complete(prompt_token_ids=prompt, sampling=sp, timeout=60)
        finally:
            await client.close()

    return asyncio.run(run())


def test_constrained_rows_share_no_state_across_restarted_clients(addr):
    """The same seeded constrained request from two fresh clients, one after the other, gets
    the same output (no matcher or mask state survives a request)."""
    sp = SamplingParams(max_tokens=40, temperature=0.9, seed=3, structured=CONSTRAINTS["json"])
    (ids_a, text_a, fin_a), (ids_b, text_b, fin_b) = (complete(addr, [9, 8, 7, 6], sp)
                                                      for _ in range(2))
    assert (ids_a, text_a, fin_a.reason) == (ids_b, text_b, fin_b.reason)
    wait_for(lambda: pools_full(addr), what="pool whole")


def test_many_distinct_grammars_at_once_each_constrain_only_their_own_request(served):
    """40 requests at once, each with a grammar of its own (new to the node: each a definition
    loaded on the executors' loader thread while the batch runs), a third aborted early, on
    the small pool: every output that ends is its own grammar's (none picks up another's,
    none is left unconstrained), and nothing leaks."""
    addr, proc = served
    grammars = {f"g{i}": StructuredOutput("regex", f"{i:02d}[a-c]{{2,5}}[!?]",
                                          param="guided_regex") for i in range(40)}
    outcome: dict[str, tuple[str, str]] = {}

    async def one(client: AsyncClient, rid: str, abort: bool) -> None:
        sp = SamplingParams(max_tokens=16, temperature=0.7, seed=int(rid[1:]),
                            structured=grammars[rid])
        text: list[str] = []
        try:
            async for msg in client.generate(prompt_token_ids=[7, 8, int(rid[1:]) + 10],
                                             sampling=sp, request_id=rid, timeout=120):
                if isinstance(msg, TokenChunk):
                    text.append(msg.text)
                    if abort and len(text) >= 2:
                        outcome[rid] = ("aborted", "")
                        return
                elif isinstance(msg, Finished):
                    outcome[rid] = (msg.reason, "".join(text))
        except RequestError as e:
            outcome[rid] = (e.error.code, e.error.message)

    async def run() -> None:
        clients = [AsyncClient(addr) for _ in range(8)]
        try:
            await asyncio.gather(*[one(clients[i % 8], rid, i % 3 == 0)
                                   for i, rid in enumerate(grammars)])
        finally:
            for c in clients:
                await c.close()

    asyncio.run(run())
    ended = [rid for rid, (reason, _) in outcome.items() if reason == "stop"]
    assert len(outcome) == len(grammars) and len(ended) >= 15, outcome
    for rid in ended:
        assert re.fullmatch(grammars[rid].spec, outcome[rid][1]), (rid, outcome[rid])
    assert all(reason in ("stop", "aborted") for reason, _ in outcome.values()), outcome
    wait_for(lambda: pools_full(addr), what="the pool whole after many grammars")
    log = proc.log_path.read_text()
    assert "out of step" not in log and "could not be loaded" not in log


LONG = StructuredOutput("regex", "[a-z]{200}", param="guided_regex")  # long, then it ends


def test_constrained_streams_end_cleanly_when_their_executor_dies(served):
    """An executor killed while constrained rows stream (the last test here: it restarts the
    module's node): each stream either ran to its end, admitted by its grammar, or ends with
    the executor's ``internal`` error; nothing hangs, the restarted node's pool is whole, and
    it serves constrained requests again, the same seeded output as before the kill. The
    restarted executor has no copies of the matchers and no grammars, and the restarted
    scheduler's book starts over."""
    kill_mid_stream(*served)
    assert "out of step" not in served[1].log_path.read_text()


def test_executor_killed_mid_stream_with_the_schedulers_masks(model, tmp_path):
    """The same kill with ``DISAGG_EXECUTOR_MASKS=0`` (the scheduler's pass fills the
    masks)."""
    addr, proc = small_node(model, tmp_path, {"DISAGG_EXECUTOR_MASKS": "0"})
    with running([proc]):
        kill_mid_stream(addr, proc)


def kill_mid_stream(addr: str, proc: NodeProcess) -> None:
    import os
    import signal

    sp = SamplingParams(max_tokens=240, temperature=0.9, seed=5, structured=LONG)
    before = complete(addr, [4, 5, 6], sp)
    assert before[2].reason == "stop" and re.fullmatch("[a-z]{200}", before[1])
    ends: dict[str, tuple[str, str]] = {}

    async def one(client: AsyncClient, rid: str, seen: asyncio.Event) -> None:
        text: list[str] = []
        try:
            async for msg in client.generate(prompt_token_ids=[7, 8, 9 + int(rid[1:])],
                                             request_id=rid, sampling=sp, timeout=60):
                if isinstance(msg, TokenChunk):
                    text.append(msg.text)
                    seen.set()
                elif isinstance(msg, Finished):
                    ends[rid] = (msg.reason, "".join(text))
        except RequestError as e:
            ends[rid] = (e.error.code, e.error.message)

    async def run() -> None:
        client = AsyncClient(addr)
        seen = [asyncio.Event() for _ in range(6)]
        try:
            tasks = [asyncio.ensure_future(one(client, f"k{i}", seen[i])) for i in range(6)]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in seen)), 60)
            kids = proc.children()
            assert len(kids) == 1, kids
            os.kill(kids[0], signal.SIGKILL)
            await asyncio.wait_for(asyncio.gather(*tasks), 90)
        finally:
            await client.close()

    asyncio.run(run())
    assert len(ends) == 6
    for rid, (reason, text) in ends.items():
        if reason == "stop":
            assert re.fullmatch("[a-z]{200}", text), (rid, text)
        else:
            assert reason == "internal" and "killed by SIGKILL" in text, (rid, reason, text)
    assert any(reason == "internal" for reason, _ in ends.values()), ends
    wait_for(lambda: sum("ready:" in line for line in proc.log_path.read_text().splitlines())
             >= 2 or proc.proc.poll() is not None, timeout=120, what="the node restarted")
    assert proc.proc.poll() is None, proc.log_path.read_text()[-3000:]
    after = complete(addr, [4, 5, 6], sp)
    assert (after[0], after[1], after[2].reason) == (before[0], before[1], before[2].reason)
    wait_for(lambda: pools_full(addr), what="the pool whole after the kill")
