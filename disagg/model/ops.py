"""The layers' elementwise ops, each one fused Triton kernel on CUDA (``disagg.model.fused``)
and torch ops elsewhere, or everywhere with ``DISAGG_NO_FUSED=1`` (``FUSED``: benchmarks flip
it to compare)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from disagg.config import env
from disagg.kernels.fp8_weight import Fp8Weight
from disagg.model.rotary import rms_norm

FUSED = env("NO_FUSED") is None
# one-row GEMVs with the norm / SiLU-mul as their prologue (``norm_linear``, ``silu_linear``);
# ``DISAGG_GEMV_PROLOGUES=0`` / ``1`` turns them off / on
PROLOGUES = env("GEMV_PROLOGUES", "1") != "0"
# the FP8 GEMVs' prologues are off unless ``DISAGG_GEMV_FP8_PROLOGUES=1``: on an H100 the fused
# FP8 kernels took 97.6 us a layer against 75.3 us for norm / SiLU-mul and the plain FP8 GEMV
# (bench/gemv_probe.py; docs/BENCHMARKS.md): a prologue's re-reads cost more than the
# half-size weights leave to hide them behind
FP8_PROLOGUES = env("GEMV_FP8_PROLOGUES", "0") != "0"


def fused_on(x: torch.Tensor) -> bool:
    """Whether ``x``'s ops take the fused kernels."""
    return x.is_cuda and FUSED


def norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS norm of ``x [T, N]`` (unit stride along N) with weight ``w``."""
    if fused_on(x):
        from disagg.model import fused

        return fused.rms_norm(x, w, eps)[0]
    return rms_norm(x, w, eps)


def add_norm(x: torch.Tensor, add: torch.Tensor | None, w: torch.Tensor,
             eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(norm(x + add), x + add)`` (``add`` None: ``(norm(x), x)``): a residual add and the norm
    after it, one kernel on CUDA."""
    if add is None:
        return norm(x, w, eps), x
    if fused_on(x):
        from disagg.model import fused

        return fused.rms_norm(add, w, eps, residual=x)
    x = x + add
    return rms_norm(x, w, eps), x


def linear(x: torch.Tensor, w: torch.Tensor | Fp8Weight,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear``; one row on CUDA goes through the Triton GEMV (``disagg.kernels.gemv``),
    which reads the weights faster than cuBLAS does at one row. A block-FP8 weight
    (``Fp8Weight``, ``disagg.model.fp8_weights``) runs the FP8 kernels on CUDA
    (``disagg.kernels.fp8_gemm.fp8_matmul``) and is dequantized elsewhere (the reference)."""
    if isinstance(w, Fp8Weight):
        if x.is_cuda:
            from disagg.kernels.fp8_gemm import fp8_matmul

            return fp8_matmul(x, w, bias)
        return F.linear(x, w.dequantize(x.dtype), bias)
    if x.shape[0] == 1 and fused_on(x) and x.stride(1) == 1 and w.is_contiguous():
        from disagg.kernels.gemv import gemv

        return gemv(x, w, bias)
    return F.linear(x, w, bias)


def project(x: torch.Tensor, w: torch.Tensor | Fp8Weight,
            bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` for a plain weight (cuBLAS at every row count), ``linear``'s FP8 path for
    an ``Fp8Weight``: the MLA projections and shared experts, kept FP8 like the dense layers."""
    if isinstance(w, Fp8Weight):
        return linear(x, w, bias)
    return F.linear(x, w, bias)


def _one_row(x: torch.Tensor, w: torch.Tensor | Fp8Weight) -> bool:
    """Whether ``x @ w.T`` is a one-row projection the fused GEMVs take (CUDA, fused on)."""
    if not PROLOGUES or x.dim() != 2 or x.shape[0] != 1 or x.stride(1) != 1 or not fused_on(x):
        return False
    return FP8_PROLOGUES if isinstance(w, Fp8Weight) else w.is_contiguous()


def norm_linear(x: torch.Tensor, add: torch.Tensor | None, norm_w: torch.Tensor, eps: float,
                w: torch.Tensor | Fp8Weight, bias: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(linear(h, w, bias), x + add)`` for ``(h, x + add) = add_norm(x, add, norm_w, eps)``:
    at one row on CUDA the norm is the GEMV's prologue (``disagg.kernels.gemv.norm_gemv``,
    ``fp8_gemv.fp8_norm_gemv``), one launch for the two."""
    if _one_row(x, w) and (add is None or (add.shape == x.shape and add.dtype == x.dtype
                                           and add.stride(1) == 1)):
        if isinstance(w, Fp8Weight):
            from disagg.kernels.fp8_gemv import fp8_norm_gemv

            y, r = fp8_norm_gemv(x, add, norm_w, eps, w.q, w.scale_inv)
            return (y if bias is None else y + bias), r
        from disagg.kernels.gemv import norm_gemv

        return norm_gemv(x, add, norm_w, eps, w, bias)
    h, x = add_norm(x, add, norm_w, eps)
    return linear(h, w, bias), x


def silu_linear(gate_up: torch.Tensor, w: torch.Tensor | Fp8Weight) -> torch.Tensor:
    """``linear(silu_mul(gate_up), w)``: at one row on CUDA SiLU-mul is the GEMV's prologue
    (``disagg.kernels.gemv.silu_gemv``, ``fp8_gemv.fp8_silu_gemv``), one launch."""
    if _one_row(gate_up, w):
        if isinstance(w, Fp8Weight):
            from disagg.kernels.fp8_gemv import fp8_silu_gemv

            return fp8_silu_gemv(gate_up, w.q, w.scale_inv)
        from disagg.kernels.gemv import silu_gemv

        return silu_gemv(gate_up, w)
    return linear(silu_mul(gate_up), w)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``[T, 2I]`` -> ``silu(gate) * up`` ``[T, I]`` (the gated MLP's activation)."""
    if fused_on(gate_up):
        from disagg.model import fused

        return fused.silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
