"""The architecture description read from a Hugging Face ``config.json``.

One decoder-only family covers ``LlamaForCausalLM``, ``Qwen2ForCausalLM`` (qkv bias) and
``Qwen3ForCausalLM`` (per-head q/k RMSNorm): GQA, RoPE (default, llama3 or YaRN scaling),
RMSNorm, SiLU-gated MLP, optionally tied embeddings. Two options extend it:

- ``moe`` (``MoEArch``): some layers' MLP is a mixture of experts (``Qwen2MoeForCausalLM``,
  ``Qwen3MoeForCausalLM``, DeepSeek V2/V3), routed per token with an optional shared expert.
- ``mla`` (``MLAArch``): DeepSeek's multi-head latent attention. The KV cache then holds one
  latent row per token (``kv_lora_rank + qk_rope_head_dim`` values, shared by every head):
  ``num_kv_heads`` is 1, ``head_dim`` that row's width and ``kv_parts`` 1 (GQA: K and V, 2).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                           "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "DeepseekV2ForCausalLM",
                           "DeepseekV3ForCausalLM")
ROPE_TYPES = ("default", "llama3", "yarn")


@dataclass(frozen=True)
class MoEArch:
    """A mixture-of-experts MLP: which layers have one and how tokens are routed.

    Routing (as Hugging Face computes it): router logits -> ``scoring`` (softmax or sigmoid);
    with ``n_group`` > 1 only experts of the best ``topk_group`` groups compete (a group scores
    its best expert, ``group_score="max"``, or its best two summed, ``"top2"``); DeepSeek V3
    adds ``e_score_correction_bias`` to choose but weighs by the uncorrected score; then top
    ``top_k``, optionally renormalised (``norm_topk_prob``), times ``routed_scaling_factor``.
    """

    num_experts: int
    top_k: int
    intermediate_size: int  # per expert (moe_intermediate_size); per rank under TP
    sparse_layers: tuple[bool, ...]  # per layer: MoE (True) or the dense MLP
    shared_intermediate_size: int = 0  # shared expert(s), 0: none; per rank under TP
    shared_gate: bool = False  # Qwen2-MoE: sigmoid(shared_expert_gate(x)) scales the shared
    scoring: str = "softmax"  # softmax | sigmoid
    norm_topk_prob: bool = False
    n_group: int = 1
    topk_group: int = 1
    group_score: str = "max"  # max (V2 group_limited_greedy) | top2 (V3)
    correction_bias: bool = False  # DeepSeek V3 e_score_correction_bias
    routed_scaling_factor: float = 1.0
    router_fp32: bool = False  # DeepSeek: router logits from float32 inputs and weights


@dataclass(frozen=True)
class MLAArch:
    """DeepSeek multi-head latent attention (``q_lora_rank`` 0: a plain ``q_proj``)."""

    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool  # rotary pairs interleaved (V2 always; V3 ``rope_interleave``)
    softmax_scale: float  # qk_head_dim**-0.5, times YaRN's mscale(mscale_all_dim)**2


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
    moe: MoEArch | None = None
    mla: MLAArch | None = None
    mtp_layers: int = 0  # DeepSeek-V3 multi-token-prediction layers after the last layer

    @property
    def kv_parts(self) -> int:
        """Tensors per cache page and head: K and V (2), or MLA's one latent (1)."""
        return 1 if self.mla is not None else 2

    @property
    def layout_kind(self) -> str:
        """What a KV page holds, as peers name it: ``gqa`` (K/V heads) or ``mla`` (latent)."""
        return "mla" if self.mla is not None else "gqa"

    @property
    def moe_shape(self) -> str:
        """The MoE as peers compare it (``KVLayoutDesc.moe``; "" for a dense model): experts,
        top-k and routing, the experts' and shared experts' widths, which layers are sparse.
        Global sizes only, never where the experts lie: each side of a pair places them as its
        own ``--tp`` / ``--dp`` / ``--expert-parallel`` say (placement never crosses the pair)."""
        m = self.moe
        if m is None:
            return ""
        routing = m.scoring + (", normalized" if m.norm_topk_prob else "")
        if m.n_group > 1:
            routing += f", {m.topk_group} of {m.n_group} groups by {m.group_score}"
        if m.correction_bias:
            routing += ", corrected"
        if m.routed_scaling_factor != 1.0:
            routing += f", scaled {m.routed_scaling_factor:g}"
        sparse = [i for i, s in enumerate(m.sparse_layers) if s]
        return (f"{m.num_experts} experts top {m.top_k} ({routing}), {m.intermediate_size} wide"
                f", shared {m.shared_intermediate_size}{' gated' if m.shared_gate else ''}"
                f", sparse layers {_spans(sparse)}")

    @property
    def rope_dim(self) -> int:
        """Dimensions that RoPE rotates per head."""
        return self.mla.qk_rope_head_dim if self.mla is not None else self.head_dim

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
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ROPE_TYPES:
            raise ValueError(f"unsupported rope type {rope_type!r}; supported: "
                             f"{', '.join(ROPE_TYPES)}")
        rope["rope_type"] = rope_type
        if rope_type == "yarn":
            rope.setdefault("original_max_position_embeddings",
                            cfg.get("max_position_embeddings", 2048))
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported activation {cfg.get('hidden_act')!r}; supported: silu")
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        num_layers = int(cfg["num_hidden_layers"])
        mla = _mla(cfg, rope, arch) if arch.startswith("Deepseek") else None
        num_kv_heads = int(cfg.get("num_key_value_heads") or num_heads)
        if mla is not None:  # one latent row per token, shared by every head
            num_kv_heads, head_dim = 1, mla.kv_lora_rank + mla.qk_rope_head_dim
        return cls(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=int(head_dim),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=arch in ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM")
            or (mla is None and bool(cfg.get("attention_bias", False))),
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
            rope_scaling=rope if rope_type != "default" else None,
            eos_token_ids=eos_ids,
            bos_token_id=cfg.get("bos_token_id"),
            torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"),
            moe=_moe(cfg, arch, num_layers),
            mla=mla,
            mtp_layers=int(cfg.get("num_nextn_predict_layers") or cfg.get("num_mtp_layers") or 0)
            if arch == "DeepseekV3ForCausalLM" else 0,
        )

    def identity(self, dtype: str) -> bytes:
        """What a cached KV page's hash is salted with: the shape of the KV it holds.
        (Nodes serving different weights of one shape must not share prefix hashes: the
        weights' fingerprint is not in it yet.)"""
        return (f"{self.architecture}:{self.layout_kind}:{self.num_layers}:{self.hidden_size}:"
                f"{self.num_kv_heads}:{self.head_dim}:{self.vocab_size}:{dtype}").encode()

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


