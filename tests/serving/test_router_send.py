"""The router's send to a decode node that fails (``RouterPlacement._send_to``: the connection
dropped and its monitor has not said so yet): the request goes to another live node, each node
tried once, and ends ``unavailable`` only when none takes it. In-process: a real ``Router``
in front of two fake decoders on ZeroMQ, one or both of whose sends are made to fail."""

from __future__ import annotations

import asyncio
import time

import msgspec
import pytest
import zmq
import zmq.asyncio

from disagg.actors.router.router import Router
from disagg.client import RequestError
from disagg.protocol import (
    ClientMessage,
    Finished,
    GenerateRequest,
    Ping,
    Pong,
    Stats,
    StatsRequest,
    TokenChunk,
    Usage,
)

STATS = Stats(role="decode", pages_total=100, pages_free=100, page_size=16, running=0,
              waiting=0, started=0, finished=0, aborted=0, errored=0, rejected=0, bad_frames=0,
              preemptions=0)


async def fake_decoder(sock: zmq.asyncio.Socket, name: str) -> None:
    """Answers Ping and Stats; streams one token (its text: ``name``) and ends each request."""
    enc, dec = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(ClientMessage)
    while True:
        ident, frame = await sock.recv_multipart()
        msg = dec.decode(frame)
        if isinstance(msg, Ping):
            await sock.send_multipart([ident, enc.encode(Pong())])
        elif isinstance(msg, StatsRequest):
            await sock.send_multipart([ident, enc.encode(STATS)])
        elif isinstance(msg, GenerateRequest):
            rid = msg.request_id
            await sock.send_multipart([ident, enc.encode(TokenChunk(rid, [7], name))])
            await sock.send_multipart([ident, enc.encode(Finished(rid, "length", Usage(3, 1)))])


class FailingSends:
    """A peer socket whose sends of requests fail as a dropped connection's do (heartbeats
    still pass, so the router keeps the peer live); counts the attempts."""

    def __init__(self, sock: zmq.asyncio.Socket) -> None:
        self.sock, self.attempts = sock, 0
        self.dec = msgspec.msgpack.Decoder(ClientMessage)

    async def send(self, frame: bytes, flags: int = 0) -> None:
        if isinstance(self.dec.decode(frame), GenerateRequest):
            self.attempts += 1
            raise zmq.Again("Resource temporarily unavailable")
        await self.sock.send(frame, flags)

    def __getattr__(self, name: str):
        return getattr(self.sock, name)


@pytest.fixture
async def two_nodes():
    ctx = zmq.asyncio.Context()
    socks, tasks, addrs = [], [], []
    for name in ("a", "b"):
        s = ctx.socket(zmq.ROUTER)
        s.setsockopt(zmq.LINGER, 0)
        addrs.append(f"tcp://127.0.0.1:{s.bind_to_random_port('tcp://127.0.0.1')}")
        socks.append(s)
        tasks.append(asyncio.create_task(fake_decoder(s, name)))
    router = Router(addrs, ctx=ctx, poll_interval=0.05)
    try:
        await router.start(wait_for_peer=10)
        deadline = time.monotonic() + 10
        while len(router.balancer.serving()) < 2:
            assert time.monotonic() < deadline, "both fake decoders were never live"
            await asyncio.sleep(0.05)
        yield router, addrs
    finally:
        await router.stop()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for s in socks:
            s.close()
        ctx.destroy(linger=0)


async def texts(router: Router, n: int) -> list[str]:
    out = []
    for i in range(n):
        text = ""
        async for m in router.generate(prompt_token_ids=[i + 1, 2, 3], request_id=str(i),
                                       timeout=10):
            if isinstance(m, TokenChunk):
                text += m.text
        out.append(text)
    return out


async def test_a_failed_send_goes_to_the_other_live_node(two_nodes):
    router, addrs = two_nodes
    a = addrs[0]
    failing = FailingSends(router.peers[a])
    router.peers[a] = failing  # type: ignore[assignment]
    assert await texts(router, 6) == ["b"] * 6  # none ended unavailable
    assert failing.attempts >= 1  # the balancer did pick the failing node, and it was passed over
    assert set(router.balancer.serving()) == set(addrs)  # both still live
    assert not router.flights
    assert all(p.in_flight == 0 for p in router.balancer.peers.values())  # none left counted


async def test_a_request_no_node_takes_ends_unavailable_after_trying_each_once(two_nodes):
    router, addrs = two_nodes
    failing = [FailingSends(router.peers[a]) for a in addrs]
    for a, f in zip(addrs, failing, strict=True):
        router.peers[a] = f  # type: ignore[assignment]
    for i in range(3):
        with pytest.raises(RequestError) as e:
            await texts(router, 1)
        assert e.value.error.code == "unavailable"
        assert "could not send to" in e.value.error.message
        assert all(a in e.value.error.message for a in addrs)
        assert [f.attempts for f in failing] == [i + 1, i + 1]  # each node once per request
    assert not router.flights
    assert all(p.in_flight == 0 for p in router.balancer.peers.values())
