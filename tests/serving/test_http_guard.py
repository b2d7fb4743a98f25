"""The gateway's connection guard in process (a fake backend, raw sockets): at the cap the
oldest idle connection makes room and, with every one busy, a newcomer gets a 503; bodies are
read within the shared budget, and over the limit refused unread."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from disagg.actors.http.http import Gateway
from disagg.serving.http_limits import MIN_CONNECTIONS, HttpLimits

CAP = MIN_CONNECTIONS


class NoBackend:
    def generate(self, **kw: object) -> AsyncIterator[object]:
        raise AssertionError("not reached: no request here gets that far")

    async def stats(self, timeout: float = 10.0) -> object:
        raise TimeoutError


async def gateway(**kw: object) -> Gateway:
    limits = HttpLimits(max_connections=CAP, header_timeout_s=60, body_timeout_s=60, **kw)
    gw = Gateway(NoBackend(), "127.0.0.1:0", "m", tokenizer=None,  # type: ignore[arg-type]
                 max_model_len=64, stats_label=None, limits=limits)
    await gw.start()
    return gw


async def until(cond, what: str, timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        assert asyncio.get_running_loop().time() < deadline, what
        await asyncio.sleep(0.01)


def head(length: int) -> bytes:
    return (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {length}\r\n\r\n").encode()


async def connect(gw: Gateway, data: bytes = b""):
    r, w = await asyncio.open_connection(gw.host, gw.port)
    if data:
        w.write(data)
        await w.drain()
    return r, w


async def answer(r: asyncio.StreamReader) -> bytes:
    return await asyncio.wait_for(r.read(), 10)  # all of it, to the server's close


async def response(r: asyncio.StreamReader) -> bytes:
    """One response, head and body (not waiting for the server to close)."""
    async def one() -> bytes:
        head = await r.readuntil(b"\r\n\r\n")
        length = next(int(x.split(b":")[1]) for x in head.split(b"\r\n")
                      if x.lower().startswith(b"content-length:"))
        return head + await r.readexactly(length)
    return await asyncio.wait_for(one(), 10)


async def test_at_the_cap_the_oldest_idle_connection_makes_room():
    gw = await gateway()
    assert gw.gate is not None
    try:
        idle = [await connect(gw) for _ in range(CAP)]
        await until(lambda: len(gw.gate.open_connections()) == CAP, "all accepted")
        r, w = await connect(gw, b"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert (await answer(r)).startswith(b"HTTP/1.1 200")
        assert await answer(idle[0][0]) == b""  # the oldest idle one was closed for it
        assert gw.gate.evicted >= 1 and gw.gate.refused == 0
        for _, w in idle:
            w.close()
    finally:
        await gw.stop()


async def test_with_every_connection_busy_a_newcomer_gets_a_503():
    gw = await gateway()
    assert gw.gate is not None
    try:
        busy = [await connect(gw, head(100) + b'{"prompt": ') for _ in range(CAP)]
        await until(lambda: len(gw._busy) == CAP, "every connection reading its body")
        r, _ = await connect(gw, b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
        got = await answer(r)
        assert got.startswith(b"HTTP/1.1 503") and b"too many HTTP connections" in got, got
        assert gw.gate.refused == 1 and gw.gate.evicted == 0
        for _, w in busy:
            w.close()
        await until(lambda: not gw._busy and gw._bodies.used == 0, "bodies given back")
    finally:
        await gw.stop()


async def test_bodies_share_a_budget_and_the_limit_is_checked_before_reading():
    gw = await gateway(max_body_bytes=1000, body_buffer_bytes=1500)
    try:
        _, w1 = await connect(gw, head(1000) + b"{")  # holds 1000 of the 1500
        await until(lambda: gw._bodies.used == 1000, "the first body counted")
        r2, _ = await connect(gw, head(600))
        got = await response(r2)
        assert got.startswith(b"HTTP/1.1 503") and b"overloaded" in got, got
        r3, _ = await connect(gw, head(1001))
        got = await response(r3)
        assert got.startswith(b"HTTP/1.1 413") and b"larger than 1000 bytes" in got, got
        chunked = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
                   b"\r\n" + b"%x\r\n%s\r\n" % (1200, b" " * 1200))
        r4, _ = await connect(gw, chunked)  # no length declared: cut at the limit
        got = await response(r4)
        assert got.startswith(b"HTTP/1.1 413"), got
        w1.close()
        await until(lambda: gw._bodies.used == 0, "the budget given back")
    finally:
        await gw.stop()


@pytest.mark.parametrize("data", [b"", b"GET /v1/mod"])
async def test_a_connection_without_a_whole_head_is_closed_at_the_header_timeout(data):
    limits = HttpLimits(header_timeout_s=0.3)
    gw = Gateway(NoBackend(), "127.0.0.1:0", "m", tokenizer=None,  # type: ignore[arg-type]
                 max_model_len=64, stats_label=None, limits=limits)
    await gw.start()
    try:
        r, _ = await connect(gw, data)
        assert await answer(r) == b""
    finally:
        await gw.stop()
