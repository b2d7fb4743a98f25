"""The eager decode attention launches a runner warms before serving: one per distinct split
count (``ModelRunner.pin_decode_splits`` runs them in turn, ``disagg.engine.warmup`` in
parallel), so an eager decode step never compiles a variant mid-serving."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from disagg.kernels.interface import AttentionMetadata

if TYPE_CHECKING:
    from disagg.engine.runner import ModelRunner


def decode_split_launches(runner: ModelRunner, max_batch: int,
                          max_model_len: int) -> list[tuple[str, Callable[[], Any]]]:
    """One eager decode attention launch per distinct split count of batch sizes 1 ..
    ``max_batch`` (at most 256) with the split count pinned to ``max_model_len`` (MLA: its one
    launch shape), as (name, callable); triton backend only (else none)."""
    from disagg.kernels.decode import decode_tile, default_num_splits

    if runner.backend.name != "triton":
        return []
    arch = runner.model.arch
    dtype, dev = runner.model.dtype, runner.device
    if arch.mla is not None:  # its split count is a kernel argument: one launch shape
        from disagg.kernels import mla
        from disagg.model.mla import MLAAttention

        layer = next(m for m in runner.model.modules() if isinstance(m, MLAAttention))
        return [("mla decode", functools.partial(
            mla.warm, runner.kv[0, :, 0], layer.num_heads, arch.mla.kv_lora_rank, dtype))]
    k, v = runner.kv[0, :, 0], runner.kv[0, :, -1]
    width = -(-max_model_len // runner.page_size)
    scales = getattr(runner.model.layers[0], "kv_scales", None)

    def attend(b: int) -> None:
        i32 = torch.int32
        meta = AttentionMetadata(
            slot_mapping=torch.full((b,), -1, dtype=torch.int64, device=dev),
            block_tables=torch.zeros((b, width), dtype=i32, device=dev),
            seq_lens=torch.ones(b, dtype=i32, device=dev),
            cu_seqlens_q=torch.arange(b + 1, dtype=i32, device=dev), num_decodes=b,
            max_q_len=1, max_seq_len=max_model_len)
        q = torch.zeros((b, arch.num_heads, arch.head_dim), dtype=dtype, device=dev)
        runner.backend.attend(q, k, v, meta, arch.head_dim**-0.5, scales)

    seen: dict[int, int] = {}  # split count -> the first batch size with it
    block_n = decode_tile(k.dtype)[0]
    for b in range(1, min(max_batch, 256) + 1):
        seen.setdefault(default_num_splits(b, arch.num_kv_heads, max_model_len, block_n), b)
    return [(f"decode splits {s}", functools.partial(attend, b)) for s, b in seen.items()]
