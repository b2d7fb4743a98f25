"""Paged causal attention for variable-length chunks over the HND cache (Triton).

One program per (query block of ``BLOCK_M`` rows, sequence, query head). A chunk's queries sit at
positions ``seq_len - q_len .. seq_len - 1`` and attend to the request's earlier pages plus the
chunk itself (whose K/V must already be appended). Blocks of keys wholly before the program's
first query run without a mask; only the trailing blocks that cross the diagonal are masked.
Query blocks are visited longest-first so the causal tail does not run last. Decode rows (chunks
of one) are valid input too, but ``decode.paged_decode_attention`` is the fast path for them.

Reference: ``reference.paged_attention``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from disagg.kernels import checks

LOG2E = 1.4426950408889634
H200_SMEM = 232448  # bytes of shared memory one program may use (H100/H200 opt-in limit)


def prefill_smem_bytes(elt: int, head_dim: int, block_m: int, block_n: int, stages: int) -> int:
    """An upper bound on the shared memory the prefill kernel asks for: the Q tile plus
    ``stages`` buffered K and V tiles, and a little for barriers. Triton 3.6 on an H200
    reported exactly this at 2 stages (float32: 327,680 bytes at head_dim 128 with 128 x 128
    tiles, 393,216 at head_dim 256 with 128 x 64) and less at 3 (328,704 at 128 x 128)."""
    return elt * head_dim * (block_m + 2 * stages * block_n) + 1024


def prefill_tiles(elt: int, head_dim: int, max_q_len: int,
                  smem: int = H200_SMEM) -> tuple[int, int, int]:
    """(block_m, block_n, num_stages) for a launch: the fastest tiles measured on an H200
    (128 x 128, 3 stages for long chunks at head_dim <= 128; docs/BENCHMARKS.md), stepped down
    until they fit ``smem`` bytes for this element size and head dim (float32 at head_dim 128
    does not fit the bf16 choice)."""
    block_m = 128 if max_q_len > 64 else 64
    block_n = 128 if head_dim <= 128 and block_m >= 128 else 64
    stages = 3 if head_dim <= 128 else 2
    while prefill_smem_bytes(elt, head_dim, block_m, block_n, stages) > smem:
        smaller = smaller_tiles(block_m, block_n, stages)
        if smaller is None:
            break  # the smallest tiles: let the compiler say if even they do not fit
        block_m, block_n, stages = smaller
    return block_m, block_n, stages


def smaller_tiles(block_m: int, block_n: int, stages: int) -> tuple[int, int, int] | None:
    """The next step down the ladder (fewer stages, then narrower K/V tiles, then fewer query
    rows), or None at the bottom."""
    if stages > 2:
        return block_m, block_n, stages - 1
    if block_n > 32 and block_n >= block_m // 2:
        return block_m, block_n // 2, stages
    if block_m > 32:
        return block_m // 2, block_n, stages
    if block_n > 16:
        return block_m, block_n // 2, stages
    if stages > 1:
        return block_m, block_n, stages - 1
    return None


def device_smem(device: torch.device) -> int:
    """The opt-in shared memory per program of ``device`` (the H200's where unknown)."""
    try:
        props = triton.runtime.driver.active.utils.get_device_properties(device.index or 0)
        return int(props["max_shared_mem"])
    except Exception:  # no driver query (interpreter, CPU): the tiles are small there anyway
        return H200_SMEM


@triton.jit
def _attend_block(
    acc, l_i, m_i, q, k_ptr, v_ptr, bt_row, stride_kp, stride_vp, head_off, lo, hi, kv_len,
    q_pos, scale_log2, d,
    MASKED: tl.constexpr, PAGE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
    F32_DOT: tl.constexpr, STAGES: tl.constexpr, FP8: tl.constexpr,
):  # fmt: skip
    for n0 in tl.range(lo, hi, BLOCK_N, num_stages=STAGES):
        n = n0 + tl.arange(0, BLOCK_N)
        if MASKED:
            valid = n < kv_len
            page = tl.load(bt_row + n // PAGE, mask=valid, other=0).to(tl.int64)
        else:
            page = tl.load(bt_row + n // PAGE).to(tl.int64)
        tok = head_off + (n % PAGE) * HEAD_DIM
        k_ptrs = k_ptr + (page * stride_kp + tok)[:, None] + d[None, :]
        v_ptrs = v_ptr + (page * stride_vp + tok)[:, None] + d[None, :]
        if MASKED:
            k = tl.load(k_ptrs, mask=valid[:, None], other=0.0)
        else:
            k = tl.load(k_ptrs)
        if F32_DOT:
            k = k.to(tl.float32)
        elif FP8:
            k = k.to(q.dtype)
        s = tl.dot(q, tl.trans(k)) * scale_log2
        if MASKED:
            keep = (n[None, :] <= q_pos[:, None]) & valid[None, :]
            s = tl.where(keep, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        if MASKED:
            v = tl.load(v_ptrs, mask=valid[:, None], other=0.0)
        else:
            v = tl.load(v_ptrs)
        if F32_DOT:
            v = v.to(tl.float32)
        elif FP8:
            v = v.to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    return acc, l_i, m_i


# Per-step sizes must not select kernel variants: Triton specializes int arguments on
# divisibility by 16 (and == 1), so a varying block-table width or sequence offset would compile
# a new variant mid-serving (seen: 0.5-2 s stalls of mixed steps on an H200).
@triton.jit(do_not_specialize=["stride_bt", "seq_base"])
def _prefill_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    bt_ptr,
    seq_lens_ptr,
    cu_ptr,
    scale_log2,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kp,
    stride_vp,
    stride_bt,
    seq_base,  # index of this launch's first sequence in bt/seq_lens/cu (whole arrays passed)
    k_scale_ptr,  # [Hkv] float32, read only with FP8 pages
    v_scale_ptr,
    GROUP: tl.constexpr,
    PAGE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    F32_DOT: tl.constexpr,
    STAGES: tl.constexpr,  # software-pipelining depth of the K/V loops
    FP8: tl.constexpr,  # FP8 pages: K's scale folds into the scores, V's into the output
):
    b = tl.program_id(1) + seq_base
    h = tl.program_id(2)
    q_start = tl.load(cu_ptr + b)
    q_len = tl.load(cu_ptr + b + 1) - q_start
    num_m = tl.cdiv(q_len, BLOCK_M)
    mb = num_m - 1 - tl.program_id(0)  # longest rows first
    if mb >= 0:
        kv_len = tl.load(seq_lens_ptr + b)
        ctx = kv_len - q_len
        m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = m < q_len
        q_pos = ctx + m
        d = tl.arange(0, HEAD_DIM)
        rows = (q_start + m).to(tl.int64)
        q = tl.load(
            q_ptr + rows[:, None] * stride_qt + h * stride_qh + d[None, :],
            mask=row_ok[:, None],
            other=0.0,
        )
        if F32_DOT:
            q = q.to(tl.float32)
        elif FP8:  # e4m3 -> fp16 is one packed instruction on sm_90, -> bf16 is not
            q = q.to(tl.float16)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        bt_row = bt_ptr + b.to(tl.int64) * stride_bt
        head_off = (h // GROUP) * (PAGE * HEAD_DIM)
        if FP8:
            scale_log2 = scale_log2 * tl.load(k_scale_ptr + h // GROUP)
        first_q = ctx + mb * BLOCK_M
        full_end = (first_q // BLOCK_N) * BLOCK_N  # keys every row of the block may see
        hi = tl.minimum(kv_len, first_q + BLOCK_M)
        acc, l_i, m_i = _attend_block(
            acc, l_i, m_i, q, k_ptr, v_ptr, bt_row, stride_kp, stride_vp, head_off, 0, full_end,
            kv_len, q_pos, scale_log2, d,
            False, PAGE, HEAD_DIM, BLOCK_N, F32_DOT, STAGES, FP8,
        )  # fmt: skip
        acc, l_i, m_i = _attend_block(
            acc, l_i, m_i, q, k_ptr, v_ptr, bt_row, stride_kp, stride_vp, head_off, full_end, hi,
            kv_len, q_pos, scale_log2, d,
            True, PAGE, HEAD_DIM, BLOCK_N, F32_DOT, STAGES, FP8,
        )  # fmt: skip
        out = acc / tl.where(row_ok, l_i, 1.0)[:, None]
        if FP8:
            out = out * tl.load(v_scale_ptr + h // GROUP)
        tl.store(
            out_ptr + rows[:, None] * stride_ot + h * stride_oh + d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None],
        )


# (device index, element size, head dim) -> the shared memory budget tiles are chosen for: the
# device's limit, lowered when a compile still ran out (the estimate is an upper bound only
# as far as it was measured)
_SMEM: dict[tuple[int, int, int], int] = {}


def _tiles_for(elt: int, head_dim: int, max_q_len: int, device: torch.device) -> tuple[int, int, int]:
    key = (device.index or 0, elt, head_dim)
    if key not in _SMEM:
        _SMEM[key] = device_smem(device)
    return prefill_tiles(elt, head_dim, max_q_len, _SMEM[key])


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    scale: float,
    *,
    max_q_len: int | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    out: torch.Tensor | None = None,
    seq_base: int = 0,
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Causal attention of chunks ``q`` ``[T, Hq, D]`` (rows ``cu[b]:cu[b+1]``) -> ``[T, Hq, D]``.

    FP8 pages (``disagg.kernels.kv_quant``) need ``kv_scales``: float32 ``[Hkv]`` K and V scales.

    ``cu_seqlens_q`` may be a slice whose offsets do not start at 0: rows are absolute indices
    into ``q`` and ``out``; rows outside every chunk are left untouched. ``max_q_len`` (a host
    upper bound on chunk lengths) sizes the grid; without it the launcher reads ``cu_seqlens_q``
    (a device sync). ``seq_base`` skips the first sequences of ``block_tables``, ``seq_lens``
    and ``cu_seqlens_q`` (pass whole arrays rather than slices: slices change the pointers'
    alignment, and with it the compiled variant).
    """
    group = checks.check_attention_inputs(q, k_cache, v_cache, block_tables, seq_lens)
    checks.check_index("cu_seqlens_q", cu_seqlens_q, 1, torch.int32, k_cache.device)
    if not 0 <= seq_base <= seq_lens.shape[0]:
        raise ValueError(f"seq_base {seq_base} outside [0, {seq_lens.shape[0]}]")
    num_seqs = seq_lens.shape[0] - seq_base
    if cu_seqlens_q.shape[0] != seq_lens.shape[0] + 1:
        raise ValueError(
            f"cu_seqlens_q has {cu_seqlens_q.shape[0]} entries for {seq_lens.shape[0]} sequences"
        )
    _, num_heads, head_dim = q.shape
    _, num_kv_heads, page_size, _ = k_cache.shape
    ks, vs = checks.launch_scales(kv_scales, k_cache, num_kv_heads, seq_lens)
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    elif out.shape != q.shape or out.stride(2) != 1:
        raise ValueError(
            f"out must be {tuple(q.shape)} with unit dim stride, got {tuple(out.shape)}"
        )
    if num_seqs == 0 or q.shape[0] == 0:
        return out
    if max_q_len is None:
        cu = cu_seqlens_q[seq_base:]
        max_q_len = int((cu[1:] - cu[:-1]).max())
    interp = checks.interpreting()
    if interp:
        tiles = (16, 16, 3 if head_dim <= 128 else 2)
    else:
        tiles = _tiles_for(q.element_size(), head_dim, max_q_len, q.device)
    block_m = block_m or tiles[0]
    block_n = block_n or tiles[1]
    num_stages = num_stages or tiles[2]
    if num_warps is None:
        num_warps = 8 if block_m >= 128 else 4
    f32_dot = interp or q.dtype == torch.float32
    while True:
        grid = (triton.cdiv(max_q_len, block_m), num_seqs, num_heads)
        try:
            _prefill_kernel[grid](
                q, k_cache, v_cache, out, block_tables, seq_lens, cu_seqlens_q, scale * LOG2E,
                q.stride(0), q.stride(1), out.stride(0), out.stride(1),
                k_cache.stride(0), v_cache.stride(0), block_tables.stride(0), seq_base, ks, vs,
                GROUP=group, PAGE=page_size, HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=block_n,
                F32_DOT=f32_dot, STAGES=num_stages, FP8=k_cache.dtype == torch.float8_e4m3fn,
                **({} if interp else dict(num_warps=num_warps, num_stages=num_stages)),
            )  # fmt: skip
            return out
        except triton.runtime.errors.OutOfResources:  # the estimate was short: step down
            smaller = smaller_tiles(block_m, block_n, num_stages)
            if smaller is None:
                raise
            block_m, block_n, num_stages = smaller
            num_warps = 8 if block_m >= 128 else 4
            key = (q.device.index or 0, q.element_size(), head_dim)
            _SMEM[key] = min(_SMEM.get(key, H200_SMEM), prefill_smem_bytes(  # start lower later
                q.element_size(), head_dim, block_m, block_n, num_stages))
