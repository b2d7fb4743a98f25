"""GPU memory budget of a model under tensor parallelism: weights, KV bytes per token, KV tokens.

Pure arithmetic on a ``ModelArch`` (no torch), following what the loader and ``disagg.model.tp``
hold on one rank:

- Split over the ranks: attention heads (q/k/v rows, ``o_proj`` columns; MLA ``q_b``/``q_proj``
  and ``kv_b`` rows, ``o_proj`` columns), the dense MLP's and every expert's intermediate
  dimension (gate/up rows, down columns), the shared expert's likewise. KV heads fewer than
  the ranks are replicated (``shard_kv_heads``: one head per rank).
- Replicated on every rank: embeddings, ``lm_head``, norms, routers (and DeepSeek's float32
  correction bias), Qwen2-MoE's shared-expert gate, MLA's latent projections ``q_a`` and
  ``kv_a_proj_with_mqa`` with their norms (so the latent cache too), the MTP layer's
  ``eh_proj`` and norms.
- Block FP8 (``disagg.model.fp8``, ``quantizable``): every linear weight of a decoder layer
  (``*proj``, experts included) is one byte per value plus a float32 scale per 128x128 block
  of the rank's shard; embeddings, ``lm_head``, norms and routers stay in the model's dtype.

KV pages are sized as the executor does at ``--num-pages 0`` (``pages_from_free_memory``):
``total x --gpu-memory-utilization - memory outside torch - torch peak (weights + activation
peak) - CUDA graph headroom (activation peak + 256 MiB)``, in whole pages. The activation peak
and the memory outside torch are estimates here (``Budget``); the executor measures them.

``python -m disagg.model.budget CONFIG_JSON --tp 8`` prints the budget of a ``config.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

from disagg.model.config import ModelArch, shard_kv_heads

GIB = 1 << 30
H200_BYTES = 150_109_880_320  # torch.cuda.mem_get_info total of one H200 (139.8 GiB)
FP8_BLOCK = 128  # the 128x128 scale blocks of the DeepSeek / Qwen3 FP8 releases
SCALE_BYTES = 4  # float32 weight_scale_inv


@dataclass(frozen=True)
class Weight:
    """One kind of tensor as a rank holds it: ``rows x cols`` (``cols`` 1: a vector), ``count``
    of them on the rank (layers x experts); ``params`` over the whole model."""

    name: str
    rows: int
    cols: int
    count: int
    params: int
    fp8: bool  # a linear weight a block-FP8 checkpoint stores as FP8
    split: str = ""  # the dimension split over the ranks: rows, cols or "" (replicated)
    dtype_bytes: int = 2  # when not FP8 (the model's dtype; DeepSeek's correction bias: 4)

    def nbytes(self, fp8_weights: bool, block: int = FP8_BLOCK) -> int:
        """Bytes on one rank: FP8 values plus block scales, else ``dtype_bytes`` per value."""
        if fp8_weights and self.fp8:
            scales = math.ceil(self.rows / block) * math.ceil(self.cols / block)
            return self.count * (self.rows * self.cols + SCALE_BYTES * scales)
        return self.count * self.rows * self.cols * self.dtype_bytes

    def splits_block(self, block: int = FP8_BLOCK) -> bool:
        """Whether a rank's shard keeps part of a scale block (the loader refuses such a
        checkpoint: ``... splits its 128-wide FP8 scale blocks``)."""
        if not self.fp8 or not self.split:
            return False
        return (self.rows if self.split == "rows" else self.cols) % block != 0


def weights(arch: ModelArch, tp: int = 1, mtp: bool = False) -> list[Weight]:
    """Every tensor one rank of ``tp`` holds (``mtp``: with the multi-token-prediction layer,
    as ``--speculative-method mtp`` loads it)."""
    h, out = arch.hidden_size, []
    out.append(Weight("embed_tokens", arch.vocab_size, h, 1, arch.vocab_size * h, False))
    if not arch.tie_word_embeddings:
        out.append(Weight("lm_head", arch.vocab_size, h, 1, arch.vocab_size * h, False))
    out.append(Weight("norm", h, 1, 1, h, False))
    sparse = arch.moe.sparse_layers if arch.moe is not None else (False,) * arch.num_layers
    extra = arch.mtp_layers if mtp else 0
    n_sparse = sum(sparse) + (extra if sparse and sparse[-1] else 0)
    n_dense = arch.num_layers + extra - n_sparse
    out += _attention(arch, tp, arch.num_layers + extra)
    out.append(Weight("input/post_attention_layernorm", h, 1, 2 * (arch.num_layers + extra),
                      2 * h * (arch.num_layers + extra), False))
    if n_dense:
        out += _mlp("mlp", h, arch.intermediate_size, tp, n_dense)
    if n_sparse and arch.moe is not None:
        out += _moe(arch, tp, n_sparse)
    if extra:
        out.append(Weight("mtp.eh_proj", h, 2 * h, extra, 2 * h * h * extra, True))
        out.append(Weight("mtp.enorm/hnorm/head_norm", h, 1, 3 * extra, 3 * h * extra, False))
    return out


def _attention(arch: ModelArch, tp: int, layers: int) -> list[Weight]:
    h, n = arch.hidden_size, arch.num_heads

    def w(name: str, rows: int, cols: int, split: str = "", fp8: bool = True,
          shards: int = 1) -> Weight:
        local = (rows // shards, cols) if split == "rows" else (rows, cols // shards)
        return Weight(name, *local, layers, rows * cols * layers, fp8, split)

    if arch.mla is not None:
        a = arch.mla
        qk = a.qk_nope_head_dim + a.qk_rope_head_dim
        out = [w("self_attn.q_proj", n * qk, h, "rows", shards=tp)] if not a.q_lora_rank else [
            w("self_attn.q_a_proj", a.q_lora_rank, h),
            w("self_attn.q_a_layernorm", a.q_lora_rank, 1, fp8=False),
            w("self_attn.q_b_proj", n * qk, a.q_lora_rank, "rows", shards=tp)]
        return out + [
            w("self_attn.kv_a_proj_with_mqa", a.kv_lora_rank + a.qk_rope_head_dim, h),
            w("self_attn.kv_a_layernorm", a.kv_lora_rank, 1, fp8=False),
            w("self_attn.kv_b_proj", n * (a.qk_nope_head_dim + a.v_head_dim), a.kv_lora_rank,
              "rows", shards=tp),
            w("self_attn.o_proj", h, n * a.v_head_dim, "cols", shards=tp)]
    d, kv = arch.head_dim, arch.num_kv_heads
    kv_local, _ = shard_kv_heads(kv, tp)
    out = [w("self_attn.q_proj", n * d, h, "rows", shards=tp),
           Weight("self_attn.k_proj/v_proj", kv_local * d, h, 2 * layers, 2 * kv * d * h * layers,
                  True, "rows" if tp > 1 else ""),
           w("self_attn.o_proj", h, n * d, "cols", shards=tp)]
    if arch.qkv_bias:
        out.append(Weight("self_attn.qkv_bias", (n // tp + 2 * kv_local) * d, 1, layers,
                          (n + 2 * kv) * d * layers, False, "rows"))
    if arch.qk_norm:
        out.append(Weight("self_attn.q_norm/k_norm", d, 1, 2 * layers, 2 * d * layers, False))
    return out


def _mlp(name: str, h: int, inter: int, tp: int, count: int) -> list[Weight]:
    """A SiLU-gated MLP's gate/up (rows split) and down (columns split), ``count`` of them."""
    local = inter // tp
    return [Weight(f"{name}.gate_proj/up_proj", local, h, 2 * count, 2 * inter * h * count,
                   True, "rows"),
            Weight(f"{name}.down_proj", h, local, count, inter * h * count, True, "cols")]


