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
from disagg.model.rotary import rms_norm, rotate_half

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
    # q/k norm + rope and the KV append in one launch: the same q and cache as the three
    from disagg.kernels.reference import append_kv
    P, S = 3, 4
    slots = torch.tensor([5, -1, 0, 11, 6], dtype=torch.int64)  # -1: not stored
    for wq_, wk_ in ((wq, (1 + 0.1 * torch.randn(D)).to(dtype)), (None, None)):
        caches = [torch.randn(P, Hkv, S, D, dtype=dtype) for _ in range(2)]
        want = [c.clone() for c in caches]
        ref_k = fused.norm_rope(k, wk_, cos, sin, 1e-6)
        append_kv(ref_k, qkv[:, (H + Hkv) * D :].view(T, Hkv, D), want[0], want[1], slots)
        got = fused.qk_rope_append(qkv, wq_, wk_, cos, sin, 1e-6, caches[0], caches[1], slots, H)
        torch.testing.assert_close(got, fused.norm_rope(q, wq_, cos, sin, 1e-6), atol=0, rtol=0)
        torch.testing.assert_close(caches[0], want[0], atol=0, rtol=0)
        torch.testing.assert_close(caches[1], want[1], atol=0, rtol=0)
    # one row times a weight (batch-1 projections): F.linear, a bias, N and K off the tiles
    from disagg.kernels.gemv import gemv
    for n, k in ((40, 96), (7, 600)):
        wt = torch.randn(n, k, dtype=dtype) * 0.1
        bias = torch.randn(n, dtype=dtype)
        row = torch.randn(1, k, dtype=dtype)
        for b_ in (None, bias):
            want = F.linear(row.float(), wt.float(), None if b_ is None else b_.float())
            got = gemv(row, wt, b_)
            assert got.shape == (1, n) and got.dtype == dtype
            torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)
    gu = torch.randn(T, 2 * I, dtype=dtype)
    g, u = gu.chunk(2, dim=-1)
    torch.testing.assert_close(fused.silu_mul(gu), F.silu(g) * u, atol=tol, rtol=tol)
print("fused ok")
"""

# The whole fused layer path (q/k rope with the append, the MLP's residual add left to the next
# norm) against the torch path, on the same Triton attention, a prefill then a decode step.
MODEL_SCRIPT = r"""
import torch
from disagg.kernels.backends import TritonBackend
from disagg.kernels.interface import AttentionMetadata
from disagg.model import layer, ops
from disagg.model.config import ModelArch
from disagg.model.fp8 import Fp8Format
from disagg.model.loader import random_model

cfg = dict(architectures=["Qwen3ForCausalLM"], vocab_size=64, hidden_size=64, head_dim=16,
           intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
           num_key_value_heads=2, max_position_embeddings=64)
arch = ModelArch.from_hf_config(cfg)
i32 = torch.int32
steps = [  # (ids, positions, slots, seq_len, decodes)
    (torch.tensor([3, 9, 27, 1, 40, 8]), torch.arange(6), torch.arange(6), 6, 0),
    (torch.tensor([17]), torch.tensor([6]), torch.tensor([6]), 7, 1),
]
# plain weights, then block-FP8 weights kept FP8 (the decode row through the FP8 GEMVs with
# their norm / SiLU-mul prologues; more rows and the torch path dequantize)
for fp8 in (None, Fp8Format("fp8", (128, 128))):
    model = random_model(arch, "float32", seed=1, fp8=fp8, fp8_gemm=fp8 is not None)
    outs = {}
    for fuse in (False, True):
        ops.fused_on = layer.fused_on = (lambda x: True) if fuse else (lambda x: False)
        kv = torch.zeros(arch.num_layers, 2, 2, arch.num_kv_heads, 4, arch.head_dim)
        got = []
        for ids, pos, slots, n, nd in steps:
            t = ids.shape[0]
            meta = AttentionMetadata(slots, torch.tensor([[0, 1]], dtype=i32),
                                     torch.tensor([n], dtype=i32),
                                     torch.tensor([0, t], dtype=i32), nd, t, n)
            got.append(model(ids, pos, kv, meta, TritonBackend()))
        outs[fuse] = (got, kv)
    for a, b in zip(outs[False][0], outs[True][0]):
        torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(outs[True][1], outs[False][1], atol=1e-5, rtol=1e-5)
print("model ok")
"""


def _interpret(script: str) -> str:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_fused_kernels_match_torch_layer_ops():
    assert "fused ok" in _interpret(SCRIPT)


def test_fused_layer_path_matches_torch_path():
    assert "model ok" in _interpret(MODEL_SCRIPT)
