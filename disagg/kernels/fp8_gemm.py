"""Block-FP8 linear layers (W8A8, Triton): ``y = x @ W.T`` on FP8 tensor cores, for the
checkpoints of ``disagg.model.fp8``'s block format with ``128 x 128`` weight blocks.

Operands (``M`` rows of activations, ``N`` output features, ``K`` input features; ``G = 128``):

- weights: ``w_fp8 [N, K]`` ``float8_e4m3fn`` and the checkpoint's ``weight_scale_inv``
  ``[ceil(N/G), ceil(K/G)]`` float32, the multiplier that dequantizes: ``w = w_fp8 * s_w``
  block by block (edge blocks partial);
- activations, quantized at run time (``quantize_groups``): per row, each group of ``G``
  columns (the last one partial) gets ``s_x = max(amax, 1e-10) / 448`` and is stored as
  ``x_fp8 = sat(x / s_x)`` (IEEE division, so the bytes equal the torch reference's) with
  ``x_scale [M, ceil(K/G)]`` float32. The floor keeps an all-zero group's scale finite and
  positive (its bytes are zeros whatever the scale), as vLLM's per-token-group quantizer does.

The GEMM (``fp8_block_matmul``) walks K in 128-column steps, one weight block and one activation
group each: ``acc += dot(x_fp8, w_fp8^T) * s_x[m, kb] * s_w[n // G, kb]``, the dot on fp8
operands accumulating float32 (sm_90: FP8 wgmma for tiles of 64 rows and more; Triton runs
16-row tiles as fp16 mma on exactly upcast operands). Each block's partial product is promoted
to the float32 accumulator by the scaling, which keeps Hopper's reduced-precision FP8
accumulation to 128 terms. The result is rounded to the output dtype once. M, N and K need not be multiples of
the tiles (edges are masked). ``fp8_linear`` is both steps. Tiles come from ``TILE_TABLE`` by M;
under ``TRITON_INTERPRET=1`` the dots run in float32 on small tiles.

Reference: ``disagg.kernels.reference.fp8_linear`` (dequantize both operands, float32 matmul).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from disagg.config import env
from disagg.kernels import checks
from disagg.kernels.fp8_gemv import fp8_gemv
from disagg.kernels.fp8_weight import Fp8Weight

GROUP = 128  # activation group and weight block edge (the checkpoint's weight_block_size)
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
AMAX_FLOOR = 1e-10  # the smallest amax a scale is taken from (reference.FP8_AMAX_FLOOR)
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
IN_DTYPES = OUT_DTYPES


@dataclass(frozen=True)
class Fp8Tile:
    block_m: int
    block_n: int
    group_m: int  # row blocks that share each weight tile while it is in L2
    num_warps: int
    num_stages: int


# (largest M for which the entry applies, tile); BLOCK_K is GROUP (one scale block per step).
# Chosen by ``bench/fp8_gemm.py`` on an H200 (2026-12-04, Qwen3-8B shapes, the geometric mean
# over them of each tile's time against the row's best): decode (M <= 64) reads the weights
# once and wants narrow N tiles for enough programs; up to M = 8192 64 x 128 tiles with 4 warps
# beat 128 x 128 with 8 (1.4-1.5x): wider tiles hold a second float32 tile for each block's
# scaled partial product, and spill.
TILE_TABLE: tuple[tuple[int, Fp8Tile], ...] = (
    (16, Fp8Tile(16, 64, 1, 4, 4)),
    (64, Fp8Tile(64, 32, 8, 4, 5)),
    (256, Fp8Tile(64, 64, 8, 4, 4)),
    (1 << 62, Fp8Tile(64, 128, 8, 4, 4)),
)
INTERP_TILE = Fp8Tile(16, 16, 2, 1, 1)  # TRITON_INTERPRET=1: small tiles keep it fast

def quant_rows(m: int) -> tuple[int, int]:
    """(rows per quantize program, its warps) for ``m`` rows."""
    return (16, 4) if m > 64 else (4, 1)


def tile_for(m: int) -> Fp8Tile:
    """The GEMM tile for ``m`` rows (deterministic from ``m``)."""
    if checks.interpreting():
        return INTERP_TILE
    return next(tile for bound, tile in TILE_TABLE if m <= bound)


@triton.jit(do_not_specialize=["M"])
def _quantize_groups_kernel(
    x_ptr, q_ptr, s_ptr, M, K, stride_xm, stride_qm, stride_sm, stride_sg,
    ROWS: tl.constexpr, GROUP: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    g = tl.program_id(1)
    cols = g * GROUP + tl.arange(0, GROUP)
    ok = (rows[:, None] < M) & (cols[None, :] < K)
    r64 = rows.to(tl.int64)[:, None]
    x = tl.load(x_ptr + r64 * stride_xm + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), 1)
    scale = tl.math.div_rn(tl.maximum(amax, 1e-10), 448.0)  # AMAX_FLOOR, FP8_MAX
    q = tl.clamp(tl.math.div_rn(x, scale[:, None]), -448.0, 448.0)
    tl.store(q_ptr + r64 * stride_qm + cols[None, :], q.to(q_ptr.dtype.element_ty), mask=ok)
    tl.store(s_ptr + rows.to(tl.int64) * stride_sm + g * stride_sg, scale, mask=rows < M)


@triton.jit(do_not_specialize=["M"])
def _fp8_gemm_kernel(
    a_ptr,  # [M, K] fp8 activations
    as_ptr,  # [M, ceil(K/G)] float32 activation scales
    b_ptr,  # [N, K] fp8 weights
    bs_ptr,  # [ceil(N/G), ceil(K/G)] float32 weight scales (weight_scale_inv)
    c_ptr,  # [M, N] out
    M, N, K, stride_am, stride_asm, stride_bn, stride_bsn, stride_cm,
    EVEN_K: tl.constexpr, F32_DOT: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_pid_n
    first_m = (pid // per_group) * GROUP_M
    size_m = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % size_m
    pid_n = (pid % per_group) // size_m

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # edge rows / columns read a valid row (wrapped) and are never stored
    rm = (offs_m % M).to(tl.int64)
    rn = (offs_n % N).to(tl.int64)
    offs_k = tl.arange(0, GROUP)
    a_ptrs = a_ptr + rm[:, None] * stride_am + offs_k[None, :]
    b_ptrs = b_ptr + rn[None, :] * stride_bn + offs_k[:, None]  # [G, BLOCK_N], K contiguous
    as_ptrs = as_ptr + rm * stride_asm
    bs_ptrs = bs_ptr + (rn // GROUP) * stride_bsn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for kb in range(0, tl.cdiv(K, GROUP)):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            k_ok = offs_k < K - kb * GROUP
            a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_ok[:, None], other=0.0)
        sa = tl.load(as_ptrs + kb)
        sb = tl.load(bs_ptrs + kb)
        if F32_DOT:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc += tl.dot(a, b) * sa[:, None] * sb[None, :]
        a_ptrs += GROUP
        b_ptrs += GROUP

    c_ptrs = c_ptr + offs_m.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask)


def _groups(k: int) -> int:
    return -(-k // GROUP)


def _check_rows(name: str, t: torch.Tensor, dtypes: tuple[torch.dtype, ...]) -> None:
    if t.dim() != 2 or t.dtype not in dtypes or (t.numel() and t.stride(1) != 1):
        raise ValueError(f"{name} must be a 2-d tensor of {dtypes} with a unit last stride, "
                         f"got {tuple(t.shape)} {t.dtype} strides {t.stride()}")


def quantize_groups(x: torch.Tensor, column_major_scales: bool = False
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` (bf16 / fp16 / float32, unit last stride) -> ``(x_fp8 [M, K]``
    ``float8_e4m3fn``, ``x_scale [M, ceil(K/128)]`` float32), both contiguous (module
    docstring); ``column_major_scales``: ``x_scale`` is the transpose of a contiguous
    ``[ceil(K/128), M]`` (the layout cuBLAS's block-scaled FP8 GEMM reads)."""
    _check_rows("x", x, IN_DTYPES)
    m, k = x.shape
    q = torch.empty((m, k), dtype=FP8, device=x.device)
    if column_major_scales:
        s = torch.empty((_groups(k), m), dtype=torch.float32, device=x.device).T
    else:
        s = torch.empty((m, _groups(k)), dtype=torch.float32, device=x.device)
    if m == 0 or k == 0:
        return q, s
    rows, warps = quant_rows(m)
    launch = {} if checks.interpreting() else dict(num_warps=warps)
    grid = (triton.cdiv(m, rows), _groups(k))
    _quantize_groups_kernel[grid](x, q, s, m, k, x.stride(0), q.stride(0), s.stride(0),
                                  s.stride(1), ROWS=rows, GROUP=GROUP, **launch)
    return q, s


