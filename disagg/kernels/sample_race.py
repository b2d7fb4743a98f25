"""The exponential race of seeded sampling, one launch for the batch.

Drawing token v with probability p_v is the race ``argmax_v p_v / E_v`` over independent
E_v ~ Exp(1) (what ``torch.multinomial`` runs for one sample), i.e. ``argmax_v x_v - log E_v``
for the row's (temperature-scaled, filtered) logits x, without a softmax. The noise is a
function of the row's key (``disagg.engine.sampling.draw_seed`` of the request's seed and the
output index) and v alone: a counter-based hash (murmur3's 32-bit finalizer, twice, over v and
the key's two halves; 24 bits make the uniform), so a row draws the same token alone or in any
batch, on the CPU (``race_torch``, torch ops) and on CUDA (``race``'s Triton kernel: one program
a row reads its logits once) alike.

A row that is not a distribution one can draw from (a NaN or +inf logit, or no finite one:
nothing left after top-k/top-p) gets -1: the caller takes its greedy token instead
(``disagg.engine.sampling``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from disagg.kernels import checks

M32 = 0xFFFFFFFF
GOLDEN = 0x9E3779B9
C1, C2 = 0x85EBCA6B, 0xC2B2AE35
INV24 = 1.0 / (1 << 24)
BLOCK = 2048


def _fmix(x: torch.Tensor) -> torch.Tensor:
    """murmur3's fmix32 on int64 tensors holding 32-bit values (products wrap; low bits kept)."""
    x = x ^ (x >> 16)
    x = (x * C1) & M32
    x = x ^ (x >> 13)
    x = (x * C2) & M32
    return x ^ (x >> 16)


def noise_torch(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """``-log E`` (Gumbel) for every row key (int64 ``[N]``) and token: float32 ``[N, vocab]``."""
    k0 = (keys & M32)[:, None]
    k1 = ((keys >> 32) & M32)[:, None]
    v = torch.arange(vocab, dtype=torch.int64, device=keys.device)[None, :]
    h = _fmix(_fmix(((v * GOLDEN) & M32) ^ k0) ^ k1)
    u = ((h >> 8).to(torch.float32) + 0.5) * INV24
    return -torch.log(-torch.log(u))


def race_torch(x: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """The race on ``x`` (float32 ``[N, V]``) with torch ops: int64 ``[N]``, -1 for rows that
    cannot be drawn from."""
    tok = (x + noise_torch(keys, x.shape[1])).argmax(dim=-1)
    bad = (torch.isnan(x) | torch.isposinf(x)).any(dim=-1)
    ok = ~bad & torch.isfinite(x).any(dim=-1)
    return torch.where(ok, tok, torch.full_like(tok, -1))


@triton.jit
def _fmix_tl(x):
    x = x ^ (x >> 16)
    x = (x * 0x85EBCA6B) & 0xFFFFFFFF
    x = x ^ (x >> 13)
    x = (x * 0xC2B2AE35) & 0xFFFFFFFF
    return x ^ (x >> 16)


@triton.jit
def _race_kernel(x_ptr, keys_ptr, out_ptr, vocab, stride_x, BLOCK_V: tl.constexpr):
    row = tl.program_id(0)
    key = tl.load(keys_ptr + row)
    k0 = key & 0xFFFFFFFF
    k1 = (key >> 32) & 0xFFFFFFFF
    best = tl.full([], float("-inf"), tl.float32)
    best_i = tl.full([], 0, tl.int64)
    bad = tl.full([], 0, tl.int32)
    finite = tl.full([], 0, tl.int32)
    base = x_ptr + row.to(tl.int64) * stride_x
    for v0 in range(0, vocab, BLOCK_V):
        v = v0 + tl.arange(0, BLOCK_V)
        inside = v < vocab
        x = tl.load(base + v, mask=inside, other=float("-inf"))
        vv = v.to(tl.int64)
        h = _fmix_tl(_fmix_tl(((vv * 0x9E3779B9) & 0xFFFFFFFF) ^ k0) ^ k1)
        u = ((h >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
        score = x - tl.log(-tl.log(u))
        score = tl.where(inside, score, float("-inf"))
        bad = tl.maximum(bad, tl.max(((x != x) | (x == float("inf"))).to(tl.int32), axis=0))
        finite = tl.maximum(finite, tl.max(((x == x) & (tl.abs(x) < float("inf"))).to(tl.int32),
                                           axis=0))
        m = tl.max(score, axis=0)
        i = tl.argmax(score, axis=0).to(tl.int64) + v0
        take = m > best
        best_i = tl.where(take, i, best_i)
        best = tl.where(take, m, best)
    tl.store(out_ptr + row, tl.where((bad == 0) & (finite > 0), best_i, -1))


def race(x: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """``race_torch``'s tokens: on CUDA one Triton program a row, elsewhere torch ops."""
    if x.dim() != 2 or x.dtype != torch.float32 or x.stride(1) != 1:
        raise ValueError(f"x must be float32 [N, V] with unit stride, got {x.dtype} "
                         f"{tuple(x.shape)}")
    if keys.shape != (x.shape[0],) or keys.dtype != torch.int64 or keys.device != x.device:
        raise ValueError(f"keys must be int64 [{x.shape[0]}] on {x.device}")
    if not (x.is_cuda or checks.interpreting()):
        return race_torch(x, keys)
    out = torch.empty(x.shape[0], dtype=torch.int64, device=x.device)
    if x.shape[0]:
        launch = {} if checks.interpreting() else {"num_warps": 8}
        _race_kernel[(x.shape[0],)](x, keys, out, x.shape[1], x.stride(0), BLOCK_V=BLOCK,
                                    **launch)
    return out
