"""The prefiller's ownership checks cannot be exhausted by a peer (issue 41, item 2): 200
connections keep offering endpoints on a closed port. Such a check's nonce write is never
posted (the provider is still connecting at its deadline): its nonce slot used to rest 600 s
all the same, and 4,096 failed checks later a new decoder's requests were refused "too many
ownership checks under way". Now the slot comes back at once (the write is known dead), the
flood's checks are bounded per identity and per address and back off as they fail, and a
request whose check cannot start waits for one instead of being refused, ahead of every
offer. Scaled down: 128 nonce slots, a 0.5 s ownership timeout.
A real PrefillMessenger and DecodeMessenger in one event loop, libfabric tcp over loopback,
the schedulers replaced by the test (their inproc sockets)."""

from __future__ import annotations

import asyncio
import socket
import struct
import time
from typing import Any

import msgspec
import pytest
import torch
import zmq
import zmq.asyncio

from disagg.actors.decode_messenger.decode_messenger import DecodeMessenger
from disagg.actors.prefill_messenger import ownership_gate
from disagg.actors.prefill_messenger.prefill_messenger import PrefillMessenger
from disagg.protocol.inproc import AttemptEvent, PrefillJob, SendPrefill
from disagg.protocol.peer import OwnershipOffer
from disagg.remote.transfer_plan import make_key, new_generation
from disagg.transfer import TransferEngine
from remote.messengers import ENC, LAYOUT, SCHED, Counter

pytestmark = pytest.mark.fabric

FLOOD_CONNS = 200


def closed_port_descriptor(engine: TransferEngine) -> bytes:
    """A context descriptor as a decoder would offer it, but on a loopback port nobody
    listens on (a libfabric tcp address: sockaddr_in)."""
    region = engine.register(torch.zeros(1 << 20, dtype=torch.uint8), access="target")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    address = (struct.pack("<H", socket.AF_INET) + struct.pack(">H", port)
               + socket.inet_aton("127.0.0.1") + bytes(8))
    return msgspec.structs.replace(region.descriptor, address=address).encode()


async def flood(ctx: zmq.asyncio.Context, address: str, offer: bytes, stop: asyncio.Event,
                sent: list[int]) -> None:
    socks = []
    for _ in range(FLOOD_CONNS):
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(address)
        socks.append(s)
    try:
        while not stop.is_set():
            for s in socks:
                await s.send(offer)
                sent[0] += 1
            await asyncio.sleep(0.2)
    finally:
        for s in socks:
            s.close(0)


async def first(sock: zmq.asyncio.Socket, kinds: tuple[type, ...], timeout: float) -> Any:
    deadline = time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0:
        if await sock.poll(int(left * 1000) + 1):
            msg = SCHED.decode(await sock.recv())
            if isinstance(msg, kinds):
                return msg
    raise AssertionError(f"none of {kinds} reached the scheduler in {timeout}s")


def test_a_new_decoder_is_checked_and_served_during_a_closed_port_offer_flood(monkeypatch):
    monkeypatch.setattr(ownership_gate, "NONCE_SOURCE_SLOTS", 128)

    async def main() -> None:
        ctx = zmq.asyncio.Context()
        socks = [ctx.socket(zmq.PAIR) for _ in range(4)]
        socks[0].bind("inproc://p-sched")
        socks[1].connect("inproc://p-sched")
        socks[2].bind("inproc://d-sched")
        socks[3].connect("inproc://d-sched")
        engines = [TransferEngine("fabric", "tcp").start() for _ in range(3)]
        p = PrefillMessenger("tcp://127.0.0.1:0", ctx, socks[1], engines[0], LAYOUT,
                             [torch.zeros(LAYOUT.total_bytes, dtype=torch.uint8)], Counter(),
                             vocab_size=100, max_jobs=4, ownership_timeout_s=0.5)
        tasks = [asyncio.ensure_future(p.run())]
        stop, sent = asyncio.Event(), [0]
        offer = ENC.encode(OwnershipOffer(closed_port_descriptor(engines[2]), 0, 1))
        tasks.append(asyncio.ensure_future(flood(ctx, p.address, offer, stop, sent)))
        d = None
        try:
            await asyncio.sleep(3.0)  # 15 rounds of 200 offers: 6 slot lifetimes of checks
            assert sent[0] >= 2 * FLOOD_CONNS
            # the flood's checks are bounded (per address: they all come from this host)
            assert p.gate.quotas.under_way <= ownership_gate.CHECKS_PER_ADDRESS
            # a new decoder comes while the flood goes on: checked and served
            d = DecodeMessenger([p.address], ctx, socks[3], engines[1], LAYOUT,
                                [torch.zeros(LAYOUT.total_bytes, dtype=torch.uint8)],
                                max_slots=4, heartbeat_s=0.1)
            tasks.append(asyncio.ensure_future(d.run()))
            deadline = time.monotonic() + 20
            while not d.prefillers.alive_count():
                assert time.monotonic() < deadline, "the prefiller never answered a Ping"
                await asyncio.sleep(0.05)
            for i in range(2):  # its share of the 4 job slots
                await socks[2].send(ENC.encode(SendPrefill.of(
                    f"r{i}", make_key(1, new_generation()), list(range(7)), [0, 1], 30.0)))
                got = await first(socks[0], (PrefillJob,), timeout=20)
                assert got.prompt_ids == list(range(7))
            events = []
            while await socks[2].poll(0):
                events.append(SCHED.decode(await socks[2].recv()))
            refused = [m for m in events if isinstance(m, AttemptEvent) and m.kind == "failed"]
            assert refused == []
            # the nonce slots were not used up: the flood's writes are known dead, their slots
            # back at once (on a loaded machine a few writes get posted before their deadline,
            # and those rest as before: a few, spread over the lanes, not the pool)
            assert len(p.gate.nonce_slots.quarantined) <= 128 // 4
        finally:
            stop.set()
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            p.close()
            if d is not None:
                d.close()
            for e in engines:
                await e.close()
            for s in socks:
                s.close(0)
            ctx.term()

    asyncio.run(main())
