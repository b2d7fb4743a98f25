"""One row times a weight matrix (``y = x @ W.T + b`` for ``x`` ``[1, K]``): the projections of
a batch-1 decode step (Triton).

At one row cuBLAS picks tiles sized for wider problems: on the H200 the Qwen3-8B shape's o
projection ran at 3.1 TB/s and its down projection needed a split-K pass plus a reduction
kernel, where this kernel reads the weights at 3.9-5.4 TB/s (``bench/gemv_probe.py``). Each
program owns ``BN`` output features and walks K in ``BK`` columns, keeping ``[BN, BK]``
float32 partial products and summing them once at the end; the result is rounded to the
output dtype once, as cuBLAS does (the sum order differs).

A prologue can compute the row from what precedes the projection in the layer, so that kernel
is not launched (``norm_gemv``, ``silu_gemv``; the FP8 GEMV of ``disagg.kernels.fp8_gemv``
takes the same prologues, ``_act``):

- ``PRO_NORM``: the residual add and RMSNorm before qkv and gate_up. Every program first sums
  the row's squares (``x + delta``: a few KB from L2), then walks K computing
  ``w_norm * (r * rsqrt(mean(r^2) + eps))`` with the roundings of ``fused.rms_norm``; program 0
  also writes ``r = x + delta`` to a separate buffer (the other programs still read ``x``).
- ``PRO_SILU``: ``silu(gate) * up`` of a ``[1, 2K]`` row before down, rounded as
  ``fused.silu_mul``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from disagg.kernels import checks

PRO_NONE, PRO_NORM, PRO_SILU = 0, 1, 2


@triton.jit
def _residual(x_ptr, d_ptr, k, K, HAS_DELTA: tl.constexpr):
    """``x + delta`` at columns ``k``, rounded to ``x``'s dtype (``x`` alone without delta)."""
    x = tl.load(x_ptr + k, mask=k < K, other=0.0)
    if HAS_DELTA:
        d = tl.load(d_ptr + k, mask=k < K, other=0.0)
        x = (d.to(tl.float32) + x.to(tl.float32)).to(x_ptr.dtype.element_ty)
    return x


@triton.jit
def _inv_rms(x_ptr, d_ptr, K, eps, HAS_DELTA: tl.constexpr, BK: tl.constexpr):
    """``rsqrt(mean((x + delta)^2) + eps)`` of the whole row (float32)."""
    acc = tl.zeros((BK,), dtype=tl.float32)
    for k0 in range(0, K, BK):
        v = _residual(x_ptr, d_ptr, k0 + tl.arange(0, BK), K, HAS_DELTA).to(tl.float32)
        acc += v * v
    return tl.math.rsqrt(tl.sum(acc, 0) / K + eps)


@triton.jit
def _act(x_ptr, d_ptr, nw_ptr, xo_ptr, k, K, inv, write, PRO: tl.constexpr,
         HAS_DELTA: tl.constexpr):
    """The row's activations at columns ``k`` (float32, each rounded to the model dtype where
    the unfused kernels round): ``x``, ``norm(x + delta)`` (also stores ``x + delta`` at ``xo``
    for the columns below ``write``: K in one program, 0 in the others), or ``silu(gate) * up``."""
    dt = x_ptr.dtype.element_ty
    if PRO == 1:
        r = _residual(x_ptr, d_ptr, k, K, HAS_DELTA)
        if HAS_DELTA:
            tl.store(xo_ptr + k, r, mask=k < write)
        h = (r.to(tl.float32) * inv).to(dt).to(tl.float32)
        nw = tl.load(nw_ptr + k, mask=k < K, other=0.0).to(tl.float32)
        a = (nw * h).to(dt).to(tl.float32)
    elif PRO == 2:
        g = tl.load(x_ptr + k, mask=k < K, other=0.0).to(tl.float32)
        u = tl.load(x_ptr + K + k, mask=k < K, other=0.0).to(tl.float32)
        s = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
        a = (s * u).to(dt).to(tl.float32)
    else:
        a = tl.load(x_ptr + k, mask=k < K, other=0.0).to(tl.float32)
    return a