def check_operands(x_fp8: torch.Tensor, x_scale: torch.Tensor, w_fp8: torch.Tensor,
                   w_scale_inv: torch.Tensor) -> None:
    """Shapes, dtypes, strides and devices ``fp8_block_matmul`` takes; ValueError by name."""
    _check_rows("x_fp8", x_fp8, (FP8,))
    _check_rows("w_fp8", w_fp8, (FP8,))
    _check_rows("x_scale", x_scale, (torch.float32,))
    _check_rows("w_scale_inv", w_scale_inv, (torch.float32,))
    m, k = x_fp8.shape
    n = w_fp8.shape[0]
    if w_fp8.shape[1] != k:
        raise ValueError(f"w_fp8 must be [N, {k}] (x_fp8's K), got {tuple(w_fp8.shape)}")
    if tuple(x_scale.shape) != (m, _groups(k)):
        raise ValueError(f"x_scale must be [{m}, {_groups(k)}] (one per row and {GROUP} "
                         f"columns), got {tuple(x_scale.shape)}")
    want = (_groups(n), _groups(k))
    if tuple(w_scale_inv.shape) != want:
        raise ValueError(f"w_scale_inv must be {list(want)} ({GROUP}x{GROUP} weight blocks of "
                         f"[{n}, {k}]), got {tuple(w_scale_inv.shape)}")
    for name, t in (("x_scale", x_scale), ("w_fp8", w_fp8), ("w_scale_inv", w_scale_inv)):
        if t.device != x_fp8.device:
            raise ValueError(f"{name} on {t.device} but x_fp8 on {x_fp8.device}")


