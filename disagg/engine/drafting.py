"""Draft-model speculation in the executor: fill a step's drafts before the target verifies.

The draft model (same vocabulary, smaller) has its own paged KV cache with the target's page
ids, so the scheduler's block tables serve both. For a step whose chunks ask for
``draft_tokens`` drafts, ``DraftModel.fill``:

1. runs the draft over every chunk (``draft_prefix``, the tokens before the chunk it has not
   computed -- one after a fully accepted run, the whole prompt after a remote prefill -- then
   the chunk's own tokens), taking its greedy token after each drafting chunk: draft 1;
2. runs k more single-token steps over the drafting chunks, each feeding the last draft at
   the next position: drafts 2 .. k, and a last one that only computes draft k's KV (so after
   a fully accepted run the draft has seen every token and its next step is a plain decode,
   graph-replayable, instead of a two-token chunk);
3. returns the plan with each drafting chunk's ``token_ids`` extended by its drafts
   (``num_draft``), for the target to verify (``disagg.engine.speculative``).

Drafts are the draft model's greedy choices, verified by comparing each with the target's
own token there (its seeded draw for a sampled request). The draft's KV past the accepted
tokens is overwritten later, never read. Its steps replay the draft runner's decode CUDA
graphs when they are plain decodes.

Across the split (SEED.md 25) a prefill node given the same draft model prefills it too
(``DraftModel.prefill``: the draft over every chunk of the step, before the model, sampling
nothing), into a cache that lies in the node's registered KV memory right after the model's
(``KVAllocation.spec_tensor``), so its messenger ships the draft's pages beside the model's and
the decoder's first step drafts at once (``KVLayoutDesc.spec``).
"""

from __future__ import annotations

import logging
from typing import Any

import msgspec
import torch

from disagg.engine.runner import ModelRunner
from disagg.model.transformer import Transformer
from disagg.protocol.executor import SeqChunk, StepPlan

log = logging.getLogger(__name__)


class DraftModel:
    def __init__(self, runner: ModelRunner, target_vocab: int):
        vocab = runner.model.arch.vocab_size
        if vocab != target_vocab:
            raise ValueError(f"the draft model's vocabulary ({vocab}) differs from the target's "
                             f"({target_vocab})")
        self.runner = runner

    def fill(self, plan: StepPlan) -> StepPlan:
        chunks = plan.chunks
        drafting = [i for i, c in enumerate(chunks) if c.draft_tokens > 0]
        first = [_first_pass(c) for c in chunks]
        single = all(len(c.token_ids) == 1 for c in first)
        if single:  # a plain decode step for the draft: every row sampled, graph-replayable
            first = [msgspec.structs.replace(c, sample=True) for c in first]
        lead = next((i for i, c in enumerate(first) if len(c.token_ids) > 1), len(first))
        tokens, _, _ = self.runner.execute(StepPlan(plan.step_id, first, lead))
        sampled = [i for i, c in enumerate(first) if c.sample]
        last = dict(zip(sampled, tokens, strict=True))
        drafts = {i: [last[i]] for i in drafting}
        for j in range(1, max((chunks[i].draft_tokens for i in drafting), default=0) + 1):
            rows = [i for i in drafting if chunks[i].draft_tokens >= j]
            step = [SeqChunk(chunks[i].slot, [drafts[i][-1]], chunks[i].start_pos + j,
                             chunks[i].block_table, True) for i in rows]
            out, _, _ = self.runner.execute(StepPlan(plan.step_id, step, len(step)))
            for i, t in zip(rows, out, strict=True):
                if len(drafts[i]) < chunks[i].draft_tokens:  # the last pass: KV only
                    drafts[i].append(t)
        filled = [msgspec.structs.replace(c, token_ids=c.token_ids + drafts[i],
                                          num_draft=len(drafts[i]), draft_tokens=0,
                                          draft_prefix=[])
                  if i in drafts else c for i, c in enumerate(chunks)]
        return StepPlan(plan.step_id, filled, plan.num_decodes, plan.counter_base)

    def prefill(self, plan: StepPlan) -> None:
        """A prefill node's step for the draft: its KV over every chunk, nothing sampled."""
        chunks = [SeqChunk(c.slot, c.token_ids, c.start_pos, c.block_table, False)
                  for c in plan.chunks]
        self.runner.execute(StepPlan(plan.step_id, chunks, plan.num_decodes))


def _first_pass(c: SeqChunk) -> SeqChunk:
    """The draft's view of a chunk: its unseen prefix and its tokens, greedy, sampled only when
    it drafts."""
    return SeqChunk(c.slot, c.draft_prefix + c.token_ids, c.start_pos - len(c.draft_prefix),
                    c.block_table, c.draft_tokens > 0)


def attach_draft(runner: ModelRunner, draft: Transformer, kv: torch.Tensor, backend: str,
                 graphs: bool, max_batch: int, max_model_len: int,
                 prefill_only: bool = False) -> DraftModel:
    """Give ``runner`` a draft model over ``kv`` (its cache with the runner's page ids:
    ``spec_layout``), its own attention backend (an MLA draft takes auto's where the target's
    is flashinfer), and decode CUDA graphs when the target has them. ``prefill_only`` (a
    prefill node): it only prefills (``DraftModel.prefill`` before each step)."""
    from disagg.engine.attention import get_backend

    a = draft.arch
    mla_ok = a.mla is None or backend != "flashinfer"
    sub = ModelRunner(draft, kv, get_backend(backend if mla_ok else "auto", draft.device))
    if graphs and not prefill_only and (a.moe is None or draft.dtype != torch.float32):
        sub.enable_cuda_graphs(max_batch, max_model_len)
    if draft.device.type == "cuda":  # its eager steps compile before ready
        if sub.graphs is None:
            sub.pin_decode_splits(max_batch, max_model_len)
        sub.warm_prefill(max_batch, max_model_len)
    drafter = DraftModel(sub, runner.model.arch.vocab_size)
    if prefill_only:
        runner.spec_prefill = drafter.prefill
    else:
        runner.drafter = drafter
    log.info("draft model %s: %d layers, %.1f MiB KV over the same %d pages%s", a.architecture,
             a.num_layers, kv.nbytes / 2**20, runner.num_pages,
             " (prefilled here, shipped to decoders)" if prefill_only else "")
    return drafter


def spec_layout(layout: Any, draft: Transformer | None, mtp: Transformer | None) -> Any:
    """The ``KVLayout`` of the speculative region of an executor's KV memory (after the
    model's, same pages): a draft model's cache, or the MTP layers' (``mtp``: the model, when
    it drafts with its MTP layers); None without either."""
    from disagg.engine.kv_memory import KVLayout

    if draft is not None:
        a, dtype = draft.arch, draft.dtype
        layers = a.num_layers
    elif mtp is not None:
        a, dtype = mtp.arch, mtp.dtype
        layers = 1  # the MTP layer this engine drafts with (disagg.model.mtp)
    else:
        return None
    return KVLayout(layers, layout.num_pages, a.num_kv_heads, layout.page_size, a.head_dim,
                    dtype, a.kv_parts)


def share_with_draft(pages: int, arch: Any, draft: Any) -> int:
    """Pages sized for the target alone, shrunk so a draft model's cache with the same page
    ids fits in the same budget."""
    if draft is None:
        return pages
    a, d = arch, draft.arch
    mine = a.num_layers * a.kv_parts * a.num_kv_heads * a.head_dim
    theirs = d.num_layers * d.kv_parts * d.num_kv_heads * d.head_dim
    return max(1, pages * mine // (mine + theirs))
