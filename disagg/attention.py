"""Attention backend selection over the HND paged cache.

Backends: ``torch`` (reference, CPU default), ``triton`` (CUDA default), ``flashinfer``
(optional, ``kv_layout="HND"``, only when importable). A backend implements
``append_kv`` and ``attend`` over one layer's K/V cache views (see ``disagg.kernels``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from disagg.kernels import reference


@dataclass
class AttentionMetadata:
    """Per-step attention inputs, built once per step and shared by every layer.

    Sequences are ordered decodes first: rows ``0:num_decodes`` of ``block_tables`` have one
    query each; the rest are prefill chunks.
    """

    slot_mapping: torch.Tensor  # [T] int64: page_id * page_size + offset; <0 = do not store
    block_tables: torch.Tensor  # [B, max_pages] int32, node-local page ids
    seq_lens: torch.Tensor  # [B] int32, kv length including this step's tokens
    cu_seqlens_q: torch.Tensor  # [B + 1] int32, query row offsets
    num_decodes: int  # leading sequences with exactly one query token
    max_q_len: int
    max_seq_len: int

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])


class AttentionBackend(Protocol):
    name: str

    def append_kv(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> None: ...

    def attend(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor: ...


class TorchBackend:
    """The plain torch reference: correct everywhere, fast nowhere."""

    name = "torch"

    def append_kv(self, k, v, k_cache, v_cache, meta):  # type: ignore[no-untyped-def]
        reference.append_kv(k, v, k_cache, v_cache, meta.slot_mapping)

    def attend(self, q, k_cache, v_cache, meta, scale):  # type: ignore[no-untyped-def]
        return reference.paged_attention(
            q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.cu_seqlens_q, scale
        )


BACKENDS = ("auto", "torch", "triton", "flashinfer")


def get_backend(name: str, device: torch.device) -> AttentionBackend:
    """Build the named backend; ``auto`` is ``triton`` on CUDA and ``torch`` elsewhere."""
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    if name == "torch":
        return TorchBackend()
    if name == "triton":
        from disagg.kernels.backends import TritonBackend

        return TritonBackend()
    if name == "flashinfer":
        from disagg.kernels.backends import FlashInferBackend

        return FlashInferBackend(device)
    raise ValueError(f"unknown attention backend {name!r}; choose one of {', '.join(BACKENDS)}")
