"""Fused mixture-of-experts experts (Triton): align the routed pairs by expert, two grouped GEMMs.

Shapes: ``x [T, H]``; routing ``weights``/``experts [T, k]`` (pair ``p`` is token ``p // k``,
slot ``p % k``); ``gate_up [E, 2I, H]`` (rows ``0:I`` gate, ``I:2I`` up); ``down [E, H, I]``.

1. **Align** (``align``): the ``T*k`` pairs are sorted stably by expert into blocks of
   ``BLOCK_M`` rows, each block one expert's, its tail padded with the sentinel ``T*k``:
   ``sorted_ids [cap]`` (int32), ``expert_ids [cap / BLOCK_M]`` (int32) and ``num_post [1]``
   (int32, rows in use, a multiple of ``BLOCK_M``; blocks past it hold garbage and are skipped).
   ``cap`` is the static bound ``T*k + min(E, T*k) * (BLOCK_M - 1)`` rounded up to ``BLOCK_M``.
   Two small kernels with one program per expert: count its pairs, then place them (its offset
   is the padded prefix sum of the counts, its in-order ranks a running ``tl.cumsum``).
2. **gate_up GEMM**: per block, ``act[p] = silu(x[p // k] @ Wg_e^T) * (x[p // k] @ Wu_e^T)``
   with both weight tiles loaded in one K loop (the SiLU-and-multiply is the epilogue):
   ``act [T*k, I]``.
3. **down GEMM**: ``y[p] = weights[p] * act[p] @ Wd_e^T`` (fp32 epilogue), ``y [T, k, H]``,
   then ``y.sum(1)``: deterministic, no atomics.

Every launch is sized from ``T`` alone and reads ``num_post`` on the device: no host sync, so a
forward can be captured in a CUDA graph. Ints that vary with ``T`` are not specialised on, so
the compiled variants depend only on the tile config, chosen by ``tile_config`` from ``T``; a
warm-up over ``config_tokens`` compiles them all.

Reference: ``disagg.model.moe.experts_loop`` (the torch loop).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from disagg.kernels import checks
from disagg.kernels.fp8_weight import Fp8Weight

MOE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class GemmTile:
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int


@dataclass(frozen=True)
class MoETiles:
    """One launch's tiles: ``block_m`` rows per aligned block (shared by both GEMMs), each GEMM's
    own N/K tiles (the gate_up tile is ``block_n`` columns of gate *and* of up), and the chunk
    of pairs the alignment kernels scan at a time."""

    block_m: int
    up: GemmTile
    down: GemmTile
    align_block: int = 1024


# (largest average rows per expert, T*k/E, for which the entry applies; tiles). Chosen on an H200
# with ``bench/moe_kernel.py --sweep`` (coordinate descent over block_m, then each GEMM's tile)
# at Qwen3-30B-A3B and DeepSeek-V2-Lite layer shapes, T = 1, 64, 256, 2048, 8192. Decode (one
# or two 16-row blocks per hit expert) is bound by reading each hit expert's weights once:
# narrow N tiles give enough programs, every tile tried was within ~3% of the best, and both
# GEMMs ran at the copy roofline (T=1: gate_up 12.1 us, down 5.7 us). Past ~12 rows per expert
# 32-row blocks read each expert's weights once instead of twice. Prefill is compute-bound and
# wants 64-row blocks at T=2048 and 128-row ones with wide 8-warp tiles at T=8192 (there the
# 128x(2x128) gate_up and 128x256 down tiles took 1.53 ms against 1.87 ms for 128x(2x64) and
# 128x128; 55% of a cuBLAS 8192^3 matmul's rate in active FLOPs, routing included).
TILE_TABLE: tuple[tuple[float, MoETiles], ...] = (
    (12, MoETiles(16, GemmTile(32, 128, 1, 4, 4), GemmTile(64, 128, 1, 4, 3))),
    (48, MoETiles(32, GemmTile(64, 128, 1, 4, 3), GemmTile(128, 128, 1, 4, 3))),
    (192, MoETiles(64, GemmTile(64, 64, 8, 4, 4), GemmTile(128, 64, 8, 4, 4), 4096)),
    (float("inf"), MoETiles(128, GemmTile(128, 64, 8, 8, 3), GemmTile(256, 64, 8, 8, 3), 4096)),
)
# under TRITON_INTERPRET=1 (CPU tests): tiny tiles, so that the interpreter stays fast
INTERP_TILES = MoETiles(16, GemmTile(16, 16, 2, 1, 1), GemmTile(16, 16, 2, 1, 1), 64)


def tile_config(tokens: int, top_k: int, num_experts: int) -> MoETiles:
    """The tiles for ``tokens`` rows: deterministic from ``T`` (for a given model)."""
    if checks.interpreting():
        return INTERP_TILES
    rows = tokens * top_k / num_experts
    return next(tiles for bound, tiles in TILE_TABLE if rows <= bound)


def config_tokens(top_k: int, num_experts: int, max_tokens: int) -> list[int]:
    """The smallest ``T`` (up to ``max_tokens``) of each distinct ``tile_config``: one forward
    at each compiles every kernel variant ``T <= max_tokens`` can launch."""
    out: list[int] = []
    seen: list[MoETiles] = []
    bounds = [0.0] + [bound for bound, _ in TILE_TABLE[:-1]]
    for bound in bounds:
        t = max(1, int(bound * num_experts // top_k) + 1)
        tiles = tile_config(t, top_k, num_experts)
        if t <= max_tokens and tiles not in seen:
            seen.append(tiles)
            out.append(t)
    return out


def align_capacity(pairs: int, num_experts: int, block_m: int) -> int:
    """Rows of ``sorted_ids``: every pair plus at most ``block_m - 1`` padding per hit expert."""
    cap = pairs + min(num_experts, pairs) * (block_m - 1)
    return triton.cdiv(cap, block_m) * block_m


@triton.jit(do_not_specialize=["num_pairs"])
def _count_kernel(experts_ptr, counts_ptr, num_pairs, BLOCK: tl.constexpr):
    e = tl.program_id(0)
    hits = tl.zeros([BLOCK], tl.int32)
    for start in range(0, num_pairs, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        ids = tl.load(experts_ptr + offs, mask=offs < num_pairs, other=-1)
        hits += (ids == e).to(tl.int32)
    tl.store(counts_ptr + e, tl.sum(hits, 0))


@triton.jit(do_not_specialize=["num_pairs"])
def _place_kernel(
    experts_ptr, counts_ptr, sorted_ids_ptr, expert_ids_ptr, num_post_ptr, num_pairs,
    NUM_EXPERTS: tl.constexpr, E_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    e = tl.program_id(0)
    es = tl.arange(0, E_PAD)
    counts = tl.load(counts_ptr + es, mask=es < NUM_EXPERTS, other=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    end = tl.sum(tl.where(es <= e, padded, 0), 0)
    count = tl.sum(tl.where(es == e, counts, 0), 0)
    start = end - (count + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    if e == 0:
        tl.store(num_post_ptr, tl.sum(padded, 0))
    # this expert's blocks, and the sentinel in its last block's tail
    for b0 in range(start // BLOCK_M, end // BLOCK_M, BLOCK):
        b = b0 + tl.arange(0, BLOCK)
        tl.store(expert_ids_ptr + b, tl.zeros([BLOCK], tl.int32) + e, mask=b < end // BLOCK_M)
    tail = start + count + tl.arange(0, BLOCK_M)
    tl.store(sorted_ids_ptr + tail, tl.zeros([BLOCK_M], tl.int32) + num_pairs, mask=tail < end)
    # its pairs in order: rank = running count + inclusive cumsum within the chunk
    pos = start
    for s0 in range(0, num_pairs, BLOCK):
        offs = s0 + tl.arange(0, BLOCK)
        hit = (tl.load(experts_ptr + offs, mask=offs < num_pairs, other=-1) == e).to(tl.int32)
        rank = tl.cumsum(hit, 0)
        tl.store(sorted_ids_ptr + pos + rank - 1, offs, mask=hit > 0)
        pos += tl.sum(hit, 0)


def align(
    experts: torch.Tensor, num_experts: int, block_m: int, block: int = 1024
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``experts [T, k]`` -> ``(sorted_ids [cap], expert_ids [cap / block_m], num_post [1])``,
    all int32 on the device (module docstring); no host sync."""
    if experts.dim() != 2 or experts.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"experts must be [T, k] int32/int64, got {tuple(experts.shape)} "
                         f"{experts.dtype}")
    flat = experts.reshape(-1)  # topk output: contiguous, so a view
    pairs = flat.numel()
    cap = align_capacity(pairs, num_experts, block_m)
    dev = experts.device
    sorted_ids = torch.empty(cap, dtype=torch.int32, device=dev)
    expert_ids = torch.empty(cap // block_m, dtype=torch.int32, device=dev)
    num_post = torch.empty(1, dtype=torch.int32, device=dev)  # the place kernel writes it
    if pairs == 0:
        return sorted_ids, expert_ids, num_post.zero_()
    counts = torch.empty(num_experts, dtype=torch.int32, device=dev)
    launch = {} if checks.interpreting() else dict(num_warps=4)
    _count_kernel[(num_experts,)](flat, counts, pairs, BLOCK=block, **launch)
    _place_kernel[(num_experts,)](
        flat, counts, sorted_ids, expert_ids, num_post, pairs, NUM_EXPERTS=num_experts,
        E_PAD=triton.next_power_of_2(num_experts), BLOCK_M=block_m, BLOCK=block, **launch,
    )  # fmt: skip
    return sorted_ids, expert_ids, num_post


@triton.jit(do_not_specialize=["num_pairs", "num_rows_cap"])
def _moe_gemm_kernel(
    a_ptr,  # [rows, K]: x (a pair's row is p // a_div, a_div = top_k) or act (a_div = 1)
    w_ptr,  # [E, N or 2N, K]; GATED: rows 0:N gate, N:2N up
    ws_ptr,  # FP8_W: [E, ceil(rows / 128), ceil(K / 128)] float32 block scales of w
    out_ptr,  # [T*k, N], row p
    topk_w_ptr,  # [T*k] routing weights, read when ROUTED
    sorted_ids_ptr, expert_ids_ptr, num_post_ptr,
    num_pairs, num_rows_cap, N, K, a_div,
    stride_am, stride_we, stride_wn, stride_om, stride_se, stride_sn,
    GATED: tl.constexpr, ROUTED: tl.constexpr, EVEN: tl.constexpr, F32_DOT: tl.constexpr,
    FP8_W: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    # grouped order: GROUP_M blocks of rows share each weight tile while it is in L2
    pid = tl.program_id(0)
    num_pid_m = num_rows_cap // BLOCK_M
    num_pid_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_pid_n
    first_m = (pid // per_group) * GROUP_M
    size_m = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % size_m
    pid_n = (pid % per_group) // size_m
    if pid_m * BLOCK_M >= tl.load(num_post_ptr):
        return

    ids = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = ids < num_pairs
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    n_ok = offs_n < N
    a_ptrs = a_ptr + (ids // a_div).to(tl.int64)[:, None] * stride_am + offs_k[None, :]
    w_ptrs = w_ptr + expert * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None]
    up_off = N * stride_wn
    # FP8_W: a K step lies inside one 128-column block (BLOCK_K divides 128): per column of
    # the tile one scale, applied to the step's partial product before it is accumulated
    s_ptrs = ws_ptr + expert * stride_se + (offs_n % N // 128) * stride_sn
    su_ptrs = ws_ptr + expert * stride_se + ((offs_n % N + N) // 128) * stride_sn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN:
            a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
            w = tl.load(w_ptrs)
        else:
            k_ok = offs_k < K - k0
            a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if F32_DOT:
            a = a.to(tl.float32)
            w = w.to(tl.float32)
        if FP8_W:  # e4m3 values are exact in bf16 / fp16: the dot runs on a's dtype
            acc += tl.dot(a, w.to(a.dtype)) * tl.load(s_ptrs + k0 // 128)[None, :]
        else:
            acc = tl.dot(a, w, acc)
        if GATED:
            if EVEN:
                u = tl.load(w_ptrs + up_off)
            else:
                u = tl.load(w_ptrs + up_off, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            if F32_DOT:
                u = u.to(tl.float32)
            if FP8_W:
                acc_up += tl.dot(a, u.to(a.dtype)) * tl.load(su_ptrs + k0 // 128)[None, :]
            else:
                acc_up = tl.dot(a, u, acc_up)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K

    if GATED:  # silu(gate) * up
        acc = acc / (1.0 + tl.exp(-acc)) * acc_up
    if ROUTED:
        acc = acc * tl.load(topk_w_ptr + ids, mask=row_ok, other=0.0).to(tl.float32)[:, None]
    out_ptrs = out_ptr + ids.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


def _gemm(
    a: torch.Tensor, w: torch.Tensor | Fp8Weight, out: torch.Tensor, topk_w: torch.Tensor | None,
    aligned: tuple[torch.Tensor, torch.Tensor, torch.Tensor], a_div: int, gated: bool,
    block_m: int, tile: GemmTile,
) -> None:  # fmt: skip
    sorted_ids, expert_ids, num_post = aligned
    n, k = out.shape[1], a.shape[1]
    interp = checks.interpreting()
    fp8 = isinstance(w, Fp8Weight)
    if fp8 and 128 % tile.block_k:
        raise ValueError(f"FP8 experts need a block_k dividing 128, got {tile.block_k}")
    wt, ws = (w.q, w.scale_inv) if isinstance(w, Fp8Weight) else (w, w)
    grid = (sorted_ids.numel() // block_m * triton.cdiv(n, tile.block_n),)
    launch = {} if interp else dict(num_warps=tile.num_warps, num_stages=tile.num_stages)
    _moe_gemm_kernel[grid](
        a, wt, ws, out, out if topk_w is None else topk_w, sorted_ids, expert_ids, num_post,
        out.shape[0], sorted_ids.numel(), n, k, a_div,
        a.stride(0), wt.stride(0), wt.stride(1), out.stride(0), ws.stride(0),
        ws.stride(1) if fp8 else 0,
        GATED=gated, ROUTED=topk_w is not None, FP8_W=fp8,
        EVEN=k % tile.block_k == 0 and n % tile.block_n == 0,
        F32_DOT=interp or a.dtype == torch.float32,
        BLOCK_M=block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, GROUP_M=tile.group_m,
        **launch,
    )  # fmt: skip


def _check(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
           gate_up: torch.Tensor | Fp8Weight, down: torch.Tensor | Fp8Weight) -> None:
    if x.dim() != 2 or x.stride(1) != 1 or x.dtype not in MOE_DTYPES:
        raise ValueError(f"x must be [T, H] with a unit last stride in one of {MOE_DTYPES}, got "
                         f"{tuple(x.shape)} strides {x.stride()} {x.dtype}")
    t, h = x.shape
    if gate_up.dim() != 3 or gate_up.shape[2] != h or gate_up.shape[1] % 2:
        raise ValueError(f"gate_up must be [E, 2I, {h}], got {tuple(gate_up.shape)}")
    e, two_i, _ = gate_up.shape
    if tuple(down.shape) != (e, h, two_i // 2):
        raise ValueError(f"down must be [{e}, {h}, {two_i // 2}], got {tuple(down.shape)}")
    for name, w in (("gate_up", gate_up), ("down", down)):
        if isinstance(w, Fp8Weight):
            if x.dtype == torch.float32 and not checks.interpreting():
                raise ValueError("FP8 experts run with bf16 / fp16 activations")
            p, want = w.q, w.q.dtype
        else:
            p, want = w, x.dtype
        if not p.is_contiguous() or p.dtype != want or p.device != x.device:
            raise ValueError(f"{name} must be contiguous {x.dtype} on {x.device}, got "
                             f"{p.dtype} on {p.device} strides {p.stride()}")
    if experts.dim() != 2 or experts.shape[0] != t or weights.shape != experts.shape:
        raise ValueError(f"weights and experts must both be [{t}, k], got "
                         f"{tuple(weights.shape)} and {tuple(experts.shape)}")


def fused_experts(
    x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
    gate_up: torch.Tensor | Fp8Weight, down: torch.Tensor | Fp8Weight,
    tiles: MoETiles | None = None,
) -> torch.Tensor:  # fmt: skip
    """The routed experts' weighted sum: ``x [T, H]`` -> ``[T, H]`` in ``x.dtype``.

    ``weights``/``experts [T, k]`` come from ``route``; ``tiles`` overrides ``tile_config``
    (benchmark sweeps). float32 runs its dots in tf32 on a GPU (exactly under the interpreter).
    Block-FP8 experts (``Fp8Weight``, 128x128 blocks) are read as FP8 and each step's partial
    product scaled by its block's scale (weight-only: the dots on the activations' dtype).
    """
    _check(x, weights, experts, gate_up, down)
    t, h = x.shape
    top_k = experts.shape[1]
    e, i = gate_up.shape[0], gate_up.shape[1] // 2
    if t == 0:
        return torch.zeros_like(x)
    tiles = tiles or tile_config(t, top_k, e)
    aligned = align(experts, e, tiles.block_m, tiles.align_block)
    act = torch.empty(t * top_k, i, dtype=x.dtype, device=x.device)
    _gemm(x, gate_up, act, None, aligned, top_k, True, tiles.block_m, tiles.up)
    y = torch.empty(t, top_k, h, dtype=x.dtype, device=x.device)
    topk_w = weights.reshape(-1).contiguous()
    _gemm(act, down, y.view(t * top_k, h), topk_w, aligned, 1, False, tiles.block_m, tiles.down)
    return y.sum(1) if top_k > 1 else y.view(t, h)
