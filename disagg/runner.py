"""Model runner: turns a ``StepPlan`` into tensors, runs the model, samples.

Owned by an executor process (or used in-process by ``disagg.llm.LLM``). Holds the model, the
KV cache and the attention backend; keeps no per-request state between steps.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from disagg.attention import AttentionBackend, AttentionMetadata
from disagg.cache import slot_mapping
from disagg.config import env
from disagg.kernels.counter import LayerCounter
from disagg.model.transformer import Transformer
from disagg.protocol import StepPlan
from disagg.sampling import sample


class ModelRunner:
    def __init__(
        self,
        model: Transformer,
        kv: torch.Tensor,
        backend: AttentionBackend,
        counter: LayerCounter | None = None,
    ):
        self.model = model
        self.kv = kv  # [L, P, 2, Hkv, S, D]
        self.page_size = kv.shape[4]
        self.num_pages = kv.shape[1]
        self.backend = backend
        self.counter = counter  # bumped to base + layer + 1 after each layer's o_proj
        self.layer_hook: Callable[[int], None] | None = None
        if counter is not None:
            delay = float(env("TEST_LAYER_DELAY_S") or 0)  # tests: make layers observably slow

            def bump(layer: int) -> None:
                if delay:
                    time.sleep(delay)
                counter.bump(layer + 1)

            self.layer_hook = bump
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

    def build(
        self, plan: StepPlan
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int], list[int]]:
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        seq_lens: list[int] = []
        cu = [0]
        sample_rows: list[int] = []
        hidden_rows: list[int] = []
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
            if c.want_hidden:
                hidden_rows.append(cu[-1] - 1)
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
        return input_ids, pos, meta, sample_rows, hidden_rows

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> tuple[list[int], torch.Tensor | None]:
        """Run one step. Returns one sampled token per chunk with ``sample=True`` and the final
        hidden states ``[k, H]`` of the chunks with ``want_hidden`` (None when there are none)."""
        self.check_plan(plan)
        input_ids, positions, meta, rows, hidden_rows = self.build(plan)
        if self.counter is not None:
            self.counter.set_base(plan.counter_base)
        hidden = self.model(input_ids, positions, self.kv, meta, self.backend, self.layer_hook)
        ctx = hidden[hidden_rows] if hidden_rows else None
        if not rows:
            return [], ctx
        logits = self.model.logits(hidden[rows])
        return sample(logits, [c for c in plan.chunks if c.sample]), ctx
