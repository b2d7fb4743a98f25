"""DeepSeek multi-head latent attention over a paged latent cache.

Per token the cache holds one row ``[c_kv (kv_lora_rank), k_pe (qk_rope_head_dim)]``: the
normalised compressed KV and the rotated shared rope key, the same for every head (so under
tensor parallelism every rank holds the whole row while the heads are split).

Attention runs absorbed, for prefill and decode alike: ``kv_b_proj`` splits per head into
``W_UK [nope, kv_lora]`` and ``W_UV [v, kv_lora]``; the query's no-rope part is folded into
the latent space (``q_nope @ W_UK``), so a head's score against a cached row is
``[q_nope W_UK, q_pe] . [c_kv, k_pe]`` -- multi-query attention with one 576-wide kv head --
and its output ``(softmax . c_kv) @ W_UV^T``. That equals expanding the latent into per-head
keys and values (Hugging Face's form) up to rounding. The triton backend runs the latent
kernels of ``disagg.kernels.mla`` (append, split-kv decode, causal prefill); any other backend's
``attend`` computes it with the latent as both K and V (the value's rope tail dropped after).
"""

from __future__ import annotations

import torch
from torch import nn

from disagg.kernels.interface import AttentionBackend, AttentionMetadata
from disagg.model.config import MLAArch
from disagg.model.ops import fused_on, norm, project
from disagg.model.rotary import rotate_half


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool) -> torch.Tensor:
    """Rotate ``x [T, H, R]`` by ``cos``/``sin [T, 1, R]`` (``cat(freqs, freqs)`` layout).
    Interleaved pairs ``(x0, x1), (x2, x3) ...`` come out de-interleaved (first the rotated
    evens, then the odds): the same dot products as DeepSeek's complex form."""
    if not interleave:
        return x * cos + rotate_half(x) * sin
    half = cos.shape[-1] // 2
    c, s = cos[..., :half], sin[..., :half]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool
          ) -> torch.Tensor:
    """``rope``, in one kernel on CUDA (``disagg.model.fused.norm_rope``)."""
    if fused_on(x):
        from disagg.model import fused

        return fused.norm_rope(x, None, cos, sin, 0.0, interleave=interleave)
    return rope(x, cos, sin, interleave)


class MLAAttention(nn.Module):
    def __init__(self, hidden: int, num_heads: int, mla: MLAArch, eps: float,
                 dtype: torch.dtype, device: torch.device):
        """``num_heads``: this rank's heads."""
        super().__init__()
        self.arch, self.num_heads, self.eps = mla, num_heads, eps
        qk = mla.qk_nope_head_dim + mla.qk_rope_head_dim

        def p(*shape: int) -> nn.Parameter:
            return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)

        if mla.q_lora_rank:
            self.q_a = p(mla.q_lora_rank, hidden)
            self.q_a_norm = p(mla.q_lora_rank)
            self.q_b = p(num_heads * qk, mla.q_lora_rank)
        else:
            self.q_proj = p(num_heads * qk, hidden)
        self.kv_a = p(mla.kv_lora_rank + mla.qk_rope_head_dim, hidden)
        self.kv_a_norm = p(mla.kv_lora_rank)
        self.kv_b = p(num_heads * (mla.qk_nope_head_dim + mla.v_head_dim), mla.kv_lora_rank)
        self.o = p(hidden, num_heads * mla.v_head_dim)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: torch.Tensor, meta: AttentionMetadata,
                backend: AttentionBackend, kv_scale: torch.Tensor | None = None
                ) -> torch.Tensor:
        """``h [T, H]`` (normed input) -> this rank's partial attention output ``[T, H]``;
        appends the tokens' latent rows to ``cache [P, 1, S, kv_lora + rope]`` (FP8 pages:
        quantized by ``kv_scale``, the layer's float32 ``[1]``)."""
        a, t, n = self.arch, h.shape[0], self.num_heads
        nope, r, c = a.qk_nope_head_dim, a.qk_rope_head_dim, a.kv_lora_rank
        if a.q_lora_rank:
            q = project(norm(project(h, self.q_a), self.q_a_norm, self.eps), self.q_b)
        else:
            q = project(h, self.q_proj)
        q = q.view(t, n, nope + r)
        q_nope, q_pe = q[..., :nope], q[..., nope:]
        ckv = project(h, self.kv_a)
        latent = torch.cat((norm(ckv[:, :c], self.kv_a_norm, self.eps),
                            _rope(ckv[:, None, c:], cos, sin, a.rope_interleave)[:, 0]), dim=-1)
        latent = latent.view(t, 1, c + r)
        triton = backend.name == "triton"
        pair = None if kv_scale is None else (kv_scale, kv_scale)
        if triton:
            from disagg.kernels import mla as kernels

            kernels.append_latent(latent, cache, meta.slot_mapping, kv_scale)
        else:
            backend.append_kv(latent, latent, cache, cache, meta, pair)
        w = self.kv_b.view(n, nope + a.v_head_dim, c)
        q_lat = torch.einsum("thd,hdc->thc", q_nope, w[:, :nope])
        query = torch.cat((q_lat, _rope(q_pe, cos, sin, a.rope_interleave)), dim=-1)
        if triton:
            out = kernels.mla_attention(query, cache, meta, a.softmax_scale, c, kv_scale)
        else:
            out = backend.attend(query, cache, cache, meta, a.softmax_scale, pair)[..., :c]
        heads = torch.einsum("thc,hvc->thv", out, w[:, nope:])
        return project(heads.reshape(t, n * a.v_head_dim), self.o)
