"""The fused elementwise kernels (``disagg.model.fused``) against the torch layer, run by the
Triton interpreter on CPU in a subprocess (TRITON_INTERPRET must be set before Triton loads)."""

from __future__ import annotations

import os
import subprocess
import sys

SCRIPT = r"""
import torch
import torch.nn.functional as F
from disagg.model import fused
from disagg.model.transformer import rms_norm, rotate_half

torch.manual_seed(0)
for dtype in (torch.float32, torch.bfloat16):
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    T, H, Hkv, D, HID, I = 5, 4, 2, 32, 96, 80
    x = torch.randn(T, HID, dtype=dtype)
    r = torch.randn(T, HID, dtype=dtype)
    w = (1 + 0.1 * torch.randn(HID)).to(dtype)
    out, xo = fused.rms_norm(x, w, 1e-6)
    assert xo is x
    torch.testing.assert_close(out, rms_norm(x, w, 1e-6), atol=tol, rtol=tol)
    out, xo = fused.rms_norm(x, w, 1e-6, residual=r)
    torch.testing.assert_close(xo, x + r, atol=tol, rtol=tol)  # interpreter bf16 rounding
    torch.testing.assert_close(out, rms_norm(x + r, w, 1e-6), atol=tol, rtol=tol)
    qkv = torch.randn(T, (H + 2 * Hkv) * D, dtype=dtype)
    q = qkv[:, : H * D].view(T, H, D)
    k = qkv[:, H * D : (H + Hkv) * D].view(T, Hkv, D)
    wq = (1 + 0.1 * torch.randn(D)).to(dtype)
    ang = torch.rand(T, 1, D // 2) * 6
    cos = torch.cat([ang.cos(), ang.cos()], -1).to(dtype)
    sin = torch.cat([ang.sin(), ang.sin()], -1).to(dtype)
    for src, wn in ((q, wq), (k, None)):
        ref = src if wn is None else rms_norm(src, wn, 1e-6)
        ref = ref * cos + rotate_half(ref) * sin
        got = fused.norm_rope(src, wn, cos, sin, 1e-6)
        assert got.is_contiguous() and got.shape == src.shape
        torch.testing.assert_close(got, ref, atol=tol, rtol=tol)
    # MLA's rope parts: a strided [T, H, R] tail of each head's query, and the shared k_pe;
    # DeepSeek's interleaved pairs come out de-interleaved, as disagg.model.mla.rope does
    from disagg.model.mla import rope
    q_mla = torch.randn(T, H, 24 + D, dtype=dtype)
    for src in (q_mla[..., 24:], q_mla[:, :1, 24:]):
        for inter in (True, False):
            got = fused.norm_rope(src, None, cos, sin, 0.0, interleave=inter)
            torch.testing.assert_close(got, rope(src, cos, sin, inter), atol=tol, rtol=tol)
    gu = torch.randn(T, 2 * I, dtype=dtype)
    g, u = gu.chunk(2, dim=-1)
    torch.testing.assert_close(fused.silu_mul(gu), F.silu(g) * u, atol=tol, rtol=tol)
print("fused ok")
"""


def test_fused_kernels_match_torch_layer_ops():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True,
                          text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "fused ok" in proc.stdout
