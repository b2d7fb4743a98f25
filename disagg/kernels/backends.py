"""Attention backends over the HND paged cache: ``triton`` (CUDA default) and ``flashinfer``.

Each implements ``disagg.kernels.interface.AttentionBackend``; ``torch`` is the plain reference. Sequences come decodes first
(``meta.num_decodes``), so a step runs the decode kernel on rows ``0:num_decodes`` and the
chunked-prefill kernel on the rest; a pure decode step is one split-kv launch plus its merge.

CUDA graphs: the Triton launches depend only on host sizes (``num_seqs``, ``num_decodes``,
``max_q_len``, ``max_seq_len``), never on device values, so a decode step captured for a fixed
batch and a fixed ``meta.max_seq_len`` bound replays correctly with new ``seq_lens``,
``block_tables`` and ``slot_mapping`` copied into the captured tensors.
"""

from __future__ import annotations

from typing import Any

import torch

from disagg.kernels import reference
from disagg.kernels.interface import AttentionMetadata
from disagg.kernels.kv_quant import KVScales, is_fp8


class TorchBackend:
    """The plain torch reference: correct everywhere, fast nowhere."""

    name = "torch"
    triton_append = False  # see TritonBackend

    def append_kv(self, k, v, k_cache, v_cache, meta, kv_scales=None):  # type: ignore[no-untyped-def]
        reference.append_kv(k, v, k_cache, v_cache, meta.slot_mapping, kv_scales)

    def attend(self, q, k_cache, v_cache, meta, scale, kv_scales=None):  # type: ignore[no-untyped-def]
        return reference.paged_attention(
            q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.cu_seqlens_q, scale,
            kv_scales,
        )


class TritonBackend:
    """Triton kernels (``disagg.kernels.append/decode/prefill``); CUDA, or CPU under the interpreter."""

    name = "triton"
    # its KV append is ``disagg.kernels.append``'s slot layout, so the fused layer may do the
    # append inside its q/k rope kernel (``disagg.model.fused.qk_rope_append``)
    triton_append = True

    def append_kv(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        kv_scales: KVScales | None = None,
    ) -> None:
        from disagg.kernels.append import append_kv

        append_kv(k, v, k_cache, v_cache, meta.slot_mapping, kv_scales)

    def attend(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        kv_scales: KVScales | None = None,
    ) -> torch.Tensor:
        from disagg.kernels.decode import paged_decode_attention
        from disagg.kernels.prefill import paged_prefill_attention

        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        nd, ns = meta.num_decodes, meta.num_seqs
        if nd > 0:
            paged_decode_attention(
                q[:nd], k_cache, v_cache, meta.block_tables[:nd], meta.seq_lens[:nd], scale,
                max_seq_len=meta.max_seq_len, out=out[:nd], kv_scales=kv_scales,
            )  # fmt: skip
        if nd < ns:
            paged_prefill_attention(
                q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.cu_seqlens_q, scale,
                max_q_len=meta.max_q_len, out=out, seq_base=nd, kv_scales=kv_scales,
            )  # fmt: skip
        return out


class FlashInferBackend(TritonBackend):
    """FlashInfer's paged wrappers with ``kv_layout="HND"`` (optional; only when importable);
    KV appends are the Triton backend's.

    Planning reads the block tables on the host (a device sync) once per step: the plan is
    cached for the ``AttentionMetadata`` object it was made for, which every layer shares.
    """

    name = "flashinfer"

    def __init__(self, device: torch.device, workspace_bytes: int = 256 << 20) -> None:
        try:
            import flashinfer
        except ImportError as e:
            raise ValueError(
                "attention backend 'flashinfer' needs the flashinfer package; install it or "
                "choose --attention-backend triton"
            ) from e
        self._fi: Any = flashinfer
        self._workspace = torch.empty(workspace_bytes, dtype=torch.uint8, device=device)
        self._decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self._workspace, kv_layout="HND"
        )
        self._prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            self._workspace, kv_layout="HND"
        )
        self._planned: tuple[AttentionMetadata, tuple[Any, ...]] | None = None

    def _plan(
        self, q: torch.Tensor, k_cache: torch.Tensor, meta: AttentionMetadata, scale: float
    ) -> None:
        key = (q.shape[1], tuple(k_cache.shape[1:]), q.dtype, scale)
        if self._planned is not None and self._planned[0] is meta and self._planned[1] == key:
            return
        num_heads = q.shape[1]
        _, num_kv_heads, page_size, head_dim = k_cache.shape
        lens = meta.seq_lens.to("cpu", torch.int64)
        tables = meta.block_tables.cpu()
        pages = (lens + page_size - 1) // page_size
        indptr = torch.zeros(len(lens) + 1, dtype=torch.int32)
        indptr[1:] = torch.cumsum(pages, 0)
        indices = torch.cat([tables[b, : int(n)] for b, n in enumerate(pages)]).to(torch.int32)
        last = (lens - (pages - 1) * page_size).to(torch.int32)
        nd = meta.num_decodes
        dev = q.device
        if nd > 0:
            self._decode.plan(
                indptr[: nd + 1].to(dev), indices[: int(indptr[nd])].to(dev), last[:nd].to(dev),
                num_heads, num_kv_heads, head_dim, page_size,
                q_data_type=q.dtype, kv_data_type=k_cache.dtype, sm_scale=scale,
            )  # fmt: skip
        if nd < meta.num_seqs:
            cu = meta.cu_seqlens_q.cpu()
            qo = (cu[nd:] - cu[nd]).to(torch.int32)
            kv_ptr = (indptr[nd:] - indptr[nd]).to(torch.int32)
            self._prefill.plan(
                qo.to(dev), kv_ptr.to(dev), indices[int(indptr[nd]) :].to(dev), last[nd:].to(dev),
                num_heads, num_kv_heads, head_dim, page_size, causal=True,
                q_data_type=q.dtype, kv_data_type=k_cache.dtype, sm_scale=scale,
            )  # fmt: skip
        self._planned = (meta, key)

    def attend(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        kv_scales: KVScales | None = None,
    ) -> torch.Tensor:
        if is_fp8(k_cache):
            raise ValueError("attention backend 'flashinfer' does not read FP8 KV pages; "
                             "choose --attention-backend triton with --kv-cache-dtype fp8_e4m3")
        self._plan(q, k_cache, meta, scale)
        nd = meta.num_decodes
        parts = []
        if nd > 0:
            parts.append(self._decode.run(q[:nd], (k_cache, v_cache)))
        if nd < meta.num_seqs:
            parts.append(self._prefill.run(q[nd:], (k_cache, v_cache)))
        return parts[0] if len(parts) == 1 else torch.cat(parts)
