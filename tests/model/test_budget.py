"""The memory budget (disagg.model.budget): parameter counts of the real DeepSeek-R1 and
Qwen3-Coder-480B configs against their published totals, KV bytes per token, TP sharding and
the FP8 block rule, and the per-rank counts against the tensors the model really builds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from disagg.model.budget import (
    GIB,
    Budget,
    Weight,
    kv_bytes_per_token,
    param_count,
    report,
    split_blocks,
    weight_bytes,
    weights,
)
from disagg.model.config import ModelArch

CONFIGS = Path(__file__).parent / "configs"


def load(name: str) -> ModelArch:
    return ModelArch.from_hf_config(json.loads((CONFIGS / name).read_text()))


R1 = "deepseek-r1.json"
CODER = "qwen3-coder-480b-a35b-instruct-fp8.json"


def test_the_real_configs_parse_as_their_families():
    r1, coder = load(R1), load(CODER)
    assert r1.mla is not None and r1.moe is not None and r1.mtp_layers == 1
    assert (r1.num_kv_heads, r1.head_dim, r1.kv_parts) == (1, 576, 1)
    assert r1.moe.sparse_layers[:4] == (False, False, False, True) and sum(r1.moe.sparse_layers) == 58
    assert r1.moe.shared_intermediate_size == 2048 and r1.moe.correction_bias
    assert coder.moe is not None and coder.mla is None and coder.qk_norm
    assert (coder.num_heads, coder.num_kv_heads, coder.head_dim) == (96, 8, 128)
    assert all(coder.moe.sparse_layers) and coder.moe.num_experts == 160


def within(value: float, published: float, tolerance: float = 0.01) -> bool:
    return abs(value - published) <= tolerance * published


def test_parameter_counts_match_the_published_totals():
    r1, coder = load(R1), load(CODER)
    assert within(param_count(r1), 671e9)  # main model (the model card's 671B)
    # the checkpoint's 685B: with the MTP layer and its copies of the embedding and head
    copies = 2 * r1.vocab_size * r1.hidden_size
    assert within(param_count(r1, mtp=True) + copies, 685e9)
    assert within(param_count(r1, mtp=True) - param_count(r1), 11.5e9 + 0.1e9, 0.02)
    assert within(param_count(coder), 480e9)


def test_kv_bytes_per_token_hand_computed():
    gqa = ModelArch.from_hf_config(dict(
        architectures=["LlamaForCausalLM"], vocab_size=64, hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4, head_dim=8))
    # K and V x 2 layers x kv heads per rank x 8 dims x 2 bytes
    assert kv_bytes_per_token(gqa, 1, 2) == 2 * 2 * 4 * 8 * 2 == 256
    assert kv_bytes_per_token(gqa, 2, 2) == 2 * 2 * 2 * 8 * 2 == 128
    assert kv_bytes_per_token(gqa, 4, 2) == 2 * 2 * 1 * 8 * 2 == 64
    assert kv_bytes_per_token(gqa, 8, 2) == 64  # 4 kv heads over 8 ranks: one, replicated
    mla = ModelArch.from_hf_config(dict(
        architectures=["DeepseekV2ForCausalLM"], vocab_size=64, hidden_size=64,
        intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, kv_lora_rank=16,
        qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8))
    assert [kv_bytes_per_token(mla, tp, 2) for tp in (1, 2, 4)] == [3 * 24 * 2] * 3  # latent
    for arch in (gqa, mla, load(R1), load(CODER)):
        assert kv_bytes_per_token(arch, 2, 1) * 2 == kv_bytes_per_token(arch, 2, 2)
    assert kv_bytes_per_token(load(R1), 8, 2) == 61 * (512 + 64) * 2 == 70_272
    assert kv_bytes_per_token(load(CODER), 8, 2) == 2 * 62 * 1 * 128 * 2 == 31_744


def named(arch: ModelArch, tp: int) -> dict[str, Weight]:
    return {w.name: w for w in weights(arch, tp)}


def test_tp_splits_heads_and_experts_and_replicates_what_it_must():
    coder = load(CODER)
    one, eight = named(coder, 1), named(coder, 8)
    assert eight["self_attn.q_proj"].rows * 8 == one["self_attn.q_proj"].rows == 96 * 128
    assert eight["self_attn.k_proj/v_proj"].rows == 128  # 8 kv heads / 8 ranks: one head
    assert eight["self_attn.o_proj"].cols * 8 == one["self_attn.o_proj"].cols
    assert eight["mlp.experts.down_proj"].cols == 2560 // 8 == 320
    small_kv = ModelArch.from_hf_config(dict(
        architectures=["Qwen3ForCausalLM"], vocab_size=64, hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2, head_dim=8))
    assert named(small_kv, 8)["self_attn.k_proj/v_proj"].rows == 8  # replicated, not 2/8
    assert named(small_kv, 8)["self_attn.k_proj/v_proj"].params == 2 * 2 * 2 * 8 * 64
    r1, r1_eight = named(load(R1), 1), named(load(R1), 8)
    for same in ("embed_tokens", "lm_head", "self_attn.q_a_proj", "self_attn.kv_a_proj_with_mqa",
                 "self_attn.kv_a_layernorm", "mlp.gate (router)"):
        assert r1_eight[same] == r1[same], same
    assert r1_eight["self_attn.kv_b_proj"].rows * 8 == r1["self_attn.kv_b_proj"].rows


def test_fp8_bytes_count_one_byte_and_a_float32_scale_per_block():
    w = Weight("x", 300, 200, 2, 120_000, True, "rows")
    assert w.nbytes(True) == 2 * (300 * 200 + 4 * 3 * 2)  # blocks 3 x 2, edges partial
    assert w.nbytes(False) == 2 * 300 * 200 * 2
    assert Weight("norm", 300, 1, 1, 300, False).nbytes(True) == 600  # not quantized
    assert w.splits_block() and not Weight("x", 256, 200, 1, 0, True, "rows").splits_block()
    r1 = load(R1)
    fp8, bf16 = weight_bytes(r1, 8, True), weight_bytes(r1, 8, False)
    assert 0.5 < fp8 / bf16 < 0.53  # the unquantized embeddings and head are replicated
    assert bf16 > Budget().gpu_bytes  # R1 in bf16 does not fit on 8 H200s


def test_scale_blocks_split_by_tp_are_named():
    assert split_blocks(load(R1), 8) == []
    assert split_blocks(load(CODER), 4) == []  # 2560 / 4 = 640: five blocks
    assert split_blocks(load(CODER), 8) == ["mlp.experts.gate_proj/up_proj",
                                            "mlp.experts.down_proj"]  # 320: 2.5 blocks
    assert "refused at --tp 8" in report(load(CODER), 8)


def test_kv_tokens_follow_the_executors_formula():
    b = Budget(gpu_bytes=100 * GIB, utilization=0.5, outside_torch=GIB, activation_peak=2 * GIB,
               page_size=16)
    # 50 GiB - 1 outside torch - (10 weights + 2 activations) - graphs (2 + 0.25)
    assert b.kv_bytes(10 * GIB) == int((50 - 1 - 12 - 2.25) * GIB)
    per = 1000
    assert b.kv_tokens(10 * GIB, per) == b.kv_bytes(10 * GIB) // (per * 16) * 16
    eager = Budget(gpu_bytes=100 * GIB, utilization=0.5, outside_torch=GIB,
                   activation_peak=2 * GIB, cuda_graphs=False)
    assert eager.kv_bytes(10 * GIB) - b.kv_bytes(10 * GIB) == int(2.25 * GIB)
    assert b.kv_tokens(60 * GIB, per) == 0
    r1 = load(R1)
    w = weight_bytes(r1, 8, True)
    assert Budget().kv_tokens(w, kv_bytes_per_token(r1, 8, 1)) == pytest.approx(
        2 * Budget().kv_tokens(w, kv_bytes_per_token(r1, 8, 2)), abs=16)


TINY = [
    dict(architectures=["DeepseekV3ForCausalLM"], vocab_size=96, hidden_size=64,
         intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, q_lora_rank=32,
         kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
         n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, moe_intermediate_size=32,
         first_k_dense_replace=1, n_group=2, topk_group=1, num_nextn_predict_layers=1),
    dict(architectures=["DeepseekV2ForCausalLM"], vocab_size=96, hidden_size=64,
         intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, kv_lora_rank=16,
         qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, n_routed_experts=4,
         num_experts_per_tok=2, moe_intermediate_size=32),
    dict(architectures=["Qwen2MoeForCausalLM"], vocab_size=96, hidden_size=64,
         intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
         num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
         shared_expert_intermediate_size=64),
    dict(architectures=["Qwen3MoeForCausalLM"], vocab_size=96, hidden_size=64,
         intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
         head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
    dict(architectures=["LlamaForCausalLM"], vocab_size=96, hidden_size=64,
         intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
         tie_word_embeddings=True),
]


@pytest.mark.parametrize("cfg", TINY, ids=lambda c: c["architectures"][0])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_counts_match_the_parameters_a_rank_builds(cfg, tp):
    """Per rank, the budget's elements are those of the model the executor builds (MTP too)."""
    from disagg.model.loader import random_model
    from disagg.model.tp import TensorParallel

    arch = ModelArch.from_hf_config(cfg)
    mtp = arch.mtp_layers > 0
    model = random_model(arch, "float32", tp=TensorParallel(0, tp), mtp=mtp)
    built = sum(p.numel() for p in model.parameters())
    assert built == sum(w.rows * w.cols * w.count for w in weights(arch, tp, mtp))
    if tp == 1:
        assert param_count(arch, mtp) == built
