"""Paged decode attention over the HND cache (Triton), split along the kv length.

Stage 1: one program per (sequence, kv head, split) loads the kv head's whole query group
(``GROUP`` = Hq / Hkv rows, padded to 16 for ``tl.dot``) once and streams its share of the
sequence's pages: every K/V byte is read once per step, whatever the GQA ratio. Each split owns a
run of whole ``BLOCK_N`` blocks, computed in the kernel from the device ``seq_lens``, so the
launch (grid, ``num_splits``) depends on host sizes only and is safe to capture in a CUDA graph.
Stage 2 merges the splits' partial outputs by their log-sum-exp; with one split stage 1 writes
the output directly and stage 2 is skipped.

Reference: ``reference.paged_decode_attention``.
"""

from __future__ import annotations

import math
from typing import cast

import torch
import triton
import triton.language as tl

from disagg.config import env_ints
from disagg.kernels import checks

LOG2E = 1.4426950408889634

# (block_n, num_warps, num_stages) of a decode launch by page dtype (bench/decode_kv_sweep.py).
# ``DISAGG_DECODE_TILE=block_n,warps,stages`` overrides every dtype's (experiments).
DECODE_TILES: dict[torch.dtype, tuple[int, int, int]] = {
    torch.bfloat16: (64, 4, 2),
    torch.float16: (64, 4, 2),
    torch.float32: (64, 4, 2),
    # FP8 pages: a 64-token block is half the bytes of bf16's, too little in flight per
    # program; 128 tokens took 221 us a layer at B=64 ctx 4k against 258 (H100, 2026-12-07)
    torch.float8_e4m3fn: (128, 4, 2),
}


def _tile_override() -> tuple[int, int, int] | None:
    return cast("tuple[int, int, int] | None",
                env_ints("DECODE_TILE", 3, "block_n,warps,stages"))


_OVERRIDE = _tile_override()


def decode_tile(dtype: torch.dtype) -> tuple[int, int, int]:
    """The (block_n, num_warps, num_stages) a decode launch over ``dtype`` pages uses."""
    return _OVERRIDE or DECODE_TILES.get(dtype, (64, 4, 2))


