"""One decoder layer over the paged HND KV cache: attention (GQA, or DeepSeek's latent
attention, ``disagg.model.mla``) and the MLP (dense, or a mixture of experts,
``disagg.model.moe``). The transformer stacks them (``disagg.model.transformer``); the MTP
layer wraps one (``disagg.model.mtp``)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from disagg.kernels.interface import AttentionBackend, AttentionMetadata
from disagg.kernels.kv_quant import KVScales, is_fp8
from disagg.model.config import ModelArch
from disagg.model.mla import MLAAttention
from disagg.model.moe import MoEMLP
from disagg.model.ops import add_norm, fused_on, linear, norm_linear, silu_linear
from disagg.model.rotary import rms_norm, rotate_half
from disagg.model.tp import TensorParallel


class DecoderLayer(nn.Module):
    k_scale: torch.Tensor  # buffers: FP8 KV scales (see __init__)
    v_scale: torch.Tensor

    def __init__(self, arch: ModelArch, dtype: torch.dtype, device: torch.device,
                 tp: TensorParallel | None = None, layer: int = 0):
        super().__init__()
        self.tp = tp or TensorParallel()  # ``arch`` holds this rank's (local) shapes
        h, d = arch.hidden_size, arch.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = arch.num_heads, arch.num_kv_heads, d
        self.eps = arch.rms_norm_eps
        qkv_out = (arch.num_heads + 2 * arch.num_kv_heads) * d

        def p(*shape: int) -> nn.Parameter:
            return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)

        self.input_norm = p(h)
        self.post_norm = p(h)
        self.mla = (MLAAttention(h, arch.num_heads, arch.mla, arch.rms_norm_eps, dtype, device)
                    if arch.mla is not None else None)
        if self.mla is None:
            self.qkv_weight = p(qkv_out, h)
            self.qkv_bias = p(qkv_out) if arch.qkv_bias else None
            self.q_norm = p(d) if arch.qk_norm else None
            self.k_norm = p(d) if arch.qk_norm else None
            self.o_weight = p(h, arch.num_heads * d)
        # FP8 KV pages' scales (disagg.kernels.kv_quant): per kv head, MLA one for the latent;
        # 1.0 unless the checkpoint ships k_scale / v_scale (the loader sets them)
        heads = 1 if self.mla is not None else arch.num_kv_heads
        self.register_buffer("k_scale", torch.ones(heads, dtype=torch.float32, device=device),
                             persistent=False)
        self.register_buffer("v_scale", torch.ones(heads, dtype=torch.float32, device=device),
                             persistent=False)
        sparse = arch.moe is not None and arch.moe.sparse_layers[layer]
        self.moe = MoEMLP(h, arch.moe, dtype, device, self.tp) if sparse and arch.moe else None
        if self.moe is None:
            self.gate_up_weight = p(2 * arch.intermediate_size, h)
            self.down_weight = p(h, arch.intermediate_size)

    @property
    def kv_scales(self) -> KVScales:
        """The (K, V) scales of this layer's FP8 pages (MLA: the latent's, twice)."""
        if self.mla is not None:
            return self.k_scale, self.k_scale
        return self.k_scale, self.v_scale

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        backend: AttentionBackend,
        after_attention: Callable[[], None] | None,
        delta: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The layer over the residual stream ``x`` (plus ``delta``, the last layer's MLP output
        not yet added, if given) -> ``(x, delta)`` the same way: on CUDA the MLP's residual add
        is left to the next norm's kernel (``fused.rms_norm`` with a residual), elsewhere
        ``delta`` comes back None."""
        if self.mla is not None:
            h, x = add_norm(x, delta, self.input_norm, self.eps)
            attn = self.mla(h, cos, sin, k_cache, meta, backend, self.k_scale)
            return self._mlp(x, after_attention, self.tp.all_reduce(attn))
        if fused_on(x):
            return self._forward_fused(x, delta, cos, sin, k_cache, v_cache, meta, backend,
                                       after_attention)
        assert delta is None  # only the fused path leaves the residual add pending
        t = x.shape[0]
        hq, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        h = rms_norm(x, self.input_norm, self.eps)
        qkv = linear(h, self.qkv_weight, self.qkv_bias)
        q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
        q = q.view(t, hq, d)
        k = k.view(t, hkv, d)
        v = v.view(t, hkv, d)
        if self.q_norm is not None and self.k_norm is not None:
            q = rms_norm(q, self.q_norm, self.eps)
            k = rms_norm(k, self.k_norm, self.eps)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        backend.append_kv(k, v, k_cache, v_cache, meta, self.kv_scales)
        attn = backend.attend(q, k_cache, v_cache, meta, d**-0.5, self.kv_scales)
        x = x + self.tp.all_reduce(linear(attn.reshape(t, hq * d), self.o_weight))
        return self._mlp(x, after_attention)

    def _mlp(self, x: torch.Tensor, after_attention: Callable[[], None] | None,
             attn: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The MLP half of the layer over ``x`` (plus ``attn``, the attention output, when
        given: added with the norm in one kernel on CUDA) -> ``(x, mlp output)`` on CUDA (the
        next norm adds it), ``(x + mlp output, None)`` elsewhere."""
        if after_attention is not None:
            after_attention()
        if self.moe is not None:
            h, x = add_norm(x, attn, self.post_norm, self.eps)
            out = self.tp.all_reduce(self.moe(h))
        else:  # one row on CUDA: norm + gate_up and SiLU-mul + down, a launch each
            gate_up, x = norm_linear(x, attn, self.post_norm, self.eps, self.gate_up_weight)
            out = self.tp.all_reduce(silu_linear(gate_up, self.down_weight))
        return (x, out) if fused_on(x) else (x + out, None)

    def _forward_fused(
        self,
        x: torch.Tensor,
        delta: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        backend: AttentionBackend,
        after_attention: Callable[[], None] | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The same layer with the elementwise work in fused Triton kernels (CUDA)."""
        from disagg.model import fused

        t = x.shape[0]
        hq, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        qkv, x = norm_linear(x, delta, self.input_norm, self.eps, self.qkv_weight,
                             self.qkv_bias)  # one launch at one row
        if backend.triton_append and not is_fp8(k_cache):  # norm + rope + append: one kernel
            q = fused.qk_rope_append(qkv, self.q_norm, self.k_norm, cos, sin, self.eps, k_cache,
                                     v_cache, meta.slot_mapping, hq)
        else:
            q = fused.norm_rope(qkv[:, : hq * d].view(t, hq, d), self.q_norm, cos, sin, self.eps)
            k = fused.norm_rope(qkv[:, hq * d : (hq + hkv) * d].view(t, hkv, d), self.k_norm,
                                cos, sin, self.eps)
            backend.append_kv(k, qkv[:, (hq + hkv) * d :].view(t, hkv, d), k_cache, v_cache, meta,
                              self.kv_scales)
        attn = backend.attend(q, k_cache, v_cache, meta, d**-0.5, self.kv_scales)
        o = self.tp.all_reduce(linear(attn.reshape(t, hq * d), self.o_weight))
        return self._mlp(x, after_attention, o)
