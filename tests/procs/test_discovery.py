"""Peers that come and go (``dns:NAME:PORT``): nodes bound to distinct loopback addresses
(127.0.0.2, 127.0.0.3, ...) stand for hosts, and a resolver file (the test hook
``DISAGG_TEST_RESOLVER``) for the DNS of a headless Service, changed while requests run."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from nodes import Req, node, pools_full, prompt, running, stats, wait_for
from tinymodels import free_port, hf_greedy, make_tiny_model

pytestmark = pytest.mark.fabric

SLOW = {"DISAGG_TEST_LAYER_DELAY_S": "0.05"}  # each layer of each prefill step >= 50 ms
LONG = 49  # 48 prefill tokens in chunks of 4: 12 steps, >= 1.2 s of prefill each
FAST = ["--heartbeat", "0.2", "--peer-timeout", "1.0", "--peer-resolve-interval", "0.2"]
P1, P2, D, M = "127.0.0.2", "127.0.0.3", "127.0.0.4", "127.0.0.5"  # the "hosts"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model("llama", tmp_path_factory.mktemp("discovery") / "llama")


class Dns:
    """The resolver file every node reads again at each resolution."""

    def __init__(self, path: Path):
        self.path = path
        self.env = {"DISAGG_TEST_RESOLVER": str(path)}

    def set(self, **names: list[str]) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({k.replace("_", "."): v for k, v in names.items()}))
        os.replace(tmp, self.path)  # a node never reads half a file


@pytest.fixture(scope="module")
def cluster(model_dir, tmp_path_factory):
    """Two prefillers on one port (P1, P2), a decoder using dns:prefill.test (on retry) and
    a mixed node on the decoder's port (M): only P1 is in the DNS at first."""
    tmp = tmp_path_factory.mktemp("hosts")
    dns = Dns(tmp / "dns.json")
    dns.set(prefill_test=[P1], decode_test=[D])
    p_port, d_port = free_port(), free_port()
    env = {**dns.env, **SLOW}
    pre = [node("prefill", model_dir, tmp, "--num-pages", "64", "--max-batch-tokens", "4",
                addr=f"tcp://{ip}:{p_port}", log=tmp / f"prefill-{ip}.log", env=env)
           for ip in (P1, P2)]
    dec = node("decode", model_dir, tmp, "--num-pages", "256", "--on-prefill-failure", "retry",
               "--prefill-peer", f"dns:prefill.test:{p_port}", *FAST, addr=f"tcp://{D}:{d_port}",
               log=tmp / "decode.log", env=dns.env)
    mixed = node("mixed", model_dir, tmp, "--num-pages", "128", addr=f"tcp://{M}:{d_port}",
                 log=tmp / "mixed.log")
    with running([p for _, p in pre] + [dec[1], mixed[1]]):
        yield dns, [a for a, _ in pre], dec[0], mixed[0], d_port, tmp


def alive(addr: str) -> int:
    return stats(addr).prefill_peers_alive


def check(reqs: list[Req], model_dir: Path, new: int = 4,
          ok_codes: tuple[str | None, ...] = (None,)) -> None:
    """Every request ended (within its deadline) with an accepted code; those that succeeded
    with the transformers greedy tokens."""
    for r in reqs:
        r.join()
        assert r.code in ok_codes, r.code
        if r.code is None:
            assert r.tokens == hf_greedy(model_dir, r.ids, new) and r.reason == "length"


def test_prefillers_scale_out_and_in_under_load(cluster, model_dir):
    dns, (p1, p2), d_addr, _, _, tmp = cluster
    dns.set(prefill_test=[P1], decode_test=[D])
    wait_for(lambda: alive(d_addr) == 1, what="P1 seen through dns")
    first = [Req(d_addr, prompt(LONG, salt=i)) for i in range(2)]  # both on P1: its only peer
    wait_for(lambda: stats(p1).running > 0, what="P1 prefilling")
    dns.set(prefill_test=[P1, P2], decode_test=[D])  # scale out mid-load
    wait_for(lambda: alive(d_addr) == 2, timeout=10, what="P2 picked up")
    second = [Req(d_addr, prompt(LONG, salt=10 + i)) for i in range(2)]  # P2 is less loaded
    assert stats(p1).running > 0, "P1 finished too early for the test to mean anything"
    dns.set(prefill_test=[P2], decode_test=[D])  # scale in mid-load: P1's attempts retried
    wait_for(lambda: alive(d_addr) == 1, timeout=10, what="P1 dropped")
    check(first + second, model_dir)
    assert "left the peer set" in (tmp / "decode.log").read_text()
    assert stats(p2).kv_writes_sent > 0
    # a failed resolution keeps the last known set; an empty one leaves none (local prefill)
    dns.set(decode_test=[D])
    time.sleep(1.0)
    assert alive(d_addr) == 1
    assert "could not resolve dns:prefill.test" in (tmp / "decode.log").read_text()
    dns.set(prefill_test=[], decode_test=[D])
    wait_for(lambda: alive(d_addr) == 0, timeout=10, what="no prefiller left")
    check([Req(d_addr, prompt(LONG, salt=20))], model_dir)
    for addr in (d_addr, p1, p2):
        wait_for(lambda a=addr: pools_full(a), what=f"full pool on {addr}")
        s = stats(addr)
        assert s.started == s.finished + s.aborted + s.errored
    assert stats(d_addr).errored == 0
    dns.set(prefill_test=[P2], decode_test=[D])  # as the fixture's other users expect
    wait_for(lambda: alive(d_addr) == 1, timeout=10, what="P2 back")


def test_router_picks_up_a_second_decoder_and_drops_the_first(cluster, model_dir):
    dns, prefillers, d_addr, m_addr, d_port, tmp = cluster
    dns.set(prefill_test=[P2], decode_test=[D])
    r_addr, router = node("router", model_dir, tmp, "--decode-peer", f"dns:decode.test:{d_port}",
                          "--peer-resolve-interval", "0.2", env=dns.env, log=tmp / "router.log")
    with running([router]):
        d_before = stats(d_addr).started
        check([Req(r_addr, prompt(9, salt=i)) for i in range(2)], model_dir)
        assert stats(d_addr).started - d_before == 2  # its only peer
        total = stats(d_addr).pages_total + stats(m_addr).pages_total
        dns.set(prefill_test=[P2], decode_test=[D, M])  # scale out
        wait_for(lambda: stats(r_addr).pages_total == total, what="router sees both")
        m_before = stats(m_addr).started
        check([Req(r_addr, prompt(9, salt=30 + i)) for i in range(4)], model_dir)
        assert stats(m_addr).started > m_before
        # scale in mid-load: D's requests not streamed yet move to M, streamed ones end
        reqs = [Req(r_addr, prompt(LONG, salt=40 + i), max_tokens=8) for i in range(4)]
        dns.set(prefill_test=[P2], decode_test=[M])
        wait_for(lambda: stats(r_addr).pages_total == stats(m_addr).pages_total,
                 what="router dropped D")
        check(reqs, model_dir, 8, ok_codes=(None, "unavailable"))
        after = [Req(r_addr, prompt(9, salt=50 + i)) for i in range(2)]
        check(after, model_dir)
        assert "left the peer set" in (tmp / "router.log").read_text()
    for addr in (d_addr, m_addr, *prefillers):
        wait_for(lambda a=addr: pools_full(a), what=f"full pool on {addr}")
