"""One-row GEMV cases (``disagg.kernels.gemv`` bf16 and ``disagg.kernels.fp8_gemv`` block-FP8,
plain and with their prologues), run by ``test_gemv`` in a TRITON_INTERPRET=1 subprocess and
on a GPU by its CUDA tests.

A case id is ``{weights}-{prologue}-{dtype}-{N}x{K}[-s{split}]``: weights ``bf``
(``w`` in the row's dtype) or ``fp8`` (block FP8, split-K ``split`` ways); prologue ``plain``,
``norm`` (RMSNorm of ``x``), ``addnorm`` (of ``x + delta``, the new residual returned) or
``silu`` (``silu(gate) * up`` of a ``[1, 2K]`` row). Each returns the relative L2 error of the
output against the torch layer ops it replaces (``F.linear`` of ``ops.add_norm``'s or
``F.silu(g) * u``'s output), over the same weights (FP8: dequantized); ``inf`` if the residual
the kernel returns is not ``x + delta`` as torch rounds it (float32 exactly; bf16 / fp16 within
one rounding: the interpreter's casts to them do not round to nearest even)."""

from __future__ import annotations

from typing import Any

F32_TOL = 1e-5
HALF_TOL = 8e-3  # compiled: the output's rounding (~2e-3 RMS) and an ulp of a few h
INTERP_HALF_TOL = 2e-2  # the interpreter's bf16 / fp16 casts truncate (as in test_fused.py)
EPS = 1e-6

# N off the programs' rows and K off the 128-blocks and the steps; K of 512: whole steps
SHAPES = ((200, 300), (256, 512), (130, 129))


def all_cases() -> list[str]:
    ids = []
    for pro in ("plain", "norm", "addnorm", "silu"):
        ids += [f"bf-{pro}-float32-{n}x{k}" for n, k in SHAPES]
        ids.append(f"bf-{pro}-bfloat16-200x300")
        ids += [f"fp8-{pro}-float32-{n}x{k}" for n, k in SHAPES]
        ids.append(f"fp8-{pro}-bfloat16-256x512")
        ids += [f"fp8-{pro}-float32-200x300-s3", f"fp8-{pro}-float32-256x512-s2"]
    return ids


def bound(cid: str, device: str = "cpu") -> float:
    if cid.split("-")[2] == "float32":
        return F32_TOL
    return INTERP_HALF_TOL if device == "cpu" else HALF_TOL


def rel(out: Any, ref: Any) -> float:
    import torch

    if not torch.isfinite(out.float()).all():
        return float("inf")
    return float((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30))


def operands(n: int, k: int, dtype: Any, device: str, fp8: bool, seed: int = 0) -> dict:
    """A row ``x``, a residual-stream delta, a norm weight, a ``[1, 2k]`` gate_up row and a
    weight (``w``: as the model holds it; ``w_ref``: float32, dequantized for FP8)."""
    import torch

    from disagg.kernels.reference import dequantize_weight
    from disagg.model.fp8 import quantize_blocks

    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(1, k, generator=gen) * 2
    delta = torch.randn(1, k, generator=gen)
    norm_w = 1 + 0.1 * torch.randn(k, generator=gen)
    gate_up = torch.randn(1, 2 * k, generator=gen) * 2
    w = torch.randn(n, k, generator=gen) * 0.05 * (1 + torch.rand(n, 1, generator=gen))
    out = {name: t.to(device, dtype) for name, t in
           (("x", x), ("delta", delta), ("norm_w", norm_w), ("gate_up", gate_up))}
    if fp8:
        wq, ws = quantize_blocks(w, (128, 128))
        out.update(wq=wq.to(device), ws=ws.to(device))
        out["w_ref"] = dequantize_weight(out["wq"], out["ws"]).float()
    else:
        out["w"] = w.to(device, dtype)
        out["w_ref"] = out["w"].float()
    return out


def reference(pro: str, ops: dict) -> tuple[Any, Any]:
    """(float32 output, the residual ``x + delta`` in the row's dtype or None): the torch ops."""
    import torch.nn.functional as F

    from disagg.model.rotary import rms_norm

    x, r = ops["x"], None
    if pro in ("norm", "addnorm"):
        if pro == "addnorm":
            r = x + ops["delta"]
        x = rms_norm(r if r is not None else x, ops["norm_w"], EPS)
    elif pro == "silu":
        g, u = ops["gate_up"].chunk(2, dim=-1)
        x = F.silu(g) * u
    return F.linear(x.float(), ops["w_ref"]), r


def run_kernel(weights: str, pro: str, ops: dict, split: int = 1) -> tuple[Any, Any]:
    """(the kernel's output, its residual or None)."""
    from disagg.kernels import fp8_gemv, gemv

    delta = ops["delta"] if pro == "addnorm" else None
    if weights == "bf":
        w = ops["w"]
        if pro == "plain":
            return gemv.gemv(ops["x"], w), None
        if pro == "silu":
            return gemv.silu_gemv(ops["gate_up"], w), None
        y, r = gemv.norm_gemv(ops["x"], delta, ops["norm_w"], EPS, w)
        return y, r if delta is not None else None
    wq, ws = ops["wq"], ops["ws"]
    tile = None
    if split > 1:
        t = fp8_gemv.gemv_tile(*wq.shape)
        tile = fp8_gemv.GemvTile(t.bn, t.sub, t.warps, t.stages, split)
    if pro == "plain":
        return fp8_gemv.fp8_gemv(ops["x"], wq, ws, tile), None
    if pro == "silu":
        return fp8_gemv.fp8_silu_gemv(ops["gate_up"], wq, ws, tile), None
    y, r = fp8_gemv.fp8_norm_gemv(ops["x"], delta, ops["norm_w"], EPS, wq, ws, tile)
    return y, r if delta is not None else None


def residual_ok(got: Any, want: Any, device: str) -> bool:
    import torch

    if want is None:
        return got is None
    if got is None or got.shape != want.shape or got.dtype != want.dtype:
        return False
    if want.dtype == torch.float32 or device != "cpu":
        return torch.equal(got, want)
    return bool(((got.float() - want.float()).abs() <= want.float().abs() * 2**-7).all())


def run_case(cid: str, device: str = "cpu") -> float:
    import torch

    weights, pro, dt, shape, *rest = cid.split("-")
    n, k = map(int, shape.split("x"))
    split = int(rest[0][1:]) if rest else 1
    ops = operands(n, k, getattr(torch, dt), device, weights == "fp8")
    x_before = ops["x"].clone()
    out, r = run_kernel(weights, pro, ops, split)
    ref, r_ref = reference(pro, ops)
    if tuple(out.shape) != (1, n) or out.dtype != ops["x"].dtype:
        return float("inf")
    if not residual_ok(r, r_ref, device) or not torch.equal(ops["x"], x_before):
        return float("inf")
    if split > 1:  # the workspace is left zeroed: a second call gives the same bytes
        again, _ = run_kernel(weights, pro, ops, split)
        if not torch.equal(again, out):
            return float("inf")
    return rel(out, ref)


if __name__ == "__main__":
    from interp import serve

    serve(run_case)
