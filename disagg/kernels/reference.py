"""Plain torch reference kernels over the HND paged cache: slow, obviously correct.

Shapes (T = tokens in the step, B = sequences, Hq/Hkv = query/kv heads, D = head_dim,
P = pages, S = page_size):
- ``k_cache``, ``v_cache``: ``[P, Hkv, S, D]`` (page stride may exceed ``Hkv*S*D``);
- ``slot_mapping``: ``[T]`` int64, ``page_id * S + offset_in_page``; a negative slot is skipped;
- ``block_tables``: ``[B, max_pages]`` int32, a sequence's pages in order (unused tail = any value);
- ``seq_lens``: ``[B]`` int32, kv length of each sequence INCLUDING the tokens of this step;
- ``cu_seqlens_q``: ``[B + 1]`` int32, query rows of sequence b are ``cu[b]:cu[b+1]``; query row
  i of sequence b sits at position ``seq_lens[b] - q_len_b + i`` and attends causally to kv
  positions ``<=`` its own.
"""

from __future__ import annotations

import torch

from disagg.kernels.kv_quant import KVScales, dequantize, store_values


def append_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scales: KVScales | None = None,
) -> None:
    """Write the step's new keys/values ``[T, Hkv, D]`` into their cache slots (an FP8 cache:
    quantized by ``kv_scales``, ``disagg.kernels.kv_quant``)."""
    page_size = k_cache.shape[2]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    pages = slots // page_size
    offsets = slots % page_size
    ks, vs = kv_scales if kv_scales is not None else (None, None)
    k_cache[pages, :, offsets] = store_values(k[keep], k_cache, ks)
    v_cache[pages, :, offsets] = store_values(v[keep], v_cache, vs)


def gather_kv(
    cache: torch.Tensor, block_table: torch.Tensor, kv_len: int
) -> torch.Tensor:
    """One sequence's cache entries as a dense ``[Hkv, kv_len, D]`` tensor."""
    page_size = cache.shape[2]
    num_pages = (kv_len + page_size - 1) // page_size
    pages = cache[block_table[:num_pages].long()]  # [n, Hkv, S, D]
    dense = pages.permute(1, 0, 2, 3).reshape(cache.shape[1], num_pages * page_size, -1)
    return dense[:, :kv_len]


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    scale: float,
    kv_scales: KVScales | None = None,
) -> torch.Tensor:
    """Causal attention of variable-length query chunks over their paged history.

    Covers prefill chunks and decode steps (a decode step is a chunk of one query). Computes in
    float32 and returns ``q.dtype``, shape ``[T, Hq, D]``; FP8 pages are dequantized by
    ``kv_scales`` first.
    """
    ks, vs = kv_scales if kv_scales is not None else (None, None)
    out = torch.empty_like(q)
    num_q_heads = q.shape[1]
    num_kv_heads = k_cache.shape[1]
    group = num_q_heads // num_kv_heads
    cu = cu_seqlens_q.tolist()
    lens = seq_lens.tolist()
    for b, kv_len in enumerate(lens):
        start, end = cu[b], cu[b + 1]
        q_len = end - start
        if q_len == 0:
            continue
        k = dequantize(gather_kv(k_cache, block_tables[b], kv_len), ks)  # [Hkv, L, D]
        v = dequantize(gather_kv(v_cache, block_tables[b], kv_len), vs)
        k = k.repeat_interleave(group, dim=0)  # [Hq, L, D]
        v = v.repeat_interleave(group, dim=0)
        qb = q[start:end].float().transpose(0, 1)  # [Hq, q_len, D]
        scores = torch.matmul(qb, k.transpose(1, 2)) * scale  # [Hq, q_len, L]
        q_pos = torch.arange(kv_len - q_len, kv_len, device=q.device)
        k_pos = torch.arange(kv_len, device=q.device)
        mask = k_pos[None, :] > q_pos[:, None]
        scores.masked_fill_(mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[start:end] = torch.matmul(probs, v).transpose(0, 1).to(q.dtype)
    return out


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    kv_scales: KVScales | None = None,
) -> torch.Tensor:
    """Decode attention: one query per sequence, ``q`` is ``[B, Hq, D]``."""
    batch = q.shape[0]
    cu = torch.arange(batch + 1, dtype=torch.int32, device=q.device)
    return paged_attention(q, k_cache, v_cache, block_tables, seq_lens, cu, scale, kv_scales)


