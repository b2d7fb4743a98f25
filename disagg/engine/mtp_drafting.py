"""Multi-token-prediction drafting in the executor (``--speculative-method mtp``).

After the main model's step, ``MTPDrafter.after_step`` runs the checkpoint's MTP layer
(``disagg.model.mtp``) over the positions whose token became known in the step, each with the
main model's hidden state at the position before: a chunk at positions ``s .. s + n - 1`` gives
positions ``s + 1 .. s + kept`` (``kept``: the positions whose tokens the step kept: all, or
the accepted drafts plus one), their tokens being the chunk's next ones and the token the step
emitted (an unfinished prefill chunk: ``SeqChunk.next_token``, the prompt's next token). A
chunk starting at 0 also computes position 0 (no previous token). Every position's MTP KV is
therefore written exactly once, in the step that learns its token, and a later step sees it.

For each chunk that sampled, the layer then drafts: its output at the last position predicts
draft 1; fed back (with draft 1 as the token) it predicts draft 2, and so on. Drafts are
returned per sampled chunk; the scheduler offers them as the next step's drafts (so the next
step verifies them like prompt-lookup drafts). The scheduler reserves the page of the
position after a chunk (``BatchScheduler`` look-ahead), and the drafting positions' pages
when free; a draft whose position has no page is not made.
"""

from __future__ import annotations

import torch

from disagg.engine.host_step import flatten_plan
from disagg.engine.runner import ModelRunner
from disagg.protocol.executor import SeqChunk, StepPlan


class MTPDrafter:
    def __init__(self, runner: ModelRunner, tokens: int, cache: torch.Tensor | None = None):
        """``cache``: the layer's KV (one layer over the runner's pages), by default its own;
        a node passes the spec region of its KV memory (shipped by prefill nodes)."""
        model = runner.model
        if model.mtp is None:
            raise ValueError("--speculative-method mtp needs the checkpoint's MTP layer loaded")
        a = model.arch
        self.runner, self.tokens = runner, tokens
        shape = (1, runner.num_pages, a.kv_parts, a.num_kv_heads, runner.page_size, a.head_dim)
        if cache is not None and tuple(cache.shape) != shape:
            raise ValueError(f"MTP cache of shape {tuple(cache.shape)}, expected {shape}")
        self.cache = (cache if cache is not None
                      else torch.zeros(shape, dtype=model.dtype, device=model.device))

    @torch.inference_mode()
    def after_step(self, plan: StepPlan, hidden: torch.Tensor,
                   emitted: list[list[int]]) -> list[list[int]]:
        """``hidden``: the step's final hidden rows; ``emitted``: per sampled chunk, the tokens
        the step emitted. Returns the drafts per sampled chunk."""
        chunks: list[SeqChunk] = []
        rows: list[int] = []  # per MTP position: its previous hidden row in ``source``
        h = hidden.shape[1]
        extra = [hidden.new_zeros(1, h)]  # after the step's rows: zeros, then given rows
        row = 0
        out_index = 0
        last_of: dict[int, int] = {}  # sampled chunk -> index of its MTP chunk
        for c in plan.chunks:
            n = len(c.token_ids)
            tokens = list(c.token_ids)
            if c.sample:
                kept = emitted[out_index]  # with drafts: the accepted ones and one more
                tokens = (tokens[:len(kept)] if c.num_draft else tokens) + [kept[-1]]
            elif c.next_token >= 0:
                tokens = tokens + [c.next_token]
            positions = list(range(c.start_pos + 1, c.start_pos + len(tokens)))
            src = [row + j for j in range(len(positions))]  # hidden at the position before
            ids = tokens[1:]
            if c.start_pos == 0:  # position 0: its own token, no previous hidden
                positions, ids, src = [0, *positions], [tokens[0], *ids], [-1, *src]
            elif c.prev_hidden:  # after a remote prefill: the prefiller's last hidden row
                extra.append(torch.frombuffer(bytearray(c.prev_hidden), dtype=hidden.dtype)
                             .view(1, h).to(hidden.device))
                positions, ids = [c.start_pos, *positions], [tokens[0], *ids]
                src = [-len(extra), *src]
            limit = len(c.block_table) * self.runner.page_size
            keep = [j for j, p in enumerate(positions) if p < limit]
            if keep:
                if c.sample:
                    last_of[out_index] = len(chunks)
                chunks.append(SeqChunk(c.slot, [ids[j] for j in keep], positions[keep[0]],
                                       c.block_table, c.sample))
                rows += [src[j] for j in keep]
            if c.sample:
                out_index += 1
            row += n
        drafts: list[list[int]] = [[] for _ in emitted]
        if not chunks:
            return drafts
        source = torch.cat([hidden, *extra])  # row -k: extra[k - 1]
        index = torch.tensor([r if r >= 0 else hidden.shape[0] - r - 1 for r in rows],
                             device=hidden.device)
        previous = source.index_select(0, index)
        y, last = self._run(StepPlan(plan.step_id, chunks, 0), previous)
        tails = {k: last[v] for k, v in last_of.items()}
        for _ in range(self.tokens):
            if not tails:
                break
            picks = self._argmax(y, tails)
            step, keys = [], []
            for k, (tok, (pos, table)) in picks.items():
                drafts[k].append(tok)
                if len(drafts[k]) < self.tokens and pos + 1 < len(table) * self.runner.page_size:
                    step.append(SeqChunk(chunks[last_of[k]].slot, [tok], pos + 1, table, True))
                    keys.append(k)
            if not step:
                break
            prev_rows = torch.stack([y[tails[k][0]] for k in keys])
            y, last = self._run(StepPlan(plan.step_id, step, len(step)), prev_rows)
            tails = {k: last[i] for i, k in enumerate(keys)}
        return drafts

    def _run(self, plan: StepPlan, previous: torch.Tensor
             ) -> tuple[torch.Tensor, list[tuple[int, tuple[int, list[int]]]]]:
        """The MTP layer over ``plan``; returns its output rows and, per chunk, (its last row,
        (its last position, its block table))."""
        r = self.runner
        model = r.model
        assert model.mtp is not None
        host = flatten_plan(plan, r.page_size, r.num_pages, model.arch.vocab_size)
        ids, positions, meta = r._to_device(host, plan.num_decodes)
        cos, sin = model.rotary.cos_sin(positions, model.dtype)
        y = model.mtp(ids, previous, positions, model.embed, cos, sin, self.cache, meta,
                      r.backend)
        ends = host.cu[1:] - 1
        last = [(int(ends[i]), (int(host.positions[ends[i]]), c.block_table))
                for i, c in enumerate(plan.chunks)]
        return y, last

    def _argmax(self, y: torch.Tensor, tails: dict[int, tuple[int, tuple[int, list[int]]]]
                ) -> dict[int, tuple[int, tuple[int, list[int]]]]:
        keys = list(tails)
        rows = torch.tensor([tails[k][0] for k in keys], device=y.device)
        tokens = self.runner.model.logits(y.index_select(0, rows)).argmax(dim=-1).tolist()
        return {k: (int(t), tails[k][1]) for k, t in zip(keys, tokens, strict=True)}
