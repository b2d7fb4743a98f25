"""FP8 checkpoints: the block format (quantizer and loader), its checks, and the CPU path
(weights dequantized at load) token-exact against transformers run on the same weights
dequantized by a plain reference here, and against transformers' own fine-grained FP8 loader
(which dequantizes on a machine without FP8 tensor cores) reading the quantizer's output."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from disagg.llm import LLM
from disagg.model.fp8 import (
    Fp8Error,
    Fp8Format,
    check_block_shard,
    dequantize,
    quantize_blocks,
)
from disagg.model.loader import load_model, safetensors_files
from disagg.model.quantize import main as quantize_main
from disagg.model.quantize import quantizable, quantize_dir
from disagg.model.tp import TensorParallel
from disagg.protocol import SamplingParams
from tinymodels import FAMILIES, hf_greedy, make_tiny_model

PAGE = 4
NEW = 6
PROMPTS = [[5], [7, 9, 11], list(range(20, 37)), [3 + (i * 37) % 290 for i in range(29)]]


def reference_dequant(w: torch.Tensor, s: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """Block by block, the plain way: every block of ``w`` times its one scale."""
    x = w.to(torch.float32).clone()
    bn, bk = block
    for idx in torch.cartesian_prod(*[torch.arange(n) for n in s.shape]).reshape(-1, s.dim()):
        *lead, i, j = idx.tolist()
        x[(*lead, slice(i * bn, (i + 1) * bn), slice(j * bk, (j + 1) * bk))] *= s[tuple(idx)]
    return x


def dequantized_copy(src: Path, dst: Path) -> Path:
    """``src`` (FP8) as a float32 directory without quantization_config, by the reference."""
    cfg = json.loads((src / "config.json").read_text())
    block = tuple(cfg.pop("quantization_config")["weight_block_size"])
    dst.mkdir(parents=True)
    for file in safetensors_files(src):
        out = {}
        with safe_open(str(file), framework="pt") as f:
            names = list(f.keys())  # noqa: SIM118
            for name in names:
                if name.endswith("_scale_inv"):
                    continue
                t = f.get_tensor(name)
                if t.dtype == torch.float8_e4m3fn:
                    t = reference_dequant(t, f.get_tensor(f"{name}_scale_inv"), block)
                out[name] = t
        save_file(out, str(dst / file.name))
    cfg["torch_dtype"] = "float32"
    (dst / "config.json").write_text(json.dumps(cfg))
    for extra in ("model.safetensors.index.json", "generation_config.json"):
        if (src / extra).is_file():
            index = json.loads((src / extra).read_text())
            if "weight_map" in index:
                index["weight_map"] = {k: v for k, v in index["weight_map"].items()
                                       if not k.endswith("_scale_inv")}
            (dst / extra).write_text(json.dumps(index))
    return dst


# ---------------------------------------------------------------- the format


@pytest.mark.parametrize("shape, block", [((70, 50), (16, 32)), ((3, 40, 24), (16, 16)),
                                          ((128, 256), (128, 128))])
def test_block_quantization_round_trips_within_e4m3_precision(shape, block):
    w = torch.randn(shape) * 0.05
    w[..., :3, :3] = 0.0  # an all-zero corner stays exact
    q, s = quantize_blocks(w, block)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
    assert s.shape == (*shape[:-2], -(-shape[-2] // block[0]), -(-shape[-1] // block[1]))
    back = dequantize("w", q, s, block)
    assert torch.equal(back, reference_dequant(q, s, block))
    # 3 mantissa bits: each value within 1/16 of its block's largest magnitude
    amax = s.repeat_interleave(block[0], -2)[..., :shape[-2], :].repeat_interleave(
        block[1], -1)[..., :shape[-1]] * 448
    assert ((back - w).abs() <= amax / 16 + 1e-12).all()
    assert (back[..., :3, :3] == 0).all()


def test_per_tensor_and_per_channel_scales():
    w = (torch.randn(6, 5) * 100).clamp(-440, 440).to(torch.float8_e4m3fn)
    x = w.to(torch.float32)
    assert torch.equal(dequantize("t", w, torch.tensor(0.5), None), x * 0.5)
    ch = torch.arange(1, 7, dtype=torch.float32)
    assert torch.equal(dequantize("c", w, ch, None), x * ch[:, None])
    assert torch.equal(dequantize("c", w, ch[:, None], None), x * ch[:, None])
    with pytest.raises(Fp8Error, match=r"layer\.x: its scale has shape \(5,\)"):
        dequantize("layer.x", w, torch.ones(5), None)


def test_mis_shaped_or_poisoned_scales_are_refused_by_name():
    q, s = quantize_blocks(torch.randn(40, 40), (16, 16))
    with pytest.raises(Fp8Error, match=r"q_proj.weight: its scale has shape \(2, 3\), "
                                       r"expected \(3, 3\)"):
        dequantize("q_proj.weight", q, s[:2], (16, 16))
    bad = s.clone()
    bad[0, 0] = float("nan")
    with pytest.raises(Fp8Error, match="not finite"):
        dequantize("q_proj.weight", q, bad, (16, 16))
    with pytest.raises(Fp8Error, match="expected an FP8 tensor"):
        dequantize("q_proj.weight", torch.randn(4, 4), s, (16, 16))


@pytest.mark.parametrize("q, match", [
    ({"quant_method": "awq", "bits": 4}, "quant_method 'awq' is not supported"),
    ({"quant_method": "fp8", "fmt": "e5m2"}, "fmt 'e5m2' is not supported"),
    ({"quant_method": "fp8", "weight_block_size": [128]}, "two positive integers"),
    ({"quant_method": "fp8", "weight_block_size": [0, 128]}, "two positive integers"),
    ({"quant_method": "fp8", "scale_fmt": "ue8m0"}, "scale_fmt 'ue8m0'"),
    ("fp8", "must be an object"),
])
def test_unsupported_quantization_configs_are_refused_by_name(q, match):
    with pytest.raises(Fp8Error, match=match):
        Fp8Format.from_config({"quantization_config": q})


def test_the_seeds_config_is_read():
    cfg = {"quantization_config": {"quant_method": "fp8", "fmt": "e4m3",
                                   "activation_scheme": "dynamic",
                                   "weight_block_size": [128, 128]}}
    fmt = Fp8Format.from_config(cfg)
    assert fmt == Fp8Format("fp8", (128, 128))
    assert fmt.config() == cfg["quantization_config"]
    assert Fp8Format.from_config({}) is None
    assert Fp8Format.from_config({"quantization_config": {"quant_method": "fbgemm_fp8"}}) == \
        Fp8Format("fbgemm_fp8", None)


def test_a_shard_that_splits_a_block_is_refused():
    check_block_shard("w", torch.arange(32, 64), 64, 16, 2)  # whole blocks
    check_block_shard("w", torch.arange(0, 40), 40, 128, 1)  # the whole dim (one edge block)
    check_block_shard("w", torch.cat([torch.arange(0, 16), torch.arange(32, 48)]), 64, 16, 2)
    with pytest.raises(Fp8Error, match=r"w: --tp 2 splits its 128-wide FP8 scale blocks"):
        check_block_shard("w", torch.arange(32, 64), 64, 128, 2)
    with pytest.raises(Fp8Error, match="keeps 8..15"):
        check_block_shard("w", torch.arange(8, 16), 16, 16, 2)


def test_what_the_quantizer_quantizes():
    w2, w1 = torch.zeros(4, 4), torch.zeros(4)
    assert quantizable("model.layers.0.self_attn.q_proj.weight", w2)
    assert quantizable("model.layers.0.self_attn.kv_a_proj_with_mqa.weight", w2)
    assert quantizable("model.layers.1.mlp.experts.3.down_proj.weight", w2)
    assert quantizable("model.layers.1.mlp.experts.gate_up_proj", torch.zeros(2, 4, 4))
    assert not quantizable("model.embed_tokens.weight", w2)
    assert not quantizable("lm_head.weight", w2)
    assert not quantizable("model.layers.0.input_layernorm.weight", w1)
    assert not quantizable("model.layers.1.mlp.gate.weight", w2)  # the router
    assert not quantizable("model.layers.1.mlp.shared_expert_gate.weight", w2)
    assert not quantizable("model.layers.0.self_attn.q_proj.bias", w1)
    assert not quantizable("model.layers.0.self_attn.q_proj.weight", w2, ("self_attn",))


# ---------------------------------------------------------------- checkpoints


@pytest.fixture(scope="module")
def fp8_models(tmp_path_factory):
    """Per family: (FP8 directory with 8x8 blocks, its reference-dequantized float32 copy).
    8 divides every weight's dims here: transformers' CPU dequantization refuses partial edge
    blocks (``test_partial_edge_blocks`` covers those)."""
    root = tmp_path_factory.mktemp("fp8")
    out = {}
    for kind in FAMILIES:
        src = make_tiny_model(kind, root / f"{kind}-src")
        quantize_dir(src, root / f"{kind}-fp8", (8, 8))
        out[kind] = (root / f"{kind}-fp8", dequantized_copy(root / f"{kind}-fp8",
                                                             root / f"{kind}-ref"))
    return out


def test_the_quantizer_writes_the_seeds_format(fp8_models):
    fp8, _ = fp8_models["deepseek_v3"]
    cfg = json.loads((fp8 / "config.json").read_text())
    assert cfg["quantization_config"] == {"quant_method": "fp8", "fmt": "e4m3",
                                          "activation_scheme": "dynamic",
                                          "weight_block_size": [8, 8]}
    dtypes = {}
    for file in safetensors_files(fp8):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118
                dtypes[name] = f.get_tensor(name).dtype
    assert dtypes["model.layers.1.self_attn.kv_b_proj.weight"] == torch.float8_e4m3fn
    assert dtypes["model.layers.1.self_attn.kv_b_proj.weight_scale_inv"] == torch.float32
    experts = [n for n in dtypes if ".mlp.experts." in n and not n.endswith("_scale_inv")]
    assert experts and all(dtypes[n] == torch.float8_e4m3fn for n in experts)
    for kept in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight",
                 "model.layers.1.mlp.gate.weight"):
        assert dtypes[kept] == torch.float32, kept
    # the index names every tensor, scales included
    index = json.loads((fp8 / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(index) == set(dtypes)


@pytest.mark.parametrize("kind", FAMILIES)
def test_an_fp8_checkpoint_is_token_exact_with_transformers_on_its_dequantized_weights(
        kind, fp8_models):
    fp8, ref = fp8_models[kind]
    expected = [hf_greedy(ref, p, NEW) for p in PROMPTS]
    # transformers' own fine-grained FP8 loader reads the quantizer's output the same way
    assert [hf_greedy(fp8, p, NEW) for p in PROMPTS] == expected
    llm = LLM(load_model(fp8, "float32"), num_pages=64, page_size=PAGE, max_batch_tokens=7)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=NEW, ignore_eos=True))
    assert [o.token_ids for o in outs] == expected
    # and the weights the engine holds are the reference's, exactly
    plain = load_model(ref, "float32")
    for (name, a), (_, b) in zip(load_model(fp8, "float32").named_parameters(),
                                 plain.named_parameters(), strict=True):
        assert torch.equal(a, b), name


def test_partial_edge_blocks(tmp_path):
    """DeepSeek's kv_a_proj_with_mqa has kv_lora_rank + rope rows (576 in V3: 4.5 blocks of
    128); here 40 rows in blocks of 16: its last block row is partial."""
    src = make_tiny_model("deepseek_v2", tmp_path / "src")
    quantize_dir(src, tmp_path / "fp8", (16, 16))
    ref = dequantized_copy(tmp_path / "fp8", tmp_path / "ref")
    llm = LLM(load_model(tmp_path / "fp8", "float32"), num_pages=64, page_size=PAGE)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=NEW, ignore_eos=True))
    assert [o.token_ids for o in outs] == [hf_greedy(ref, p, NEW) for p in PROMPTS]


def test_tp_shards_of_an_fp8_checkpoint_equal_the_dequantized_shards(fp8_models):
    fp8, ref = fp8_models["qwen3_moe"]
    for rank in range(2):
        tp = TensorParallel(rank, 2)
        a, b = load_model(fp8, "float32", tp=tp), load_model(ref, "float32", tp=tp)
        for (name, x), (_, y) in zip(a.named_parameters(), b.named_parameters(), strict=True):
            assert torch.equal(x, y), (rank, name)


def test_a_tp_shard_across_a_128_block_is_refused_by_name(tmp_path):
    src = make_tiny_model("llama", tmp_path / "src")
    quantize_dir(src, tmp_path / "fp8", (128, 128))
    load_model(tmp_path / "fp8", "float32")  # one edge block per weight: fine unsharded
    with pytest.raises(Fp8Error, match=r"model\.layers\.\d\.[a-z_.]+_proj\.weight: --tp 2 "
                                       r"splits its 128-wide FP8 scale blocks"):
        load_model(tmp_path / "fp8", "float32", tp=TensorParallel(0, 2))


def test_broken_fp8_checkpoints_are_refused_by_name(tmp_path):
    src = make_tiny_model("qwen2", tmp_path / "src")
    fp8 = tmp_path / "fp8"
    quantize_dir(src, fp8, (16, 16))

    def rewrite(edit) -> Path:
        bad = tmp_path / f"bad{len(list(tmp_path.iterdir()))}"
        shutil.copytree(fp8, bad)
        for file in safetensors_files(bad):
            with safe_open(str(file), framework="pt") as f:
                tensors = {n: f.get_tensor(n) for n in f.keys()}  # noqa: SIM118
            save_file(edit(tensors), str(file))
        return bad

    name = "model.layers.1.mlp.down_proj.weight"
    missing = rewrite(lambda t: {k: v for k, v in t.items() if k != f"{name}_scale_inv"})
    with pytest.raises(Fp8Error, match=rf"{name} is FP8 but the checkpoint has no "
                                       rf"{name}_scale_inv"):
        load_model(missing, "float32")
    short = rewrite(lambda t: {**t, f"{name}_scale_inv": t[f"{name}_scale_inv"][:1]}
                    if f"{name}_scale_inv" in t else t)
    with pytest.raises(Fp8Error, match=rf"{name}: its scale has shape \(1, 8\)"):
        load_model(short, "float32")
    no_config = tmp_path / "no-config"
    shutil.copytree(fp8, no_config)
    cfg = json.loads((no_config / "config.json").read_text())
    del cfg["quantization_config"]
    (no_config / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(Fp8Error, match="but config.json has no quantization_config"):
        load_model(no_config, "float32")
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (no_config / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(Fp8Error, match="'gptq' is not supported"):
        load_model(no_config, "float32")


def test_the_quantizer_cli(tmp_path, capsys):
    src = make_tiny_model("llama", tmp_path / "src")
    assert quantize_main([str(src), str(tmp_path / "out"), "--block-size", "32", "32",
                          "--skip", "layers.1."]) == 0
    assert "weights quantized to FP8 (32x32 blocks)" in capsys.readouterr().out
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["quantization_config"]["modules_to_not_convert"] == ["layers.1."]
    with safe_open(str(safetensors_files(tmp_path / "out")[0]), framework="pt") as f:
        names = list(f.keys())  # noqa: SIM118
    assert not any(n.startswith("model.layers.1.") and n.endswith("_scale_inv") for n in names)
    assert quantize_main([str(tmp_path / "out"), str(tmp_path / "again")]) == 2  # already FP8
    assert "already quantized" in capsys.readouterr().err


# ---------------------------------------------------------------- --quantization fp8


def test_quantization_fp8_rounds_an_unquantized_checkpoint_as_the_quantizer_stores_it(tmp_path):
    src = make_tiny_model("qwen2_moe", tmp_path / "src")
    quantize_dir(src, tmp_path / "fp8", (128, 128))
    online = load_model(src, "float32", quantization="fp8")
    stored = load_model(tmp_path / "fp8", "float32")
    plain = load_model(src, "float32")
    changed = 0
    for (name, a), (_, b), (_, c) in zip(online.named_parameters(), stored.named_parameters(),
                                         plain.named_parameters(), strict=True):
        assert torch.equal(a, b), name
        changed += not torch.equal(a, c)
    assert changed > 0  # the linear weights moved; embeddings, norms, routers did not
    assert torch.equal(online.embed, plain.embed)


def test_random_weights_rounded_to_fp8(tmp_path):
    from disagg.model.config import ModelArch
    from disagg.model.fp8 import round_to_fp8
    from disagg.model.loader import random_model

    arch = ModelArch.from_dir(make_tiny_model("deepseek_v3", tmp_path / "v3"))
    a = random_model(arch, "float32", seed=3)
    b = random_model(arch, "float32", seed=3, fp8=Fp8Format("fp8", (16, 16)))
    rounded = 0
    for (name, x), (_, y) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        if name.endswith(("router", "norm", "correction_bias")) or name in ("embed", "lm_head"):
            assert torch.equal(x, y), name
        elif y.dim() >= 2:
            assert torch.equal(round_to_fp8(y, (16, 16)), y), name  # already on the grid
            assert torch.equal(round_to_fp8(x, (16, 16)), y), name
            rounded += 1
    assert rounded > 0


def test_the_quantization_flag_is_checked():
    from disagg.config import ConfigError, ExecutorConfig

    with pytest.raises(ConfigError, match="--quantization must be auto or fp8"):
        ExecutorConfig(quantization="int4").validate()
