"""Fused elementwise kernels for the transformer on CUDA (Triton).

The eager model spends a large share of a step in small elementwise kernels (an RMSNorm in
float32 is eight of them; rotary embedding six per tensor; the gated MLP two). Each kernel here
does one of those in a single pass and rounds to the model dtype at the same points as the torch
code in ``disagg.model.layer``, so outputs match it up to the float32 sum order:

- ``rms_norm(x, w, eps, residual=None)``: with ``residual``, first ``x = x + residual`` (rounded,
  returned as the new residual stream), then ``w * (x * rsqrt(mean(x^2) + eps)).to(dtype)``.
- ``norm_rope(x, w, cos, sin, eps)``: per head, optional RMSNorm (``w`` may be None) then
  rotate-half RoPE, on a strided ``[T, H, D]`` view (q or k inside the fused qkv output);
  ``interleave``: DeepSeek's interleaved pairs (MLA's rope parts), de-interleaved out.
- ``qk_rope_append(qkv, ...)``: ``norm_rope`` of q and of k plus the KV append, one launch.
- ``silu_mul(gate_up)``: ``silu(gate) * up`` of the halves of ``[T, 2I]``.

Imported only on CUDA paths (or under ``TRITON_INTERPRET=1`` in tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from disagg.kernels import checks
from disagg.kernels.append import slot_tile


@triton.jit
def _rms_norm_kernel(x_ptr, r_ptr, w_ptr, out_ptr, xout_ptr, stride_x, stride_r, stride_o,
                     stride_xo, n, eps, HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RES:
        r = tl.load(r_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(xout_ptr.dtype.element_ty)
        tl.store(xout_ptr + row * stride_xo + cols, x, mask=mask)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, 0) / n
    h = (xf * tl.math.rsqrt(var + eps)).to(out_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (w * h).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns ``(normed, x_or_sum)``: ``x_or_sum`` is ``x + residual`` when given, else ``x``."""
    t, n = x.shape
    if x.stride(1) != 1 or (residual is not None and residual.stride(1) != 1):
        raise ValueError("rms_norm needs unit stride along the hidden dim")
    out = torch.empty_like(x)
    xout = torch.empty_like(x) if residual is not None else x
    if t == 0:
        return out, xout
    block = triton.next_power_of_2(n)
    r = residual if residual is not None else x
    launch = {} if checks.interpreting() else dict(num_warps=8 if block >= 2048 else 4)
    _rms_norm_kernel[(t,)](x, r, w, out, xout, x.stride(0), r.stride(0), out.stride(0),
                           xout.stride(0), n, eps, HAS_RES=residual is not None, BLOCK=block,
                           **launch)
    return out, xout


@triton.jit
def _rope_heads(row, stride_h, w_ptr, cos_ptr, sin_ptr, heads, eps, dt: tl.constexpr,
                HAS_NORM: tl.constexpr, H_PAD: tl.constexpr, HALF: tl.constexpr,
                INTERLEAVE: tl.constexpr):
    """One token's ``heads`` heads at ``row`` (head stride ``stride_h``): optional RMSNorm,
    then RoPE with that token's ``cos``/``sin`` rows -> the two rotated halves ``[H_PAD, HALF]``
    in ``dt`` (rows past ``heads`` are zeros)."""
    h = tl.arange(0, H_PAD)
    d = tl.arange(0, HALF)
    mask = (h[:, None] < heads) & (d[None, :] < HALF)
    row = row + h[:, None] * stride_h
    if INTERLEAVE:  # pairs (x0, x1), (x2, x3) ...: the evens rotate with the odds
        x1 = tl.load(row + 2 * d[None, :], mask=mask, other=0.0)
        x2 = tl.load(row + 2 * d[None, :] + 1, mask=mask, other=0.0)
    else:
        x1 = tl.load(row + d[None, :], mask=mask, other=0.0)
        x2 = tl.load(row + d[None, :] + HALF, mask=mask, other=0.0)
    if HAS_NORM:
        f1 = x1.to(tl.float32)
        f2 = x2.to(tl.float32)
        var = (tl.sum(f1 * f1, 1) + tl.sum(f2 * f2, 1)) / (2 * HALF)
        inv = tl.math.rsqrt(var + eps)[:, None]
        w1 = tl.load(w_ptr + d).to(tl.float32)[None, :]
        w2 = tl.load(w_ptr + HALF + d).to(tl.float32)[None, :]
        x1 = (w1 * (f1 * inv).to(dt).to(tl.float32)).to(dt)
        x2 = (w2 * (f2 * inv).to(dt).to(tl.float32)).to(dt)
    c1 = tl.load(cos_ptr + d).to(tl.float32)[None, :]
    c2 = tl.load(cos_ptr + HALF + d).to(tl.float32)[None, :]
    s1 = tl.load(sin_ptr + d).to(tl.float32)[None, :]
    s2 = tl.load(sin_ptr + HALF + d).to(tl.float32)[None, :]
    a1 = x1.to(tl.float32)
    a2 = x2.to(tl.float32)
    # torch: x * cos + rotate_half(x) * sin, each product rounded, then the sum
    o1 = ((a1 * c1).to(dt).to(tl.float32) + (-a2 * s1).to(dt).to(tl.float32)).to(dt)
    o2 = ((a2 * c2).to(dt).to(tl.float32) + (a1 * s2).to(dt).to(tl.float32)).to(dt)
    return o1, o2


