"""Operations behind a router over two real mixed nodes (issue 36): tenants keep their own
share of a decoder behind the router; a node drained under load (POST /drain on its metrics
endpoint) admits nothing new, finishes its streams and exits within its drain timeout, and no
request is lost; once the last node is dead, the router's /health says 503 exactly as requests
get ``unavailable``. The tests run in this order on the module's nodes."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
import urllib.error
import urllib.request

import pytest

from disagg.actors.router.router import start_router
from disagg.cli.node import drain_command
from disagg.client import RequestError
from disagg.protocol import Finished, SamplingParams, TokenChunk
from nodes import LoopThread, node, running, wait_for
from tinymodels import free_port

pytestmark = pytest.mark.procs

MODEL = "tiny-llama"
DRAIN_TIMEOUT_S = 30.0
PER_CLIENT = 6  # --max-requests-per-client: the router is one client of each node


@pytest.fixture(scope="module")
def nodes(chat_llama, tmp_path_factory):
    logs = tmp_path_factory.mktemp("drain-logs")
    out = {}
    for _ in range(2):
        metrics = f"127.0.0.1:{free_port()}"
        addr, proc = node("mixed", chat_llama, logs, "--num-pages", "96", "--max-model-len",
                          "256", "--metrics-listen", metrics, "--drain-timeout",
                          str(DRAIN_TIMEOUT_S), "--max-requests-per-client", str(PER_CLIENT))
        out[addr] = (proc, metrics)
    with running([p for p, _ in out.values()]):
        yield out


@pytest.fixture(scope="module")
def router(nodes, chat_llama):
    lt = LoopThread()
    r, gw = lt.run(start_router(f"tcp://127.0.0.1:{free_port()}", list(nodes), "127.0.0.1:0",
                                str(chat_llama), MODEL, poll_interval=0.2, dead_after=1.5,
                                wait_for_peer=30))
    wait_for(lambda: len(r.balancer.serving()) == 2, what="both nodes live")
    yield lt, r, gw
    lt.run(gw.stop())
    lt.run(r.stop())
    lt.close()


async def one(r, prompt_ids: list[int], max_tokens: int, tenant: str | None = None
              ) -> tuple[list[int], str]:
    """A greedy request through the router: (tokens, finish reason or error code)."""
    tokens: list[int] = []
    try:
        async for msg in r.generate(prompt_token_ids=prompt_ids, tenant=tenant, timeout=120,
                                    sampling=SamplingParams(max_tokens=max_tokens,
                                                            ignore_eos=True)):
            if isinstance(msg, TokenChunk):
                tokens += msg.token_ids
            elif isinstance(msg, Finished):
                return tokens, msg.reason
    except RequestError as e:
        return tokens, e.error.code
    return tokens, "no finish"


def test_a_flooding_tenant_leaves_another_admitted_behind_the_router(router):
    """16 requests of one tenant and then one of another, all through the router: each node
    takes PER_CLIENT of the flood and refuses the rest ``overloaded``, and still admits the
    other tenant's (before, all of the router's requests shared one share: it was refused)."""
    lt, r, _ = router

    async def scenario():
        flood = [asyncio.ensure_future(one(r, [5 + i, 6, 7], 64, tenant="flood"))
                 for i in range(16)]
        await asyncio.sleep(0)  # the flood goes out first
        calm = asyncio.ensure_future(one(r, [9, 8, 7], 8, tenant="calm"))
        return await asyncio.gather(*flood), await calm

    flood, calm = lt.run(scenario())
    codes = [code for _, code in flood]
    assert codes.count("overloaded") >= 16 - 2 * PER_CLIENT, codes
    assert calm == (calm[0], "length") and len(calm[0]) == 8
    assert all(code in ("length", "overloaded") for code in codes)


def test_a_node_drained_under_load_loses_no_request_and_exits_in_time(router, nodes, caplog):
    lt, r, _ = router
    drained, other = list(nodes)
    proc, metrics = nodes[drained]
    started = threading.Event()
    results: list[tuple[list[int], str]] = []

    async def load():
        # a tenant each: the router is one client of each node (PER_CLIENT)
        early = [asyncio.ensure_future(one(r, [11 + i % 40, 3, 4], 160, tenant=f"t{i}"))
                 for i in range(24)]
        while not any(r.flights[k].streamed for k in list(r.flights)
                      if r.flights[k].peer == drained):
            await asyncio.sleep(0.01)
        started.set()  # the drained node streams some of them now
        await asyncio.sleep(0.3)  # the drain has begun: these come after it
        late = [asyncio.ensure_future(one(r, [13 + i, 3, 4], 16, tenant=f"late{i}"))
                for i in range(8)]
        results.extend(await asyncio.gather(*early, *late))

    with caplog.at_level("INFO", logger="disagg.actors.router.router"):
        fut = asyncio.run_coroutine_threadsafe(load(), lt.loop)
        assert started.wait(60), "no request reached the node to drain"
        on_it = sum(f.peer == drained for f in list(r.flights.values()))
        t0 = time.monotonic()
        # what a pod's preStop hook runs: POST /drain, then wait for the node to be gone
        assert drain_command([metrics, "--wait", str(DRAIN_TIMEOUT_S + 15)]) == 0
        code = proc.proc.wait(timeout=15)
        exited_after = time.monotonic() - t0
        fut.result(timeout=120)
    assert code == 0
    lost = [(len(t), why) for t, why in results if why != "length"]
    assert not lost, lost
    assert [len(t) for t, _ in results] == [160] * 24 + [16] * 8
    assert f"decode peer {drained} is draining" in caplog.text
    assert "moved to" not in caplog.text  # its streams ended on it, none migrated
    log = proc.log_path.read_text()
    assert "drained: every live request ended" in log
    print(f"drain: {on_it} requests on the drained node at POST /drain, "
          f"{len(results)}/{len(results)} finished, exit 0 after {exited_after:.1f} s "
          f"(--drain-timeout {DRAIN_TIMEOUT_S:g})")
    wait_for(lambda: r.balancer.serving() == [other], what="the drained node gone")


def _health(url: str) -> int:
    try:
        with urllib.request.urlopen(url + "/health", timeout=10) as resp:
            return resp.status
    except urllib.error.HTTPError as e:
        return e.code


def test_health_agrees_with_requests_once_the_last_node_is_dead(router, nodes):
    """The last node SIGKILLed: the router sees its connection drop, and from the moment a
    request gets ``unavailable`` /health answers 503 (it answered 200 for ~4 s more)."""
    lt, r, gw = router
    _, last = list(nodes)
    proc, _ = nodes[last]
    assert _health(gw.url) == 200
    assert lt.run(one(r, [7, 7, 7], 2))[1] == "length"
    kids = proc.children()
    proc.proc.send_signal(signal.SIGKILL)
    proc.proc.wait(10)
    for k in kids:
        os.kill(k, signal.SIGKILL)
    wait_for(lambda: lt.run(one(r, [7, 7, 7], 2))[1] == "unavailable", timeout=10,
             what="requests refused")
    for _ in range(5):  # from then on both say so, together
        assert _health(gw.url) == 503
        assert lt.run(one(r, [7, 7, 7], 2))[1] == "unavailable"
