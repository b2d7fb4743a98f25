"""The ownership check runs ahead of a decoder's first request (issue 18, item 8): when a
prefiller first answers a decoder's Ping on a connection, the decoder offers its endpoints
(``OwnershipOffer``) and the prefiller checks them at once, so the first request finds the
binding made and waits for no check round trip. A decoder that fails that check is refused as
before; a malformed offer gets a clear error and the prefiller keeps serving.
A real PrefillMessenger and DecodeMessenger in one event loop, libfabric tcp over loopback,
the schedulers replaced by the test (their inproc sockets)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import pytest
import torch
import zmq
import zmq.asyncio

from disagg.actors.decode_messenger.decode_messenger import DecodeMessenger
from disagg.actors.prefill_messenger.prefill_messenger import PrefillMessenger
from disagg.protocol.inproc import AttemptEvent, PrefillJob, SendPrefill
from disagg.protocol.peer import ChallengeAnswer, OwnershipOffer, Ping
from disagg.remote.transfer_plan import make_key, new_generation
from disagg.transfer import TransferEngine
from remote.messengers import ENC, LAYOUT, SCHED, Counter

pytestmark = pytest.mark.fabric



@dataclass
class Pair:
    p: PrefillMessenger
    d: DecodeMessenger
    p_sched: zmq.asyncio.Socket  # the prefill scheduler's end
    d_sched: zmq.asyncio.Socket  # the decode scheduler's end
    events: list[Any] = field(default_factory=list)  # what the prefiller's gate did, in order
    prepared: list[Any] = field(default_factory=list)  # descriptors it was told to map ahead

    async def until(self, cond: Callable[[], bool], what: str, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while not cond():
            assert time.monotonic() < deadline, f"{what} not reached in {timeout}s"
            await asyncio.sleep(0.02)

    async def scheduler_message(self, sock: zmq.asyncio.Socket, kind: type,
                                timeout: float = 20.0) -> Any:
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            if await sock.poll(int(left * 1000) + 1):
                msg = SCHED.decode(await sock.recv())
                if isinstance(msg, kind):
                    return msg
        raise AssertionError(f"no {kind.__name__} reached the scheduler in {timeout}s")

    async def send_prefill(self, rid: str) -> None:
        await self.d_sched.send(ENC.encode(SendPrefill.of(
            rid, make_key(1, new_generation()), list(range(7)), [0, 1], 30.0)))


@contextlib.asynccontextmanager
async def pair(mr_per_attempt: str) -> AsyncIterator[Pair]:
    ctx = zmq.asyncio.Context()
    socks = [ctx.socket(zmq.PAIR) for _ in range(4)]
    socks[0].bind("inproc://p-sched")
    socks[1].connect("inproc://p-sched")
    socks[2].bind("inproc://d-sched")
    socks[3].connect("inproc://d-sched")
    engines = [TransferEngine("fabric", "tcp", mr_per_attempt=mr_per_attempt).start()
               for _ in range(2)]
    p = PrefillMessenger("tcp://127.0.0.1:0", ctx, socks[1], engines[0], LAYOUT,
                         [torch.zeros(LAYOUT.total_bytes, dtype=torch.uint8)], Counter(),
                         vocab_size=100, max_jobs=4)
    d = DecodeMessenger([p.address], ctx, socks[3], engines[1], LAYOUT,
                        [torch.zeros(LAYOUT.total_bytes, dtype=torch.uint8)], max_slots=4,
                        heartbeat_s=0.1)
    t = Pair(p, d, socks[0], socks[2])
    park, answered = p.gate.park, p.gate.owners.answered

    async def parked(peer: bytes, conn: Any, req: Any, *args: Any) -> None:
        t.events.append(("parked", req.request_id))
        await park(peer, conn, req, *args)

    def checked(check: Any, answer: Any, now: float, **kw: Any) -> bool:
        ok = answered(check, answer, now, **kw)
        t.events.append(("checked", ok))
        return ok

    p.gate.park = parked  # type: ignore[method-assign]
    p.gate.owners.answered = checked  # type: ignore[method-assign]
    engines[0].prepare = t.prepared.extend  # type: ignore[method-assign]
    tasks = [asyncio.ensure_future(p.run()), asyncio.ensure_future(d.run())]
    try:
        yield t
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        p.close()
        d.close()
        for e in engines:
            await e.close()
        for s in socks:
            s.close(0)
        ctx.term()


@pytest.mark.parametrize("mr_per_attempt", ["on", "off"])
def test_the_check_is_done_before_the_first_request_arrives(mr_per_attempt: str) -> None:
    async def main() -> None:
        async with pair(mr_per_attempt) as t:
            # nothing was requested: the check ran on the decoder's offer alone
            await t.until(lambda: ("checked", True) in t.events,
                          "an ownership check ahead of any request")
            await t.send_prefill("first")
            job = await t.scheduler_message(t.p_sched, PrefillJob)
            assert job.prompt_ids == list(range(7))
            # the first request found the binding made: it never waited for a check
            assert t.events == [("checked", True)]
            # with shared registrations the offer named the KV, mapped ahead (cuda-ipc);
            # per-attempt windows name none (each request brings its own)
            assert len(t.prepared) == (1 if mr_per_attempt == "off" else 0)
            # the offer's window is revoked once its check was answered
            assert all(peer.offer_window is None for peer in t.d.peers)

    asyncio.run(main())


def test_a_decoder_that_fails_the_check_ahead_is_refused_as_before() -> None:
    async def main() -> None:
        async with pair("on") as t:
            async def wrong(peer: Any, ch: Any) -> None:  # cannot read the nonce back
                await peer.sock.send(ENC.encode(ChallengeAnswer(ch.id, bytes(16 * ch.lanes))))

            t.d._answer = wrong  # type: ignore[method-assign]
            await t.until(lambda: ("checked", False) in t.events, "the failed check")
            await t.send_prefill("first")
            ev = await t.scheduler_message(t.d_sched, AttemptEvent)
            assert (ev.request_id, ev.kind, ev.code) == ("first", "failed", "bad_request")
            assert "not owned by the requester" in ev.message
            assert t.prepared == []  # no trust, nothing mapped

    asyncio.run(main())


def test_a_malformed_offer_gets_a_clear_error_and_the_prefiller_keeps_serving() -> None:
    async def main() -> None:
        async with pair("on") as t:
            ctx = zmq.asyncio.Context()
            s = ctx.socket(zmq.DEALER)
            s.connect(t.p.address)
            try:
                await s.send(ENC.encode(OwnershipOffer(b"junk", 0, 1)))
                await s.send(ENC.encode(Ping(7)))
                replies = [msgspec.msgpack.decode(await asyncio.wait_for(s.recv(), 20))
                           for _ in range(2)]
            finally:
                s.close(0)
                ctx.term()
            assert replies[0]["type"] == "prefill_failed"
            assert replies[0]["code"] == "bad_request"
            assert replies[0]["message"].startswith("ownership offer: bad memory descriptor")
            assert replies[1]["type"] == "pong"
            # the real decoder is served all the same; the junk offer started no check
            await t.until(lambda: ("checked", True) in t.events, "the decoder's check")
            await t.send_prefill("first")
            await t.scheduler_message(t.p_sched, PrefillJob)
            assert t.events == [("checked", True)]

    asyncio.run(main())
