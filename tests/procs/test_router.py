"""The router in front of two real mixed nodes: client protocol and HTTP, aborts, a node killed."""

from __future__ import annotations

import os
import signal
import time

import msgspec
import pytest
import zmq

from disagg.actors.router.router import start_router
from disagg.client import Client, RequestError
from disagg.protocol import Error, Finished, SamplingParams, Stats, TokenChunk
from nodes import LoopThread, node, openai_client, running, stats, wait_for
from tinymodels import free_port

MODEL = "tiny-llama"
MAX_LEN = 128


@pytest.fixture(scope="module")
def model_dir(chat_llama):
    return chat_llama


@pytest.fixture(scope="module")
def nodes(model_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("log")
    procs = dict(node("mixed", model_dir, logs, "--num-pages", "48", "--max-model-len",
                      str(MAX_LEN)) for _ in range(2))
    with running(list(procs.values())):
        yield procs


@pytest.fixture(scope="module")
def router(nodes, model_dir):
    lt = LoopThread()
    listen = f"tcp://127.0.0.1:{free_port()}"
    r, gw = lt.run(start_router(listen, list(nodes), "127.0.0.1:0", str(model_dir), MODEL,
                                poll_interval=0.2, dead_after=1.5, wait_for_peer=30))
    lt.run(wait_all_live(r))
    yield r, gw
    lt.run(gw.stop())
    lt.run(r.stop())
    lt.close()


async def wait_all_live(r, timeout=30.0):
    import asyncio

    deadline = time.monotonic() + timeout
    while len(r.balancer.alive()) < len(r.balancer.order):
        assert time.monotonic() < deadline, (
            f"decode peers never answered: {r.balancer.peers} tasks {r._tasks}")
        await asyncio.sleep(0.05)


@pytest.fixture(scope="module")
def oai(router):
    with openai_client(router[1].url) as client:
        yield client


def run(addr, **kw):
    c = Client(addr)
    try:
        return list(c.generate(**kw, timeout=30))
    finally:
        c.close()


def test_requests_spread_over_both_nodes(router, nodes):
    before = {a: stats(a).started for a in nodes}
    sp = SamplingParams(max_tokens=3, ignore_eos=True)
    for i in range(4):
        msgs = run(router[0].address, prompt=f"w{i + 5} w9", sampling=sp, request_id="same")
        assert isinstance(msgs[-1], Finished) and msgs[-1].request_id == "same"
        assert msgs[-1].usage.completion_tokens == 3
    after = {a: stats(a).started for a in nodes}
    assert all(after[a] > before[a] for a in nodes), (before, after)
    s = stats(router[0].address)
    assert s.role == "router" and s.pages_total == 2 * 48


def test_front_door_validates_and_forwards_aborts(router, nodes):
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(router[0].address)
    dec = msgspec.msgpack.Decoder(TokenChunk | Finished | Error | Stats)

    def recv():
        assert sock.poll(30_000), "no reply from the router"
        return dec.decode(sock.recv())

    try:
        sock.send(b"\xc1 junk")
        assert recv().code == "bad_frame"
        sock.send(msgspec.msgpack.encode({"type": "abort", "request_id": "ghost"}))
        assert recv().code == "unknown_request"
        aborted = sum(stats(a).aborted for a in nodes)
        sock.send(msgspec.msgpack.encode({"type": "generate", "request_id": "long",
                                          "prompt": "w5 w6",
                                          "sampling": {"max_tokens": MAX_LEN - 4,
                                                       "ignore_eos": True}}))
        first = recv()
        assert isinstance(first, TokenChunk) and first.request_id == "long"
        sock.send(msgspec.msgpack.encode({"type": "abort", "request_id": "long"}))
        while not isinstance(msg := recv(), Finished):
            assert isinstance(msg, TokenChunk)
        assert msg.reason == "abort" and msg.request_id == "long"
        assert sum(stats(a).aborted for a in nodes) == aborted + 1
        sock.send(msgspec.msgpack.encode({"type": "generate", "request_id": "bad",
                                          "prompt_token_ids": [1],
                                          "sampling": {"max_tokens": 0}}))
        err = recv()  # the node's refusal comes back under the client's id
        assert isinstance(err, Error) and err.code == "bad_request" and err.request_id == "bad"
    finally:
        sock.close()
        ctx.term()


def test_http_through_the_router(oai):
    r = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "w7"}],
                                    max_tokens=4, temperature=0)
    assert r.usage.completion_tokens <= 4 and r.choices[0].message.role == "assistant"
    chunks = list(oai.completions.create(model=MODEL, prompt="w5 w6", max_tokens=4,
                                         temperature=0, stream=True,
                                         stream_options={"include_usage": True},
                                         extra_body={"ignore_eos": True}))
    assert chunks[-1].usage.completion_tokens == 4


