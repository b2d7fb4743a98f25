"""Model runner: turns a ``StepPlan`` into tensors, runs the model, samples.

Owned by an executor process (or used in-process by ``disagg.llm.LLM``). Holds the model, the
KV cache and the attention backend; keeps no per-request state between steps.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from disagg.attention import AttentionBackend, AttentionMetadata
from disagg.cache import slot_mapping
from disagg.model.transformer import Transformer
from disagg.protocol import StepPlan
from disagg.sampling import sample


class ModelRunner:
    def __init__(
        self,
        model: Transformer,
        kv: torch.Tensor,
        backend: AttentionBackend,
        layer_hook: Callable[[int], None] | None = None,
    ):
        self.model = model
        self.kv = kv  # [L, P, 2, Hkv, S, D]
        self.page_size = kv.shape[4]
        self.num_pages = kv.shape[1]
        self.backend = backend
        self.layer_hook = layer_hook
        self.device = model.device

    def check_plan(self, plan: StepPlan) -> None:
        """Bounds-check a plan before it touches the cache (it crossed a process boundary)."""
        vocab = self.model.arch.vocab_size
        for c in plan.chunks:
            end = c.start_pos + len(c.token_ids)
            if not c.token_ids or c.start_pos < 0:
                raise ValueError(f"slot {c.slot}: empty chunk or negative start")
            if len(c.block_table) * self.page_size < end:
                raise ValueError(f"slot {c.slot}: block table too short for position {end - 1}")
            if any(not 0 <= p < self.num_pages for p in c.block_table):
                raise ValueError(f"slot {c.slot}: page id out of range")
            if any(not 0 <= t < vocab for t in c.token_ids):
                raise ValueError(f"slot {c.slot}: token id out of vocabulary")

    def build(self, plan: StepPlan) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        seq_lens: list[int] = []
        cu = [0]
        sample_rows: list[int] = []
        max_pages = max(len(c.block_table) for c in plan.chunks)
        tables = torch.zeros((len(plan.chunks), max_pages), dtype=torch.int32)
        for i, c in enumerate(plan.chunks):
            n = len(c.token_ids)
            ids.extend(c.token_ids)
            positions.extend(range(c.start_pos, c.start_pos + n))
            slots.extend(slot_mapping(c.block_table, c.start_pos, n, self.page_size))
            seq_lens.append(c.start_pos + n)
            cu.append(cu[-1] + n)
            tables[i, : len(c.block_table)] = torch.tensor(c.block_table, dtype=torch.int32)
            if c.sample:
                sample_rows.append(cu[-1] - 1)
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            block_tables=tables.to(dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=dev),
            num_decodes=plan.num_decodes,
            max_q_len=max(len(c.token_ids) for c in plan.chunks),
            max_seq_len=max(seq_lens),
        )
        input_ids = torch.tensor(ids, dtype=torch.int64, device=dev)
        pos = torch.tensor(positions, dtype=torch.int64, device=dev)
        return input_ids, pos, meta, sample_rows

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> list[int]:
        """Run one step; returns one sampled token per chunk with ``sample=True``."""
        self.check_plan(plan)
        input_ids, positions, meta, rows = self.build(plan)
        hidden = self.model(input_ids, positions, self.kv, meta, self.backend, self.layer_hook)
        if not rows:
            return []
        logits = self.model.logits(hidden[rows])
        return sample(logits, [c for c in plan.chunks if c.sample])
