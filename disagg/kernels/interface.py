"""The attention interface every backend implements, over the HND paged cache: per-step
metadata and the two calls a layer makes (``append_kv``, ``attend``); with FP8 pages both
take the layer's ``kv_scales`` (``disagg.kernels.kv_quant``). Backends live in
``disagg.kernels.backends``; ``disagg.engine.attention`` picks one by name."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from disagg.kernels.kv_quant import KVScales


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
    triton_append: bool  # append_kv is disagg.kernels.append's (other kernels may do it)

    def append_kv(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        kv_scales: KVScales | None = None,
    ) -> None: ...

    def attend(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        kv_scales: KVScales | None = None,
    ) -> torch.Tensor: ...