def fp8_block_matmul(x_fp8: torch.Tensor, x_scale: torch.Tensor, w_fp8: torch.Tensor,
                     w_scale_inv: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16,
                     tile: Fp8Tile | None = None) -> torch.Tensor:
    """``(x_fp8 * x_scale) @ (w_fp8 * w_scale_inv).T`` -> ``[M, N]`` in ``out_dtype``
    (bf16 / fp16 / float32); ``tile`` overrides ``tile_for(M)`` (benchmark sweeps)."""
    check_operands(x_fp8, x_scale, w_fp8, w_scale_inv)
    if out_dtype not in OUT_DTYPES:
        raise ValueError(f"out_dtype must be one of {OUT_DTYPES}, got {out_dtype}")
    m, k = x_fp8.shape
    n = w_fp8.shape[0]
    out = torch.empty((m, n), dtype=out_dtype, device=x_fp8.device)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_()
    interp = checks.interpreting()
    t = tile or tile_for(m)
    grid = (triton.cdiv(m, t.block_m) * triton.cdiv(n, t.block_n),)
    launch = {} if interp else dict(num_warps=t.num_warps, num_stages=t.num_stages)
    _fp8_gemm_kernel[grid](
        x_fp8, x_scale, w_fp8, w_scale_inv, out, m, n, k,
        x_fp8.stride(0), x_scale.stride(0), w_fp8.stride(0), w_scale_inv.stride(0),
        out.stride(0), EVEN_K=k % GROUP == 0, F32_DOT=interp, GROUP=GROUP,
        BLOCK_M=t.block_m, BLOCK_N=t.block_n, GROUP_M=t.group_m, **launch,
    )  # fmt: skip
    return out


