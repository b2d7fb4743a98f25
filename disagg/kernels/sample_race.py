"""The exponential race of seeded sampling, one launch for the batch.

Drawing token v with probability p_v is the race ``argmax_v p_v / E_v`` over independent
E_v ~ Exp(1) (what ``torch.multinomial`` runs for one sample), i.e. ``argmax_v x_v - log E_v``
for the row's (temperature-scaled, filtered) logits x, without a softmax. The noise is a
function of the row's key (``disagg.engine.sampling.draw_seed`` of the request's seed and the
output index) and v alone: a counter-based hash (murmur3's 32-bit finalizer, twice, over v and
the key's two halves; 24 bits make the uniform), so a row draws the same token alone or in any
batch, on the CPU (``race_torch``, torch ops) and on CUDA (``race``'s Triton kernel: one program
a row, which divides by the row's temperature itself) alike.

Top-k and top-p need no sort. Top-k is a floor per row (its k-th largest logit, which the
caller takes with ``torch.topk``: its ties stay). Top-p keeps a prefix of the row in its
stable descending order, so the race's winner over the row is the winner over what top-p
keeps whenever it is kept itself, and otherwise all that is kept lies before it. The kernel
races the row (above the floor) in one pass, then checks the winner in a second: kept if the
probability mass before it in that order (over what the floor keeps) is below ``top_p``. If
not, a third pass races the tokens before it, and the check repeats on that winner. A winner
is dropped with the mass top-p leaves out (1 - ``top_p``), so a row takes about 2 passes over
its logits. The CPU path masks with ``filter_batch`` (the sort, the reference) and races what
is left; the two agree up to the rounding of the mass at the cut. The hash runs in uint32 on
the device (int64 products cost several instructions each), and each lane keeps its own
running results until one reduction after the loop.

A row that is not a distribution one can draw from (a NaN or +inf logit, or no finite one:
nothing left after top-k/top-p) gets -1: the caller takes its greedy token instead
(``disagg.engine.sampling``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from disagg.kernels import checks

M32 = 0xFFFFFFFF
GOLDEN = 0x9E3779B9
C1, C2 = 0x85EBCA6B, 0xC2B2AE35
INV24 = 1.0 / (1 << 24)
BLOCK = 2048  # logits a program loads per loop step (bench/sampling_probe.py --sweep)
WARPS = 16


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


def filter_batch(logits: torch.Tensor, top_k: Sequence[int], top_p: Sequence[float]
                 ) -> torch.Tensor:
    """Mask (to -inf) what top-k and top-p exclude from each row of float32 ``logits [N, V]``,
    with its own ``top_k[i]`` (0: off) / ``top_p[i]`` (1: off), one sort for the batch (on the
    device, not waited for). Top-k keeps the values at least the k-th largest (its ties);
    top-p then drops a token once the mass before it (in a stable descending order, after
    top-k) reaches ``top_p``, so the top token always stays unless ``top_p`` <= 0."""
    n, vocab = logits.shape
    dev = logits.device
    ks = torch.tensor([k if 0 < k < vocab else vocab for k in top_k], dtype=torch.int64)
    ps = torch.tensor(list(top_p), dtype=torch.float32)
    ks, ps = ks.to(dev, non_blocking=True), ps.to(dev, non_blocking=True)
    ordered, order = torch.sort(logits, dim=-1, descending=True, stable=True)
    kth = ordered.gather(1, (ks - 1)[:, None])
    cut = ordered < kth  # top-k: below the k-th largest value (its ties stay)
    ordered = ordered.masked_fill(cut, float("-inf"))
    probs = torch.softmax(ordered, dim=-1)
    # top-p: a token goes when the mass before it already reaches top_p (the top one stays)
    drop = cut | (((torch.cumsum(probs, dim=-1) - probs) >= ps[:, None]) & (ps < 1.0)[:, None])
    return logits.masked_fill(torch.zeros_like(drop).scatter(1, order, drop), float("-inf"))


@triton.jit
def _fmix_u32(x):
    """fmix32 on uint32 (products wrap mod 2**32, as the torch path's masked int64 ones)."""
    x = x ^ (x >> 16)
    x = x * 0x85EBCA6B
    x = x ^ (x >> 13)
    x = x * 0xC2B2AE35
    return x ^ (x >> 16)


@triton.jit
def _score(x, v, k0, k1):
    """The row's logits ``x`` at token ids ``v`` (uint32) plus their Gumbel noise."""
    h = _fmix_u32(_fmix_u32((v * 0x9E3779B9) ^ k0) ^ k1)
    u = ((h >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
    return x - tl.log(-tl.log(u))


@triton.jit
def _first_max(best, idx):
    """The block's largest value and its smallest index (argmax's first-index rule)."""
    m = tl.max(best, axis=0)
    return m, tl.min(tl.where(best == m, idx, 0x7FFFFFFF), axis=0)


@triton.jit
def _dropped(base, vocab, temp, floor, top_p, m, w, BLOCK_V: tl.constexpr):
    """Top-p drops token ``w``: the mass before it (stable descending order, over what the
    floor keeps; ``m`` the kept logits' max) reaches ``top_p``."""
    lane = tl.arange(0, BLOCK_V)
    xw = tl.div_rn(tl.load(base + w), temp)
    z = tl.zeros([BLOCK_V], tl.float32)
    mass = tl.zeros([BLOCK_V], tl.float32)
    for v0 in range(0, vocab, BLOCK_V):
        v = v0 + lane
        inside = v < vocab
        x = tl.div_rn(tl.load(base + v, mask=inside, other=float("-inf")), temp)
        keep = inside & (x >= floor)
        e = tl.where(keep, tl.exp(x - m), 0.0)
        z += e
        mass += tl.where(keep & ((x > xw) | ((x == xw) & (v < w))), e, 0.0)
    return tl.sum(mass, axis=0) / tl.sum(z, axis=0) >= top_p


@triton.jit
def _race_before(base, vocab, temp, floor, k0, k1, w, BLOCK_V: tl.constexpr):
    """The race's winner among the kept tokens before ``w`` in stable descending order (-1:
    none)."""
    lane = tl.arange(0, BLOCK_V)
    xw = tl.div_rn(tl.load(base + w), temp)
    nb = tl.full([BLOCK_V], float("-inf"), tl.float32)
    nb_i = tl.zeros([BLOCK_V], tl.int32)
    for v0 in range(0, vocab, BLOCK_V):
        v = v0 + lane
        inside = v < vocab
        x = tl.div_rn(tl.load(base + v, mask=inside, other=float("-inf")), temp)
        before = inside & (x >= floor) & ((x > xw) | ((x == xw) & (v < w)))
        score = tl.where(before, _score(x, v.to(tl.uint32), k0, k1), float("-inf"))
        take = score > nb
        nb_i = tl.where(take, v, nb_i)
        nb = tl.where(take, score, nb)
    top, nxt = _first_max(nb, nb_i)
    return tl.where(top > float("-inf"), nxt, -1)


@triton.jit
def _race_kernel(x_ptr, t_ptr, keys_ptr, floor_ptr, p_ptr, out_ptr, vocab, stride_x,
                 BLOCK_V: tl.constexpr, CHECK: tl.constexpr):
    # each lane keeps its own running results over the row (no reduction inside the loops:
    # a block-wide max and argmax every step serialised the loads); one reduction at the end
    row = tl.program_id(0)
    key = tl.load(keys_ptr + row)
    k0 = (key & 0xFFFFFFFF).to(tl.uint32)
    k1 = ((key >> 32) & 0xFFFFFFFF).to(tl.uint32)
    temp = tl.load(t_ptr + row)
    floor = tl.load(floor_ptr + row)  # top-k: below it is out (-inf: none)
    top_p = tl.load(p_ptr + row)  # >= 1: off
    base = x_ptr + row.to(tl.int64) * stride_x
    lane = tl.arange(0, BLOCK_V)
    best = tl.full([BLOCK_V], float("-inf"), tl.float32)
    best_i = tl.zeros([BLOCK_V], tl.int32)
    bad = tl.zeros([BLOCK_V], tl.int32)
    finite = tl.zeros([BLOCK_V], tl.int32)
    mx = tl.full([BLOCK_V], float("-inf"), tl.float32)  # the kept logits' max
    for v0 in range(0, vocab, BLOCK_V):
        v = v0 + lane
        inside = v < vocab
        x = tl.div_rn(tl.load(base + v, mask=inside, other=float("-inf")), temp)
        keep = inside & (x >= floor)
        score = tl.where(keep, _score(x, v.to(tl.uint32), k0, k1), float("-inf"))
        bad |= ((x != x) | (x == float("inf"))).to(tl.int32)
        isfin = keep & (tl.abs(x) < float("inf"))
        finite |= isfin.to(tl.int32)
        take = score > best
        best_i = tl.where(take, v, best_i)
        best = tl.where(take, score, best)
        mx = tl.maximum(mx, tl.where(isfin, x, float("-inf")))
    top, w = _first_max(best, best_i)
    ok = (tl.max(bad, axis=0) == 0) & (tl.max(finite, axis=0) > 0) & (top > float("-inf"))
    w = tl.where(ok, w, -1)
    m = tl.max(mx, axis=0)
    if CHECK:  # some row has top-p (a compile of its own)
        if ok & (top_p < 1.0):  # is w kept by top-p: is the mass before it below top_p?
            dropped = _dropped(base, vocab, temp, floor, top_p, m, w, BLOCK_V)
            while dropped:  # all top-p keeps lies before w: race that, check its winner
                w = _race_before(base, vocab, temp, floor, k0, k1, w, BLOCK_V)
                dropped = (w >= 0) & _dropped(base, vocab, temp, floor, top_p, m,
                                              tl.maximum(w, 0), BLOCK_V)
    tl.store(out_ptr + row, w.to(tl.int64))


def race(x: torch.Tensor, keys: torch.Tensor, floor: torch.Tensor | None = None,
         top_p: torch.Tensor | None = None, temperature: torch.Tensor | None = None
         ) -> torch.Tensor:
    """``race_torch``'s tokens on ``x / temperature`` (float32 ``[N]``, default 1: the
    division is the kernel's, rounded as torch's) among what top-k and top-p keep, when given
    (``floor`` float32 ``[N]``: the row's k-th largest scaled logit, what is below it is out,
    -inf: no top-k; ``top_p`` float32 ``[N]``, >= 1: off; top-p's mass is over what the floor
    keeps): on CUDA one Triton program a row, elsewhere the sort (``filter_batch``) and torch
    ops."""
    if x.dim() != 2 or x.dtype != torch.float32 or x.stride(1) != 1:
        raise ValueError(f"x must be float32 [N, V] with unit stride, got {x.dtype} "
                         f"{tuple(x.shape)}")
    n, vocab = x.shape
    if keys.shape != (n,) or keys.dtype != torch.int64 or keys.device != x.device:
        raise ValueError(f"keys must be int64 [{n}] on {x.device}")
    for name, t in (("floor", floor), ("top_p", top_p), ("temperature", temperature)):
        if t is not None and (t.shape != (n,) or t.dtype != torch.float32
                              or t.device != x.device):
            raise ValueError(f"{name} must be float32 [{n}] on {x.device}")
    if not (x.is_cuda or checks.interpreting()):
        if temperature is not None:
            x = x / temperature[:, None]
        if floor is not None:
            x = x.masked_fill(x < floor[:, None], float("-inf"))
        if top_p is not None:
            x = filter_batch(x, [0] * n, top_p.tolist())
        return race_torch(x, keys)
    ones = None
    if temperature is None or top_p is None:
        ones = torch.ones(n, dtype=torch.float32, device=x.device)
    if floor is None:
        floor = torch.full((n,), float("-inf"), dtype=torch.float32, device=x.device)
    out = torch.empty(n, dtype=torch.int64, device=x.device)
    if n:
        launch = {} if checks.interpreting() else {"num_warps": WARPS}
        _race_kernel[(n,)](x, ones if temperature is None else temperature, keys, floor,
                           ones if top_p is None else top_p, out, vocab, x.stride(0),
                           BLOCK_V=BLOCK, CHECK=top_p is not None, **launch)
    return out