@triton.jit
def _gemv_kernel(w_ptr, x_ptr, b_ptr, out_ptr, d_ptr, nw_ptr, xo_ptr, N, K, eps,
                 HAS_BIAS: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                 PRO: tl.constexpr = 0, HAS_DELTA: tl.constexpr = False):
    pid = tl.program_id(0)
    n = pid * BN + tl.arange(0, BN)
    rows = w_ptr + n[:, None].to(tl.int64) * K
    inv = 1.0
    if PRO == 1:
        inv = _inv_rms(x_ptr, d_ptr, K, eps, HAS_DELTA, BK)
    acc = tl.zeros((BN, BK), dtype=tl.float32)
    for k0 in tl.range(0, K, BK, num_stages=4):
        k = k0 + tl.arange(0, BK)
        w = tl.load(rows + k[None, :], mask=(n[:, None] < N) & (k[None, :] < K), other=0.0)
        x = _act(x_ptr, d_ptr, nw_ptr, xo_ptr, k, K, inv, tl.where(pid == 0, K, 0), PRO,
                 HAS_DELTA)
        acc += w.to(tl.float32) * x[None, :]
    y = tl.sum(acc, 1)
    if HAS_BIAS:
        y += tl.load(b_ptr + n, mask=n < N, other=0.0).to(tl.float32)
    tl.store(out_ptr + n, y.to(out_ptr.dtype.element_ty), mask=n < N)


def tiles(n: int, k: int) -> tuple[int, int]:
    """(BN, BK) for an ``[n, k]`` weight: the probe's fastest of a few near-equal choices."""
    return (16, 256) if n <= 8192 and k <= 4096 else (16, 512)


def check_row(name: str, x: torch.Tensor, k: int) -> None:
    """``x`` is ``[1, k]`` with a unit last stride (ValueError naming ``name``)."""
    if x.dim() != 2 or x.shape[0] != 1 or x.shape[1] != k or x.stride(1) != 1:
        raise ValueError(f"{name} must be [1, {k}] with unit stride, got {tuple(x.shape)}")


def check_norm(x: torch.Tensor, delta: torch.Tensor | None, norm_w: torch.Tensor) -> None:
    """The norm prologue's operands: ``delta`` like ``x``, ``norm_w`` ``[K]`` contiguous."""
    k = x.shape[1]
    if delta is not None:
        check_row("delta", delta, k)
        if delta.dtype != x.dtype:
            raise ValueError(f"delta dtype {delta.dtype} differs from x's {x.dtype}")
    if norm_w.shape != (k,) or not norm_w.is_contiguous():
        raise ValueError(f"norm weight must be contiguous [{k}], got {tuple(norm_w.shape)}")


def _launch(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, pro: int,
            delta: torch.Tensor | None = None, norm_w: torch.Tensor | None = None,
            eps: float = 0.0, tile: tuple[int, int] | None = None) -> torch.Tensor | tuple:
    n, k = w.shape
    check_row("x", x, 2 * k if pro == PRO_SILU else k)
    if not w.is_contiguous() or (bias is not None and bias.shape != (n,)):
        raise ValueError("gemv: w must be contiguous [N, K] and bias [N]")
    out = torch.empty((1, n), dtype=x.dtype, device=x.device)
    xo = torch.empty_like(x) if delta is not None else x
    bn, bk = tile or tiles(n, k)
    launch = {} if checks.interpreting() else dict(num_warps=4)
    _gemv_kernel[(triton.cdiv(n, bn),)](
        w, x, bias if bias is not None else w, out, delta if delta is not None else x,
        norm_w if norm_w is not None else x, xo, n, k, eps, HAS_BIAS=bias is not None,
        BN=bn, BK=bk, PRO=pro, HAS_DELTA=delta is not None, **launch)
    return (out, xo) if pro == PRO_NORM else out


def gemv(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
         tile: tuple[int, int] | None = None) -> torch.Tensor:
    """``x`` ``[1, K]`` (unit stride), ``w`` ``[N, K]`` contiguous, ``bias`` ``[N]`` or None
    -> ``[1, N]`` in ``x``'s dtype: ``F.linear(x, w, bias)``."""
    out = _launch(x, w, bias, PRO_NONE, tile=tile)
    assert isinstance(out, torch.Tensor)
    return out


def norm_gemv(x: torch.Tensor, delta: torch.Tensor | None, norm_w: torch.Tensor, eps: float,
              w: torch.Tensor, bias: torch.Tensor | None = None,
              tile: tuple[int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(F.linear(h, w, bias), r)`` for ``(h, r) = ops.add_norm(x, delta, norm_w, eps)``, one
    launch: ``r`` is a new tensor (``x`` itself when ``delta`` is None)."""
    check_row("x", x, w.shape[1])
    check_norm(x, delta, norm_w)
    y, r = _launch(x, w, bias, PRO_NORM, delta, norm_w, eps, tile)
    return y, r


def silu_gemv(gate_up: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
              tile: tuple[int, int] | None = None) -> torch.Tensor:
    """``F.linear(silu(gate) * up, w, bias)`` for ``gate_up`` ``[1, 2K]`` (gate first), one
    launch."""
    out = _launch(gate_up, w, bias, PRO_SILU, tile=tile)
    assert isinstance(out, torch.Tensor)
    return out