def fp8_matmul(x: torch.Tensor, w: Fp8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, w, bias)`` for a block-FP8 weight on CUDA: one row through ``fp8_gemv``
    (weight-only), more through ``fp8_linear`` (W8A8, per-token-group activation scales)."""
    x2 = x.reshape(-1, x.shape[-1])
    if x2.shape[0] == 1 and x2.stride(1) == 1:
        out = fp8_gemv(x2, w.q, w.scale_inv)  # disagg.kernels.fp8_gemv
    else:
        out = fp8_linear(x2, w.q, w.scale_inv)
    if bias is not None:
        out += bias
    return out.reshape(*x.shape[:-1], w.q.shape[0])


# Prefill rows run cuBLASLt's block-scaled FP8 GEMM (``torch._scaled_mm`` with 1x128 activation
# and 128x128 weight scales, sm_90, CUDA 12.9+): on an H200 it ran Qwen3-8B's 8k-row GEMMs at
# 1.1-1.2 PFLOP/s, 1.6x cuBLAS bf16, where the Triton kernel stays near bf16's rate
# (bench/fp8_scaled_mm_probe.py). Below CUBLAS_MIN_M rows, and where it is not available, the
# Triton kernel runs. DISAGG_FP8_GEMM=triton keeps the Triton kernel everywhere;
# DISAGG_FP8_CUBLAS_MIN_M=64 (say) sends decode batches there too (an experiment: the Triton
# kernel ran M = 64-256 at 0.6-0.9x cuBLAS bf16, cuBLASLt there is not measured yet).
CUBLAS_MIN_M = int(env("FP8_CUBLAS_MIN_M") or 1024)
_cublas_ok: dict[torch.device, bool] = {}


def cublas_block_fp8(device: torch.device) -> bool:
    """Whether ``torch._scaled_mm`` takes block FP8 scales on ``device`` (tried once, outside
    graph capture; a capture before the first try uses the Triton kernel)."""
    if device in _cublas_ok:
        return _cublas_ok[device]
    if device.type != "cuda" or env("FP8_GEMM") == "triton" or checks.interpreting():
        _cublas_ok[device] = False
        return False
    if torch.cuda.is_current_stream_capturing():
        return False
    try:
        a = torch.zeros((128, 128), dtype=FP8, device=device)
        sa = torch.ones((1, 128), dtype=torch.float32, device=device).T
        sb = torch.ones((1, 1), dtype=torch.float32, device=device)
        torch._scaled_mm(a, a.T, scale_a=sa, scale_b=sb.T, out_dtype=torch.bfloat16)
        _cublas_ok[device] = True
    except (RuntimeError, TypeError, ValueError) as e:
        import logging

        logging.getLogger(__name__).info("block-FP8 GEMMs on Triton only: torch._scaled_mm "
                                         "refused block scales (%s)", str(e)[:200])
        _cublas_ok[device] = False
    return _cublas_ok[device]


def cublas_fp8_linear(x: torch.Tensor, w_fp8: torch.Tensor, w_scale_inv: torch.Tensor,
                      out_dtype: torch.dtype) -> torch.Tensor:
    """``x [M, K] @ W.T`` through cuBLASLt: the same activation quantizer (scales laid out
    column-major), then ``torch._scaled_mm`` with 1x128 and 128x128 block scales."""
    m = x.shape[0]
    if m % 16:  # cuBLASLt has no algorithm for other row counts (H200, CUDA 13): zero rows
        x = torch.nn.functional.pad(x, (0, 0, 0, 16 - m % 16))
    q, s = quantize_groups(x, column_major_scales=True)
    out = torch._scaled_mm(q, w_fp8.T, scale_a=s, scale_b=w_scale_inv.T, out_dtype=out_dtype)
    return out[:m]


def _cublas_refused(m: int, n: int, k: int, e: Exception) -> None:
    import logging

    logging.getLogger(__name__).warning("cuBLASLt refused a block-FP8 GEMM [%d x %d x %d] (%s); "
                                        "the Triton kernel runs it", m, n, k, str(e)[:160])


def fp8_linear(x: torch.Tensor, w_fp8: torch.Tensor, w_scale_inv: torch.Tensor,
               out_dtype: torch.dtype | None = None, tile: Fp8Tile | None = None
               ) -> torch.Tensor:
    """``x [..., K] @ W.T`` for a block-FP8 weight: ``quantize_groups`` then
    ``fp8_block_matmul`` (or, for ``CUBLAS_MIN_M`` rows and more with N and K whole blocks,
    cuBLASLt's block-scaled GEMM); ``[..., N]`` in ``out_dtype`` (default ``x.dtype``)."""
    if x.dim() < 1:
        raise ValueError("x must have at least one dim (its last is K)")
    lead, k = x.shape[:-1], x.shape[-1]
    if w_fp8.dim() != 2 or w_fp8.shape[1] != k:
        raise ValueError(f"w_fp8 must be [N, {k}] (x's last dim), got {tuple(w_fp8.shape)}")
    x2 = x.reshape(-1, k)
    if x2.numel() and x2.stride(1) != 1:
        x2 = x2.contiguous()
    dtype = out_dtype or x.dtype
    n = w_fp8.shape[0]
    if (tile is None and x2.shape[0] >= CUBLAS_MIN_M and n % GROUP == 0 and k % GROUP == 0
            and dtype in (torch.bfloat16, torch.float16) and cublas_block_fp8(x2.device)):
        _check_rows("w_fp8", w_fp8, (FP8,))
        if tuple(w_scale_inv.shape) != (_groups(n), _groups(k)) or \
                w_scale_inv.dtype != torch.float32 or w_scale_inv.device != x2.device:
            raise ValueError(f"w_scale_inv must be float32 [{_groups(n)}, {_groups(k)}] on "
                             f"{x2.device}, got {tuple(w_scale_inv.shape)} {w_scale_inv.dtype}")
        try:
            return cublas_fp8_linear(x2, w_fp8, w_scale_inv, dtype).reshape(*lead, n)
        except RuntimeError as e:  # a shape cuBLASLt has no algorithm for: Triton does it
            _cublas_refused(x2.shape[0], n, k, e)
    q, s = quantize_groups(x2)
    out = fp8_block_matmul(q, s, w_fp8, w_scale_inv, dtype, tile)
    return out.reshape(*lead, n)
