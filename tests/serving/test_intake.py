"""The scheduler's intake (``disagg.actors.scheduler.intake.ClientIntake``) against a fake
scheduler: admission bounds, tenants' fair share, aborts, departed clients, stats, acks."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any

from disagg.actors.scheduler.intake import INLINE_TOKENIZE_CHARS, ClientIntake
from disagg.engine.scheduling import Sequence
from disagg.protocol import (
    Abort,
    ClientMessage,
    Error,
    Finished,
    GenerateRequest,
    NodeReply,
    Resume,
    Stats,
    StatsRequest,
    Usage,
)
from disagg.protocol.inproc import ClientGone, FromClient
from disagg.serving.admission import Counters, Limits

VOCAB = 100


class GatedTokenizer:
    """Encodes a text to one id per 1000 characters once ``gate`` is set (a worker thread
    waits on it); an all-"x" text encodes to nothing (refused: empty prompt)."""

    def __init__(self) -> None:
        self.gate = threading.Event()

    def encode(self, text: str) -> list[int]:
        assert self.gate.wait(10)
        return [] if set(text) == {"x"} else [1] * (len(text) // 1000)


class FakeScheduler:
    """What the intake's host does, as the scheduler actor does it: live requests by key,
    ending one tells the intake (``ended``) and counts it, replies are recorded."""

    def __init__(self, limits: Limits = Limits(), tokenizer: Any = None,
                 max_model_len: int = 1000) -> None:
        self.counters = Counters()
        self.live: dict[tuple[bytes, str], Sequence] = {}
        self.sent: list[tuple[bytes, NodeReply]] = []
        self.tasks: list[asyncio.Task[None]] = []
        self._slot = 0
        self.intake = ClientIntake(self, limits, self.counters, tokenizer, VOCAB,
                                   max_model_len, "--max-model-len")

    def live_request(self, key: tuple[bytes, str]) -> Sequence | None:
        return self.live.get(key)

    def requests_of(self, identity: bytes) -> list[Sequence]:
        return [seq for key, seq in self.live.items() if key[0] == identity]

    def make_live(self, identity: bytes, seq: Sequence, admitted_at: float,
                  resume: Resume | None = None) -> None:
        self.live[(identity, seq.request_id)] = seq

    def next_slot(self) -> int:
        self._slot += 1
        return self._slot

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        self.tasks.append(asyncio.ensure_future(coro))

    def usage(self, seq: Sequence) -> Usage:
        return Usage(len(seq.prompt_ids), len(seq.output_ids))

    def stats(self) -> Stats:
        c = self.counters
        return Stats("mixed", 8, 8, 16, 0, self.intake.waiting(), c.started, c.finished,
                     c.aborted, c.errored, c.rejected, 0, 0)

    async def send(self, identity: bytes, msg: NodeReply) -> None:
        self.sent.append((identity, msg))

    async def end(self, seq: Sequence, terminal: Finished | Error) -> None:
        identity = next((k[0] for k, s in self.live.items() if s is seq), None)
        if identity is None:
            return
        del self.live[(identity, seq.request_id)]
        self.intake.ended(identity, seq)
        if isinstance(terminal, Error):
            self.counters.errored += 1
        elif terminal.reason == "abort":
            self.counters.aborted += 1
        await self.send(identity, terminal)

    def replies(self, identity: bytes) -> list[NodeReply]:
        return [m for who, m in self.sent if who == identity]


async def generate(s: FakeScheduler, identity: bytes, rid: str, tenant: bytes | None = None,
                   prompt: str | None = None) -> None:
    msg: ClientMessage = (GenerateRequest(rid, prompt_token_ids=[1, 2, 3]) if prompt is None
                          else GenerateRequest(rid, prompt=prompt))
    await s.intake.handle(FromClient.of(identity, msg, tenant))


async def test_admitted_requests_are_live_and_queued_in_arrival_order() -> None:
    s = FakeScheduler()
    await generate(s, b"a", "r1")
    await generate(s, b"a", "r2")
    assert set(s.live) == {(b"a", "r1"), (b"a", "r2")} and s.sent == []
    assert s.live[(b"a", "r1")].prompt_ids == [1, 2, 3]
    assert s.counters.started == 2 and s.intake.queued() == 2
    assert [s.intake.next_queued().request_id for _ in range(2)] == ["r1", "r2"]
    assert s.intake.next_queued() is None


async def test_duplicate_and_bad_requests_are_refused() -> None:
    s = FakeScheduler()
    await generate(s, b"a", "r1")
    await generate(s, b"a", "r1")
    await s.intake.handle(FromClient.of(b"a", GenerateRequest("r2", prompt_token_ids=[VOCAB])))
    dup, bad = s.replies(b"a")
    assert isinstance(dup, Error) and dup.code == "duplicate_request"
    assert isinstance(bad, Error) and bad.code == "bad_request" and "vocabulary" in bad.message
    assert s.counters.rejected == 2 and s.counters.started == 1
    await generate(s, b"b", "r1")  # another client may use the same id
    assert (b"b", "r1") in s.live


async def test_per_client_bound_counts_live_requests_of_the_tenant() -> None:
    s = FakeScheduler(Limits(per_client=2))
    await generate(s, b"a1", "r1", tenant=b"key")
    await generate(s, b"a2", "r2", tenant=b"key")  # the same client key, another connection
    await generate(s, b"a2", "r3", tenant=b"key")
    [refused] = s.replies(b"a2")
    assert isinstance(refused, Error) and refused.code == "overloaded"
    assert "--max-requests-per-client" in refused.message
    await generate(s, b"b", "r1")  # another tenant is not held back
    assert (b"b", "r1") in s.live
    await s.end(s.live[(b"a1", "r1")], Finished("r1", "stop", Usage(3, 0)))
    await generate(s, b"a2", "r4", tenant=b"key")  # a seat came free
    assert (b"a2", "r4") in s.live


async def test_full_queue_refuses_a_client_at_its_share() -> None:
    s = FakeScheduler(Limits(queued=2))
    await generate(s, b"a", "r1")
    await generate(s, b"b", "r1")
    await generate(s, b"a", "r2")
    [refused] = s.replies(b"a")
    assert isinstance(refused, Error) and refused.code == "overloaded"
    assert "--max-queued-requests" in refused.message and "share of 1" in refused.message
    s.intake.next_queued()  # one handed to batching: room again
    await generate(s, b"a", "r3")
    assert (b"a", "r3") in s.live and s.counters.rejected == 1


async def test_client_below_its_share_makes_the_largest_give_way() -> None:
    s = FakeScheduler(Limits(queued=4))
    for rid in ("r1", "r2", "r3", "r4"):
        await generate(s, b"flood", rid)
    await generate(s, b"late", "x1")
    assert (b"late", "x1") in s.live and s.replies(b"late") == []
    [gave_way] = s.replies(b"flood")
    assert isinstance(gave_way, Error) and gave_way.code == "overloaded"
    assert gave_way.request_id == "r4" and "gave way" in gave_way.message
    assert s.intake.queued() == 4 and (b"flood", "r4") not in s.live
    # round robin over tenants: the late client's request is handed out second
    assert [s.intake.next_queued().request_id for _ in range(3)] == ["r1", "x1", "r2"]


async def test_abort_of_a_queued_request_and_of_an_unknown_one() -> None:
    s = FakeScheduler()
    await generate(s, b"a", "r1")
    await s.intake.handle(FromClient.of(b"a", Abort("r1")))
    await s.intake.handle(FromClient.of(b"a", Abort("nope")))
    done, unknown = s.replies(b"a")
    assert done == Finished("r1", "abort", Usage(3, 0))
    assert isinstance(unknown, Error) and unknown.code == "unknown_request"
    assert s.intake.queued() == 0 and s.live == {} and s.counters.aborted == 1


async def test_a_long_text_is_tokenized_off_the_loop_then_queued() -> None:
    tok = GatedTokenizer()
    s = FakeScheduler(tokenizer=tok)
    await generate(s, b"a", "r1", prompt="y" * (INLINE_TOKENIZE_CHARS + 1))
    assert s.live == {} and s.intake.has_tokenizing() and s.intake.waiting() == 1
    assert s.counters.started == 1
    tok.gate.set()
    await asyncio.gather(*s.tasks)
    assert len(s.live[(b"a", "r1")].prompt_ids) == (INLINE_TOKENIZE_CHARS + 1) // 1000
    assert not s.intake.has_tokenizing() and s.intake.queued() == 1 and s.sent == []


async def test_abort_while_tokenizing_drops_the_tokens() -> None:
    tok = GatedTokenizer()
    s = FakeScheduler(Limits(per_client=1), tokenizer=tok)
    await generate(s, b"a", "r1", prompt="y" * (INLINE_TOKENIZE_CHARS + 1))
    await generate(s, b"a", "r2")  # the tokenizing request holds the client's one seat
    await s.intake.handle(FromClient.of(b"a", Abort("r1")))
    refused, aborted = s.replies(b"a")
    assert isinstance(refused, Error) and refused.code == "overloaded"
    assert aborted == Finished("r1", "abort", Usage(0, 0))
    assert s.counters.aborted == 1 and not s.intake.has_tokenizing()
    tok.gate.set()
    await asyncio.gather(*s.tasks)
    assert s.live == {} and s.intake.queued() == 0 and len(s.sent) == 2
    await generate(s, b"a", "r3")  # its seat is free again
    assert (b"a", "r3") in s.live


async def test_a_text_refused_after_tokenizing_ends_with_an_error() -> None:
    tok = GatedTokenizer()
    s = FakeScheduler(tokenizer=tok)
    await generate(s, b"a", "r1", prompt="x" * (INLINE_TOKENIZE_CHARS + 1))
    tok.gate.set()
    await asyncio.gather(*s.tasks)
    [err] = s.replies(b"a")
    assert isinstance(err, Error) and err.code == "bad_request" and err.request_id == "r1"
    assert s.counters.errored == 1 and s.counters.rejected == 0 and s.intake.waiting() == 0


async def test_client_gone_ends_its_requests_and_forgets_it() -> None:
    tok = GatedTokenizer()
    s = FakeScheduler(Limits(per_client=2), tokenizer=tok)
    await generate(s, b"a", "r1", tenant=b"key")
    await generate(s, b"a", "r2", tenant=b"key", prompt="y" * (INLINE_TOKENIZE_CHARS + 1))
    await generate(s, b"b", "r1")
    await s.intake.client_gone(ClientGone(b"a", "disconnected"))
    assert s.replies(b"a") == [Finished("r1", "abort", Usage(3, 0))]
    assert s.counters.aborted == 2 and not s.intake.has_tokenizing()
    assert list(s.live) == [(b"b", "r1")] and s.intake.take_acks(b"a") == 0
    tok.gate.set()
    await asyncio.gather(*s.tasks)
    assert list(s.live) == [(b"b", "r1")]
    for rid in ("r3", "r4"):  # the key's seats are free again
        await generate(s, b"a2", rid, tenant=b"key")
    assert {(b"a2", "r3"), (b"a2", "r4")} <= s.live.keys()


async def test_a_stalled_client_has_its_requests_end_overloaded() -> None:
    s = FakeScheduler()
    await generate(s, b"a", "r1")
    await s.intake.client_gone(ClientGone(b"a", "stalled"))
    [err] = s.replies(b"a")
    assert isinstance(err, Error) and err.code == "overloaded" and err.request_id == "r1"
    assert "stopped reading" in err.message and s.counters.errored == 1


async def test_stats_request_is_answered_with_the_schedulers_stats() -> None:
    s = FakeScheduler()
    await generate(s, b"a", "r1")
    await s.intake.handle(FromClient.of(b"b", StatsRequest()))
    [(who, stats)] = s.sent
    assert who == b"b" and isinstance(stats, Stats)
    assert stats.waiting == 1 and stats.started == 1


async def test_every_handled_frame_is_acked_once() -> None:
    s = FakeScheduler()
    await generate(s, b"a", "r1")
    await generate(s, b"a", "r2")
    await generate(s, b"b", "r1")
    assert s.intake.take_acks(b"a") == 2 and s.intake.take_acks(b"a") == 0
    assert s.intake.pop_acks() == (b"b", 1) and s.intake.pop_acks() is None
    await s.intake.refuse_frame(FromClient.of(b"c", StatsRequest()),
                                lambda msg: Error("shutting_down", "stopping"))
    assert s.replies(b"c") == [Error("shutting_down", "stopping")]
    assert s.intake.take_acks(b"c") == 1


async def test_failing_tokenizing_requests_answers_each() -> None:
    tok = GatedTokenizer()
    s = FakeScheduler(tokenizer=tok)
    await generate(s, b"a", "r1", prompt="y" * (INLINE_TOKENIZE_CHARS + 1))
    await s.intake.fail_tokenizing("internal", "executor failure")
    assert s.replies(b"a") == [Error("internal", "executor failure", "r1")]
    assert s.counters.errored == 1 and s.intake.waiting() == 0
    tok.gate.set()
    await asyncio.gather(*s.tasks)
    assert s.live == {}


async def test_a_resumed_request_is_live_with_its_streamed_tokens_and_checked() -> None:
    s = FakeScheduler(max_model_len=8)
    resumed = GenerateRequest("r1", prompt_token_ids=[1, 2, 3], resume=Resume([7, 8], 0, 1))
    await s.intake.handle(FromClient.of(b"a", resumed))
    seq = s.live[(b"a", "r1")]
    assert seq.prompt_ids == [1, 2, 3] and seq.output_ids == [7, 8]
    bad = [GenerateRequest("r2", prompt_token_ids=[1], resume=Resume([VOCAB])),  # vocabulary
           GenerateRequest("r3", prompt_token_ids=[1, 2, 3], resume=Resume([5] * 6)),  # context
           GenerateRequest("r4", prompt_token_ids=[1], resume=Resume([])),
           GenerateRequest("r5", prompt_token_ids=[1], resume=Resume([5], 1, 1))]
    for req in bad:
        await s.intake.handle(FromClient.of(b"a", req))
    errors = [m for m in s.replies(b"a") if isinstance(m, Error)]
    assert [e.request_id for e in errors] == ["r2", "r3", "r4", "r5"]
    assert all(e.code == "bad_request" and "resume" in e.message for e in errors), errors
