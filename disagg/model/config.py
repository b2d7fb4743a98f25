"""The architecture description read from a Hugging Face ``config.json``.

One decoder-only family covers ``LlamaForCausalLM``, ``Qwen2ForCausalLM`` (qkv bias) and
``Qwen3ForCausalLM`` (per-head q/k RMSNorm): GQA, RoPE (default or llama3 scaling), RMSNorm,
SiLU-gated MLP, optionally tied embeddings.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


@dataclass(frozen=True)
class ModelArch:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    rope_scaling: dict[str, Any] | None = None
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    torch_dtype: str = "float32"
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> ModelArch:
        archs = cfg.get("architectures") or []
        arch = archs[0] if archs else _arch_from_model_type(cfg.get("model_type", ""))
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        num_heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        head_dim = cfg.get("head_dim") or hidden // num_heads
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "llama3"):
            raise ValueError(f"unsupported rope type {rope_type!r}; supported: default, llama3")
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return cls(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=arch == "Qwen2ForCausalLM" or bool(cfg.get("attention_bias", False)),
            qk_norm=arch == "Qwen3ForCausalLM",
            rope_scaling=dict(rope) if rope_type == "llama3" else None,
            eos_token_ids=eos_ids,
            bos_token_id=cfg.get("bos_token_id"),
            torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"),
        )

    def identity(self, dtype: str) -> bytes:
        """What a cached KV page's hash is salted with: the shape of the KV it holds.
        (Nodes serving different weights of one shape must not share prefix hashes: the
        weights' fingerprint is not in it yet.)"""
        return (f"{self.architecture}:{self.num_layers}:{self.hidden_size}:{self.num_kv_heads}:"
                f"{self.head_dim}:{self.vocab_size}:{dtype}").encode()

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelArch:
        cfg_path = Path(path) / "config.json"
        if not cfg_path.is_file():
            raise FileNotFoundError(f"{cfg_path} not found: --model must be a local HF directory")
        arch = cls.from_hf_config(json.loads(cfg_path.read_text()))
        gen_path = Path(path) / "generation_config.json"
        if gen_path.is_file():
            gen = json.loads(gen_path.read_text())
            eos = gen.get("eos_token_id")
            if eos is not None:
                ids = tuple(eos) if isinstance(eos, list) else (int(eos),)
                merged = tuple(dict.fromkeys(arch.eos_token_ids + ids))
                arch = _replace(arch, eos_token_ids=merged)
        return arch


def _replace(arch: ModelArch, **changes: Any) -> ModelArch:
    from dataclasses import replace

    return replace(arch, **changes)


def _arch_from_model_type(model_type: str) -> str:
    return {
        "llama": "LlamaForCausalLM",
        "qwen2": "Qwen2ForCausalLM",
        "qwen3": "Qwen3ForCausalLM",
    }.get(model_type, model_type)
