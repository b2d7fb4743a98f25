"""Shared pieces of the models: RMSNorm as Hugging Face computes it, and RoPE tables."""

from __future__ import annotations

import math

import torch
from torch import nn

from disagg.model.config import ModelArch, yarn_mscale


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in float32, as Hugging Face does."""
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def llama3_scaled(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """llama3 RoPE scaling: long wavelengths divided by ``factor``, a smooth band between."""
    factor = float(scaling["factor"])
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    old_len = float(scaling.get("original_max_position_embeddings", 8192))
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def yarn_scaled(inv_freq: torch.Tensor, dim: int, base: float,
                scaling: dict) -> tuple[torch.Tensor, float]:
    """YaRN: frequencies interpolated by ``factor`` below a ramp, kept above it; returns them
    and the factor cos/sin are scaled by (Hugging Face's ``_compute_yarn_parameters``)."""
    factor = float(scaling["factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    attention = scaling.get("attention_factor")
    if attention is None:
        mscale, mscale_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention = (yarn_mscale(factor, float(mscale)) / yarn_mscale(factor, float(mscale_all))
                     if mscale and mscale_all else yarn_mscale(factor))
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(old_len / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolate = 1 - ramp
    inv = (inv_freq / factor) * (1 - extrapolate) + inv_freq * extrapolate
    return inv, float(attention)


class Rotary(nn.Module):
    """RoPE tables over ``arch.rope_dim`` (default, llama3 or YaRN frequencies); the
    rotate-half or interleaved application is the attention's (``rotate_half``,
    ``disagg.model.mla.rope``)."""

    def __init__(self, arch: ModelArch, device: torch.device):
        super().__init__()
        dim = arch.rope_dim
        base = arch.rope_theta
        inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        self.scale = 1.0  # cos/sin factor (YaRN's attention factor)
        kind = (arch.rope_scaling or {}).get("rope_type", "default")
        if kind == "llama3":
            inv = llama3_scaled(inv, arch.rope_scaling or {})
        elif kind == "yarn":
            inv, self.scale = yarn_scaled(inv, dim, base, arch.rope_scaling or {})
        self.inv_freq: torch.Tensor
        self.register_buffer("inv_freq", inv.to(device), persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]  # [T, 1, D]
        if self.scale != 1.0:
            return (emb.cos() * self.scale).to(dtype), (emb.sin() * self.scale).to(dtype)
        return emb.cos().to(dtype), emb.sin().to(dtype)
