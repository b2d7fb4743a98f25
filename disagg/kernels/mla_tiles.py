"""Host side of the MLA kernels (``disagg.kernels.mla``): argument checks, tile choices
(with a step-down where a device has less shared memory than an H200) and the decode split
count."""

from __future__ import annotations

import math
from typing import Any

import torch

from disagg.kernels import checks, reference


def check_latent_cache(cache: torch.Tensor, latent_dim: int | None) -> tuple[int, int, int]:
    """``cache`` is ``[P, 1, S, W]`` with token stride ``W`` and dim stride 1 (the page stride
    is free) and ``0 < latent_dim < W`` (unless None). Returns ``(S, W, W - latent_dim)``."""
    if cache.dim() != 4 or cache.shape[1] != 1:
        raise ValueError(f"latent cache must be [pages, 1, page_size, width], got "
                         f"{tuple(cache.shape)}")
    _, _, page, width = cache.shape
    if cache.stride(2) != width or cache.stride(3) != 1:
        raise ValueError(f"latent cache rows must be contiguous (token stride {width}, dim "
                         f"stride 1), got strides {cache.stride()}")
    if cache.dtype not in checks.CACHE_DTYPES:
        raise ValueError(f"latent cache dtype {cache.dtype} not supported; use one of "
                         f"{checks.CACHE_DTYPES}")
    if latent_dim is None:
        return page, width, 0
    if not 0 < latent_dim < width:
        raise ValueError(f"latent_dim {latent_dim} must be in (0, {width})")
    return page, width, width - latent_dim


def _check_attention(q: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor,
                     seq_lens: torch.Tensor, latent_dim: int) -> tuple[int, int, int]:
    page, width, rope = check_latent_cache(cache, latent_dim)
    if q.dim() != 3 or q.shape[2] != width or q.stride(2) != 1:
        raise ValueError(f"q must be [tokens, heads, {width}] with unit dim stride, got "
                         f"{tuple(q.shape)} strides {q.stride()}")
    if q.device != cache.device:
        raise ValueError(f"q on {q.device} but the cache is on {cache.device}")
    checks.check_query_dtype(q, cache)
    checks.check_index("block_tables", block_tables, 2, torch.int32, cache.device)
    checks.check_index("seq_lens", seq_lens, 1, torch.int32, cache.device)
    if block_tables.shape[0] != seq_lens.shape[0]:
        raise ValueError(f"block_tables has {block_tables.shape[0]} rows but seq_lens has "
                         f"{seq_lens.shape[0]}")
    return page, width, rope


def _check_out(out: torch.Tensor | None, q: torch.Tensor, latent_dim: int) -> torch.Tensor:
    shape = (q.shape[0], q.shape[1], latent_dim)
    if out is None:
        return torch.empty(shape, dtype=q.dtype, device=q.device)
    if tuple(out.shape) != shape or out.stride(2) != 1 or out.dtype != q.dtype:
        raise ValueError(f"out must be {shape} {q.dtype} with unit dim stride, got "
                         f"{tuple(out.shape)} {out.dtype} strides {out.stride()}")
    return out


def decode_tiles(num_heads: int, elt: int, interp: bool = False) -> tuple[int, int, int, int]:
    """(block_h, block_n, num_stages, num_warps) of the decode kernel, the fastest measured on
    an H200 (bench/mla_kernel.py): up to 16 heads one block of 16; more heads blocks of 32 (4
    warps) or 64 (8 warps: a 64 x 512 float32 accumulator), where 128 heads are compute-bound;
    64 rows of 576 a key tile, two buffered (float32: 32 rows)."""
    if interp:
        return 16, 16, 1, 4
    block_n = 64 if elt <= 2 else 32
    if num_heads <= 16:
        return 16, block_n, 2, 4
    if elt > 2:
        return 16, block_n, 2, 4
    if num_heads <= 32:
        return 32, block_n, 2, 4
    return 64, block_n, 2, 8


def prefill_tiles(elt: int, interp: bool = False) -> tuple[int, int, int, int]:
    """(block_m, block_n, num_stages, num_warps) of the prefill kernel: 64 (token, head) rows
    by 64 keys, two buffered, 8 warps in bf16 (the fastest of those measured on an H200 for an
    8k prompt at 16 and 128 heads: about 300 TFLOP/s absorbed); 32 by 16 in float32."""
    if interp:
        return 32, 16, 1, 4
    return (64, 64, 2, 8) if elt <= 2 else (32, 16, 2, 8)


# (kernel, device, dtype, heads, latent, rope, tiles asked for) -> the tiles that compiled, where
# the device has less shared memory than an H200 (remembered, so warm-up compiles what serving
# launches)
_FITTED: dict[tuple[Any, ...], tuple[int, int, int, int]] = {}


def _step_down(key: tuple[Any, ...], tiles: tuple[int, int, int, int]) -> bool:
    """After an out-of-resources compile: fewer key rows a tile, then fewer buffered tiles;
    False at the bottom."""
    rows, block_n, stages, warps = tiles
    if block_n > 16:
        _FITTED[key] = (rows, block_n // 2, stages, warps)
    elif stages > 1:
        _FITTED[key] = (rows, block_n, stages - 1, warps)
    else:
        return False
    return True


def tiles_used(kind: str, want: tuple[int, int, int, int]) -> tuple[int, int, int, int]:
    """The tiles a ``kind`` ("decode" or "prefill") launch asked for ``want`` ran with."""
    return next((t for k, t in _FITTED.items() if k[0] == kind and k[-1] == want), want)


def num_decode_splits(batch: int, head_blocks: int, max_seq_len: int, block_n: int,
                      programs: int = 528) -> int:
    """Enough programs to fill an H200 (about four per SM), >= 4 key blocks a split."""
    want = math.ceil(programs / max(1, batch * head_blocks))
    most = max(1, math.ceil(max_seq_len / (4 * block_n)))
    return max(1, min(want, most, 64))


def latent_scale(kv_scale: torch.Tensor | None, cache: torch.Tensor,
                  placeholder: torch.Tensor) -> torch.Tensor:
    """The launch's scale tensor (FP8 pages: ``kv_scale``, checked; else never read)."""
    pair = None if kv_scale is None else (kv_scale, kv_scale)
    return checks.launch_scales(pair, cache, 1, placeholder)[0]


def reference_attention(q: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor,
                        seq_lens: torch.Tensor, cu_seqlens_q: torch.Tensor, scale: float,
                        latent_dim: int, kv_scale: torch.Tensor | None = None) -> torch.Tensor:
    """The plain torch oracle (float32 inside): rows as both keys and values, causal chunks,
    values cut to the latent part -- what the torch backend computes for MLA."""
    pair = None if kv_scale is None else (kv_scale, kv_scale)
    return reference.paged_attention(q, cache, cache, block_tables, seq_lens, cu_seqlens_q,
                                     scale, pair)[..., :latent_dim]