def test_requests_refused_by_a_restarting_node_go_to_the_other(router, nodes, caplog):
    """An executor of one node dies: while that node restarts it answers every request with
    ``unavailable``; the router sends those requests to the other node, so clients see none of
    it (they used to get the node's ``unavailable``). The request the executor died under ends
    with ``internal`` there and migrates (tests/procs/test_migration.py): it ends as it would
    have, or ``internal`` past its bounds."""
    restarting, _ = list(nodes)
    proc = nodes[restarting]

    def starts() -> int:
        return sum("ready:" in line for line in proc.log_path.read_text().splitlines())

    before = starts()
    [executor] = proc.children()
    os.kill(executor, signal.SIGKILL)
    sp = SamplingParams(max_tokens=2, ignore_eos=True)
    outcomes = []
    deadline = time.monotonic() + 60
    with caplog.at_level("INFO", logger="disagg.actors.router.router"):
        while starts() == before and time.monotonic() < deadline:  # until it serves again
            c = Client(router[0].address)
            try:
                outcomes.append(list(c.generate(prompt_token_ids=[5 + len(outcomes) % 50],
                                                sampling=sp, timeout=30))[-1])
            except RequestError as e:
                outcomes.append(e.error)
            finally:
                c.close()
    refused = [m for m in outcomes if isinstance(m, Error) and m.code != "internal"]
    assert not refused, refused[:3]
    assert sum(isinstance(m, Finished) for m in outcomes) >= 3
    # the restarting node was asked and refused, or its heartbeat said so first
    assert ("is unavailable, resent to" in caplog.text
            or f"decode peer {restarting} refuses new requests" in caplog.text)
    wait_for(lambda: len(router[0].balancer.alive()) == 2, what="both nodes live again")


def test_router_survives_a_killed_node(router, nodes, oai):
    victim, survivor = list(nodes)
    proc = nodes[victim]
    kids = proc.children()
    proc.proc.send_signal(signal.SIGKILL)
    proc.proc.wait(10)
    for k in kids:
        os.kill(k, signal.SIGKILL)
    proc.stop()
    before = stats(survivor).started
    sp = SamplingParams(max_tokens=3, ignore_eos=True)
    for i in range(4):  # the first ones may go to the dead node: resent once it is declared dead
        msgs = run(router[0].address, prompt=f"w{i + 5}", sampling=sp)
        assert isinstance(msgs[-1], Finished) and msgs[-1].usage.completion_tokens == 3
        r = oai.completions.create(model=MODEL, prompt="w5", max_tokens=2, temperature=0,
                                   extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 2
    assert stats(survivor).started >= before + 8
    assert router[0].balancer.alive() == [survivor]
    import urllib.request

    with urllib.request.urlopen(router[1].url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    assert f'disagg_router_peer_up{{peer="{victim}"}} 0.0' in text
    with urllib.request.urlopen(router[1].url + "/health", timeout=10) as resp:
        assert resp.status == 200
