"""The in-process engine with FP8 KV pages (``kv_cache_dtype="fp8_e4m3"``, the torch path):
greedy tokens equal a reference engine whose float32 pages hold K and V quantized and
dequantized the same way, for GQA pages and the MLA latent, with prefix caching and
speculative steps; the checkpoint's ``k_scale`` / ``v_scale`` are read per layer and head."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from disagg.engine.speculative import Speculation
from disagg.kernels import kv_quant
from disagg.kernels.backends import TorchBackend
from disagg.llm import LLM
from disagg.model.loader import load_model
from disagg.protocol import SamplingParams
from tinymodels import make_tiny_model

PAGE = 4
PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7], list(range(10, 10 + 3 * PAGE + 1)), [3, 4]]
NEW = 8


class QuantDequantBackend(TorchBackend):
    """The reference: float32 pages holding ``dequantize(quantize(x))``, read as they are."""

    def append_kv(self, k, v, k_cache, v_cache, meta, kv_scales=None):  # type: ignore[no-untyped-def]
        ks, vs = kv_scales
        k = kv_quant.dequantize(kv_quant.quantize(k, ks), ks, head_dim=1)
        v = kv_quant.dequantize(kv_quant.quantize(v, vs), vs, head_dim=1)
        super().append_kv(k, v, k_cache, v_cache, meta)

    def attend(self, q, k_cache, v_cache, meta, scale, kv_scales=None):  # type: ignore[no-untyped-def]
        return super().attend(q, k_cache, v_cache, meta, scale)


def greedy(llm: LLM) -> list[list[int]]:
    params = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
    return [o.token_ids for o in llm.generate(PROMPTS, params)]


def with_kv_scales(path, scale_of):
    """Add ``self_attn.k_scale`` / ``v_scale`` to the checkpoint: ``scale_of(layer, kind)``."""
    cfg = json.loads((path / "config.json").read_text())
    tensors = {f"model.layers.{i}.self_attn.{kind}_scale": scale_of(i, kind)
               for i in range(cfg["num_hidden_layers"]) for kind in "kv"}
    save_file(tensors, str(path / "kv-scales.safetensors"), metadata={"format": "pt"})
    index = path / "model.safetensors.index.json"
    if index.is_file():
        doc = json.loads(index.read_text())
        doc["weight_map"].update(dict.fromkeys(tensors, "kv-scales.safetensors"))
        index.write_text(json.dumps(doc))
    return path


@pytest.mark.parametrize("kind", ["llama", "deepseek_v2"])
def test_fp8_pages_give_the_tokens_of_quantized_float32_pages(kind, tmp_path):
    path = make_tiny_model(kind, tmp_path / kind)
    if kind == "llama":  # per-head scales, different per layer
        path = with_kv_scales(path, lambda i, k: torch.tensor([0.02 * (i + 1), 0.05])
                              if k == "k" else torch.tensor(0.03))
    else:  # MLA: one scale for the latent (k_scale)
        path = with_kv_scales(path, lambda i, k: torch.tensor(0.001 * (i + 1)))
    model = load_model(path, "float32")
    assert model.kv_scales_id.startswith("sha256:")
    assert model.layers[0].k_scale.shape == ((1,) if kind == "deepseek_v2" else (2,))
    fp8 = LLM(model, num_pages=64, page_size=PAGE, kv_cache_dtype="fp8_e4m3")
    assert fp8.runner.kv.dtype == torch.float8_e4m3fn
    ref = LLM(model, num_pages=64, page_size=PAGE)
    ref.runner.backend = QuantDequantBackend()
    plain = greedy(LLM(model, num_pages=64, page_size=PAGE))
    got = greedy(fp8)
    assert got == greedy(ref)
    assert greedy(fp8) == got  # again: the prompts' pages now come from the prefix cache
    # the scales matter: these small ones saturate the pages, so the tokens differ from plain
    assert got != plain


def test_fp8_pages_with_unit_scales_and_speculative_steps(tmp_path):
    model = load_model(make_tiny_model("qwen3", tmp_path / "q3"), "float32")
    assert model.kv_scales_id == kv_quant.UNIT_SCALES
    ref = LLM(model, num_pages=64, page_size=PAGE)
    ref.runner.backend = QuantDequantBackend()
    want = greedy(ref)
    assert greedy(LLM(model, num_pages=64, page_size=PAGE, kv_cache_dtype="fp8_e4m3")) == want
    spec = LLM(model, num_pages=64, page_size=PAGE, kv_cache_dtype="fp8_e4m3",
               speculative=Speculation("ngram", 3))
    assert greedy(spec) == want


def test_mis_shaped_checkpoint_scales_are_refused_by_name(tmp_path):
    path = with_kv_scales(make_tiny_model("llama", tmp_path / "m"),
                          lambda i, k: torch.ones(3))
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.[kv]_scale has shape"):
        load_model(path, "float32")


@pytest.mark.parametrize("size, kv_heads", [(2, 2), (4, 2)])  # heads split, then replicated
def test_each_tp_rank_holds_its_kv_heads_scales_and_the_identity_is_global(tmp_path, size,
                                                                          kv_heads):
    from disagg.model.tp import TensorParallel

    path = with_kv_scales(make_tiny_model("llama", tmp_path / "m"),
                          lambda i, k: torch.tensor([1.0 + i, 2.0 + i]) * (1 if k == "k" else 3))
    ids = set()
    for rank in range(size):
        model = load_model(path, "float32", tp=TensorParallel(rank, size))
        ids.add(model.kv_scales_id)
        head = rank // (size // kv_heads) if size > kv_heads else rank
        for i, layer in enumerate(model.layers):
            assert layer.k_scale.tolist() == [[1.0 + i, 2.0 + i][head]]
            assert layer.v_scale.tolist() == [3 * [1.0 + i, 2.0 + i][head]]
    assert len(ids) == 1 and ids.pop().startswith("sha256:")