@triton.jit
def _norm_rope_kernel(x_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, stride_xt, stride_xh,
                      stride_ct, heads, eps, HAS_NORM: tl.constexpr, H_PAD: tl.constexpr,
                      HALF: tl.constexpr, INTERLEAVE: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    o1, o2 = _rope_heads(x_ptr + t * stride_xt, stride_xh, w_ptr, cos_ptr + t * stride_ct,
                         sin_ptr + t * stride_ct, heads, eps, out_ptr.dtype.element_ty,
                         HAS_NORM, H_PAD, HALF, INTERLEAVE)
    h = tl.arange(0, H_PAD)
    d = tl.arange(0, HALF)
    mask = (h[:, None] < heads) & (d[None, :] < HALF)
    obase = out_ptr + t * (heads * 2 * HALF) + h[:, None] * (2 * HALF) + d[None, :]
    tl.store(obase, o1, mask=mask)
    tl.store(obase + HALF, o2, mask=mask)


def norm_rope(x: torch.Tensor, w: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
              eps: float, interleave: bool = False) -> torch.Tensor:
    """``x`` ``[T, H, D]`` (unit stride along D), ``cos``/``sin`` ``[T, 1, D]`` -> contiguous
    ``[T, H, D]``: optional per-head RMSNorm with ``w`` ``[D]``, then rotate-half RoPE; with
    ``interleave`` (DeepSeek's pairs, no norm) the rotated evens then odds, as
    ``disagg.model.mla.rope`` computes them."""
    if interleave and w is not None:
        raise ValueError("norm_rope: an interleaved rope takes no norm")
    t, heads, d = x.shape
    if x.stride(2) != 1 or cos.stride(2) != 1 or cos.stride() != sin.stride():
        raise ValueError("norm_rope needs unit stride along head_dim and matching cos/sin")
    out = torch.empty((t, heads, d), dtype=x.dtype, device=x.device)
    if t == 0:
        return out
    launch = {} if checks.interpreting() else dict(num_warps=4)
    _norm_rope_kernel[(t,)](x, w if w is not None else x, cos, sin, out, x.stride(0),
                            x.stride(1), cos.stride(0), heads, eps, HAS_NORM=w is not None,
                            H_PAD=triton.next_power_of_2(heads), HALF=d // 2,
                            INTERLEAVE=interleave, **launch)
    return out


@triton.jit
def _qk_rope_append_kernel(qkv_ptr, qn_ptr, kn_ptr, cos_ptr, sin_ptr, q_ptr, k_cache_ptr,
                           v_cache_ptr, slot_ptr, stride_t, stride_ct, stride_kp, stride_vp, eps,
                           HQ: tl.constexpr, HKV: tl.constexpr, HQ_PAD: tl.constexpr,
                           HKV_PAD: tl.constexpr, HALF: tl.constexpr, PAGE: tl.constexpr,
                           HAS_NORM: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    row = qkv_ptr + t * stride_t
    dt = q_ptr.dtype.element_ty
    D: tl.constexpr = 2 * HALF
    d = tl.arange(0, HALF)
    # (the two branches name their values apart: Triton needs a name that both assign to keep
    # one type, and the query and key tiles differ in shape)
    if tl.program_id(1) == 0:  # the query heads -> q
        q1, q2 = _rope_heads(row, D, qn_ptr, cos_ptr + t * stride_ct, sin_ptr + t * stride_ct,
                             HQ, eps, dt, HAS_NORM, HQ_PAD, HALF, False)
        hq = tl.arange(0, HQ_PAD)
        qmask = (hq[:, None] < HQ) & (d[None, :] < HALF)
        qout = q_ptr + t * (HQ * D) + hq[:, None] * D + d[None, :]
        tl.store(qout, q1, mask=qmask)
        tl.store(qout + HALF, q2, mask=qmask)
    else:  # the key heads (normed, rotated) and the value heads -> their cache slot
        k1, k2 = _rope_heads(row + HQ * D, D, kn_ptr, cos_ptr + t * stride_ct,
                             sin_ptr + t * stride_ct, HKV, eps, dt, HAS_NORM, HKV_PAD, HALF,
                             False)
        page, at, kmask = slot_tile(slot_ptr, t, HKV, HKV_PAD, PAGE, D, HALF)
        hk = tl.arange(0, HKV_PAD)
        kc = k_cache_ptr + page * stride_kp + at
        ct = k_cache_ptr.dtype.element_ty
        tl.store(kc, k1.to(ct), mask=kmask)
        tl.store(kc + HALF, k2.to(ct), mask=kmask)
        vrow = row + (HQ + HKV) * D + hk[:, None] * D + d[None, :]
        vc = v_cache_ptr + page * stride_vp + at
        vt = v_cache_ptr.dtype.element_ty
        tl.store(vc, tl.load(vrow, mask=kmask, other=0.0).to(vt), mask=kmask)
        tl.store(vc + HALF, tl.load(vrow + HALF, mask=kmask, other=0.0).to(vt), mask=kmask)


def qk_rope_append(qkv: torch.Tensor, q_norm: torch.Tensor | None, k_norm: torch.Tensor | None,
                   cos: torch.Tensor, sin: torch.Tensor, eps: float, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                   num_heads: int) -> torch.Tensor:
    """One launch for a layer's q/k/v between the QKV projection and attention: ``qkv``
    ``[T, (H + 2 Hkv) D]`` -> q ``[T, H, D]`` (per-head RMSNorm with ``q_norm`` if given, then
    RoPE), while k (``k_norm``, RoPE) and v go into the ``[P, Hkv, S, D]`` caches at
    ``slot_mapping`` ``[T]`` (a negative slot is skipped). The same values as ``norm_rope`` of
    q and k followed by ``append_kv``."""
    checks.check_kv_pair(k_cache, v_cache)
    _, hkv, page, d = k_cache.shape
    t = qkv.shape[0]
    if (q_norm is None) != (k_norm is None):
        raise ValueError("qk_rope_append: q_norm and k_norm go together")
    if qkv.dim() != 2 or qkv.shape[1] != (num_heads + 2 * hkv) * d or qkv.stride(1) != 1:
        raise ValueError(f"qkv must be [T, {(num_heads + 2 * hkv) * d}] with unit stride, got "
                         f"{tuple(qkv.shape)}")
    if cos.stride(2) != 1 or cos.stride() != sin.stride():
        raise ValueError("qk_rope_append needs unit stride along head_dim and matching cos/sin")
    checks.check_index("slot_mapping", slot_mapping, 1, torch.int64, k_cache.device)
    if slot_mapping.shape[0] != t:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} slots for {t} tokens")
    q = torch.empty((t, num_heads, d), dtype=qkv.dtype, device=qkv.device)
    if t == 0:
        return q
    launch = {} if checks.interpreting() else dict(num_warps=4)
    _qk_rope_append_kernel[(t, 2)](
        qkv, q_norm if q_norm is not None else qkv, k_norm if k_norm is not None else qkv,
        cos, sin, q, k_cache, v_cache, slot_mapping, qkv.stride(0), cos.stride(0),
        k_cache.stride(0), v_cache.stride(0), eps, HQ=num_heads, HKV=hkv,
        HQ_PAD=triton.next_power_of_2(num_heads), HKV_PAD=triton.next_power_of_2(hkv),
        HALF=d // 2, PAGE=page, HAS_NORM=q_norm is not None, **launch)
    return q


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, stride_g, n, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    g = tl.load(gu_ptr + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + row * stride_g + n + cols, mask=mask, other=0.0).to(tl.float32)
    dt = out_ptr.dtype.element_ty
    s = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
    tl.store(out_ptr + row * n + cols, (s * u).to(dt), mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``[T, 2I]`` -> ``silu(gate_up[:, :I]) * gate_up[:, I:]`` ``[T, I]``."""
    t, two_i = gate_up.shape
    n = two_i // 2
    if gate_up.stride(1) != 1:
        raise ValueError("silu_mul needs unit stride along the feature dim")
    out = torch.empty((t, n), dtype=gate_up.dtype, device=gate_up.device)
    if t == 0:
        return out
    block = min(1024, triton.next_power_of_2(n))
    launch = {} if checks.interpreting() else dict(num_warps=4)
    _silu_mul_kernel[(t, triton.cdiv(n, block))](gate_up, out, gate_up.stride(0), n,
                                                 BLOCK=block, **launch)
    return out
