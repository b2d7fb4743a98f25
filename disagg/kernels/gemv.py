"""One row times a weight matrix (``y = x @ W.T + b`` for ``x`` ``[1, K]``): the projections of
a batch-1 decode step (Triton).

At one row cuBLAS picks tiles sized for wider problems: on the H200 the Qwen3-8B shape's o
projection ran at 3.1 TB/s and its down projection needed a split-K pass plus a reduction
kernel, where this kernel reads the weights at 3.9-5.4 TB/s (``bench/gemv_probe.py``). Each
program owns ``BN`` output features and walks K in ``BK`` columns, keeping ``[BN, BK]``
float32 partial products and summing them once at the end; the result is rounded to the
output dtype once, as cuBLAS does (the sum order differs).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from disagg.kernels import checks


@triton.jit
def _gemv_kernel(w_ptr, x_ptr, b_ptr, out_ptr, N, K, HAS_BIAS: tl.constexpr, BN: tl.constexpr,
                 BK: tl.constexpr):
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    rows = w_ptr + n[:, None].to(tl.int64) * K
    acc = tl.zeros((BN, BK), dtype=tl.float32)
    for k0 in tl.range(0, K, BK, num_stages=4):
        k = k0 + tl.arange(0, BK)
        w = tl.load(rows + k[None, :], mask=(n[:, None] < N) & (k[None, :] < K), other=0.0)
        x = tl.load(x_ptr + k, mask=k < K, other=0.0)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    y = tl.sum(acc, 1)
    if HAS_BIAS:
        y += tl.load(b_ptr + n, mask=n < N, other=0.0).to(tl.float32)
    tl.store(out_ptr + n, y.to(out_ptr.dtype.element_ty), mask=n < N)


def tiles(n: int, k: int) -> tuple[int, int]:
    """(BN, BK) for an ``[n, k]`` weight: the probe's fastest of a few near-equal choices."""
    return (16, 256) if n <= 8192 and k <= 4096 else (16, 512)


def gemv(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` ``[1, K]`` (unit stride), ``w`` ``[N, K]`` contiguous, ``bias`` ``[N]`` or None
    -> ``[1, N]`` in ``x``'s dtype: ``F.linear(x, w, bias)``."""
    n, k = w.shape
    if x.dim() != 2 or x.shape[0] != 1 or x.shape[1] != k or x.stride(1) != 1:
        raise ValueError(f"gemv: x must be [1, {k}] with unit stride, got {tuple(x.shape)}")
    if not w.is_contiguous() or (bias is not None and bias.shape != (n,)):
        raise ValueError("gemv: w must be contiguous [N, K] and bias [N]")
    out = torch.empty((1, n), dtype=x.dtype, device=x.device)
    bn, bk = tiles(n, k)
    launch = {} if checks.interpreting() else dict(num_warps=4)
    _gemv_kernel[(triton.cdiv(n, bn),)](w, x, bias if bias is not None else w, out, n, k,
                                        HAS_BIAS=bias is not None, BN=bn, BK=bk, **launch)
    return out
