"""FP8 KV pages (``--kv-cache-dtype fp8_e4m3``): what a page holds and how it is read back.

A page of an FP8 cache holds ``float8_e4m3fn`` values ``q = sat(x / s)``, saturated to the
format's +-448, with one float32 scale ``s`` per layer and kv head (MLA: one per layer, for the
latent row); reading dequantizes, ``x' = q * s``. Scales are 1.0 unless the checkpoint ships
``k_scale`` / ``v_scale`` tensors. Every attention path (the torch reference, the Triton
decode / prefill / MLA kernels) reads FP8 pages and dequantizes inside. Pure torch: no Triton.
"""

from __future__ import annotations

import hashlib

import torch

FP8_KV = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite e4m3fn value; quantization saturates to it
UNIT_SCALES = "unit"  # the scales' identity when every one is 1.0

# (k_scale [Hkv] float32, v_scale [Hkv] float32) of one layer; None reads as 1.0 everywhere
KVScales = tuple[torch.Tensor, torch.Tensor]


def kv_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The torch dtype of KV pages for ``--kv-cache-dtype name``."""
    if name == "auto":
        return model_dtype
    if name == "fp8_e4m3":
        return FP8_KV
    raise ValueError(f"--kv-cache-dtype must be auto or fp8_e4m3, got {name!r}")


def is_fp8(cache: torch.Tensor) -> bool:
    return cache.dtype == FP8_KV


def quantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x [T, H, D]`` -> e4m3 ``sat(x / scale)`` with ``scale [H]`` (float32 math)."""
    s = scale.to(torch.float32).view(1, -1, 1)
    return (x.to(torch.float32) / s).clamp(-FP8_MAX, FP8_MAX).to(FP8_KV)


def dequantize(x: torch.Tensor, scale: torch.Tensor | None, head_dim: int = 0) -> torch.Tensor:
    """float32 values of ``x`` (an FP8 ``[H, ...]`` tensor, ``scale [H]``; dim ``head_dim``
    indexes the heads); any other dtype is only upcast."""
    out = x.to(torch.float32)
    if not is_fp8(x) or scale is None:
        return out
    shape = [1] * x.dim()
    shape[head_dim] = -1
    return out * scale.to(torch.float32).view(shape)


def store_values(x: torch.Tensor, cache: torch.Tensor, scale: torch.Tensor | None
                 ) -> torch.Tensor:
    """What ``x [T, H, D]`` becomes in ``cache``'s dtype (quantized for an FP8 cache)."""
    if not is_fp8(cache):
        return x.to(cache.dtype)
    if scale is None:
        scale = torch.ones(x.shape[1], dtype=torch.float32, device=x.device)
    return quantize(x, scale)


def unit_scales(heads: int, device: torch.device) -> torch.Tensor:
    return torch.ones(heads, dtype=torch.float32, device=device)


def checkpoint_scale(name: str, raw: torch.Tensor, total_heads: int) -> torch.Tensor:
    """A checkpoint's ``k_scale`` / ``v_scale`` tensor as float32 ``[total_heads]``: a scalar
    (or one value) is every head's, ``[total_heads]`` is per head; refused by name otherwise,
    and when a value is not finite and > 0."""
    flat = raw.to(torch.float32).flatten()
    if flat.numel() == 1:
        flat = flat.expand(total_heads).clone()
    elif flat.numel() != total_heads:
        raise ValueError(f"{name} has shape {tuple(raw.shape)}: a KV scale must be one value "
                         f"or one per kv head ({total_heads})")
    if not bool(torch.isfinite(flat).all()) or not bool((flat > 0).all()):
        raise ValueError(f"{name} must be finite and > 0, got {flat.tolist()}")
    return flat


def scales_identity(scales: list[tuple[torch.Tensor, torch.Tensor]]) -> str:
    """What two nodes compare before one writes FP8 pages for the other: ``unit`` when every
    scale is 1.0, else a digest of every layer's (global, unsharded) K and V scales."""
    if all(bool((k == 1).all()) and bool((v == 1).all()) for k, v in scales):
        return UNIT_SCALES
    h = hashlib.sha256()
    for k, v in scales:
        h.update(k.to(torch.float32).cpu().numpy().tobytes())
        h.update(v.to(torch.float32).cpu().numpy().tobytes())
    return "sha256:" + h.hexdigest()[:16]
