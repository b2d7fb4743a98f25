"""Launcher-side validation shared by the Triton kernels (no Triton import here).

Every check raises ``ValueError`` naming the argument and what was expected; kernels assume
the HND strides checked here (head stride ``S*D``, token stride ``D``, dim stride ``1``) and take
the page stride as an argument, so a layer view ``kv[layer, :, 0]`` of the one-allocation cache
is accepted as is.
"""

from __future__ import annotations

import os

import torch

ATTN_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
CACHE_DTYPES = (*ATTN_DTYPES, torch.float8_e4m3fn)  # FP8 pages: disagg.kernels.kv_quant


def interpreting() -> bool:
    """True under ``TRITON_INTERPRET=1`` (CPU): kernels then upcast dot operands to float32."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def check_cache(name: str, cache: torch.Tensor) -> None:
    """``cache`` is ``[P, Hkv, S, D]`` with HND strides inside a page (page stride is free)."""
    if cache.dim() != 4:
        raise ValueError(
            f"{name} must be [pages, kv_heads, page_size, head_dim], got {tuple(cache.shape)}"
        )
    _, _, page_size, head_dim = cache.shape
    want = (page_size * head_dim, head_dim, 1)
    got = cache.stride()[1:]
    if tuple(got) != want:
        raise ValueError(
            f"{name} must be HND inside a page (head, token, dim strides {want}), got strides {got}"
        )
    if cache.dtype not in CACHE_DTYPES:
        raise ValueError(f"{name} dtype {cache.dtype} not supported; use one of {CACHE_DTYPES}")
    if head_dim & (head_dim - 1) or head_dim < 16:
        raise ValueError(f"{name} head_dim {head_dim} must be a power of two >= 16")


def check_kv_pair(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    check_cache("k_cache", k_cache)
    check_cache("v_cache", v_cache)
    if k_cache.shape != v_cache.shape or k_cache.dtype != v_cache.dtype:
        raise ValueError(
            f"k_cache {tuple(k_cache.shape)}/{k_cache.dtype} and v_cache "
            f"{tuple(v_cache.shape)}/{v_cache.dtype} must match"
        )
    if k_cache.device != v_cache.device:
        raise ValueError(f"k_cache on {k_cache.device} but v_cache on {v_cache.device}")


def check_rows(name: str, x: torch.Tensor, heads: int, head_dim: int, device: torch.device) -> None:
    """``x`` is ``[T, heads, head_dim]`` with a unit dim stride (token/head strides are free)."""
    if x.dim() != 3 or x.shape[1] != heads or x.shape[2] != head_dim:
        raise ValueError(f"{name} must be [tokens, {heads}, {head_dim}], got {tuple(x.shape)}")
    if x.stride(2) != 1:
        raise ValueError(f"{name} must have a unit stride along head_dim, got {x.stride()}")
    if x.device != device:
        raise ValueError(f"{name} on {x.device} but the cache is on {device}")


def check_index(
    name: str, x: torch.Tensor, dims: int, dtype: torch.dtype, device: torch.device
) -> None:
    if x.dim() != dims or x.dtype != dtype:
        raise ValueError(f"{name} must be a {dims}-d {dtype} tensor, got {x.dim()}-d {x.dtype}")
    if x.stride(-1) != 1:
        raise ValueError(f"{name} must have a unit last stride, got {x.stride()}")
    if x.device != device:
        raise ValueError(f"{name} on {x.device} but the cache is on {device}")


def check_attention_inputs(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
) -> int:
    """Validate the shared attention inputs; return the GQA group size ``Hq // Hkv``."""
    check_kv_pair(k_cache, v_cache)
    _, num_kv_heads, _, head_dim = k_cache.shape
    if q.dim() != 3 or q.shape[2] != head_dim or q.stride(2) != 1:
        raise ValueError(
            f"q must be [tokens, q_heads, {head_dim}] with unit dim stride, got {tuple(q.shape)}"
        )
    if q.shape[1] % num_kv_heads:
        raise ValueError(f"q heads {q.shape[1]} must be a multiple of kv heads {num_kv_heads}")
    check_query_dtype(q, k_cache)
    if q.device != k_cache.device:
        raise ValueError(f"q on {q.device} but the cache is on {k_cache.device}")
    check_index("block_tables", block_tables, 2, torch.int32, k_cache.device)
    check_index("seq_lens", seq_lens, 1, torch.int32, k_cache.device)
    if block_tables.shape[0] != seq_lens.shape[0]:
        raise ValueError(
            f"block_tables has {block_tables.shape[0]} rows but seq_lens has {seq_lens.shape[0]}"
        )
    return q.shape[1] // num_kv_heads


def check_query_dtype(q: torch.Tensor, cache: torch.Tensor) -> None:
    """``q`` is in the cache's dtype, or in any attention dtype over FP8 pages."""
    fp8 = cache.dtype == torch.float8_e4m3fn
    if (fp8 and q.dtype not in ATTN_DTYPES) or (not fp8 and q.dtype != cache.dtype):
        raise ValueError(f"q dtype {q.dtype} must equal the cache dtype {cache.dtype}"
                         + (f" (or be one of {ATTN_DTYPES} over FP8 pages)" if fp8 else ""))


def launch_scales(kv_scales: tuple[torch.Tensor, torch.Tensor] | None, cache: torch.Tensor,
                  heads: int, placeholder: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The (K, V) scale tensors a kernel launch takes: over FP8 pages the layer's, checked
    (float32 ``[heads]`` on the cache's device; required); otherwise ``placeholder`` twice
    (never read)."""
    if cache.dtype != torch.float8_e4m3fn:
        return placeholder, placeholder
    if kv_scales is None:
        raise ValueError("FP8 KV pages need kv_scales (the layer's K and V scales)")
    for name, s in zip(("k_scale", "v_scale"), kv_scales, strict=True):
        if s.dtype != torch.float32 or tuple(s.shape) != (heads,) or s.device != cache.device:
            raise ValueError(f"{name} must be a float32 [{heads}] tensor on {cache.device}, "
                             f"got {s.dtype} {tuple(s.shape)} on {s.device}")
        if s.stride(0) != 1:
            raise ValueError(f"{name} must be contiguous")
    return kv_scales[0], kv_scales[1]
