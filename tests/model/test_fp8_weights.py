"""The GPU path's weights (``disagg.model.fp8_weights``): a block-FP8 checkpoint's dense layers
kept as FP8 with their block scales, exactly the checkpoint's bytes (this rank's shard under
TP), and a model holding them serving the same tokens as the dequantized one (on a CPU the
kept weights are dequantized per call: the reference of the GPU kernels)."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from disagg.kernels.fp8_weight import Fp8Weight
from disagg.llm import LLM
from disagg.model.config import ModelArch
from disagg.model.fp8 import Fp8Format, dequantize, quantize_blocks
from disagg.model.fp8_weights import PACKED, Fp8Parts, shard_fp8
from disagg.model.fp8_weights import kept as kept_weights
from disagg.model.loader import load_model, random_model, safetensors_files
from disagg.model.quantize import quantize_dir
from disagg.model.tp import TensorParallel
from disagg.protocol import SamplingParams
from tinymodels import make_tiny_model

# whole 128-blocks everywhere, also at TP 2: head_dim 128, q / k / v 128 rows per rank
WIDE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=2,
            num_key_value_heads=2)
PROMPTS = [[5], [7, 9, 11], list(range(20, 37))]


@pytest.fixture(scope="module")
def wide_fp8(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8w")
    out = {}
    for kind in ("llama", "qwen2"):
        src = make_tiny_model(kind, root / f"{kind}-src", **WIDE)
        quantize_dir(src, root / f"{kind}-fp8", (128, 128))
        out[kind] = root / f"{kind}-fp8"
    return out


def _checkpoint(path, name: str) -> torch.Tensor:
    for file in safetensors_files(path):
        with safe_open(str(file), framework="pt") as f:
            if name in f.keys():  # noqa: SIM118
                return f.get_tensor(name)
    raise KeyError(name)


def _kept(model) -> dict[str, Fp8Weight]:
    return {f"layers.{i}.{n}": getattr(layer, n) for i, layer in enumerate(model.layers)
            for n in PACKED if isinstance(getattr(layer, n), Fp8Weight)}


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_dense_weights_stay_fp8_and_serve_the_dequantized_models_tokens(kind, wide_fp8):
    path = wide_fp8[kind]
    kept = load_model(path, "float32", fp8_gemm=True)
    plain = load_model(path, "float32", fp8_gemm=False)
    weights = _kept(kept)
    assert len(weights) == len(PACKED) * len(kept.layers)
    # exactly the checkpoint's bytes and scales (q / k / v stacked by rows)
    q0 = weights["layers.0.qkv_weight"]
    want = torch.cat([_checkpoint(path, f"model.layers.0.self_attn.{p}_proj.weight")
                      .view(torch.uint8) for p in "qkv"])
    assert torch.equal(q0.q.view(torch.uint8), want)
    assert torch.equal(q0.scale_inv, torch.cat([
        _checkpoint(path, f"model.layers.0.self_attn.{p}_proj.weight_scale_inv")
        for p in "qkv"]))
    for name, w in weights.items():
        assert torch.equal(w.dequantize(torch.float32), plain.get_parameter(name)), name
    # the dequantized copies are gone, the rest of the model is the same
    names = {n for n, _ in kept.named_parameters()}
    assert names == {n for n, _ in plain.named_parameters()} - set(weights)
    params = dict(plain.named_parameters())
    for name, p in kept.named_parameters():
        assert torch.equal(p, params[name]), name
    sp = SamplingParams(max_tokens=6, ignore_eos=True)
    a = LLM(kept, num_pages=64, page_size=4).generate(PROMPTS, sp)
    b = LLM(plain, num_pages=64, page_size=4).generate(PROMPTS, sp)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]


def test_tp_ranks_keep_their_shard_of_the_fp8_bytes(wide_fp8):
    path = wide_fp8["qwen2"]
    full = load_model(path, "float32", fp8_gemm=True)
    for rank in range(2):
        tp = TensorParallel(rank, 2)
        kept = load_model(path, "float32", tp=tp, fp8_gemm=True)
        plain = load_model(path, "float32", tp=tp, fp8_gemm=False)
        weights = _kept(kept)
        assert len(weights) == len(PACKED) * len(kept.layers)
        for name, w in weights.items():
            assert torch.equal(w.dequantize(torch.float32), plain.get_parameter(name)), name
        # o: this rank's 128 input columns, one block column of scales
        o, o_full = weights["layers.1.o_weight"], _kept(full)["layers.1.o_weight"]
        cols = slice(rank * 128, (rank + 1) * 128)
        assert torch.equal(o.q.view(torch.uint8), o_full.q.view(torch.uint8)[:, cols])
        assert torch.equal(o.scale_inv, o_full.scale_inv[:, rank:rank + 1])


def test_a_fused_part_ending_inside_a_block_stays_dequantized(tmp_path):
    # head_dim 64 with one kv head: k and v are 64 rows, half a block
    src = make_tiny_model("llama", tmp_path / "src", hidden_size=256, intermediate_size=512,
                          num_attention_heads=4, num_key_value_heads=1)
    quantize_dir(src, tmp_path / "fp8", (128, 128))
    kept = load_model(tmp_path / "fp8", "float32", fp8_gemm=True)
    weights = _kept(kept)
    assert not any(n.endswith("qkv_weight") for n in weights)
    assert len(weights) == 3 * len(kept.layers)
    plain = load_model(tmp_path / "fp8", "float32", fp8_gemm=False)
    sp = SamplingParams(max_tokens=5, ignore_eos=True)
    assert [o.token_ids for o in LLM(kept, num_pages=64, page_size=4).generate(PROMPTS, sp)] \
        == [o.token_ids for o in LLM(plain, num_pages=64, page_size=4).generate(PROMPTS, sp)]


def test_online_quantization_keeps_the_quantizers_bytes(tmp_path, wide_fp8):
    src = make_tiny_model("llama", tmp_path / "src", **WIDE)
    online = load_model(src, "float32", quantization="fp8", fp8_gemm=True)
    stored = load_model(wide_fp8["llama"], "float32", fp8_gemm=True)
    a, b = _kept(online), _kept(stored)
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name].q.view(torch.uint8), b[name].q.view(torch.uint8)), name
        assert torch.equal(a[name].scale_inv, b[name].scale_inv), name


def test_random_fp8_weights_are_kept_as_drawn():
    arch = ModelArch.from_hf_config(dict(
        model_type="llama", vocab_size=64, hidden_size=256, intermediate_size=384,
        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
        max_position_embeddings=128, rms_norm_eps=1e-6))
    fmt = Fp8Format("fp8", (128, 128))
    kept = random_model(arch, "float32", seed=3, fp8=fmt, fp8_gemm=True)
    plain = random_model(arch, "float32", seed=3, fp8=fmt, fp8_gemm=False)
    weights = _kept(kept)
    assert len(weights) == 8
    for name, w in weights.items():
        torch.testing.assert_close(w.dequantize(), plain.get_parameter(name), rtol=1e-6,
                                   atol=0)


def test_shard_fp8_takes_whole_blocks_of_bytes_and_scales():
    w = torch.randn(256, 384)
    q, s = quantize_blocks(w, (128, 128))
    rows = shard_fp8(q, s, "rows", 0, lambda _k, t: t[128:256])
    assert torch.equal(rows[0].view(torch.uint8), q.view(torch.uint8)[128:])
    assert torch.equal(rows[1], s[1:2])
    cols = shard_fp8(q, s, "cols", 1, lambda _k, t: t[:, 256:])
    assert torch.equal(cols[1], s[:, 2:3])
    assert torch.equal(dequantize("w", *cols, (128, 128)), dequantize("w", q, s, (128, 128))
                       [:, 256:])
    same = shard_fp8(q, s, "replicated", None, lambda _k, t: t)
    assert same[0] is not q and torch.equal(same[1], s)


def test_parts_and_weights_refuse_what_does_not_fit():
    parts = Fp8Parts()
    q, s = quantize_blocks(torch.randn(128, 256), (128, 128))
    parts.add("layers.0.gate_up_weight", 0, q, s)  # the up half never arrives
    parts.add("layers.0.down_weight", None, q, s)
    out = parts.weights(lambda n: 2 if n.endswith("gate_up_weight") else 1)
    assert list(out) == ["layers.0.down_weight"]
    with pytest.raises(ValueError, match="scale_inv must be float32"):
        Fp8Weight(q, s[:, :1])
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        Fp8Weight(q.float(), s)


@pytest.mark.gpu
def test_on_a_gpu_the_kept_weights_run_the_fp8_kernels(wide_fp8):
    """On CUDA with FP8 tensor cores the loader keeps the weights by itself, and the FP8 GEMMs
    (activations quantized per 128 columns) serve nearly the dequantized model's tokens."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs a GPU with FP8 tensor cores")
    path = wide_fp8["qwen2"]
    fast = load_model(path, "bfloat16", "cuda")
    assert len(_kept(fast)) == len(PACKED) * len(fast.layers)
    plain = load_model(path, "bfloat16", "cuda", fp8_gemm=False)
    assert not _kept(plain)
    sp = SamplingParams(max_tokens=8, ignore_eos=True)
    prompts = [[(7 * i + j) % 250 + 3 for j in range(n)] for i, n in enumerate((1, 5, 40, 90))]
    a = [o.token_ids for o in LLM(fast, num_pages=128, page_size=16).generate(prompts, sp)]
    b = [o.token_ids for o in LLM(plain, num_pages=128, page_size=16).generate(prompts, sp)]
    first = sum(x[0] == y[0] for x, y in zip(a, b, strict=True))
    assert first >= 3, (a, b)  # the first tokens (one prefill each) agree but for a near tie


