"""KV append: write a step's new K/V rows into their cache slots (Triton).

One program per token writes all kv heads of that token's K and V; a negative slot is skipped.
Reference: ``reference.append_kv``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from disagg.kernels import checks


@triton.jit
def slot_tile(slot_ptr, t, NUM_KV_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr,
              PAGE: tl.constexpr, HEAD_DIM: tl.constexpr, COLS: tl.constexpr):
    """Where token ``t``'s KV goes in a ``[P, Hkv, PAGE, HEAD_DIM]`` cache: its page, the
    in-page offsets ``[HEADS_PAD, COLS]`` of its heads' first ``COLS`` elements, and their
    mask (all off for a negative slot: skipped)."""
    slot = tl.load(slot_ptr + t)
    keep = slot >= 0
    slot = tl.where(keep, slot, 0).to(tl.int64)
    h = tl.arange(0, HEADS_PAD)
    c = tl.arange(0, COLS)
    # (a comparison per element: the interpreter rejects masks and-ed with a scalar bool)
    heads = tl.where(keep, NUM_KV_HEADS, 0)
    mask = (h[:, None] < heads) & (c[None, :] < COLS)
    at = h[:, None] * (PAGE * HEAD_DIM) + (slot % PAGE) * HEAD_DIM + c[None, :]
    return slot // PAGE, at, mask


@triton.jit
def quantize_rows(k, v, k_scale_ptr, v_scale_ptr, h, NUM_KV_HEADS: tl.constexpr):
    """``k``/``v`` ``[HEADS_PAD, D]`` rows of heads ``h`` -> ``sat(x / scale)`` in float32
    (the caller's store rounds them to e4m3)."""
    ok = h < NUM_KV_HEADS
    ks = tl.load(k_scale_ptr + h, mask=ok, other=1.0)
    vs = tl.load(v_scale_ptr + h, mask=ok, other=1.0)
    k = tl.clamp(k.to(tl.float32) / ks[:, None], -448.0, 448.0)  # kv_quant.FP8_MAX
    v = tl.clamp(v.to(tl.float32) / vs[:, None], -448.0, 448.0)  # kv_quant.FP8_MAX
    return k, v


@triton.jit
def _append_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kp,  # page strides of the caches (elements)
    stride_vp,
    k_scale_ptr,  # [Hkv] float32 (read only with FP8)
    v_scale_ptr,
    NUM_KV_HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    PAGE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    FP8: tl.constexpr,  # FP8 caches: store sat(x / scale), disagg.kernels.kv_quant
):
    t = tl.program_id(0).to(tl.int64)
    page, dst, mask = slot_tile(slot_ptr, t, NUM_KV_HEADS, HEADS_PAD, PAGE, HEAD_DIM, HEAD_DIM)
    h = tl.arange(0, HEADS_PAD)
    d = tl.arange(0, HEAD_DIM)
    src_k = k_ptr + t * stride_kt + h[:, None] * stride_kh + d[None, :]
    src_v = v_ptr + t * stride_vt + h[:, None] * stride_vh + d[None, :]
    k = tl.load(src_k, mask=mask, other=0.0)
    v = tl.load(src_v, mask=mask, other=0.0)
    if FP8:
        k, v = quantize_rows(k, v, k_scale_ptr, v_scale_ptr, h, NUM_KV_HEADS)
    tl.store(k_cache_ptr + page * stride_kp + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + page * stride_vp + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def append_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """Write ``k``/``v`` ``[T, Hkv, D]`` into ``[P, Hkv, S, D]`` caches at ``slot_mapping`` ``[T]``
    (FP8 caches: quantized by ``kv_scales``, float32 ``[Hkv]`` each, required)."""
    checks.check_kv_pair(k_cache, v_cache)
    _, num_kv_heads, page_size, head_dim = k_cache.shape
    ks, vs = checks.launch_scales(kv_scales, k_cache, num_kv_heads, slot_mapping)
    checks.check_rows("k", k, num_kv_heads, head_dim, k_cache.device)
    checks.check_rows("v", v, num_kv_heads, head_dim, k_cache.device)
    checks.check_index("slot_mapping", slot_mapping, 1, torch.int64, k_cache.device)
    if slot_mapping.shape[0] != k.shape[0] or v.shape[0] != k.shape[0]:
        raise ValueError(
            f"slot_mapping has {slot_mapping.shape[0]} slots for {k.shape[0]} k rows and "
            f"{v.shape[0]} v rows"
        )
    num_tokens = k.shape[0]
    if num_tokens == 0:
        return
    _append_kv_kernel[(num_tokens,)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        v_cache.stride(0),
        ks,
        vs,
        NUM_KV_HEADS=num_kv_heads,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        PAGE=page_size,
        HEAD_DIM=head_dim,
        FP8=k_cache.dtype == torch.float8_e4m3fn,
        num_warps=4 if num_kv_heads * head_dim >= 1024 else 1,
    )
