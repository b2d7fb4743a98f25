"""Block-FP8 linear cases for the Triton kernels (``disagg.kernels.fp8_gemm``), run by
``test_fp8_gemm`` in a TRITON_INTERPRET=1 subprocess, and on a GPU by its CUDA tests.

Each case returns an error: ``quant`` the fraction of FP8 bytes that differ from the torch
reference's (inf if any scale differs; the interpreter's own cast error is set aside, see
there), ``gemm`` / ``linear`` the relative L2 error against the torch reference over the same
FP8 operands and scales."""

from __future__ import annotations

from typing import Any

F32_TOL = 1e-5  # float32 outputs: the same products summed in another order
HALF_TOL = 8e-3  # bf16 / fp16 outputs: each rounded once (bf16: <= 2^-9 relative, ~2e-3 RMS)

# (M, N, K): edge rows across tiles, N and K off the 128 blocks, a partial last group
GEMM_SHAPES = ((1, 128, 128), (3, 200, 300), (17, 256, 256), (40, 130, 129))
QUANT_SHAPES = ((1, 128), (3, 300), (17, 256))


def all_cases() -> list[str]:
    ids = [f"quant-{dt}-{m}x{k}" for dt in ("float32", "bfloat16") for m, k in QUANT_SHAPES]
    ids.append("quant-bfloat16-zeros")
    ids.append("quant-colmajor-17x300")  # the scales cuBLAS reads: the same values, transposed
    ids += [f"gemm-float32-{m}x{n}x{k}" for m, n, k in GEMM_SHAPES]
    ids += ["gemm-bfloat16-17x256x256", "gemm-float16-3x200x300", "gemm-tile-40x130x129"]
    # the quantize + GEMM wiring, an x of three dims
    ids += ["linear-bfloat16-3x200x300", "linear-float32-2x5x256x256"]
    # one row, weight-only (disagg.kernels.fp8_gemv): N off the programs' rows, K off the blocks
    ids += ["gemv-float32-1x200x300", "gemv-bfloat16-1x256x384", "gemv-float16-1x130x129"]
    # fp8_matmul with a bias: one row (the GEMV) and more (quantize + GEMM)
    ids += ["matmul-float32-1x200x300", "matmul-float32-3x200x300"]
    return ids


def bound(cid: str) -> float:
    """The largest error a case may return (0 for the quantizer's bytes)."""
    kind, dt, _ = cid.split("-")
    if kind == "quant":
        return 0.0
    return HALF_TOL if dt in ("bfloat16", "float16") else F32_TOL


def rel(out: Any, ref: Any) -> float:
    import torch

    if not torch.isfinite(out.float()).all():
        return float("inf")
    diff = (out.double() - ref.double()).norm()
    return float(diff / ref.double().norm().clamp_min(1e-30))


def operands(m: int, n: int, k: int, dtype: Any, device: str, seed: int = 0) -> tuple:
    """Activations ``x [m, k]`` (a few outliers, so the groups' scales differ) and a block-FP8
    weight ``[n, k]`` with its ``weight_scale_inv``, quantized by the checkpoint quantizer."""
    import torch

    from disagg.model.fp8 import quantize_blocks

    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen) * (1 + 4 * torch.rand(m, 1, generator=gen))
    x[0, -1] = 40.0
    w = torch.randn(n, k, generator=gen) * 0.02 * (1 + torch.rand(n, 1, generator=gen))
    wq, ws = quantize_blocks(w, (128, 128))
    return x.to(device, dtype), wq.to(device), ws.to(device)


def byte_mismatch(got: Any, want: Any, exact: Any, device: str) -> float:
    """The fraction of FP8 bytes of ``got`` that differ from ``want`` (``exact``: the float32
    values both rounded). The interpreter's float -> e4m3 cast drops the carry when rounding up
    crosses a power of two (1.97 -> 1.0, not 2.0) and rounds exact ties away from zero (84 ->
    88, not to even 80); a GPU rounds both right: on the CPU those bytes are its, not ours."""
    import torch

    same = got.view(torch.uint8) == want.view(torch.uint8)
    g, w = got.double(), want.double()
    mant, _ = torch.frexp(w)
    carry = (mant.abs() == 0.5) & (g * 2 == w)
    tie = (g + w) / 2 == exact.double()
    return float((~same & ~((carry | tie) & (device == "cpu"))).float().mean())


def run_case(cid: str, device: str = "cpu") -> float:
    import torch

    from disagg.kernels import fp8_gemm, reference
    from disagg.kernels.fp8_gemv import fp8_gemv

    kind, dt, shape = cid.split("-")
    dtype = torch.float32 if dt in ("tile", "colmajor") else getattr(torch, dt)
    if kind == "quant":
        m, k = (5, 300) if shape == "zeros" else map(int, shape.split("x"))
        x, _, _ = operands(m, 128, k, dtype, device)
        if shape == "zeros":
            x[1] = 0.0
            x[2, 128:256] = 0.0
        q, s = fp8_gemm.quantize_groups(x, column_major_scales=dt == "colmajor")
        if dt == "colmajor" and s.stride() != (1, m):
            return float("inf")
        rq, rs = reference.quantize_groups(x)
        if s.shape != rs.shape or not torch.equal(s, rs):
            return float("inf")
        exact = x.float() / rs.repeat_interleave(128, dim=1)[:, :k]
        return byte_mismatch(q, rq, exact, device)
    *lead, n, k = map(int, shape.split("x"))
    m = lead[-1] * (lead[0] if len(lead) == 2 else 1)
    if kind == "linear":  # against the kernel's own bytes: the quant cases check those
        x, wq, ws = operands(m, n, k, dtype, device)
        out = fp8_gemm.fp8_linear(x.view(*lead, k), wq, ws)
        if tuple(out.shape) != (*lead, n) or out.dtype != dtype:
            return float("inf")
        q, s = fp8_gemm.quantize_groups(x)
        return rel(out.view(m, n), reference.fp8_block_matmul(q, s, wq, ws, torch.float32))
    if kind == "gemv":  # weight-only: x unquantized against the dequantized weight
        x, wq, ws = operands(m, n, k, dtype, device)
        out = fp8_gemv(x, wq, ws)
        if tuple(out.shape) != (1, n) or out.dtype != dtype:
            return float("inf")
        return rel(out, x.float() @ reference.dequantize_weight(wq, ws).T)
    if kind == "matmul":
        from disagg.kernels.fp8_weight import Fp8Weight

        x, wq, ws = operands(m, n, k, dtype, device)
        bias = torch.linspace(-1, 1, n, device=device, dtype=dtype)
        out = fp8_gemm.fp8_matmul(x, Fp8Weight(wq, ws), bias)
        if m == 1:
            want = x.float() @ reference.dequantize_weight(wq, ws).T
        else:  # against the kernel's own bytes, as "linear"
            q, s = fp8_gemm.quantize_groups(x)
            want = reference.fp8_block_matmul(q, s, wq, ws, torch.float32)
        return rel(out, want + bias.float())
    # gemm: float32 activations quantized by the reference; ``dt`` is the output's dtype
    x, wq, ws = operands(m, n, k, torch.float32, device)
    q, s = reference.quantize_groups(x)
    tile = fp8_gemm.Fp8Tile(16, 32, 2, 4, 3) if dt == "tile" else None
    out = fp8_gemm.fp8_block_matmul(q, s, wq, ws, dtype, tile)
    return rel(out, reference.fp8_block_matmul(q, s, wq, ws, torch.float32))


if __name__ == "__main__":
    from interp import serve

    serve(run_case)