def _moe(arch: ModelArch, tp: int, layers: int) -> list[Weight]:
    moe, h = arch.moe, arch.hidden_size
    assert moe is not None
    e = moe.num_experts
    out = [Weight("mlp.gate (router)", e, h, layers, e * h * layers, False)]
    if moe.correction_bias:
        out.append(Weight("mlp.gate.e_score_correction_bias", e, 1, layers, e * layers, False,
                          dtype_bytes=4))
    out += _mlp("mlp.experts", h, moe.intermediate_size, tp, layers * e)
    if moe.shared_intermediate_size:
        out += _mlp("mlp.shared_experts", h, moe.shared_intermediate_size, tp, layers)
    if moe.shared_gate:
        out.append(Weight("mlp.shared_expert_gate", 1, h, layers, h * layers, False))
    return out


def param_count(arch: ModelArch, mtp: bool = False) -> int:
    """Parameters of the whole model (``mtp``: with its MTP layers, without the checkpoint's
    copies of the embedding and head in them)."""
    return sum(w.params for w in weights(arch, 1, mtp))


def weight_bytes(arch: ModelArch, tp: int, fp8: bool, mtp: bool = False) -> int:
    """Bytes of weights on one rank: block FP8 (``fp8``) or all in bf16/fp16."""
    return sum(w.nbytes(fp8) for w in weights(arch, tp, mtp))


def split_blocks(arch: ModelArch, tp: int, mtp: bool = False) -> list[str]:
    """The FP8 tensors whose ``tp`` shards would split a 128x128 scale block."""
    return [w.name for w in weights(arch, tp, mtp) if w.splits_block()]


