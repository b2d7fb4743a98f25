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

Small prompt steps (``rows_step``): a step whose chunks carry several tokens (a short prompt,
the fresh tokens after a prefix hit, chunks beside decodes) replays the same graphs with every
token as a row of its own: the row's table is its sequence's and its length its position + 1,
so it attends to its causal prefix, and every row's K/V is appended before any row attends (as
in a decode step, layer by layer). Only the sampled chunks' last rows are picked, and a prefill
node's context rows are copied from the graph's final hidden states. The eager step it
replaces is host-bound (14-16 ms for the 8B shape on an H200 whatever its size,
docs/BENCHMARKS.md), the replay is one launch; the cost moves to attention, which reads a
sequence's context once per row (mostly from L2: a sequence's rows read the same pages at the
same time), so a step is taken only while its prompt rows' lengths sum to at most
``ROWS_KV_BUDGET``.

Speculative decoding (``q_len`` = 1 + K > 1): a second set of graphs runs decode steps whose
sequences carry drafts, every sequence padded to exactly ``q_len`` query rows (padding rows:
token 0, ``slot_mapping`` -1, after the real ones, so causal attention keeps them out of the
real rows' view). Attention then runs the chunked-prefill kernel with ``max_q_len = q_len``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import numpy as np
import torch

from disagg.config import env
from disagg.kernels.interface import AttentionBackend, AttentionMetadata
from disagg.model.transformer import Transformer
from disagg.protocol.executor import SeqChunk

log = logging.getLogger(__name__)

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
# the most key rows (summed over the prompt rows, each its position + 1) a step replayed as rows
# may read (DISAGG_ROWS_KV_BUDGET; 0 turns rows steps off). On an H200 (8B shape, bf16) such a
# replay took ~5.2 ms + ~23 us per 1,000 key rows (16 fresh tokens over 4k: 6.5 ms, 64: 11.2,
# 128: 17.4) against 14-16 ms eager whatever the size (host-bound launches); 300k key rows is
# ~12 ms
ROWS_KV_BUDGET = int(env("ROWS_KV_BUDGET") or 300_000)


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


def rows_step(chunks: Sequence[SeqChunk], positions: np.ndarray, tables: np.ndarray,
              hidden_rows: list[int], max_rows: int, max_pages: int,
              kv_budget: int | None = None) -> np.ndarray | None:
    """The per-row block tables (``[T, w]``: each token's sequence's row of ``tables``) of a
    step that a decode graph may run with every token as a row, or None: when no chunk has
    more than one token and no hidden row is wanted (a decode step: the graphs take it as it
    is), when a chunk wants what a decode graph does not compute (prompt logprobs, drafts), or
    when the step is too big (more than ``max_rows`` tokens, tables wider than ``max_pages``,
    rows whose lengths sum past ``kv_budget``, default ``ROWS_KV_BUDGET``: the rows of chunks
    of more than one token; a decode row reads what it would in a decode step)."""
    t = int(positions.shape[0])
    kv_budget = ROWS_KV_BUDGET if kv_budget is None else kv_budget
    if (t == len(chunks) and not hidden_rows) or t > max_rows or int(tables.shape[1]) > max_pages:
        return None
    if any(c.prompt_rows or c.num_draft or c.draft_tokens for c in chunks):
        return None
    lens = np.fromiter((len(c.token_ids) for c in chunks), dtype=np.int64, count=len(chunks))
    multi = np.repeat(lens > 1, lens)  # decode rows read what a decode step reads anyway
    if int(positions[multi].sum()) + int(multi.sum()) > kv_budget:
        return None
    return np.repeat(tables, lens, axis=0)


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
        q_len: int = 1,
    ) -> None:
        self.model = model
        self.q_len = q = q_len
        self.kv = kv
        self.backend = backend
        self.layer_hook = layer_hook
        self.page_size = int(kv.shape[4])
        self.max_model_len = max_model_len
        self.max_pages = -(-max_model_len // self.page_size)
        self.buckets = buckets_for(max_batch)
        n = self.buckets[-1]
        dev = model.device
        # every input in one device buffer, so a step's inputs go over in one copy from one of
        # two pinned staging buffers, used in turn (staging a step never overwrites what the
        # step before it may still be copying: overlapped decoding launches a step while the
        # previous one runs)
        self.layout = InputLayout(n * q, n, self.max_pages)
        self._buffer = torch.zeros(self.layout.nbytes, dtype=torch.uint8, device=dev)
        rows, self.seq_lens, self.block_tables = self.layout.views(self._buffer)
        self.input_ids, self.positions, self.slot_mapping, self.fill_src = rows
        self._staging = [torch.zeros(self.layout.nbytes, dtype=torch.uint8).pin_memory()
                         for _ in range(2)]
        self._staged = [tuple(v.numpy() for v in self.layout.views(b)) for b in self._staging]
        self._turn = 0
        self.cu_seqlens_q = torch.arange(0, n * q + 1, q, dtype=torch.int32, device=dev)
        # each replay's argmax, where the next replay's follow rows take their tokens
        # (an eager step's tokens, copied here, may be one per sequence up to ``max_batch``)
        self.sampled = torch.zeros(max(n * q, max_batch), dtype=torch.int64, device=dev)
        self._pad_positions = np.tile(np.arange(q, dtype=np.int64), n)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # bucket -> logits, argmax
        self.hidden: dict[int, torch.Tensor] = {}  # bucket -> the final hidden states
        self._last = 0  # the last replay's bucket
        self.pool = torch.cuda.graph_pool_handle()
        self.replays = 0

    def hidden_rows(self, rows: list[int]) -> torch.Tensor:
        """A copy of the last replay's final hidden states at ``rows`` (a prefill's context
        rows)."""
        idx = torch.tensor(rows, dtype=torch.int64).to(self.input_ids.device, non_blocking=True)
        return self.hidden[self._last].index_select(0, idx)

    def fits(self, num_seqs: int, max_pages: int) -> bool:
        return num_seqs <= self.buckets[-1] and max_pages <= self.max_pages

    def _meta(self, b: int) -> AttentionMetadata:
        q = self.q_len
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:b * q], block_tables=self.block_tables[:b],
            seq_lens=self.seq_lens[:b], cu_seqlens_q=self.cu_seqlens_q[: b + 1],
            num_decodes=b if q == 1 else 0, max_q_len=q, max_seq_len=self.max_model_len)

    def _forward(self, b: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        t = b * self.q_len
        ids = self.input_ids[:t]
        if self.q_len == 1:  # follow rows: the previous replay's token (overlap; no drafts)
            src = self.fill_src[:t]
            ids = torch.where(src >= 0, self.sampled.index_select(0, src.clamp(min=0)), ids)
        hidden = self.model(ids, self.positions[:t], self.kv, self._meta(b), self.backend,
                            self.layer_hook)
        logits = self.model.logits(hidden)
        if self.q_len > 1:
            return logits, logits.argmax(dim=-1), hidden
        self.sampled[:t].copy_(logits.argmax(dim=-1))
        return logits, self.sampled[:t], hidden

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
                    logits, tokens, hidden = self._forward(b)
                self.graphs[b] = graph
                self.outputs[b] = logits, tokens
                self.hidden[b] = hidden
        torch.cuda.current_stream().wait_stream(stream)
        # load the follow fill's kernels now, not at the first overlapped step (lazy loading)
        idx = torch.zeros(1, dtype=torch.int64, device=self.input_ids.device)
        self.input_ids.index_copy_(0, idx, self.input_ids.index_select(0, idx))
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    def _reset_inputs(self) -> None:
        self.input_ids.zero_()
        self.positions.copy_(torch.arange(self.q_len, device=self.positions.device).repeat(
            self.buckets[-1]))
        self.slot_mapping.fill_(-1)
        self.fill_src.fill_(-1)
        self.block_tables.zero_()
        self.seq_lens.fill_(self.q_len)

    def run(self, token_ids: np.ndarray, positions: np.ndarray, slots: np.ndarray,
            tables: np.ndarray, fill: tuple[np.ndarray, np.ndarray, torch.Tensor] | None = None
            ) -> tuple[torch.Tensor, torch.Tensor]:
        """Replay the bucket for ``n = len(token_ids) / q_len`` sequences, ``q_len`` rows each
        (the caller pads drafted sequences: ``ModelRunner._spec_graph_step``). ``tables`` is
        ``[n, w]`` with ``w <= max_pages``. ``fill`` = (rows, src, tokens): input rows whose
        token is ``tokens[src]``, a device tensor (a previous step's sampled tokens: overlapped
        decoding), taken inside the graph (``tokens`` is copied to ``sampled`` first unless it
        is the last replay's). Returns (logits ``[n * q_len, V]`` float32, argmax), views of
        the graph's outputs valid until the next replay."""
        q = self.q_len
        t = int(token_ids.shape[0])
        n = t // q
        b = pick_bucket(n, self.buckets)
        assert b is not None and n * q == t
        w = int(tables.shape[1])
        staged = self._staging[self._turn]
        host, lens, ht = self._staged[self._turn]
        self._turn ^= 1
        host[0, :b * q] = 0
        host[0, :t] = token_ids
        host[1, :b * q] = self._pad_positions[:b * q]  # padding sequences: positions 0 .. q-1
        host[1, :t] = positions
        host[2, :b * q] = -1
        host[2, :t] = slots
        host[3, :b * q] = -1
        if fill is not None:
            rows, src, tokens = fill
            host[3, rows] = src
            if tokens.data_ptr() != self.sampled.data_ptr():  # not the last replay's argmax
                self.sampled[:tokens.shape[0]].copy_(tokens)
        lens[:b] = q
        lens[:n] = positions[q - 1::q] + 1
        ht[:n, :w] = tables
        # columns the kernel reads: padding rows past a sequence's own pages read page 0
        cols = max(w, -(-int(lens[:b].max()) // self.page_size))
        ht[:n, w:cols] = 0
        ht[n:b, :cols] = 0
        # one copy: the rows, lengths and the bucket's whole block-table rows (a column slice
        # is not contiguous; torch would stage it through pageable memory, a copy that waits
        # for the device, the step in flight)
        size = self.layout.size_for(b)
        self._buffer[:size].copy_(staged[:size], non_blocking=True)
        self.graphs[b].replay()
        self.replays += 1
        self._last = b
        logits, tokens = self.outputs[b]
        return logits[:t], tokens[:t]


class InputLayout:
    """Where a graph's inputs lie in its one byte buffer: four int64 rows of ``rows`` (token
    ids, positions, slots, follow sources), then ``seqs`` int32 lengths, then the ``[seqs,
    pages]`` int32 block table, each part 256-byte aligned. The first ``size_for(b)`` bytes
    hold everything a bucket of ``b`` sequences reads."""

    ALIGN = 256

    def __init__(self, rows: int, seqs: int, pages: int) -> None:
        self.rows, self.seqs, self.pages = rows, seqs, pages
        self.lens_at = self._align(4 * rows * 8)
        self.tables_at = self._align(self.lens_at + 4 * seqs)
        self.nbytes = self.tables_at + 4 * seqs * pages

    @classmethod
    def _align(cls, n: int) -> int:
        return -(-n // cls.ALIGN) * cls.ALIGN

    def size_for(self, b: int) -> int:
        return self.tables_at + 4 * b * self.pages

    def views(self, buf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(rows ``[4, rows]`` int64, lengths ``[seqs]`` int32, tables ``[seqs, pages]``
        int32) over the uint8 tensor ``buf`` of ``nbytes``."""
        assert buf.dtype == torch.uint8 and buf.numel() == self.nbytes
        rows = buf[: 32 * self.rows].view(torch.int64).view(4, self.rows)
        lens = buf[self.lens_at : self.lens_at + 4 * self.seqs].view(torch.int32)
        tables = buf[self.tables_at :].view(torch.int32).view(self.seqs, self.pages)
        return rows, lens, tables
