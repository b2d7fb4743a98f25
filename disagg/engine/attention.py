"""Attention backend selection over the HND paged cache.

Backends (``disagg.kernels.backends``): ``torch`` (reference, CPU default), ``triton`` (CUDA
default), ``flashinfer`` (optional, ``kv_layout="HND"``, only when importable). Each implements
``disagg.kernels.interface.AttentionBackend``.
"""

from __future__ import annotations

import torch

from disagg.kernels.interface import AttentionBackend

BACKENDS = ("auto", "torch", "triton", "flashinfer")


def get_backend(name: str, device: torch.device) -> AttentionBackend:
    """Build the named backend; ``auto`` is ``triton`` on CUDA and ``torch`` elsewhere."""
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    if name == "torch":
        from disagg.kernels.backends import TorchBackend

        return TorchBackend()
    if name == "triton":
        from disagg.kernels.backends import TritonBackend

        return TritonBackend()
    if name == "flashinfer":
        from disagg.kernels.backends import FlashInferBackend

        return FlashInferBackend(device)
    raise ValueError(f"unknown attention backend {name!r}; choose one of {', '.join(BACKENDS)}")
