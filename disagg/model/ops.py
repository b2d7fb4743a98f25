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


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``[T, 2I]`` -> ``silu(gate) * up`` ``[T, I]`` (the gated MLP's activation)."""
    if fused_on(gate_up):
        from disagg.model import fused

        return fused.silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
