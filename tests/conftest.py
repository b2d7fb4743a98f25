"""Shared fixtures: tiny random Hugging Face models of each supported architecture."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

TINY = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)


def make_tiny_model(kind: str, path: Path, seed: int = 0, **overrides) -> Path:
    """Save a tiny random HF model of ``kind`` (llama | qwen2 | qwen3) as float32 safetensors."""
    import transformers

    cfg_kw = dict(TINY, **overrides)
    if kind == "llama":
        cfg = transformers.LlamaConfig(
            **cfg_kw,
            rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
        )
        cls = transformers.LlamaForCausalLM
    elif kind == "qwen2":
        cfg = transformers.Qwen2Config(**cfg_kw)
        cls = transformers.Qwen2ForCausalLM
    elif kind == "qwen3":
        cfg = transformers.Qwen3Config(head_dim=32, **cfg_kw)
        cls = transformers.Qwen3ForCausalLM
    else:
        raise ValueError(kind)
    cfg.eos_token_id = 2
    cfg.bos_token_id = 1
    torch.manual_seed(seed)
    model = cls(cfg).to(torch.float32).eval()
    with torch.no_grad():  # break symmetry so greedy paths are not trivially constant
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(path, safe_serialization=True, max_shard_size="200KB")
    return path


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {k: make_tiny_model(k, root / k) for k in ("llama", "qwen2", "qwen3")}


def hf_greedy(path: Path, prompt: list[int], max_new_tokens: int) -> list[int]:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
        eos_token_id=None, pad_token_id=0, min_new_tokens=max_new_tokens,
    )
    return out[0, len(prompt):].tolist()
