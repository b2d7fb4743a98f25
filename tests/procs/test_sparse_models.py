"""MoE and MLA models in real nodes: a mixed node under TP 2, prefill -> decode pairs with
equal and different TP (MLA's latent replicated on every rank: a narrower decoder takes each
chunk's pages in shares from every source replica), token-exact with transformers; a GQA prefiller refused by an
MLA decoder by name."""

from __future__ import annotations

import time

import pytest

from disagg.client import Client
from disagg.model.config import ModelArch
from disagg.protocol import SamplingParams
from disagg.protocol.peer import KVLayoutDesc
from disagg.remote.transfer_plan import CONTEXT_UNITS, request_units, shard_kv_heads
from nodes import pools_full, stats, wait_for
from tinymodels import NodeProcess, free_port, hf_greedy, make_tiny_model

PAGE = 4
COMMON = ["--page-size", str(PAGE), "--num-pages", "64", "--threads", "1"]


def prompt(n: int) -> list[int]:
    return [(7 * i + 11) % 290 + 5 for i in range(n)]


def generate(c: Client, ids: list[int], n: int) -> list[int]:
    return [t for m in c.generate(prompt_token_ids=ids, sampling=SamplingParams(
        max_tokens=n, ignore_eos=True)) for t in getattr(m, "token_ids", [])]


def desc(arch: ModelArch, tp: int) -> KVLayoutDesc:
    """The layout a node of ``arch`` under ``tp`` advertises (what the planner counts with)."""
    per, replicas = shard_kv_heads(arch.num_kv_heads, tp)
    return KVLayoutDesc(arch.num_layers, 64, per, PAGE, arch.head_dim, "float32", 4,
                        arch.hidden_size, tp, replicas, arch.layout_kind, arch.kv_parts)


def wait_prefiller(c: Client) -> None:
    deadline = time.monotonic() + 60
    while c.stats().prefill_peers_alive == 0:
        assert time.monotonic() < deadline, "prefiller never seen"
        time.sleep(0.1)


@pytest.mark.parametrize("kind", ["deepseek_v2", "qwen3_moe"])
def test_mixed_node_tp2_matches_transformers(kind, tmp_path):
    path = make_tiny_model(kind, tmp_path / kind)
    addr = f"tcp://127.0.0.1:{free_port()}"
    node = NodeProcess(["--model", str(path), "--listen", addr, "--tp", "2",
                        "--max-batch-tokens", "6", *COMMON], tmp_path / "node.log")
    try:
        node.wait_ready()
        c = Client(addr)
        try:
            for n in (1, PAGE + 1, 3 * PAGE + 2):
                assert generate(c, prompt(n), 5) == hf_greedy(path, prompt(n), 5), n
            s = c.stats()
            assert s.pages_free == s.pages_total
        finally:
            c.close()
    finally:
        assert node.stop() == []


@pytest.mark.fabric
@pytest.mark.parametrize("kind, p_tp, d_tp", [("deepseek_v3", 1, 2), ("deepseek_v3", 2, 1),
                                              ("deepseek_v3", 2, 2), ("qwen2_moe", 1, 2)])
def test_prefill_decode_pairs_match_transformers(kind, p_tp, d_tp, tmp_path):
    """Every page of every layer lands on every decoder rank exactly as counted; tokens equal
    transformers'; both pools full after. Every prefiller rank sent a share of the longest
    prompt's pages (``Stats.kv_units_sent_by_rank``: with MLA's latent on a ``--tp 2``
    prefiller, both source replicas of one transfer, to one decoder rank too), and the ranks'
    units add up to what the decoder counted, less the context write."""
    path = make_tiny_model(kind, tmp_path / kind)
    arch = ModelArch.from_dir(path)
    p_addr, d_addr = (f"tcp://127.0.0.1:{free_port()}" for _ in range(2))
    p = NodeProcess(["--role", "prefill", "--model", str(path), "--listen", p_addr, "--tp",
                     str(p_tp), "--max-batch-tokens", "5", *COMMON], tmp_path / "p.log")
    d = NodeProcess(["--role", "decode", "--model", str(path), "--listen", d_addr, "--tp",
                     str(d_tp), "--prefill-peer", p_addr, "--heartbeat", "0.2",
                     "--no-prefix-caching", *COMMON], tmp_path / "d.log")
    try:
        p.wait_ready()
        d.wait_ready()
        c = Client(d_addr)
        try:
            wait_prefiller(c)
            sent = [0] * p_tp
            for n in (2, PAGE + 1, 3 * PAGE + 2):  # the last: a chunk of 2 pages
                before = c.stats().kv_units_received
                assert generate(c, prompt(n), 5) == hf_greedy(path, prompt(n), 5), n
                want = request_units(desc(arch, p_tp), desc(arch, d_tp), n - 1)
                assert c.stats().kv_units_received - before == want, n
                # its pages back: the messenger's counts of the job's every write are in
                wait_for(lambda: pools_full(p_addr), what="the prefiller's pages back")
                now = stats(p_addr).kv_units_sent_by_rank
                by_rank = [a - b for a, b in zip(now, sent, strict=True)]
                assert sum(by_rank) == want - CONTEXT_UNITS, (n, by_rank)
                sent = now
            assert all(u > 0 for u in by_rank), by_rank  # every source rank sent a share
        finally:
            c.close()
        assert stats(p_addr).kv_writes_sent > 0
        assert pools_full(d_addr) and pools_full(p_addr)
    finally:
        assert p.stop() == [] and d.stop() == []


@pytest.mark.fabric
def test_an_mla_decoder_refuses_a_gqa_prefiller_by_name(tmp_path):
    """The decoder never counts the prefiller alive, says why, and serves by itself."""
    mla = make_tiny_model("deepseek_v2", tmp_path / "mla")
    gqa = make_tiny_model("llama", tmp_path / "gqa")
    p_addr, d_addr = (f"tcp://127.0.0.1:{free_port()}" for _ in range(2))
    p = NodeProcess(["--role", "prefill", "--model", str(gqa), "--listen", p_addr, *COMMON],
                    tmp_path / "p.log")
    d = NodeProcess(["--role", "decode", "--model", str(mla), "--listen", d_addr,
                     "--prefill-peer", p_addr, "--heartbeat", "0.2", *COMMON], tmp_path / "d.log")
    try:
        p.wait_ready()
        d.wait_ready()
        deadline = time.monotonic() + 30
        while "KV layout mismatch" not in d.log_path.read_text():
            assert time.monotonic() < deadline, "no refusal logged"
            time.sleep(0.2)
        text = d.log_path.read_text()
        assert "hold gqa (K/V heads)" in text and "decoder's mla (latent)" in text
        c = Client(d_addr)
        try:
            assert generate(c, prompt(6), 4) == hf_greedy(mla, prompt(6), 4)
            s = c.stats()
            assert s.prefill_peers_alive == 0 and s.kv_units_received == 0
        finally:
            c.close()
    finally:
        assert p.stop() == [] and d.stop() == []