# MoE and MLA: experts (per expert or fused [E, ...] as transformers stores them), shared
# experts and the latent projections kept FP8 in whole blocks
SPARSE = {
    "qwen3_moe": dict(hidden_size=256, moe_intermediate_size=128, num_attention_heads=2,
                      num_key_value_heads=2, head_dim=128),
    "deepseek_v3": dict(hidden_size=256, moe_intermediate_size=128, intermediate_size=256,
                        num_attention_heads=2, kv_lora_rank=128, q_lora_rank=128,
                        qk_nope_head_dim=64, v_head_dim=64),
}


@pytest.mark.parametrize("kind", sorted(SPARSE))
def test_experts_shared_experts_and_latent_projections_stay_fp8(kind, tmp_path):
    src = make_tiny_model(kind, tmp_path / "src", **SPARSE[kind])
    quantize_dir(src, tmp_path / "fp8", (128, 128))
    kept = load_model(tmp_path / "fp8", "float32", fp8_gemm=True)
    plain = load_model(tmp_path / "fp8", "float32", fp8_gemm=False)
    weights = kept_weights(kept)
    sparse = [i for i, layer in enumerate(kept.layers) if layer.moe is not None]
    assert sparse
    for i in sparse:
        gate_up = weights[f"layers.{i}.moe.gate_up"]
        assert gate_up.q.dim() == 3 and gate_up.q.shape[0] == kept.layers[i].moe.arch.num_experts
        assert f"layers.{i}.moe.down" in weights
    if kind == "deepseek_v3":
        for i in range(len(kept.layers)):
            for p in ("q_a", "q_b", "kv_a", "o"):
                assert f"layers.{i}.mla.{p}" in weights
            assert not isinstance(kept.layers[i].mla.kv_b, Fp8Weight)  # absorbed: dequantized
        assert any(n.endswith("moe.shared_gate_up") for n in weights)
    for name, w in weights.items():
        assert torch.equal(w.dequantize(torch.float32), plain.get_parameter(name)), name
    sp = SamplingParams(max_tokens=5, ignore_eos=True)
    a = LLM(kept, num_pages=64, page_size=4).generate(PROMPTS, sp)
    b = LLM(plain, num_pages=64, page_size=4).generate(PROMPTS, sp)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]