def _spans(ids: list[int]) -> str:
    """Ascending ints as ranges: [0, 1, 2, 5] -> "0-2,5"; [] -> "none"."""
    runs: list[list[int]] = []
    for i in ids:
        if runs and runs[-1][1] == i - 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ",".join(f"{a}-{b}" if b > a else str(a) for a, b in runs) or "none"


def _arch_from_model_type(model_type: str) -> str:
    return {
        "llama": "LlamaForCausalLM",
        "qwen2": "Qwen2ForCausalLM",
        "qwen3": "Qwen3ForCausalLM",
        "qwen2_moe": "Qwen2MoeForCausalLM",
        "qwen3_moe": "Qwen3MoeForCausalLM",
        "deepseek_v2": "DeepseekV2ForCausalLM",
        "deepseek_v3": "DeepseekV3ForCausalLM",
    }.get(model_type, model_type)


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _mla(cfg: dict[str, Any], rope: dict[str, Any], arch: str) -> MLAArch:
    nope, rope_dim = int(cfg["qk_nope_head_dim"]), int(cfg["qk_rope_head_dim"])
    scale = (nope + rope_dim) ** -0.5
    if rope.get("rope_type", "default") != "default" and rope.get("mscale_all_dim"):
        m = yarn_mscale(float(rope["factor"]), float(rope["mscale_all_dim"]))
        scale *= m * m
    v2 = arch == "DeepseekV2ForCausalLM"
    return MLAArch(
        q_lora_rank=int(cfg.get("q_lora_rank") or 0),
        kv_lora_rank=int(cfg["kv_lora_rank"]),
        qk_nope_head_dim=nope,
        qk_rope_head_dim=rope_dim,
        v_head_dim=int(cfg.get("v_head_dim") or nope),
        rope_interleave=True if v2 else bool(cfg.get("rope_interleave", True)),
        softmax_scale=scale,
    )


