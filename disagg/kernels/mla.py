"""DeepSeek multi-head latent attention over the paged latent cache (Triton), absorbed form.

Cache: ``[P, 1, S, W]`` with ``W = latent + rope`` (512 + 64 for DeepSeek): one row per token,
``[c_kv, k_pe]``, shared by every head; the page stride is free (a layer view of the one
allocation), the token and dim strides are ``W`` and 1. A head's query is ``[q_lat, q_pe]``
(``W`` wide); its score against a row is the dot over all ``W`` values, its output the
softmax-weighted sum of the rows' first ``latent`` values. Each dot is split into the latent
and the rope part so every tile is a power of two (a part narrower than 16 or not a power of
two is padded and masked). Outputs are ``[T, H, latent]``.

- ``mla_decode``: one query per sequence. One program per (head block, split, sequence) holds
  ``BLOCK_H`` heads' queries and streams its share of the sequence's rows once: the same tile
  gives the scores and the values, so every latent byte is read once per head block (the head
  blocks of one split run side by side and share it through L2). Splits own runs of whole
  ``BLOCK_N`` blocks computed in the kernel from the device ``seq_lens``; the split count is a
  kernel argument, not a compile-time constant, and the grid depends on host sizes only, so
  launches are safe to capture in a CUDA graph and no step compiles a new variant. A second
  kernel merges the splits by their log-sum-exp (skipped with one split).
- ``mla_prefill``: causal chunks (rows ``cu[b]:cu[b+1]`` at positions ``seq_len - q_len ..``)
  over the cache, which must already hold the chunk. A program's ``BLOCK_M`` rows are
  (token, head) pairs, token-major, so the heads of a few tokens share each loaded key tile and
  one tile shape serves long prompts and speculative steps (chunks of K+1) alike.
- ``append_latent``: write a step's rows at ``slot_mapping`` (negative: skipped).

Kernel variants depend only on the heads, dims, dtype and page size (and the fixed tile
choices below; never on batch, lengths, chunk sizes or the split count): ``warm`` compiles every
one a server can need. Reference: ``reference_attention``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from disagg.kernels import checks
from disagg.kernels.interface import AttentionMetadata
from disagg.kernels.mla_tiles import (  # noqa: F401 - tiles_used, check_latent_cache, reference_attention: API
    _FITTED,
    _check_attention,
    _check_out,
    _step_down,
    check_latent_cache,
    decode_tiles,
    latent_scale,
    num_decode_splits,
    prefill_tiles,
    reference_attention,
    tiles_used,
)

LOG2E = 1.4426950408889634


def _pad(n: int) -> int:
    return max(16, triton.next_power_of_2(n))


@triton.jit
def _attend_rows(
    acc, l_i, m_i, q_lat, q_pe, cache_ptr, bt_row, stride_cp, lo, hi, last, q_pos, scale_log2,
    MASKED: tl.constexpr, CAUSAL: tl.constexpr, PAGE: tl.constexpr, LAT: tl.constexpr,
    LAT_PAD: tl.constexpr, ROPE: tl.constexpr, ROPE_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
    F32_DOT: tl.constexpr, STAGES: tl.constexpr, FP8: tl.constexpr,
):  # fmt: skip
    """Online softmax of the query rows over cache rows ``lo:hi`` (``MASKED``: the last block
    may pass ``hi``; ``CAUSAL``: row i sees keys ``<= q_pos[i]``). ``last``: the sequence's
    last row, where unmasked block-table reads are clamped (so a pipelined read-ahead past
    ``hi`` still reads one of the sequence's own pages)."""
    dl = tl.arange(0, LAT_PAD)
    dr = tl.arange(0, ROPE_PAD)
    for n0 in tl.range(lo, hi, BLOCK_N, num_stages=STAGES):
        n = n0 + tl.arange(0, BLOCK_N)
        if MASKED:
            valid = n < hi
            page = tl.load(bt_row + n // PAGE, mask=valid, other=0).to(tl.int64)
        else:
            page = tl.load(bt_row + tl.minimum(n, last) // PAGE).to(tl.int64)
        row = cache_ptr + page * stride_cp + (n % PAGE) * (LAT + ROPE)
        lat_ptrs = row[:, None] + dl[None, :]
        pe_ptrs = row[:, None] + LAT + dr[None, :]
        if LAT_PAD == LAT:
            if MASKED:
                kl = tl.load(lat_ptrs, mask=valid[:, None], other=0.0)
            else:
                kl = tl.load(lat_ptrs)
        elif MASKED:
            kl = tl.load(lat_ptrs, mask=valid[:, None] & (dl < LAT)[None, :], other=0.0)
        else:
            kl = tl.load(lat_ptrs, mask=(dl < LAT)[None, :], other=0.0)
        if ROPE_PAD == ROPE:
            if MASKED:
                kr = tl.load(pe_ptrs, mask=valid[:, None], other=0.0)
            else:
                kr = tl.load(pe_ptrs)
        elif MASKED:
            kr = tl.load(pe_ptrs, mask=valid[:, None] & (dr < ROPE)[None, :], other=0.0)
        else:
            kr = tl.load(pe_ptrs, mask=(dr < ROPE)[None, :], other=0.0)
        if F32_DOT:
            kl = kl.to(tl.float32)
            kr = kr.to(tl.float32)
        elif FP8:
            kl = kl.to(q_lat.dtype)
            kr = kr.to(q_lat.dtype)
        s = tl.dot(q_lat, tl.trans(kl))
        s = tl.dot(q_pe, tl.trans(kr), acc=s) * scale_log2
        if MASKED:
            if CAUSAL:
                s = tl.where((n[None, :] <= q_pos[:, None]) & valid[None, :], s, float("-inf"))
            else:
                s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(kl.dtype), kl)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _load_query(q_rows, ok, LAT: tl.constexpr, LAT_PAD: tl.constexpr, ROPE: tl.constexpr,
                ROPE_PAD: tl.constexpr, F32_DOT: tl.constexpr):  # fmt: skip
    """``q_rows`` ``[R]`` row pointers -> (q_lat ``[R, LAT_PAD]``, q_pe ``[R, ROPE_PAD]``)."""
    dl = tl.arange(0, LAT_PAD)
    dr = tl.arange(0, ROPE_PAD)
    q_lat = tl.load(q_rows[:, None] + dl[None, :], mask=ok[:, None] & (dl < LAT)[None, :],
                    other=0.0)
    q_pe = tl.load(q_rows[:, None] + LAT + dr[None, :], mask=ok[:, None] & (dr < ROPE)[None, :],
                   other=0.0)
    if F32_DOT:
        q_lat = q_lat.to(tl.float32)
        q_pe = q_pe.to(tl.float32)
    return q_lat, q_pe


# the split count and the block-table width vary per step: not specialized (no new variant)
@triton.jit(do_not_specialize=["num_splits", "stride_bt"])
def _mla_decode_kernel(
    q_ptr, cache_ptr, bt_ptr, seq_lens_ptr,
    out_ptr,  # [B, H, LAT] in q's dtype (written when num_splits == 1)
    part_ptr,  # [B, H, num_splits, LAT] float32 partial outputs (num_splits > 1)
    lse_ptr,  # [B, H, num_splits] float32, log2 domain (num_splits > 1)
    scale_log2, num_splits, stride_qb, stride_qh, stride_cp, stride_bt, stride_ob, stride_oh,
    scale_ptr,  # [1] float32: the latent's scale, read only with FP8 pages
    HEADS: tl.constexpr, BLOCK_H: tl.constexpr, PAGE: tl.constexpr, LAT: tl.constexpr,
    LAT_PAD: tl.constexpr, ROPE: tl.constexpr, ROPE_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
    F32_DOT: tl.constexpr, STAGES: tl.constexpr, FP8: tl.constexpr,
):  # fmt: skip
    hb = tl.program_id(0)  # fastest: the head blocks of one split share its rows in L2
    split = tl.program_id(1)
    b = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    per_split = tl.cdiv(tl.cdiv(seq_len, BLOCK_N), num_splits) * BLOCK_N
    start = split * per_split
    end = tl.maximum(tl.minimum(start + per_split, seq_len), start)
    full_end = end - (end - start) % BLOCK_N  # whole blocks unmasked, then the tail
    last = tl.maximum(seq_len - 1, 0)
    if FP8:  # the scale folds into the scores and the output
        scale_log2 = scale_log2 * tl.load(scale_ptr)

    h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = h < HEADS
    q_rows = q_ptr + b.to(tl.int64) * stride_qb + h * stride_qh
    q_lat, q_pe = _load_query(q_rows, h_ok, LAT, LAT_PAD, ROPE, ROPE_PAD, F32_DOT)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, LAT_PAD], tl.float32)
    bt_row = bt_ptr + b.to(tl.int64) * stride_bt
    acc, l_i, m_i = _attend_rows(
        acc, l_i, m_i, q_lat, q_pe, cache_ptr, bt_row, stride_cp, start, full_end, last,
        h, scale_log2, False, False, PAGE, LAT, LAT_PAD, ROPE, ROPE_PAD, BLOCK_N, F32_DOT,
        STAGES, FP8,
    )  # fmt: skip
    acc, l_i, m_i = _attend_rows(
        acc, l_i, m_i, q_lat, q_pe, cache_ptr, bt_row, stride_cp, full_end, end, last,
        h, scale_log2, True, False, PAGE, LAT, LAT_PAD, ROPE, ROPE_PAD, BLOCK_N, F32_DOT,
        STAGES, FP8,
    )  # fmt: skip

    nonempty = l_i > 0
    out = acc / tl.where(nonempty, l_i, 1.0)[:, None]
    if FP8:
        out = out * tl.load(scale_ptr)
    d = tl.arange(0, LAT_PAD)
    mask = h_ok[:, None] & (d < LAT)[None, :]
    if num_splits == 1:
        o_ptrs = out_ptr + b.to(tl.int64) * stride_ob + h[:, None] * stride_oh + d[None, :]
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        row = (b.to(tl.int64) * HEADS + h) * num_splits + split
        tl.store(part_ptr + row[:, None] * LAT + d[None, :], out, mask=mask)
        lse = tl.where(nonempty, m_i + tl.math.log2(tl.where(nonempty, l_i, 1.0)), float("-inf"))
        tl.store(lse_ptr + row, lse, mask=h_ok)


