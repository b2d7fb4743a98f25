"""The clients name a request's tenant (``GenerateRequest.tenant``): ``Client.generate`` and
``AsyncClient.generate`` take ``tenant=``, ``disagg-client`` takes ``--tenant``. Checked against
a fake node on ZeroMQ that records the requests it gets, answers each with one token, and
refuses a tenant the way a node's intake does (``GenerateRequest.validate``)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from disagg.cli.client import main
from disagg.client import AsyncClient, Client
from disagg.protocol import Finished, TokenChunk
from nodes import FakeClientNode


@pytest.fixture
def fake_node() -> Iterator[FakeClientNode]:
    n = FakeClientNode()
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
    assert [r.tenant for r in fake_node.requests] == ["alice", None]


async def test_the_async_client_names_the_tenant(fake_node):
    c = AsyncClient(fake_node.address)
    try:
        async for _ in c.generate(prompt_token_ids=[1, 2], tenant="bob", timeout=10):
            pass
    finally:
        await c.close()
    assert [r.tenant for r in fake_node.requests] == ["bob"]


def test_disagg_client_sends_its_tenant_flag(fake_node, capsys):
    main(["--connect", fake_node.address, "--prompt-token-ids", "1,2", "--tenant", "team-a",
          "--json", "--timeout", "10"])
    assert json.loads(capsys.readouterr().out)["token_ids"] == [7]
    main(["--connect", fake_node.address, "--prompt-token-ids", "1,2", "--json",
          "--timeout", "10"])
    assert [r.tenant for r in fake_node.requests] == ["team-a", None]


def test_disagg_client_reports_a_refused_tenant(fake_node, capsys):
    with pytest.raises(SystemExit) as e:
        main(["--connect", fake_node.address, "--prompt-token-ids", "1,2",
              "--tenant", "t" * 257, "--timeout", "10"])
    assert e.value.code == 1
    assert "tenant must have 1-256 characters, got 257" in capsys.readouterr().err