def _moe(cfg: dict[str, Any], arch: str, num_layers: int) -> MoEArch | None:
    """The MoE description of a Qwen-MoE or DeepSeek config (None for a dense one)."""
    if arch in ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"):
        experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
        if experts == 0:
            return None
        only = set(cfg.get("mlp_only_layers") or [])
        step = int(cfg.get("decoder_sparse_step") or 1)
        shared = int(cfg.get("shared_expert_intermediate_size") or 0) \
            if arch == "Qwen2MoeForCausalLM" else 0
        return MoEArch(
            num_experts=experts, top_k=int(cfg["num_experts_per_tok"]),
            intermediate_size=int(cfg["moe_intermediate_size"]),
            sparse_layers=tuple(i not in only and (i + 1) % step == 0 for i in range(num_layers)),
            shared_intermediate_size=shared, shared_gate=shared > 0,
            norm_topk_prob=bool(cfg.get("norm_topk_prob", False)))
    if arch in ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"):
        experts = int(cfg.get("n_routed_experts") or 0)
        if experts == 0:
            return None
        first_dense = int(cfg.get("first_k_dense_replace") or 0)
        freq = int(cfg.get("moe_layer_freq") or 1)
        v3 = arch == "DeepseekV3ForCausalLM"
        method = "noaux_tc" if v3 else str(cfg.get("topk_method") or "greedy")
        if method not in ("greedy", "group_limited_greedy", "noaux_tc"):
            raise ValueError(f"unsupported topk_method {method!r}")
        grouped = method != "greedy"
        inter = int(cfg["moe_intermediate_size"])
        return MoEArch(
            num_experts=experts, top_k=int(cfg["num_experts_per_tok"]), intermediate_size=inter,
            sparse_layers=tuple(i >= first_dense and i % freq == 0 for i in range(num_layers)),
            shared_intermediate_size=inter * int(cfg.get("n_shared_experts") or 0),
            scoring="sigmoid" if v3 else "softmax",
            norm_topk_prob=bool(cfg.get("norm_topk_prob", False)) if v3 else False,
            n_group=int(cfg.get("n_group") or 1) if grouped else 1,
            topk_group=int(cfg.get("topk_group") or 1) if grouped else 1,
            group_score="top2" if v3 else "max", correction_bias=v3,
            routed_scaling_factor=float(cfg.get("routed_scaling_factor") or 1.0),
            router_fp32=True)
    return None


def shard_kv_heads(total_kv_heads: int, tp_size: int) -> tuple[int, int]:
    """(kv heads per rank, kv_replicas) of a model with ``total_kv_heads`` over ``tp_size``
    ranks: heads split evenly when TP divides them, else each head replicated on
    ``tp_size // total_kv_heads`` consecutive ranks (TP must then be a multiple). The one rule
    the model's shards (``disagg.model.tp``) and the KV transfer planner
    (``disagg.remote.transfer_plan``) both follow."""
    if total_kv_heads < 1 or tp_size < 1:
        raise ValueError(f"kv heads ({total_kv_heads}) and tp size ({tp_size}) must be >= 1")
    if total_kv_heads % tp_size == 0:
        return total_kv_heads // tp_size, 1
    if tp_size % total_kv_heads == 0:
        return 1, tp_size // total_kv_heads
    raise ValueError(f"{total_kv_heads} kv heads cannot be sharded over --tp {tp_size}: "
                     "one must divide the other")