def kv_bytes_per_token(arch: ModelArch, tp: int, dtype_bytes: int) -> int:
    """KV bytes one rank holds per token: GQA K and V of its kv heads (at least one: heads
    fewer than the ranks are replicated), MLA the whole latent row (replicated)."""
    local, _ = shard_kv_heads(arch.num_kv_heads, tp)
    return arch.kv_parts * arch.num_layers * local * arch.head_dim * dtype_bytes


@dataclass(frozen=True)
class Budget:
    """One GPU as the executor sizes its KV pool (``--gpu-memory-utilization``, default 0.9)."""

    gpu_bytes: int = H200_BYTES
    utilization: float = 0.9
    outside_torch: int = GIB  # CUDA context (0.6 GiB measured on an H200) and NCCL buffers
    activation_peak: int = 2 * GIB  # the profiling step's activations beyond the weights
    cuda_graphs: bool = True  # graph headroom: the activation peak again + 256 MiB
    page_size: int = 16

    def headroom(self) -> int:
        graphs = self.activation_peak + (256 << 20) if self.cuda_graphs else 0
        return self.outside_torch + self.activation_peak + graphs

    def kv_bytes(self, weight_bytes: int) -> int:
        """What is left for KV pages (negative: the weights do not fit)."""
        return int(self.gpu_bytes * self.utilization) - weight_bytes - self.headroom()

    def kv_tokens(self, weight_bytes: int, per_token: int) -> int:
        """Tokens of KV that fit, in whole pages (0 when nothing is left)."""
        pages = max(self.kv_bytes(weight_bytes), 0) // (per_token * self.page_size)
        return pages * self.page_size


def report(arch: ModelArch, tp: int, budget: Budget | None = None, mtp: bool = False,
           context: int = 131072) -> str:
    """The budget of one rank as text: weights FP8 vs bf16, KV bytes per token and the tokens
    (and ``context``-long sequences) that fit with bf16 and FP8 KV pages."""
    b = budget or Budget()
    lines = [f"{arch.architecture}: {param_count(arch, mtp) / 1e9:.1f}B parameters"
             f"{' (with MTP)' if mtp else ''}, --tp {tp}, GPU {b.gpu_bytes / GIB:.1f} GiB x "
             f"{b.utilization}, headroom {b.headroom() / GIB:.2f} GiB"]
    split = split_blocks(arch, tp, mtp)
    if split:
        lines.append(f"  FP8 checkpoint refused at --tp {tp}: shards split 128-blocks of "
                     + ", ".join(split))
    for label, fp8 in (("FP8 weights", True), ("bf16 weights", False)):
        wb = weight_bytes(arch, tp, fp8, mtp)
        lines.append(f"  {label}: {wb / GIB:.1f} GiB per GPU, {b.kv_bytes(wb) / GIB:.1f} GiB "
                     "left for KV" + ("" if b.kv_bytes(wb) > 0 else " (does not fit)"))
        for kv_label, size in (("bf16", 2), ("fp8", 1)):
            per = kv_bytes_per_token(arch, tp, size)
            if mtp and arch.mtp_layers:  # the MTP layer's cache stays in the model's dtype
                per += arch.mtp_layers * kv_bytes_per_token(arch, tp, 2) // arch.num_layers
            tokens = b.kv_tokens(wb, per)
            lines.append(f"    {kv_label} KV: {per:,} B/token per GPU -> {tokens:,} tokens "
                         f"({tokens / context:.1f} x {context // 1024}k contexts)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m disagg.model.budget",
                                 description="GPU memory budget of a model under --tp")
    ap.add_argument("config", help="a config.json, or a model directory holding one")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--gpu-gib", type=float, default=H200_BYTES / GIB,
                    help="GPU memory as torch reports it (default: one H200)")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    ap.add_argument("--activation-gib", type=float, default=2.0,
                    help="activation peak of the profiling step (estimate)")
    ap.add_argument("--outside-torch-gib", type=float, default=1.0)
    ap.add_argument("--enforce-eager", action="store_true", help="no CUDA graph headroom")
    ap.add_argument("--mtp", action="store_true", help="with the MTP layer and its KV")
    ap.add_argument("--context", type=int, default=131072)
    args = ap.parse_args(argv)
    path = Path(args.config)
    arch = ModelArch.from_hf_config(json.loads(
        (path / "config.json" if path.is_dir() else path).read_text()))
    budget = Budget(int(args.gpu_gib * GIB), args.gpu_memory_utilization,
                    int(args.outside_torch_gib * GIB), int(args.activation_gib * GIB),
                    not args.enforce_eager)
    sys.stdout.write(report(arch, args.tp, budget, args.mtp, args.context) + "\n")


if __name__ == "__main__":
    main()
