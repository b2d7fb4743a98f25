"""A remote prompt's ids cross the prefill node with one decode (#39 item 1): the messenger
reads only their count and hands them to the scheduler as the decoder sent them (a bin), whose
decode checks each against the vocabulary; ids outside it are refused by name, back to the
decoder, with the same code and message as the request's own checks give. A real
PrefillMessenger and DecodeMessenger in one event loop (libfabric tcp over loopback), the real
prefill side of the scheduler behind a stand-in for the rest of it."""

from __future__ import annotations

import asyncio
import itertools
from types import SimpleNamespace

import msgspec
import pytest
import torch
import zmq
import zmq.asyncio

from disagg.actors.decode_messenger.decode_messenger import DecodeMessenger
from disagg.actors.prefill_messenger.prefill_messenger import PrefillMessenger
from disagg.actors.scheduler.prefill_scheduler import PrefillSide
from disagg.engine.scheduling import Sequence
from disagg.protocol.inproc import AttemptEvent, PrefillJob, SendPrefill
from disagg.remote.requests import OUT_OF_VOCAB
from disagg.remote.transfer_plan import make_key, new_generation
from disagg.serving.admission import Counters
from disagg.transfer import TransferEngine
from remote.messengers import ENC, LAYOUT, SCHED, Counter, until

pytestmark = pytest.mark.fabric

VOCAB = 100


class Port:
    """The scheduler as its prefill side sees it: sequences kept, messages to the messenger."""

    def __init__(self, sock: zmq.asyncio.Socket):
        self.sched = SimpleNamespace(add=self.added)
        self.arch = SimpleNamespace(vocab_size=VOCAB)
        self.counters = Counters()
        self.sock = sock
        self.seqs: list[Sequence] = []
        self.jobs: list[PrefillJob] = []
        self._slots = itertools.count()

    def added(self, seq: Sequence) -> None:
        self.seqs.append(seq)

    def next_slot(self) -> int:
        return next(self._slots)

    async def to_messenger(self, frames: list[bytes]) -> None:
        await self.sock.send_multipart(frames)


async def serve(port: Port, side: PrefillSide) -> None:
    while True:
        msg = SCHED.decode(await port.sock.recv())
        if isinstance(msg, PrefillJob):
            port.jobs.append(msg)
            await side.handle_messenger(msg)


def test_ids_outside_the_vocabulary_are_refused_by_the_schedulers_decode() -> None:
    async def main() -> None:
        ctx = zmq.asyncio.Context()
        socks = [ctx.socket(zmq.PAIR) for _ in range(4)]
        socks[0].bind("inproc://p-sched")
        socks[1].connect("inproc://p-sched")
        socks[2].bind("inproc://d-sched")
        socks[3].connect("inproc://d-sched")
        engines = [TransferEngine("fabric", "tcp").start() for _ in range(2)]
        p = PrefillMessenger("tcp://127.0.0.1:0", ctx, socks[1], engines[0], LAYOUT,
                             [torch.zeros(LAYOUT.total_bytes, dtype=torch.uint8)], Counter(),
                             vocab_size=VOCAB, max_jobs=8)
        d = DecodeMessenger([p.address], ctx, socks[3], engines[1], LAYOUT,
                            [torch.zeros(LAYOUT.total_bytes, dtype=torch.uint8)], max_slots=4,
                            heartbeat_s=0.1)
        port = Port(socks[0])
        side = PrefillSide(port)  # type: ignore[arg-type]
        events: list[AttemptEvent] = []

        async def decoder_events() -> None:
            while True:
                msg = SCHED.decode(await socks[2].recv())
                if isinstance(msg, AttemptEvent):
                    events.append(msg)

        tasks = [asyncio.ensure_future(c) for c in (p.run(), d.run(), serve(port, side),
                                                    decoder_events())]
        try:
            await until(lambda: d.prefillers.alive(p.address), "the prefiller alive")
            for rid, ids in (("bad", [5, VOCAB, 7]), ("neg", [-1, 6, 7]), ("good", [5, 6, 7])):
                await socks[2].send(ENC.encode(SendPrefill.of(
                    rid, make_key(1, new_generation()), ids, [0], 30.0)))
            await until(lambda: len(port.seqs) == 1 and len(
                [e for e in events if e.kind == "failed"]) == 2, "two refusals and one job")
            failed = {e.request_id: e for e in events if e.kind == "failed"}
            for rid in ("bad", "neg"):
                assert (failed[rid].code, failed[rid].message) == ("bad_request", OUT_OF_VOCAB)
            # the jobs' ids came as the decoder encoded them, decoded once: by the scheduler
            assert [bytes(j.prompt) for j in port.jobs] == [
                msgspec.msgpack.encode(x) for x in ([5, VOCAB, 7], [-1, 6, 7], [5, 6, 7])]
            (seq,) = port.seqs
            assert seq.prompt_ids == [5, 6, 7] and seq.prefill_only
            assert port.counters.started == 1
            # the refused jobs left nothing queued: only the job taken counts
            await until(lambda: len(p.jobs) == 1, "the refused jobs gone")
            assert p.queued_tokens == 3
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

    asyncio.run(main())