@triton.jit(do_not_specialize=["num_splits"])
def _mla_merge_kernel(
    part_ptr, lse_ptr, out_ptr, num_splits, stride_ob, stride_oh,
    HEADS: tl.constexpr, LAT: tl.constexpr, LAT_PAD: tl.constexpr,
):  # fmt: skip
    h = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    row = (b * HEADS + h) * num_splits
    d = tl.arange(0, LAT_PAD)
    m = tl.load(lse_ptr + row)  # split 0 owns the first block: -inf only for an empty row
    w_sum = tl.where(m > float("-inf"), 1.0, 0.0)
    acc = tl.load(part_ptr + row * LAT + d, mask=d < LAT, other=0.0)
    for s in range(1, num_splits):
        lse = tl.load(lse_ptr + row + s)
        m_new = tl.maximum(m, lse)
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.math.exp2(m - m_use)
        w = tl.math.exp2(lse - m_use)
        part = tl.load(part_ptr + (row + s) * LAT + d, mask=d < LAT, other=0.0)
        acc = acc * alpha + part * w
        w_sum = w_sum * alpha + w
        m = m_new
    out = acc / tl.where(w_sum > 0, w_sum, 1.0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + d, out.to(out_ptr.dtype.element_ty),
             mask=d < LAT)