@triton.jit(do_not_specialize=["stride_bt"])  # the block-table width varies per step
def _decode_split_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    bt_ptr,
    seq_lens_ptr,
    out_ptr,  # [B, Hq, D] when NUM_SPLITS == 1, else partials [B, Hq, NUM_SPLITS, D] float32
    lse_ptr,  # [B, Hq, NUM_SPLITS] float32 (log2 domain); unused when NUM_SPLITS == 1
    scale_log2,
    stride_qb,
    stride_qh,
    stride_kp,
    stride_vp,
    stride_bt,
    stride_ob,
    stride_oh,
    k_scale_ptr,  # [Hkv] float32, read only with FP8 pages
    v_scale_ptr,
    NUM_SPLITS: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    PAGE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    F32_DOT: tl.constexpr,
    STAGES: tl.constexpr,  # software-pipelining depth of the K/V loop
    FP8: tl.constexpr,  # FP8 pages: K's scale folds into the scores, V's into the output
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    if FP8:
        scale_log2 = scale_log2 * tl.load(k_scale_ptr + kvh)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    num_blocks = tl.cdiv(seq_len, BLOCK_N)
    blocks_per_split = tl.cdiv(num_blocks, NUM_SPLITS)
    start = split * blocks_per_split * BLOCK_N
    end = tl.minimum(start + blocks_per_split * BLOCK_N, seq_len)

    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, HEAD_DIM)
    heads = kvh * GROUP + g
    q_mask = (g < GROUP)[:, None]
    q = tl.load(
        q_ptr + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + d[None, :],
        mask=q_mask,
        other=0.0,
    )
    if F32_DOT:
        q = q.to(tl.float32)
    elif FP8:  # e4m3 -> fp16 is one packed instruction on sm_90, -> bf16 is not
        q = q.to(tl.float16)

    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    bt_row = bt_ptr + b.to(tl.int64) * stride_bt
    head_off = kvh * (PAGE * HEAD_DIM)
    for n0 in tl.range(start, end, BLOCK_N, num_stages=STAGES):
        n = n0 + tl.arange(0, BLOCK_N)
        valid = n < end
        page = tl.load(bt_row + n // PAGE, mask=valid, other=0).to(tl.int64)
        tok = head_off + (n % PAGE) * HEAD_DIM
        k = tl.load(
            k_ptr + (page * stride_kp + tok)[:, None] + d[None, :], mask=valid[:, None], other=0.0
        )
        v = tl.load(
            v_ptr + (page * stride_vp + tok)[:, None] + d[None, :], mask=valid[:, None], other=0.0
        )
        if F32_DOT:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        elif FP8:
            k = k.to(q.dtype)
            v = v.to(q.dtype)
        s = tl.dot(q, tl.trans(k)) * scale_log2
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    if FP8:
        acc = acc * tl.load(v_scale_ptr + kvh)

    if NUM_SPLITS == 1:
        out = acc / l_i[:, None]
        o_ptrs = out_ptr + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + d[None, :]
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=q_mask)
    else:
        nonempty = l_i > 0
        out = acc / tl.where(nonempty, l_i, 1.0)[:, None]
        lse = tl.where(nonempty, m_i + tl.math.log2(tl.where(nonempty, l_i, 1.0)), float("-inf"))
        # partials are contiguous: a (b, head) row is NUM_SPLITS * HEAD_DIM floats
        row = b.to(tl.int64) * stride_ob + heads * stride_oh + split * HEAD_DIM
        tl.store(out_ptr + row[:, None] + d[None, :], out, mask=q_mask)
        tl.store(lse_ptr + row // HEAD_DIM, lse, mask=g < GROUP)


@triton.jit
def _decode_merge_kernel(
    part_ptr,  # [B, Hq, NUM_SPLITS, D] float32
    lse_ptr,  # [B, Hq, NUM_SPLITS] float32
    out_ptr,
    stride_ob,
    stride_oh,
    NUM_HEADS: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    row = b * NUM_HEADS + h
    s = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, HEAD_DIM)
    lse = tl.load(lse_ptr + row * NUM_SPLITS + s, mask=s < NUM_SPLITS, other=float("-inf"))
    m = tl.max(lse, 0)
    w = tl.where(lse > float("-inf"), tl.math.exp2(lse - m), 0.0)
    part = tl.load(
        part_ptr + (row * NUM_SPLITS + s)[:, None] * HEAD_DIM + d[None, :],
        mask=(s < NUM_SPLITS)[:, None],
        other=0.0,
    )
    out = tl.sum(part * w[:, None], 0) / tl.sum(w, 0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + d, out.to(out_ptr.dtype.element_ty))


def default_num_splits(batch: int, num_kv_heads: int, max_seq_len: int, block_n: int) -> int:
    """Enough programs to fill an H100/H200-sized chip (~4 waves of 132 SMs), each at least
    256 tokens and one ``block_n`` block."""
    programs = max(1, batch * num_kv_heads)
    want = math.ceil(528 / programs)
    most = max(1, math.ceil(max_seq_len / max(256, block_n)))
    return max(1, min(want, most, 64))


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    max_seq_len: int | None = None,
    num_splits: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    out: torch.Tensor | None = None,
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """One query per sequence: ``q`` ``[B, Hq, D]`` -> ``[B, Hq, D]`` in ``q.dtype``.

    FP8 pages (``disagg.kernels.kv_quant``) need ``kv_scales``: float32 ``[Hkv]`` K and V scales.

    ``seq_lens`` must be >= 1 for every row. ``num_splits`` (or ``max_seq_len``, an upper bound
    used to choose it; defaults to the cache capacity of a block-table row) fixes the launch shape:
    give a fixed value when capturing a CUDA graph. ``out`` may be a preallocated output.
    ``block_n`` / ``num_warps`` / ``num_stages`` default to the page dtype's ``decode_tile``.
    """
    group = checks.check_attention_inputs(q, k_cache, v_cache, block_tables, seq_lens)
    batch, num_heads, head_dim = q.shape
    _, num_kv_heads, page_size, _ = k_cache.shape
    ks, vs = checks.launch_scales(kv_scales, k_cache, num_kv_heads, seq_lens)
    if seq_lens.shape[0] != batch:
        raise ValueError(
            f"decode needs one query per sequence: {batch} rows, {seq_lens.shape[0]} seqs"
        )
    tile = decode_tile(k_cache.dtype)
    block_n = tile[0] if block_n is None else block_n
    num_warps = tile[1] if num_warps is None else num_warps
    num_stages = tile[2] if num_stages is None else num_stages
    if block_n & (block_n - 1) or block_n < 16:
        raise ValueError(f"block_n {block_n} must be a power of two >= 16")
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    elif out.shape != q.shape or out.stride(2) != 1:
        raise ValueError(
            f"out must be {tuple(q.shape)} with unit dim stride, got {tuple(out.shape)}"
        )
    if batch == 0:
        return out
    if num_splits is None:
        bound = max_seq_len if max_seq_len is not None else block_tables.shape[1] * page_size
        num_splits = default_num_splits(batch, num_kv_heads, bound, block_n)
    interp = checks.interpreting()
    f32_dot = interp or q.dtype == torch.float32
    meta = dict(
        NUM_SPLITS=num_splits,
        GROUP=group,
        GROUP_PAD=max(16, triton.next_power_of_2(group)),
        PAGE=page_size,
        HEAD_DIM=head_dim,
        BLOCK_N=block_n,
        F32_DOT=f32_dot,
        STAGES=num_stages,
        FP8=k_cache.dtype == torch.float8_e4m3fn,
    )
    launch = {} if interp else dict(num_warps=num_warps, num_stages=num_stages)
    grid = (batch, num_kv_heads, num_splits)
    common = (scale * LOG2E, q.stride(0), q.stride(1), k_cache.stride(0), v_cache.stride(0))
    if num_splits == 1:
        _decode_split_kernel[grid](
            q, k_cache, v_cache, block_tables, seq_lens, out, out, *common,
            block_tables.stride(0), out.stride(0), out.stride(1), ks, vs, **meta, **launch,
        )  # fmt: skip
        return out
    part = torch.empty(
        (batch, num_heads, num_splits, head_dim), dtype=torch.float32, device=q.device
    )
    lse = torch.empty((batch, num_heads, num_splits), dtype=torch.float32, device=q.device)
    _decode_split_kernel[grid](
        q, k_cache, v_cache, block_tables, seq_lens, part, lse, *common,
        block_tables.stride(0), part.stride(0), part.stride(1), ks, vs, **meta, **launch,
    )  # fmt: skip
    _decode_merge_kernel[(batch, num_heads)](
        part,
        lse,
        out,
        out.stride(0),
        out.stride(1),
        NUM_HEADS=num_heads,
        NUM_SPLITS=num_splits,
        SPLITS_PAD=triton.next_power_of_2(num_splits),
        HEAD_DIM=head_dim,
        **({} if interp else dict(num_warps=4)),
    )
    return out
