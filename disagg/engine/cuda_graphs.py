"""Decode-only steps replayed from CUDA graphs, one graph per batch-size bucket.

A decode-only step (every chunk one token, sampled, no hidden rows wanted) of ``n`` sequences
runs the graph of the smallest bucket ``>= n`` (default buckets 1, 2, 4, ..., 256, capped at
``max_batch``). Inputs live in static buffers sized for the largest bucket; rows ``n:bucket``
are padding (token 0 at position 0, ``slot_mapping`` -1 so nothing is stored, ``seq_len`` 1
over a valid page id), so they read one cache row and write nothing.

Graph stability: the captured launches depend only on host sizes. The decode kernel's split
count is chosen from ``max_model_len`` (``AttentionMetadata.max_seq_len`` is pinned to it), never
from the step's real lengths, so one graph per bucket serves every context length; the block
table buffer has ``ceil(max_model_len / page_size)`` columns. The layer-counter bump
(``LayerCounter.bump``, a kernel reading the device ``base``) is captured inside the graph after
each layer's attention; ``set_base`` is a stream-ordered fill the runner issues before replay.

Each graph also computes the float32 logits and their argmax, so a greedy step costs one replay
and one device-to-host copy. CUDA only; the runner never builds this on CPU.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import numpy as np
import torch

from disagg.kernels.interface import AttentionBackend, AttentionMetadata
from disagg.model.transformer import Transformer

log = logging.getLogger(__name__)

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def buckets_for(max_batch: int, buckets: tuple[int, ...] = DEFAULT_BUCKETS) -> list[int]:
    """The capture sizes for a scheduler that runs at most ``max_batch`` sequences per step."""
    out = [b for b in buckets if b < max_batch]
    out.append(min(max_batch, buckets[-1]) if max_batch > buckets[-1] else max_batch)
    return sorted(set(out))


def pick_bucket(n: int, buckets: list[int]) -> int | None:
    """The smallest bucket holding ``n`` sequences, or None when ``n`` exceeds them all."""
    for b in buckets:
        if b >= n:
            return b
    return None


class DecodeGraphs:
    """Static buffers plus one captured decode step per bucket."""

    def __init__(
        self,
        model: Transformer,
        kv: torch.Tensor,
        backend: AttentionBackend,
        max_batch: int,
        max_model_len: int,
        layer_hook: Callable[[int], None] | None = None,
    ) -> None:
        self.model = model
        self.kv = kv
        self.backend = backend
        self.layer_hook = layer_hook
        self.page_size = int(kv.shape[4])
        self.max_model_len = max_model_len
        self.max_pages = -(-max_model_len // self.page_size)
        self.buckets = buckets_for(max_batch)
        n = self.buckets[-1]
        dev = model.device
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(n, dtype=torch.int64, device=dev)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=dev)
        self.block_tables = torch.zeros((n, self.max_pages), dtype=torch.int32, device=dev)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=dev)
        self.cu_seqlens_q = torch.arange(n + 1, dtype=torch.int32, device=dev)
        # one host staging row per input, pinned so the copies are async and cheap
        self._host = torch.zeros((3, n), dtype=torch.int64).pin_memory()  # ids, positions, slots
        self._host_lens = torch.ones(n, dtype=torch.int32).pin_memory()
        self._host_tables = torch.zeros((n, self.max_pages), dtype=torch.int32).pin_memory()
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # bucket -> logits, argmax
        self.pool = torch.cuda.graph_pool_handle()

    def fits(self, num_seqs: int, max_pages: int) -> bool:
        return num_seqs <= self.buckets[-1] and max_pages <= self.max_pages

    def _meta(self, b: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:b], block_tables=self.block_tables[:b],
            seq_lens=self.seq_lens[:b], cu_seqlens_q=self.cu_seqlens_q[: b + 1],
            num_decodes=b, max_q_len=1, max_seq_len=self.max_model_len)

    def _forward(self, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = self.model(self.input_ids[:b], self.positions[:b], self.kv, self._meta(b),
                            self.backend, self.layer_hook)
        logits = self.model.logits(hidden)
        return logits, logits.argmax(dim=-1)

    @torch.inference_mode()
    def capture_all(self) -> float:
        """Capture every bucket, largest first (its pool blocks are reused by the smaller ones).
        Returns the seconds it took."""
        t0 = time.perf_counter()
        self._reset_inputs()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for b in reversed(self.buckets):
                for _ in range(2):  # compile the kernels, settle the allocator
                    self._forward(b)
                stream.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool, stream=stream):
                    out = self._forward(b)
                self.graphs[b] = graph
                self.outputs[b] = out
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    def _reset_inputs(self) -> None:
        self.input_ids.zero_()
        self.positions.zero_()
        self.slot_mapping.fill_(-1)
        self.block_tables.zero_()
        self.seq_lens.fill_(1)

    def run(self, token_ids: np.ndarray, positions: np.ndarray, slots: np.ndarray,
            tables: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """Replay the bucket for ``len(token_ids)`` decodes. ``tables`` is ``[n, w]`` with
        ``w <= max_pages``. Returns (logits ``[n, V]`` float32, argmax ``[n]``), views of the
        graph's outputs valid until the next replay."""
        n = int(token_ids.shape[0])
        b = pick_bucket(n, self.buckets)
        assert b is not None
        w = int(tables.shape[1])
        host = self._host.numpy()
        host[:, :b] = 0
        host[0, :n] = token_ids
        host[1, :n] = positions
        host[2, :b] = -1
        host[2, :n] = slots
        lens = self._host_lens.numpy()
        lens[:b] = 1
        lens[:n] = positions + 1
        ht = self._host_tables.numpy()
        ht[:n, :w] = tables
        if n < b:
            ht[n:b, 0] = 0  # padding rows read page 0, a valid id
        self.input_ids[:b].copy_(self._host[0, :b], non_blocking=True)
        self.positions[:b].copy_(self._host[1, :b], non_blocking=True)
        self.slot_mapping[:b].copy_(self._host[2, :b], non_blocking=True)
        self.seq_lens[:b].copy_(self._host_lens[:b], non_blocking=True)
        self.block_tables[:b, :w].copy_(self._host_tables[:b, :w], non_blocking=True)
        self.graphs[b].replay()
        logits, tokens = self.outputs[b]
        return logits[:n], tokens[:n]