def test_tp_ranks_keep_their_shard_of_the_experts(tmp_path):
    src = make_tiny_model("qwen3_moe", tmp_path / "src", **{**SPARSE["qwen3_moe"],
                                                            "moe_intermediate_size": 256})
    quantize_dir(src, tmp_path / "fp8", (128, 128))
    for rank in range(2):
        tp = TensorParallel(rank, 2)
        kept = load_model(tmp_path / "fp8", "float32", tp=tp, fp8_gemm=True)
        plain = load_model(tmp_path / "fp8", "float32", tp=tp, fp8_gemm=False)
        weights = kept_weights(kept)
        assert weights["layers.0.moe.gate_up"].q.shape[1] == 256  # 2 x 128 of 2 x 256 rows
        for name, w in weights.items():
            assert torch.equal(w.dequantize(torch.float32), plain.get_parameter(name)), (rank,
                                                                                         name)


def test_kept_weights_are_never_dequantized_at_load(wide_fp8, monkeypatch):
    """The packed parameters are built on the meta device and never allocated in the model's
    dtype (a checkpoint bigger dequantized than the GPUs loads): nothing is dequantized for a
    dense checkpoint, and no parameter is left unallocated."""
    import disagg.model.loader as loader

    calls = []
    real = loader.dequantize
    monkeypatch.setattr(loader, "dequantize", lambda name, *a, **k: calls.append(name) or
                        real(name, *a, **k))
    model = load_model(wide_fp8["llama"], "float32", fp8_gemm=True)
    assert calls == []
    assert not any(p.is_meta for p in model.parameters())
    assert not any(b.is_meta for b in model.buffers())
    assert model.device == torch.device("cpu") and model.rotary.inv_freq.device.type == "cpu"


def test_a_projection_stored_unquantized_is_loaded_beside_the_fp8_parts(tmp_path):
    src = make_tiny_model("llama", tmp_path / "src", **WIDE)
    quantize_dir(src, tmp_path / "fp8", (128, 128), skip=("k_proj",))
    kept = load_model(tmp_path / "fp8", "float32", fp8_gemm=True)
    plain = load_model(tmp_path / "fp8", "float32", fp8_gemm=False)
    weights = kept_weights(kept)
    assert not any(n.endswith("qkv_weight") for n in weights)  # k is bf16: dequantized whole
    assert len(weights) == 3 * len(kept.layers)
    for i in range(len(kept.layers)):
        assert torch.equal(kept.layers[i].qkv_weight, plain.layers[i].qkv_weight)
    sp = SamplingParams(max_tokens=5, ignore_eos=True)
    assert [o.token_ids for o in LLM(kept, num_pages=64, page_size=4).generate(PROMPTS, sp)] \
        == [o.token_ids for o in LLM(plain, num_pages=64, page_size=4).generate(PROMPTS, sp)]
