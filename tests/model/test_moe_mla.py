"""MoE (Qwen2/3-MoE, DeepSeek) and MLA (DeepSeek V2/V3) models: configs read, weights loaded
and greedy output token-exact against Hugging Face transformers, in-process engine."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from disagg.llm import LLM
from disagg.model.config import ModelArch
from disagg.model.loader import load_model, random_model
from disagg.model.tp import TensorParallel, TPError
from disagg.protocol import SamplingParams
from tinymodels import DEFAULT_ROPE, hf_greedy, make_tiny_model

PAGE = 4
NEW = 6
LENGTHS = [1, PAGE, PAGE + 1, 3 * PAGE + 2]  # page and chunk (budget 5) boundaries

VARIANTS = {
    "qwen3_moe": ("qwen3_moe", {}),  # norm_topk_prob
    "qwen3_moe-sparse-step": ("qwen3_moe", dict(norm_topk_prob=False, num_hidden_layers=4,
                                                decoder_sparse_step=2, mlp_only_layers=[3])),
    "qwen2_moe": ("qwen2_moe", {}),  # shared expert with its sigmoid gate
    "qwen2_moe-norm": ("qwen2_moe", dict(norm_topk_prob=True)),
    "deepseek_v2": ("deepseek_v2", {}),  # no q_lora, greedy top-k, yarn
    "deepseek_v2-grouped": ("deepseek_v2", dict(topk_method="group_limited_greedy", n_group=4,
                                                topk_group=2, q_lora_rank=24,
                                                routed_scaling_factor=2.0,
                                                rope_parameters=DEFAULT_ROPE)),
    "deepseek_v3": ("deepseek_v3", {}),  # q_lora, grouped sigmoid + bias, yarn, interleaved
    "deepseek_v3-plain": ("deepseek_v3", dict(q_lora_rank=None, rope_interleave=False,
                                              norm_topk_prob=False, first_k_dense_replace=0,
                                              n_shared_experts=2)),
}


def prompt(n: int) -> list[int]:
    g = torch.Generator().manual_seed(2000 + n)
    return torch.randint(3, 300, (n,), generator=g).tolist()


def greedy(n=NEW):
    return SamplingParams(max_tokens=n, ignore_eos=True)


@pytest.fixture(scope="module", params=list(VARIANTS))
def variant(request, tmp_path_factory):
    kind, overrides = VARIANTS[request.param]
    path = make_tiny_model(kind, tmp_path_factory.mktemp("sparse") / request.param, **overrides)
    return path, {n: hf_greedy(path, prompt(n), NEW) for n in LENGTHS}


def test_greedy_matches_transformers(variant):
    path, refs = variant
    llm = LLM(load_model(path, "float32"), num_pages=64, page_size=PAGE, max_batch_tokens=5)
    for n in LENGTHS:
        assert llm.generate([prompt(n)], greedy())[0].token_ids == refs[n], f"prompt length {n}"
    outs = llm.generate([prompt(n) for n in LENGTHS], greedy())  # batched, chunked
    assert [o.token_ids for o in outs] == [refs[n] for n in LENGTHS]
    assert llm.pool.num_free == llm.pool.num_pages


def test_configs_are_read_as_their_families(tmp_path):
    v3 = ModelArch.from_dir(make_tiny_model("deepseek_v3", tmp_path / "v3"))
    assert v3.mla is not None and v3.moe is not None
    assert (v3.num_kv_heads, v3.head_dim, v3.kv_parts, v3.layout_kind) == (1, 40, 1, "mla")
    assert v3.moe.sparse_layers == (False, True)  # first_k_dense_replace 1
    assert (v3.moe.scoring, v3.moe.group_score, v3.moe.n_group, v3.moe.topk_group) == (
        "sigmoid", "top2", 4, 2)
    assert v3.mla.softmax_scale > (16 + 8) ** -0.5  # yarn's mscale squared
    q2 = ModelArch.from_dir(make_tiny_model("qwen2_moe", tmp_path / "q2"))
    assert q2.mla is None and q2.kv_parts == 2 and q2.layout_kind == "gqa"
    assert q2.moe is not None and q2.moe.shared_gate and q2.moe.shared_intermediate_size == 48
    q3 = ModelArch.from_dir(make_tiny_model("qwen3_moe", tmp_path / "q3", num_hidden_layers=4,
                                            decoder_sparse_step=2, mlp_only_layers=[3]))
    assert q3.moe is not None and q3.moe.sparse_layers == (False, True, False, False)
    assert v3.identity("float32") != q2.identity("float32")


@pytest.mark.parametrize("kind", ["qwen3_moe", "deepseek_v3"])
def test_tensor_parallel_shards_heads_and_experts_keeping_the_latent_whole(kind, tmp_path):
    """Loaded under TP 2, each rank's expert and head slices put back together are the
    single-rank weights; MLA's latent projection (and so its cache row) is on both ranks."""
    path = make_tiny_model(kind, tmp_path / kind)
    whole = load_model(path, "float32")
    ranks = [load_model(path, "float32", tp=TensorParallel(r, 2)) for r in range(2)]
    layer = 1  # sparse in both
    w = whole.layers[layer]
    parts = [m.layers[layer] for m in ranks]
    i = w.moe.arch.intermediate_size
    gate = torch.cat([p.moe.gate_up[:, : i // 2] for p in parts], dim=1)
    up = torch.cat([p.moe.gate_up[:, i // 2:] for p in parts], dim=1)
    assert torch.equal(torch.cat([gate, up], dim=1), w.moe.gate_up)
    assert torch.equal(torch.cat([p.moe.down for p in parts], dim=2), w.moe.down)
    assert all(torch.equal(p.moe.router, w.moe.router) for p in parts)
    if kind == "deepseek_v3":
        assert torch.equal(torch.cat([p.mla.kv_b for p in parts]), w.mla.kv_b)
        assert torch.equal(torch.cat([p.mla.o for p in parts], dim=1), w.mla.o)
        assert all(torch.equal(p.mla.kv_a, w.mla.kv_a) for p in parts)
        assert ranks[0].arch.num_kv_heads == 1 and ranks[0].arch.num_heads == 2
    arch = ModelArch.from_dir(path)
    odd = dataclasses.replace(arch, moe=dataclasses.replace(arch.moe, intermediate_size=30))
    with pytest.raises(TPError, match="expert MLP"):
        TensorParallel(0, 4).check(odd)


@pytest.mark.parametrize("kind", ["qwen2_moe", "deepseek_v2"])
def test_random_weights_build_and_run(kind, tmp_path):
    arch = ModelArch.from_dir(make_tiny_model(kind, tmp_path / kind))
    llm = LLM(random_model(arch, "float32", seed=3), num_pages=32, page_size=PAGE,
              max_batch_tokens=16)
    out = llm.generate([prompt(7), prompt(3)], greedy(4))
    assert [len(o.token_ids) for o in out] == [4, 4]
    assert llm.pool.num_free == llm.pool.num_pages
