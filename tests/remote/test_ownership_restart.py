"""A prefiller restarted on the same address is checked afresh at once (issue 35, item 8): the
decoder sees the connection's epoch move, retires the challenge key its requests carried so far
(requests queued meanwhile reach the new process naming it: their checks completed the
expectation a live request's check then trusted, and the decoder answered before the new
nonce landed: "not owned" for 10 s) and offers its endpoints under a fresh key on the new
process's first Pong; a second check on an already used key is answered only once its own
nonce is there.
A real PrefillMessenger (twice, on one address) and DecodeMessenger in one event loop,
libfabric tcp over loopback, the schedulers replaced by the test (their inproc sockets)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
import torch
import zmq
import zmq.asyncio

from disagg.actors.decode_messenger.decode_messenger import DecodeMessenger
from disagg.actors.prefill_messenger.prefill_messenger import PrefillMessenger
from disagg.protocol.inproc import PrefillJob, SendPrefill
from disagg.protocol.peer import OwnershipOffer
from disagg.remote.ownership import endpoints
from disagg.remote.transfer_plan import make_key, new_generation
from disagg.transfer import TransferEngine
from remote.messengers import ENC, LAYOUT, SCHED, Counter, until

pytestmark = pytest.mark.fabric



async def job(sock: zmq.asyncio.Socket, timeout: float = 20.0) -> PrefillJob:
    deadline = time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0:
        if await sock.poll(int(left * 1000) + 1):
            msg = SCHED.decode(await sock.recv())
            if isinstance(msg, PrefillJob):
                return msg
    raise AssertionError(f"no PrefillJob in {timeout}s")


def test_a_prefiller_restarted_on_its_address_gets_a_fresh_offer_under_a_fresh_key():
    async def main() -> None:
        ctx = zmq.asyncio.Context()
        socks = [ctx.socket(zmq.PAIR) for _ in range(6)]
        for i, name in ((0, "p1"), (2, "d"), (4, "p2")):
            socks[i].bind(f"inproc://{name}-sched")
            socks[i + 1].connect(f"inproc://{name}-sched")
        engines = [TransferEngine("fabric", "tcp").start() for _ in range(3)]
        offers: list[tuple[int, int]] = []  # (which prefiller, the offer's challenge key)

        def prefiller(n: int, address: str) -> PrefillMessenger:
            p = PrefillMessenger(address, ctx, socks[1 if n == 1 else 5], engines[n - 1],
                                 LAYOUT, [torch.zeros(LAYOUT.total_bytes, dtype=torch.uint8)],
                                 Counter(), vocab_size=100, max_jobs=8)
            offered = p.gate.offered

            async def spy(peer: bytes, conn: Any, offer: OwnershipOffer) -> None:
                offers.append((n, offer.challenge_key))
                await offered(peer, conn, offer)

            p.gate.offered = spy  # type: ignore[method-assign]
            return p

        p1 = prefiller(1, "tcp://127.0.0.1:0")
        address = p1.address
        d = DecodeMessenger([address], ctx, socks[3], engines[2], LAYOUT,
                            [torch.zeros(LAYOUT.total_bytes, dtype=torch.uint8)], max_slots=4,
                            heartbeat_s=0.1)
        t1, td = asyncio.ensure_future(p1.run()), asyncio.ensure_future(d.run())
        p2 = None
        p1_open = True
        tasks = [t1, td]
        try:
            await until(lambda: offers, "the decoder's offer")
            await until(lambda: bool(p1.gate.owners.owned), "its check passed")
            # a request armed the next challenge key (the offer's was used): served, no check
            await socks[2].send(ENC.encode(SendPrefill.of(
                "before", make_key(1, new_generation()), list(range(7)), [0, 1], 30.0)))
            await job(socks[0])
            armed = d.peers[0].challenge[0]
            # the prefiller restarts on the same address
            t1.cancel()
            await asyncio.gather(t1, return_exceptions=True)
            p1.close()
            p1_open = False
            epoch = d.peers[0].epoch
            await until(lambda: d.peers[0].epoch > epoch, "the decoder saw the connection drop")
            p2 = prefiller(2, address)
            tasks.append(asyncio.ensure_future(p2.run()))
            await until(lambda: any(n == 2 for n, _ in offers), "an offer to the new process")
            key = next(k for n, k in offers if n == 2)
            assert key != armed and key not in [k for n, k in offers if n == 1], \
                "the new process was offered a key the old one's requests carried"
            await until(lambda: bool(p2.gate.owners.owned), "the new process's check passed")
            await socks[2].send(ENC.encode(SendPrefill.of(
                "after", make_key(1, new_generation()), list(range(7)), [0, 1], 30.0)))
            assert (await job(socks[4])).prompt_ids == list(range(7))
            # a second check under a key whose expectation a first check completed (as when
            # that one was inconclusive): answered with its own nonce, not the one before
            p2.gate.owners.owned.clear()
            await socks[2].send(ENC.encode(SendPrefill.of(
                "again", make_key(1, new_generation()), list(range(7)), [2, 3], 30.0)))
            await_job = await job(socks[4])  # checked (the key's expectation completed)
            again = next(j for j in p2.jobs.values() if j.req.request_id == "again")
            assert await_job.prompt_ids == list(range(7))
            conn = next(iter(p2.gate.owners.owned))
            p2.gate.owners.owned.clear()
            ok: list[bool] = []
            answered = p2.gate.owners.answered

            def record(check: Any, answer: Any, now: float, **kw: Any) -> bool:
                ok.append(answered(check, answer, now, **kw))
                return ok[-1]

            p2.gate.owners.answered = record  # type: ignore[method-assign]
            lanes, _ = endpoints(again.dst_kv, again.dst_ctx, engines[1].lanes)
            assert p2.gate._start(conn, again.peer, again.dst_ctx, lanes,
                                  again.req.challenge_slot, again.req.challenge_key, None, [])
            await until(lambda: ok, "the second check")
            assert ok == [True]
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for p in ([p1] if p1_open else []) + ([p2] if p2 is not None else []):
                p.close()
            d.close()
            for e in engines:
                await e.close()
            for s in socks:
                s.close(0)
            ctx.term()

    asyncio.run(main())
