"""A client whose CURVE handshake fails (no keys, the wrong server key, a key the node does not
admit) gets ``HandshakeError`` within its timeout, on every call, sync and async; the node
side logs refused handshakes, rate-limited."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest
import zmq

from disagg.client import AsyncClient, Client, HandshakeError
from disagg.serving import security
from disagg.serving.security import RefusalLog, handshake_refusal


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("hs")
    security.keygen(d / "cluster")
    security.keygen(d / "other")
    return d


@pytest.fixture
def server(keys):
    """A CURVE ROUTER on the cluster's node keys (ZAP: the cluster's clients), in its own
    context; yields its address."""
    ctx = zmq.Context()
    security.install(ctx, security.load_node(keys / "cluster" / "node"))
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    security.server(sock)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    try:
        yield f"tcp://127.0.0.1:{port}", sock
    finally:
        sock.close()
        security.uninstall(ctx)
        ctx.term()


def wrong_keys(keys: Path, how: str) -> security.CurveKeys | None:
    if how == "none":
        return None
    other = security.load_client(keys / "other" / "client")
    if how == "wrong_server_key":
        return other  # its cluster's server key: no handshake completes
    cluster = security.load_client(keys / "cluster" / "client")
    # the right server key, a keypair the node does not admit
    return security.CurveKeys(other.directory, cluster.server_public, other.public, other.secret)


WAYS = ["none", "wrong_server_key", "unauthorised"]


@pytest.mark.parametrize("how", WAYS)
def test_sync_client_fails_with_the_handshake_error_not_a_hang(keys, server, how, monkeypatch):
    monkeypatch.delenv("DISAGG_CURVE_KEYS", raising=False)
    addr, _ = server
    c = Client(addr, wrong_keys(keys, how))
    try:
        for _ in range(2):  # every call, not only the first
            with pytest.raises(HandshakeError) as e:
                c.stats(timeout=60)
            assert ("not authorised" in str(e.value)) == (how == "unauthorised")
            with pytest.raises(HandshakeError):
                list(c.generate(prompt="hi", timeout=60))
    finally:
        c.close()


@pytest.mark.parametrize("how", WAYS)
def test_async_client_fails_with_the_handshake_error_on_every_call(keys, server, how,
                                                                   monkeypatch):
    monkeypatch.delenv("DISAGG_CURVE_KEYS", raising=False)
    addr, _ = server

    async def main() -> None:
        c = AsyncClient(addr, curve_keys=wrong_keys(keys, how))
        try:
            for _ in range(3):
                with pytest.raises(HandshakeError) as e:
                    await c.complete(prompt="hi", timeout=60)
                assert ("not authorised" in str(e.value)) == (how == "unauthorised")
            with pytest.raises(HandshakeError):
                await c.stats(timeout=60)
        finally:
            await c.close()

    asyncio.run(main())


def test_the_right_keys_still_reach_the_node(keys, server):
    addr, sock = server
    c = Client(addr, security.load_client(keys / "cluster" / "client"))
    try:
        c._send(b"hello", timeout=60)
        assert sock.poll(60_000)
        assert sock.recv_multipart()[1] == b"hello"
        assert c.refused is None
    finally:
        c.close()


def test_a_send_with_no_connection_ends_at_its_deadline(monkeypatch):
    """No listener: the DEALER holds no pipe (IMMEDIATE), so the send itself must give up."""
    monkeypatch.delenv("DISAGG_CURVE_KEYS", raising=False)

    async def main() -> None:
        c = AsyncClient("tcp://127.0.0.1:9")
        c.sock.setsockopt(zmq.IMMEDIATE, 1)
        c.sock.disconnect("tcp://127.0.0.1:9")
        c.sock.connect("tcp://127.0.0.1:9")
        try:
            with pytest.raises(TimeoutError, match="could not send"):
                await c.stats(timeout=0.3)
        finally:
            await c.close()

    asyncio.run(main())


def test_node_logs_refused_keys_rate_limited(keys, server, caplog, monkeypatch):
    addr, _ = server
    monkeypatch.setattr(security.REFUSALS, "_last", None)  # earlier tests' refusals
    caplog.set_level(logging.WARNING, logger="disagg.serving.security")
    before = security.REFUSALS.total
    c = Client(addr, wrong_keys(keys, "unauthorised"))
    try:
        with pytest.raises(HandshakeError):
            c.stats(timeout=60)
    finally:
        c.close()
    assert security.REFUSALS.total > before
    other = security.load_client(keys / "other" / "client").public.decode()
    assert f"key {other} is not authorised" in caplog.text


def test_refusal_log_warns_first_then_once_per_interval(caplog):
    caplog.set_level(logging.WARNING, logger="test.refusals")
    r = RefusalLog(interval=10.0, logger=logging.getLogger("test.refusals"))
    assert r.note("a", now=100.0)
    assert not r.note("b", now=101.0)
    assert not r.note("c", now=109.9)
    assert r.note("d", now=110.0)
    assert r.total == 4
    lines = [rec.getMessage() for rec in caplog.records]
    assert len(lines) == 2
    assert "a" in lines[0] and "more" not in lines[0]
    assert "d (and 2 more refused" in lines[1]


def test_handshake_refusal_names_the_reason():
    assert "not authorised" in (handshake_refusal(zmq.EVENT_HANDSHAKE_FAILED_AUTH, 400) or "")
    for ev in (zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL):
        assert "handshake with the node failed" in (handshake_refusal(ev, 1) or "")
    for ev in (zmq.EVENT_CONNECTED, zmq.EVENT_DISCONNECTED, zmq.EVENT_HANDSHAKE_SUCCEEDED):
        assert handshake_refusal(ev, 0) is None
