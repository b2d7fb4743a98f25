"""One row times a block-FP8 weight, weight-only (W8A16): the batch-1 decode projections of an
FP8 checkpoint (Triton). Operands as ``disagg.kernels.fp8_gemm``'s: ``w_fp8 [N, K]``
``float8_e4m3fn`` and ``w_scale_inv [ceil(N/128), ceil(K/128)]`` float32.

Each program owns ``BN`` output features (``BN`` divides 128, so they share one row of weight
blocks) and walks K ``SUB`` 128-column blocks per step, their loads issued together: a GEMV at
one row is bound by the bytes in flight, not by the dequantization. Each block's weights are
upcast in registers (e4m3 -> fp16 two at a time on sm_90, then float32) and multiplied by the
row times the block's scale (``x * s``: 128 multiplies per block, against ``BN * 128`` FMAs);
float32 sums, one rounding to ``x``'s dtype. A decode step at batch 1 reads each weight once,
so what counts is the weight bytes (half bf16's); quantizing one row of activations would add
a launch and an error for nothing.

``SPLIT > 1`` (split-K, for projections whose grid is a few waves): program ``(i, j)`` sums the
``j``-th share of K's blocks, adds its partial sums into a float32 workspace with atomics, and
the last of the ``SPLIT`` to finish (a counter per output tile) rounds the total, stores it and
zeroes the workspace and its counter for the next call. The workspace (``_workspace``) is one
per device, N and stream, allocated outside graph capture; a split GEMV first launched while a
graph is captured runs unsplit; graphs replay one at a time on a stream.

The prologues of ``disagg.kernels.gemv`` (the residual add + RMSNorm before qkv and gate_up,
SiLU-mul before down) run here the same way: ``fp8_norm_gemv``, ``fp8_silu_gemv``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from disagg.kernels import checks
from disagg.kernels.fp8_weight import BLOCK as GROUP
from disagg.kernels.gemv import PRO_NONE, PRO_NORM, PRO_SILU, _act, _inv_rms, check_norm, check_row

FP8 = torch.float8_e4m3fn
IN_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def _fp8_gemv_kernel(w_ptr, s_ptr, x_ptr, out_ptr, d_ptr, nw_ptr, xo_ptr, ws_ptr, cnt_ptr,
                     N, K, stride_sn, eps, GROUP: tl.constexpr, BN: tl.constexpr,
                     SUB: tl.constexpr, STAGES: tl.constexpr, SPLIT: tl.constexpr = 1,
                     EVEN: tl.constexpr = False, PRO: tl.constexpr = 0,
                     HAS_DELTA: tl.constexpr = False):
    pid = tl.program_id(0)
    n = pid * BN + tl.arange(0, BN)
    k = tl.arange(0, GROUP)
    rows = w_ptr + (n % N).to(tl.int64)[:, None] * K
    s_row = s_ptr + ((pid * BN) // GROUP).to(tl.int64) * stride_sn
    blocks = tl.cdiv(K, GROUP)
    inv = 1.0
    if PRO == 1:
        inv = _inv_rms(x_ptr, d_ptr, K, eps, HAS_DELTA, GROUP * SUB)
    if SPLIT == 1:
        first = 0
        last = blocks
    else:  # this program's share of K's blocks, a whole number of steps
        share = tl.cdiv(tl.cdiv(blocks, SPLIT), SUB) * SUB
        first = tl.program_id(1) * share
        last = tl.minimum(first + share, blocks)
    write = tl.where(pid == 0, K, 0)  # the columns of x + delta this program stores
    acc = tl.zeros((BN, GROUP), dtype=tl.float32)
    for kb in tl.range(first, last, SUB, num_stages=STAGES):
        for j in tl.static_range(SUB):
            kk = (kb + j) * GROUP + k
            if EVEN:  # K a whole number of steps: no masks
                w = tl.load(rows + kk[None, :])
                s = tl.load(s_row + kb + j)
            else:
                w = tl.load(rows + kk[None, :], mask=kk[None, :] < K, other=0.0)
                s = tl.load(s_row + kb + j, mask=kb + j < blocks, other=0.0)
            x = _act(x_ptr, d_ptr, nw_ptr, xo_ptr, kk, K, inv, write, PRO, HAS_DELTA)
            acc += w.to(tl.float16).to(tl.float32) * (x * s)[None, :]
    y = tl.sum(acc, 1)
    if SPLIT == 1:
        tl.store(out_ptr + n, y.to(out_ptr.dtype.element_ty), mask=n < N)
    else:
        tl.atomic_add(ws_ptr + n, y, mask=n < N)
        tl.debug_barrier()  # every thread's adds before the counter's release
        if tl.atomic_add(cnt_ptr + pid, 1) == SPLIT - 1:  # the last share: round, reset
            total = tl.atomic_add(ws_ptr + n, tl.zeros_like(y), mask=n < N)  # read at L2
            tl.store(out_ptr + n, total.to(out_ptr.dtype.element_ty), mask=n < N)
            tl.store(ws_ptr + n, tl.zeros_like(y), mask=n < N)
            tl.store(cnt_ptr + pid, 0)


@dataclass(frozen=True)
class GemvTile:
    bn: int  # rows per program (divides 128)
    sub: int  # 128-column blocks per step
    warps: int
    stages: int
    split: int = 1  # programs sharing one output tile's K (split-K)


# on an H200 (bench/fp8_gemm.py, 2026-12-04) the best of 14 tiles for Qwen3-8B's qkv,
# gate_up and down, 4% off the best for o: 2.1-3.6 TB/s of weight reads. GEMV_TILES: per
# [N, K] the winner of bench/gemv_probe.py's sweep where it differs (empty until measured)
GEMV_TILE = GemvTile(16, 4, 2, 4)
GEMV_TILES: dict[tuple[int, int], GemvTile] = {}
INTERP_GEMV_TILE = GemvTile(16, 2, 1, 1)


def gemv_tile(n: int, k: int) -> GemvTile:
    """The GEMV tile for an ``[n, k]`` weight."""
    return INTERP_GEMV_TILE if checks.interpreting() else GEMV_TILES.get((n, k), GEMV_TILE)


_workspaces: dict[tuple[torch.device, int, int], tuple[torch.Tensor, torch.Tensor]] = {}


def _workspace(device: torch.device, n: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(float32 ``[n]`` partial sums, int32 ``[n]`` counters), zeroed, for split-K over an
    N of ``n`` on the current stream (the kernel leaves them zero; streams never share one, so
    the parallel warm-up's streams do not race); None while a graph is captured and none
    exists (the engine's capture runs the step eagerly on its stream first)."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (device, n, stream)
    if key not in _workspaces:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        _workspaces[key] = (torch.zeros(n, dtype=torch.float32, device=device),
                            torch.zeros(n, dtype=torch.int32, device=device))
    return _workspaces[key]


def _check(x: torch.Tensor, w_fp8: torch.Tensor, w_scale_inv: torch.Tensor, k_row: int) -> None:
    if x.dtype not in IN_DTYPES:
        raise ValueError(f"x must be one of {IN_DTYPES}, got {x.dtype}")
    if w_fp8.dim() != 2 or w_fp8.dtype != FP8 or w_fp8.stride(1) != 1 or \
            w_fp8.stride(0) != w_fp8.shape[1]:
        raise ValueError(f"w_fp8 must be a contiguous 2-d {FP8} tensor, got "
                         f"{tuple(w_fp8.shape)} {w_fp8.dtype}")
    n, k = w_fp8.shape
    check_row("x", x, k_row)
    want = (-(-n // GROUP), -(-k // GROUP))
    if tuple(w_scale_inv.shape) != want or w_scale_inv.stride(1) != 1 or \
            w_scale_inv.dtype != torch.float32:
        raise ValueError(f"w_scale_inv must be float32 {list(want)} with a unit last stride, "
                         f"got {tuple(w_scale_inv.shape)} {w_scale_inv.dtype}")


def _launch(x: torch.Tensor, w_fp8: torch.Tensor, w_scale_inv: torch.Tensor, pro: int,
            tile: GemvTile | None, delta: torch.Tensor | None = None,
            norm_w: torch.Tensor | None = None, eps: float = 0.0
            ) -> tuple[torch.Tensor, torch.Tensor]:
    n, k = w_fp8.shape
    _check(x, w_fp8, w_scale_inv, 2 * k if pro == PRO_SILU else k)
    out = torch.empty((1, n), dtype=x.dtype, device=x.device)
    xo = torch.empty_like(x) if delta is not None else x
    if n == 0:
        return out, xo
    t = tile or gemv_tile(n, k)
    if GROUP % t.bn:
        raise ValueError(f"fp8_gemv: rows per program must divide {GROUP}, got {t.bn}")
    ws = _workspace(x.device, n) if t.split > 1 else None
    split = t.split if ws is not None else 1
    ws_t, cnt = ws if ws is not None else (out, out)
    launch = {} if checks.interpreting() else dict(num_warps=t.warps)
    _fp8_gemv_kernel[(triton.cdiv(n, t.bn), split)](
        w_fp8, w_scale_inv, x, out, delta if delta is not None else x,
        norm_w if norm_w is not None else x, xo, ws_t, cnt, n, k, w_scale_inv.stride(0), eps,
        GROUP=GROUP, BN=t.bn, SUB=t.sub, STAGES=t.stages, SPLIT=split,
        EVEN=k % (GROUP * t.sub) == 0, PRO=pro, HAS_DELTA=delta is not None, **launch)
    return out, xo


def fp8_gemv(x: torch.Tensor, w_fp8: torch.Tensor, w_scale_inv: torch.Tensor,
             tile: GemvTile | None = None) -> torch.Tensor:
    """One row ``x [1, K]`` (bf16 / fp16 / float32, unit stride) times a block-FP8 weight
    -> ``[1, N]`` in ``x``'s dtype (module docstring); ``tile`` overrides ``gemv_tile``."""
    return _launch(x, w_fp8, w_scale_inv, PRO_NONE, tile)[0]


def fp8_norm_gemv(x: torch.Tensor, delta: torch.Tensor | None, norm_w: torch.Tensor,
                  eps: float, w_fp8: torch.Tensor, w_scale_inv: torch.Tensor,
                  tile: GemvTile | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(fp8_gemv(h, ...), r)`` for ``(h, r) = ops.add_norm(x, delta, norm_w, eps)``, one
    launch: ``r`` is a new tensor (``x`` itself when ``delta`` is None)."""
    check_row("x", x, w_fp8.shape[-1])
    check_norm(x, delta, norm_w)
    return _launch(x, w_fp8, w_scale_inv, PRO_NORM, tile, delta, norm_w, eps)


def fp8_silu_gemv(gate_up: torch.Tensor, w_fp8: torch.Tensor, w_scale_inv: torch.Tensor,
                  tile: GemvTile | None = None) -> torch.Tensor:
    """``fp8_gemv(silu(gate) * up, ...)`` for ``gate_up`` ``[1, 2K]`` (gate first), one
    launch."""
    return _launch(gate_up, w_fp8, w_scale_inv, PRO_SILU, tile)[0]
