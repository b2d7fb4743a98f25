"""The clients name a request's tenant (``GenerateRequest.tenant``): ``Client.generate`` and
``AsyncClient.generate`` take ``tenant=``, ``disagg-client`` takes ``--tenant``. Checked against
a fake node on ZeroMQ that records the requests it gets, answers each with one token, and
refuses a tenant the way a node's intake does (``GenerateRequest.validate``)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator

import msgspec
import pytest
import zmq

from disagg.cli.client import main
from disagg.client import AsyncClient, Client
from disagg.protocol import (
    ClientMessage,
    Error,
    Finished,
    GenerateRequest,
    Ping,
    Pong,
    TokenChunk,
    Usage,
)


class FakeNode:
    """A ROUTER socket served from a thread: each GenerateRequest is kept in ``got`` and
    answered with one token and ``Finished``, or ``bad_request`` when it is invalid; a Ping
    with a Pong."""

    def __init__(self) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.address = f"tcp://127.0.0.1:{self.sock.bind_to_random_port('tcp://127.0.0.1')}"
        self.got: list[GenerateRequest] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        enc, dec = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(ClientMessage)
        while not self.stop.is_set():
            if not self.sock.poll(50):
                continue
            ident, frame = self.sock.recv_multipart()
            msg = dec.decode(frame)
            if isinstance(msg, Ping):  # disagg-client's first contact
                self.sock.send_multipart([ident, enc.encode(Pong())])
                continue
            if not isinstance(msg, GenerateRequest):
                continue
            self.got.append(msg)
            rid = msg.request_id
            bad = msg.validate()
            if bad is not None:
                self.sock.send_multipart([ident, enc.encode(Error("bad_request", bad, rid))])
                continue
            self.sock.send_multipart([ident, enc.encode(TokenChunk(rid, [7], "x"))])
            self.sock.send_multipart([ident, enc.encode(Finished(rid, "length", Usage(3, 1)))])

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        self.sock.close()
        self.ctx.term()


@pytest.fixture
def fake_node() -> Iterator[FakeNode]:
    n = FakeNode()
    try:
        yield n
    finally:
        n.close()


def test_the_sync_client_names_the_tenant(fake_node):
    c = Client(fake_node.address)
    try:
        assert [type(m) for m in c.generate(prompt_token_ids=[1, 2], tenant="alice",
                                            timeout=10)] == [TokenChunk, Finished]
        list(c.generate(prompt_token_ids=[1, 2], timeout=10))
    finally:
        c.close()
    assert [r.tenant for r in fake_node.got] == ["alice", None]


async def test_the_async_client_names_the_tenant(fake_node):
    c = AsyncClient(fake_node.address)
    try:
        async for _ in c.generate(prompt_token_ids=[1, 2], tenant="bob", timeout=10):
            pass
    finally:
        await c.close()
    assert [r.tenant for r in fake_node.got] == ["bob"]


def test_disagg_client_sends_its_tenant_flag(fake_node, capsys):
    main(["--connect", fake_node.address, "--prompt-token-ids", "1,2", "--tenant", "team-a",
          "--json", "--timeout", "10"])
    assert json.loads(capsys.readouterr().out)["token_ids"] == [7]
    main(["--connect", fake_node.address, "--prompt-token-ids", "1,2", "--json",
          "--timeout", "10"])
    assert [r.tenant for r in fake_node.got] == ["team-a", None]


def test_disagg_client_reports_a_refused_tenant(fake_node, capsys):
    with pytest.raises(SystemExit) as e:
        main(["--connect", fake_node.address, "--prompt-token-ids", "1,2",
              "--tenant", "t" * 257, "--timeout", "10"])
    assert e.value.code == 1
    assert "tenant must have 1-256 characters, got 257" in capsys.readouterr().err
