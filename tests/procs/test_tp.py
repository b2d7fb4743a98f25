"""Tensor parallelism: weight shards, and mixed nodes with --tp 2 / 4 (gloo, real processes)."""

from __future__ import annotations

import time

import pytest
import torch

from disagg.model.config import ModelArch
from disagg.model.tp import TensorParallel, TPError
from disagg.protocol.peer import KVLayoutDesc
from tinymodels import NodeProcess, free_port, hf_greedy, make_tiny_model


def arch(heads=8, kv=2, inter=64, d=4) -> ModelArch:
    return ModelArch("LlamaForCausalLM", 100, heads * d, inter, 2, heads, kv, d, 1e-6, 1e4, 64,
                     False, False, False)


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_shards_reassemble_the_weights(tp):
    a = arch()
    d, hq, hkv = a.head_dim, a.num_heads, a.num_kv_heads
    q = torch.randn(hq * d, a.hidden_size)
    kv = torch.randn(hkv * d, a.hidden_size)
    o = torch.randn(a.hidden_size, hq * d)
    up = torch.randn(a.intermediate_size, a.hidden_size)
    down = torch.randn(a.hidden_size, a.intermediate_size)
    ranks = [TensorParallel(r, tp) for r in range(tp)]
    assert torch.equal(torch.cat([r.shard("q", q, a) for r in ranks]), q)
    assert torch.equal(torch.cat([r.shard("o", o, a) for r in ranks], dim=1), o)
    assert torch.equal(torch.cat([r.shard("up", up, a) for r in ranks]), up)
    assert torch.equal(torch.cat([r.shard("down", down, a) for r in ranks], dim=1), down)
    replicas = max(1, tp // hkv)
    # each replica set holds every kv head once, in order
    for j in range(replicas):
        assert torch.equal(torch.cat([ranks[r].shard("k", kv, a) for r in range(j, tp, replicas)]),
                           kv)
    local = ranks[0].local_arch(a)
    assert (local.num_heads, local.num_kv_heads, local.intermediate_size) == (
        hq // tp, max(1, hkv // tp), a.intermediate_size // tp)
    # the same kv-head mapping the transfer planner assumes
    layout = KVLayoutDesc(2, 8, local.num_kv_heads, 4, d, "float32", 4, a.hidden_size, tp,
                          kv_replicas=replicas)
    assert all(layout.rank_heads(r.rank) == r.kv_heads(a) for r in ranks)
    # the q heads of a rank use exactly its kv heads (GQA groups stay whole)
    group = hq // hkv
    for r in ranks:
        q_heads = range(r.rank * hq // tp, (r.rank + 1) * hq // tp)
        assert {h // group for h in q_heads} == set(r.kv_heads(a))


def test_unsplittable_models_are_refused():
    with pytest.raises(TPError, match="attention heads"):
        TensorParallel(0, 3).local_arch(arch())
    with pytest.raises(TPError, match="kv heads"):
        TensorParallel(0, 4).local_arch(arch(heads=12, kv=6, inter=48))


@pytest.mark.fabric
@pytest.mark.parametrize("p_tp, d_tp", [(2, 1), (1, 2), (2, 2), (1, 4)])
def test_sharded_transfers_prefill_decode(p_tp, d_tp, tmp_path):
    """Prefiller and decoder with different TP: pages rebuilt from head ranges, split across
    ranks, or replicated (TP 4 > 2 kv heads); token-exact, pools full after."""
    from disagg.client import Client
    from disagg.protocol import SamplingParams

    path = make_tiny_model("llama", tmp_path / "llama")
    p_addr, d_addr = (f"tcp://127.0.0.1:{free_port()}" for _ in range(2))
    common = ["--model", str(path), "--page-size", "4", "--num-pages", "64", "--threads", "1"]
    p = NodeProcess(["--role", "prefill", "--listen", p_addr, "--tp", str(p_tp),
                     "--max-batch-tokens", "5", *common], tmp_path / "p.log")
    d = NodeProcess(["--role", "decode", "--listen", d_addr, "--tp", str(d_tp), "--prefill-peer",
                     p_addr, "--heartbeat", "0.2", *common], tmp_path / "d.log")
    try:
        p.wait_ready()
        d.wait_ready()
        c = Client(d_addr)
        try:
            deadline = time.monotonic() + 30
            while c.stats().prefill_peers_alive == 0:
                assert time.monotonic() < deadline, "prefiller never seen"
                time.sleep(0.1)
            for n in (2, 6, 14):
                prompt = list(range(11, 11 + n))
                ids = [t for m in c.generate(prompt_token_ids=prompt, sampling=SamplingParams(
                    max_tokens=5, ignore_eos=True)) for t in getattr(m, "token_ids", [])]
                assert ids == hf_greedy(path, prompt, 5), f"prompt length {n}"
            # a next turn: the decoder holds the first turn's full pages (skip_pages), the
            # prefiller its prompt's; only the rest is computed and written, per shard
            turn = list(range(11, 25)) + ids + list(range(40, 47))
            before = c.stats().kv_units_received
            msgs = list(c.generate(prompt_token_ids=turn, sampling=SamplingParams(
                max_tokens=5, ignore_eos=True)))
            assert [t for m in msgs for t in getattr(m, "token_ids", [])] == hf_greedy(path, turn, 5)
            assert msgs[-1].usage.cached_tokens >= 16  # at least 4 of the 4-token pages
            assert 0 < c.stats().kv_units_received - before
            s = c.stats()
            assert s.kv_units_received > 0 and s.pages_free == s.pages_total
        finally:
            c.close()
        c = Client(p_addr)
        try:
            s = c.stats()
            assert s.pages_free == s.pages_total and s.kv_writes_sent > 0
        finally:
            c.close()
    finally:
        assert p.stop() == [] and d.stop() == []


@pytest.mark.parametrize("kind, tp", [("qwen2", 2), ("llama", 4)])  # tp 4 > 2 kv heads: replicas
def test_mixed_node_tensor_parallel_matches_transformers(kind, tp, tmp_path):
    path = make_tiny_model(kind, tmp_path / kind)
    addr = f"tcp://127.0.0.1:{free_port()}"
    node = NodeProcess(["--model", str(path), "--listen", addr, "--tp", str(tp), "--num-pages", "64",
                        "--page-size", "4", "--max-batch-tokens", "6", "--threads", "1"],
                       tmp_path / "node.log")
    from disagg.client import Client
    from disagg.protocol import SamplingParams

    try:
        node.wait_ready()
        assert len(node.children()) == tp  # one executor per rank
        client = Client(addr)
        try:
            for n in (1, 5, 13):
                prompt = list(range(7, 7 + n))
                ids = [t for m in client.generate(prompt_token_ids=prompt, sampling=SamplingParams(
                    max_tokens=6, ignore_eos=True)) for t in getattr(m, "token_ids", [])]
                assert ids == hf_greedy(path, prompt, 6), f"prompt length {n}"
            s = client.stats()
            assert s.pages_free == s.pages_total and s.finished == 3
        finally:
            client.close()
    finally:
        assert node.stop() == []
