"""Launchers reject bad shapes, dtypes and strides before launching anything."""

from __future__ import annotations

import itertools

import pytest
import torch

pytest.importorskip("triton")

from disagg.kernels.append import append_kv  # noqa: E402
from disagg.kernels.decode import paged_decode_attention  # noqa: E402
from disagg.kernels.prefill import paged_prefill_attention  # noqa: E402

P, H, S, D = 6, 2, 4, 16


def _cache(dtype: torch.dtype = torch.float16) -> tuple[torch.Tensor, torch.Tensor]:
    kv = torch.zeros(2, P, 2, H, S, D, dtype=dtype)
    return kv[0, :, 0], kv[0, :, 1]


def _index() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.zeros(1, 2, dtype=torch.int32), torch.ones(1, dtype=torch.int32)


def test_rejects_nhd_cache() -> None:
    nhd = torch.zeros(P, S, H, D, dtype=torch.float16).permute(0, 2, 1, 3)  # [P, H, S, D] view
    bt, lens = _index()
    with pytest.raises(ValueError, match="HND"):
        paged_decode_attention(torch.zeros(1, H, D, dtype=torch.float16), nhd, nhd, bt, lens, 1.0)


def test_rejects_mismatched_dtypes_and_heads() -> None:
    k, v = _cache()
    bt, lens = _index()
    with pytest.raises(ValueError, match="dtype"):
        paged_decode_attention(torch.zeros(1, H, D), k, v, bt, lens, 1.0)
    with pytest.raises(ValueError, match="multiple"):
        paged_decode_attention(torch.zeros(1, 3, D, dtype=torch.float16), k, v, bt, lens, 1.0)
    with pytest.raises(ValueError, match="block_tables"):
        paged_decode_attention(
            torch.zeros(1, H, D, dtype=torch.float16), k, v, bt.long(), lens, 1.0
        )


def test_rejects_bad_cu_and_slots() -> None:
    k, v = _cache()
    bt, lens = _index()
    q = torch.zeros(3, H, D, dtype=torch.float16)
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        paged_prefill_attention(q, k, v, bt, lens, torch.tensor([0, 1, 3], dtype=torch.int32), 1.0)
    rows = torch.zeros(2, H, D, dtype=torch.float16)
    with pytest.raises(ValueError, match="slot_mapping"):
        append_kv(rows, rows, k, v, torch.zeros(3, dtype=torch.int64))
    with pytest.raises(ValueError, match="slot_mapping"):
        append_kv(rows, rows, k, v, torch.zeros(2, dtype=torch.int32))


def test_prefill_tiles_fit_shared_memory_for_every_dtype_and_head_dim() -> None:
    from disagg.kernels.prefill import H200_SMEM, prefill_smem_bytes, prefill_tiles

    # at least what Triton 3.6 reported on an H200 for float32 (the failures this fixes)
    assert prefill_smem_bytes(4, 128, 128, 128, 2) >= 327680 > H200_SMEM
    assert prefill_smem_bytes(4, 128, 128, 128, 3) >= 328704
    assert prefill_smem_bytes(4, 256, 128, 64, 2) >= 393216
    for elt, head_dim, q_len in itertools.product((2, 4), (64, 128, 256), (1, 64, 65, 8192)):
        tiles = prefill_tiles(elt, head_dim, q_len)
        assert prefill_smem_bytes(elt, head_dim, *tiles) <= H200_SMEM, (elt, head_dim, tiles)
    # the measured-fastest bf16 tiles are kept where they fit
    assert prefill_tiles(2, 128, 8192) == (128, 128, 3)
    assert prefill_tiles(2, 128, 64) == (64, 64, 3)
    assert prefill_tiles(2, 256, 8192) == (128, 64, 2)
    # a smaller chip (99 KiB, as on consumer GPUs) still gets tiles that fit
    for head_dim in (64, 128, 256):
        assert prefill_smem_bytes(4, head_dim, *prefill_tiles(4, head_dim, 8192, 101376)) <= 101376