# Block-FP8 linear layers (disagg.kernels.fp8_gemm): 128-column activation groups, 128 x 128
# weight blocks; a scale multiplies its FP8 values back (x = x_fp8 * scale).
FP8_GROUP = 128
FP8_AMAX_FLOOR = 1e-10  # an all-zero group's scale is FP8_AMAX_FLOOR / 448, not 0


def _expand_blocks(scale: torch.Tensor, rows: int, cols: int, block_rows: int) -> torch.Tensor:
    """``scale [ceil(rows/block_rows), ceil(cols/128)]`` -> one value per element, float32."""
    s = scale.to(torch.float32).repeat_interleave(block_rows, dim=0)[:rows]
    return s.repeat_interleave(FP8_GROUP, dim=1)[:, :cols]


def quantize_groups(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` -> ``(x_fp8 [M, K] float8_e4m3fn, x_scale [M, ceil(K/128)] float32)``:
    each row's 128-column group (the last partial) scaled by ``max(amax, floor) / 448``."""
    m, k = x.shape
    groups = -(-k // FP8_GROUP)
    xf = torch.zeros(m, groups * FP8_GROUP, dtype=torch.float32, device=x.device)
    xf[:, :k] = x.to(torch.float32)
    amax = xf.view(m, groups, FP8_GROUP).abs().amax(dim=-1)
    # a tensor divisor: CUDA torch turns division by a Python scalar into a multiplication
    # by its reciprocal (not the correctly rounded quotient the kernel's div_rn computes)
    scale = amax.clamp_min(FP8_AMAX_FLOOR) / torch.full_like(amax, 448.0)
    q = (xf[:, :k] / _expand_blocks(scale, m, k, 1)).clamp(-448.0, 448.0)
    return q.to(torch.float8_e4m3fn), scale


def fp8_block_matmul(x_fp8: torch.Tensor, x_scale: torch.Tensor, w_fp8: torch.Tensor,
                     w_scale_inv: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16
                     ) -> torch.Tensor:
    """``(x_fp8 * x_scale) @ (w_fp8 * w_scale_inv).T`` in float32, returned in ``out_dtype``."""
    m, k = x_fp8.shape
    n = w_fp8.shape[0]
    a = x_fp8.to(torch.float32) * _expand_blocks(x_scale, m, k, 1)
    w = w_fp8.to(torch.float32) * _expand_blocks(w_scale_inv, n, k, FP8_GROUP)
    return (a @ w.T).to(out_dtype)


def fp8_linear(x: torch.Tensor, w_fp8: torch.Tensor, w_scale_inv: torch.Tensor,
               out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x [M, K] @ W.T`` as the FP8 kernels compute it: activations quantized by
    ``quantize_groups``, the block-FP8 weight dequantized by its ``weight_scale_inv``."""
    q, s = quantize_groups(x)
    return fp8_block_matmul(q, s, w_fp8, w_scale_inv, out_dtype or x.dtype)


def dequantize_weight(w_fp8: torch.Tensor, w_scale_inv: torch.Tensor) -> torch.Tensor:
    """A block-FP8 weight ``[N, K]`` in float32: each 128x128 block (edges partial) times its
    ``weight_scale_inv`` entry (what ``fp8_gemv`` multiplies one row of activations by)."""
    n, k = w_fp8.shape
    s = w_scale_inv.to(torch.float32).repeat_interleave(128, 0)[:n]
    return w_fp8.to(torch.float32) * s.repeat_interleave(128, 1)[:, :k]