@triton.jit(do_not_specialize=["stride_bt", "seq_base"])
def _mla_prefill_kernel(
    q_ptr, cache_ptr, out_ptr, bt_ptr, seq_lens_ptr, cu_ptr, scale_log2,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_cp, stride_bt,
    seq_base,  # this launch's first sequence in bt/seq_lens/cu (whole arrays passed)
    scale_ptr,  # [1] float32: the latent's scale, read only with FP8 pages
    HEADS: tl.constexpr, PAGE: tl.constexpr, LAT: tl.constexpr, LAT_PAD: tl.constexpr,
    ROPE: tl.constexpr, ROPE_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    F32_DOT: tl.constexpr, STAGES: tl.constexpr, FP8: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(1) + seq_base
    q_start = tl.load(cu_ptr + b)
    q_len = tl.load(cu_ptr + b + 1) - q_start
    num_rows = q_len * HEADS
    mb = tl.cdiv(num_rows, BLOCK_M) - 1 - tl.program_id(0)  # the longest rows first
    if mb >= 0:
        kv_len = tl.load(seq_lens_ptr + b)
        ctx = kv_len - q_len
        r = mb * BLOCK_M + tl.arange(0, BLOCK_M)  # (token, head) pairs, token-major
        row_ok = r < num_rows
        tok = r // HEADS
        h = r % HEADS
        rows = (q_start + tok).to(tl.int64)
        q_lat, q_pe = _load_query(q_ptr + rows * stride_qt + h * stride_qh, row_ok,
                                  LAT, LAT_PAD, ROPE, ROPE_PAD, F32_DOT)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, LAT_PAD], tl.float32)
        bt_row = bt_ptr + b.to(tl.int64) * stride_bt
        first_pos = ctx + (mb * BLOCK_M) // HEADS
        last_pos = ctx + tl.minimum((mb * BLOCK_M + BLOCK_M - 1) // HEADS, q_len - 1)
        full_end = (first_pos // BLOCK_N) * BLOCK_N  # keys every row of the block sees
        if FP8:  # the scale folds into the scores and the output
            scale_log2 = scale_log2 * tl.load(scale_ptr)
        acc, l_i, m_i = _attend_rows(
            acc, l_i, m_i, q_lat, q_pe, cache_ptr, bt_row, stride_cp, 0, full_end, kv_len - 1,
            ctx + tok, scale_log2, False, True, PAGE, LAT, LAT_PAD, ROPE, ROPE_PAD, BLOCK_N,
            F32_DOT, STAGES, FP8,
        )  # fmt: skip
        acc, l_i, m_i = _attend_rows(
            acc, l_i, m_i, q_lat, q_pe, cache_ptr, bt_row, stride_cp, full_end, last_pos + 1,
            kv_len - 1, ctx + tok, scale_log2, True, True, PAGE, LAT, LAT_PAD, ROPE, ROPE_PAD,
            BLOCK_N, F32_DOT, STAGES, FP8,
        )  # fmt: skip
        out = acc / tl.where(row_ok, l_i, 1.0)[:, None]
        if FP8:
            out = out * tl.load(scale_ptr)
        d = tl.arange(0, LAT_PAD)
        tl.store(out_ptr + rows[:, None] * stride_ot + (h * stride_oh)[:, None] + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (d < LAT)[None, :])


@triton.jit
def _append_latent_kernel(
    x_ptr, cache_ptr, slot_ptr, stride_xt, stride_cp, scale_ptr,
    PAGE: tl.constexpr, WIDTH: tl.constexpr, WIDTH_PAD: tl.constexpr, FP8: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t)
    d = tl.arange(0, WIDTH_PAD)
    # (a comparison per element: the interpreter rejects masks and-ed with a scalar bool)
    mask = d < tl.where(slot >= 0, WIDTH, 0)
    slot = tl.maximum(slot, 0)
    x = tl.load(x_ptr + t * stride_xt + d, mask=mask, other=0.0)
    if FP8:  # sat(x / scale), kv_quant.FP8_MAX
        x = tl.clamp(x.to(tl.float32) / tl.load(scale_ptr), -448.0, 448.0)
    dst = cache_ptr + (slot // PAGE) * stride_cp + (slot % PAGE) * WIDTH + d
    tl.store(dst, x.to(cache_ptr.dtype.element_ty), mask=mask)


# ---------------------------------------------------------------- launchers


def mla_decode(
    q: torch.Tensor,
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    latent_dim: int,
    *,
    max_seq_len: int | None = None,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
    tiles: tuple[int, int, int, int] | None = None,
    kv_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query per sequence: ``q [B, H, W]`` -> ``[B, H, latent_dim]`` in ``q.dtype``
    (FP8 pages: ``kv_scale``, the latent's float32 ``[1]`` scale, required).

    ``seq_lens`` >= 1 for every row. ``num_splits`` (or ``max_seq_len``, a host bound it is
    chosen for; default the capacity of a block-table row) fixes the launch shape: give a fixed
    value when capturing a CUDA graph. ``tiles``: ``decode_tiles``' tuple, to override."""
    page, width, rope = _check_attention(q, cache, block_tables, seq_lens, latent_dim)
    batch, heads, _ = q.shape
    if seq_lens.shape[0] != batch:
        raise ValueError(f"decode needs one query per sequence: {batch} rows, "
                         f"{seq_lens.shape[0]} seqs")
    out = _check_out(out, q, latent_dim)
    scale_t = latent_scale(kv_scale, cache, seq_lens)
    if batch == 0:
        return out
    interp = checks.interpreting()
    want = tiles or decode_tiles(heads, q.element_size(), interp)
    key = ("decode", q.device, q.dtype, heads, latent_dim, rope, want)
    while True:
        block_h, block_n, stages, warps = _FITTED.get(key, want)
        head_blocks = triton.cdiv(heads, block_h)
        splits = num_splits
        if splits is None:
            bound = max_seq_len if max_seq_len is not None else block_tables.shape[1] * page
            splits = num_decode_splits(batch, head_blocks, bound, block_n)
        if splits > 1:
            part = torch.empty((batch, heads, splits, latent_dim), dtype=torch.float32,
                               device=q.device)
            lse = torch.empty((batch, heads, splits), dtype=torch.float32, device=q.device)
        else:  # not written; float32 all the same, so one compiled variant serves every count
            part = lse = torch.empty(1, dtype=torch.float32, device=q.device)
        try:
            _mla_decode_kernel[(head_blocks, splits, batch)](
                q, cache, block_tables, seq_lens, out, part, lse, scale * LOG2E, splits,
                q.stride(0), q.stride(1), cache.stride(0), block_tables.stride(0),
                out.stride(0), out.stride(1), scale_t, HEADS=heads, BLOCK_H=block_h, PAGE=page,
                LAT=latent_dim, LAT_PAD=_pad(latent_dim), ROPE=rope, ROPE_PAD=_pad(rope),
                BLOCK_N=block_n, F32_DOT=interp or q.dtype == torch.float32, STAGES=stages,
                FP8=cache.dtype == torch.float8_e4m3fn,
                **({} if interp else dict(num_warps=warps, num_stages=stages)),
            )  # fmt: skip
            break
        except triton.runtime.errors.OutOfResources:
            if not _step_down(key, (block_h, block_n, stages, warps)):
                raise
    num_splits = splits
    if num_splits > 1:
        _mla_merge_kernel[(heads, batch)](
            part, lse, out, num_splits, out.stride(0), out.stride(1), HEADS=heads,
            LAT=latent_dim, LAT_PAD=_pad(latent_dim), **({} if interp else dict(num_warps=4)),
        )  # fmt: skip
    return out


def mla_prefill(
    q: torch.Tensor,
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    scale: float,
    latent_dim: int,
    *,
    max_q_len: int | None = None,
    out: torch.Tensor | None = None,
    seq_base: int = 0,
    tiles: tuple[int, int, int, int] | None = None,
    kv_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal chunks ``q [T, H, W]`` (rows ``cu[b]:cu[b+1]``) -> ``[T, H, latent_dim]``
    (FP8 pages: ``kv_scale``, the latent's float32 ``[1]`` scale, required).

    Rows are absolute indices into ``q`` and ``out``; rows outside every chunk are left
    untouched. ``max_q_len`` (a host bound on chunk lengths) sizes the grid; without it the
    launcher reads ``cu_seqlens_q`` (a device sync). ``seq_base`` skips the first sequences
    of ``block_tables``, ``seq_lens`` and ``cu_seqlens_q`` (whole arrays, not slices)."""
    page, width, rope = _check_attention(q, cache, block_tables, seq_lens, latent_dim)
    checks.check_index("cu_seqlens_q", cu_seqlens_q, 1, torch.int32, cache.device)
    if cu_seqlens_q.shape[0] != seq_lens.shape[0] + 1:
        raise ValueError(f"cu_seqlens_q has {cu_seqlens_q.shape[0]} entries for "
                         f"{seq_lens.shape[0]} sequences")
    if not 0 <= seq_base <= seq_lens.shape[0]:
        raise ValueError(f"seq_base {seq_base} outside [0, {seq_lens.shape[0]}]")
    out = _check_out(out, q, latent_dim)
    scale_t = latent_scale(kv_scale, cache, seq_lens)
    num_seqs = seq_lens.shape[0] - seq_base
    if num_seqs == 0 or q.shape[0] == 0:
        return out
    if max_q_len is None:
        cu = cu_seqlens_q[seq_base:]
        max_q_len = int((cu[1:] - cu[:-1]).max())
    heads = q.shape[1]
    interp = checks.interpreting()
    want = tiles or prefill_tiles(q.element_size(), interp)
    key = ("prefill", q.device, q.dtype, heads, latent_dim, rope, want)
    while True:
        block_m, block_n, stages, warps = _FITTED.get(key, want)
        grid = (triton.cdiv(max_q_len * heads, block_m), num_seqs)
        try:
            _mla_prefill_kernel[grid](
                q, cache, out, block_tables, seq_lens, cu_seqlens_q, scale * LOG2E,
                q.stride(0), q.stride(1), out.stride(0), out.stride(1), cache.stride(0),
                block_tables.stride(0), seq_base, scale_t, HEADS=heads, PAGE=page,
                LAT=latent_dim,
                LAT_PAD=_pad(latent_dim), ROPE=rope, ROPE_PAD=_pad(rope), BLOCK_M=block_m,
                BLOCK_N=block_n, F32_DOT=interp or q.dtype == torch.float32, STAGES=stages,
                FP8=cache.dtype == torch.float8_e4m3fn,
                **({} if interp else dict(num_warps=warps, num_stages=stages)),
            )  # fmt: skip
            break
        except triton.runtime.errors.OutOfResources:
            if not _step_down(key, (block_m, block_n, stages, warps)):
                raise
    return out


def append_latent(rows: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor,
                  kv_scale: torch.Tensor | None = None) -> None:
    """Write ``rows [T, W]`` (or ``[T, 1, W]``) into ``cache [P, 1, S, W]`` at
    ``slot_mapping [T]`` (int64 ``page * S + offset``; negative: skipped); FP8 pages:
    quantized by ``kv_scale`` (float32 ``[1]``)."""
    page, width, _ = check_latent_cache(cache, None)
    x = rows.reshape(rows.shape[0], -1) if rows.dim() == 3 else rows
    if x.dim() != 2 or x.shape[1] != width or x.stride(1) != 1 or x.device != cache.device:
        raise ValueError(f"rows must be [tokens, {width}] (or [tokens, 1, {width}]) on "
                         f"{cache.device} with unit dim stride, got {tuple(rows.shape)}")
    checks.check_index("slot_mapping", slot_mapping, 1, torch.int64, cache.device)
    if slot_mapping.shape[0] != x.shape[0]:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} slots for {x.shape[0]} rows")
    scale_t = latent_scale(kv_scale, cache, slot_mapping)
    if x.shape[0] == 0:
        return
    interp = checks.interpreting()
    _append_latent_kernel[(x.shape[0],)](
        x, cache, slot_mapping, x.stride(0), cache.stride(0), scale_t, PAGE=page, WIDTH=width,
        WIDTH_PAD=triton.next_power_of_2(width), FP8=cache.dtype == torch.float8_e4m3fn,
        **({} if interp else dict(num_warps=2)),
    )  # fmt: skip



def mla_attention(query: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                  latent_dim: int, kv_scale: torch.Tensor | None = None) -> torch.Tensor:
    """A step's attention, ``query [T, H, W]`` -> ``[T, H, latent_dim]``: the decode kernel on
    rows ``0:num_decodes``, the prefill kernel on the chunks after them (speculative steps,
    chunks of K+1, included)."""
    out = torch.empty((query.shape[0], query.shape[1], latent_dim), dtype=query.dtype,
                      device=query.device)
    nd, ns = meta.num_decodes, meta.num_seqs
    if nd > 0:
        mla_decode(query[:nd], cache, meta.block_tables[:nd], meta.seq_lens[:nd], scale,
                   latent_dim, max_seq_len=meta.max_seq_len, out=out[:nd], kv_scale=kv_scale)
    if nd < ns:
        mla_prefill(query, cache, meta.block_tables, meta.seq_lens, meta.cu_seqlens_q, scale,
                    latent_dim, max_q_len=meta.max_q_len, out=out, seq_base=nd,
                    kv_scale=kv_scale)
    return out


def warm(cache: torch.Tensor, num_heads: int, latent_dim: int,
         q_dtype: torch.dtype | None = None) -> int:
    """Compile every kernel variant serving can launch on this layer cache (the latent
    append, decode with one and with several splits plus the merge, prefill): the variants
    depend on dims, dtype and page size only. Writes nothing to the cache. Returns the
    launches run."""
    dev, i32 = cache.device, torch.int32
    page, width, _ = check_latent_cache(cache, latent_dim)
    dtype = q_dtype or cache.dtype  # the model's: FP8 pages are read by queries of another
    one = torch.ones(1, dtype=torch.float32, device=dev)
    q = torch.zeros((2, num_heads, width), dtype=dtype, device=dev)
    tables = torch.zeros((2, 4), dtype=i32, device=dev)
    lens = torch.full((2,), page, dtype=i32, device=dev)
    rows = torch.zeros((2, width), dtype=dtype, device=dev)  # strided as a step's rows
    append_latent(rows, cache, torch.full((2,), -1, dtype=torch.int64, device=dev), one)
    for splits in (1, 2):
        mla_decode(q, cache, tables, lens, 1.0, latent_dim, num_splits=splits, kv_scale=one)
    cu = torch.arange(3, dtype=i32, device=dev)
    mla_prefill(q, cache, tables, lens, cu, 1.0, latent_dim, max_q_len=1, seq_base=1, kv_scale=one)
    return 4
