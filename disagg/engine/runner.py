"""Model runner: turns a ``StepPlan`` into tensors, runs the model, samples.

Owned by an executor process (or used in-process by ``disagg.llm.LLM``). Holds the model, the
KV cache and the attention backend; keeps no per-request state between steps.

Host work per step is vectorised (numpy over the flattened plan: one pass builds token ids,
positions, slots, block tables and checks the bounds). On CUDA, ``enable_cuda_graphs`` makes
decode-only steps replay a captured graph (``disagg.engine.cuda_graphs``), and so do small steps
with prompt chunks, every token a row of its own (``cuda_graphs.rows_step``); larger prefill and
mixed steps run eagerly.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

import msgspec
import numpy as np
import torch

from disagg.config import env
from disagg.engine.host_step import HostStep, flatten_plan
from disagg.engine.launched import Launched
from disagg.engine.picking import Fill, pick, prompt_rows, verify_rows
from disagg.engine.speculative import emitted_per_chunk
from disagg.kernels.counter import LayerCounter
from disagg.kernels.interface import AttentionBackend, AttentionMetadata
from disagg.model.transformer import Transformer
from disagg.protocol.executor import SeqChunk, StepPlan

if TYPE_CHECKING:
    from disagg.engine.cuda_graphs import DecodeGraphs

log = logging.getLogger(__name__)


class Drafter(Protocol):  # engine/drafting.py's DraftModel: fills drafts before the target runs
    def fill(self, plan: StepPlan) -> StepPlan: ...


class StepDrafter(Protocol):  # engine/mtp_drafting.py's MTPDrafter: drafts after each step
    def after_step(self, plan: StepPlan, hidden: torch.Tensor,
                   emitted: list[list[int]]) -> list[list[int]]: ...


class ModelRunner:
    def __init__(
        self,
        model: Transformer,
        kv: torch.Tensor,
        backend: AttentionBackend,
        counter: LayerCounter | None = None,
    ):
        self.model = model
        self.kv = kv  # [L, P, kv_parts (K, V: 2; MLA latent: 1), Hkv, S, D]
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
        self.split_bound = 0  # CUDA: decode split count chosen for this bound (graph-stable)
        self.graphs: DecodeGraphs | None = None  # disagg.engine.cuda_graphs.DecodeGraphs once enabled (CUDA only)
        self.spec_graphs: DecodeGraphs | None = None  # decode steps carrying drafts
        self.drafter: Drafter | None = None  # draft-model speculation (sees every step)
        self.mtp_drafter: StepDrafter | None = None  # MTP speculation (after every step)
        self.next_drafts: list[list[int]] | None = None  # mtp: the last step's drafts
        # a prefill node's draft model: prefilled over each step's chunks, first (drafting)
        self.spec_prefill: Callable[[StepPlan], None] | None = None
        # overlapped decoding: the last step's sampled tokens (on the device) and the row of
        # each slot in them, for the next step's follow chunks; None when it sampled none
        self._prev: tuple[torch.Tensor, dict[int, int]] | None = None
        self._pinned: list[torch.Tensor] = []  # two host buffers for sampled tokens, in turn
        self.reload_events: list[Any] = []  # per layer, a host-tier reload's (tier_reload)

    def enable_cuda_graphs(self, max_batch: int, max_model_len: int, spec_tokens: int = 0) -> float:
        """Capture decode-only steps for batch buckets up to ``max_batch`` (CUDA only; a no-op
        elsewhere), and with ``spec_tokens`` > 0 decode steps carrying that many drafts per
        sequence (buckets up to 64). Returns the capture time in seconds."""
        if self.device.type != "cuda":
            return 0.0
        from disagg.engine.cuda_graphs import DecodeGraphs

        graphs = DecodeGraphs(self.model, self.kv, self.backend, max_batch, max_model_len,
                              self.layer_hook)
        seconds = graphs.capture_all()
        self.graphs = graphs
        log.info("captured decode CUDA graphs for batch sizes %s in %.1f s", graphs.buckets,
                 seconds)
        if spec_tokens > 0:
            spec = DecodeGraphs(self.model, self.kv, self.backend, min(max_batch, 64),
                                max_model_len, self.layer_hook, q_len=spec_tokens + 1)
            took = spec.capture_all()
            seconds += took
            self.spec_graphs = spec
            log.info("captured speculative decode CUDA graphs (%d drafts) for batch sizes %s in "
                     "%.1f s", spec_tokens, spec.buckets, took)
        self.pin_decode_splits(max_batch, max_model_len)
        return seconds

    @torch.inference_mode()
    def pin_decode_splits(self, max_batch: int, max_model_len: int) -> int:
        """Pin the decode split count of eager steps to ``max_model_len`` (as the graphs do),
        so it depends on the batch size only, and compile each distinct launch now rather
        than mid-serving (CUDA, triton backend). Returns the launches compiled."""
        from disagg.engine.decode_splits import decode_split_launches

        if self.device.type != "cuda" or self.backend.name != "triton":
            return 0
        t0 = time.perf_counter()
        self.split_bound = max_model_len
        launches = decode_split_launches(self, max_batch, max_model_len)
        for _, launch in launches:
            launch()
        torch.cuda.synchronize(self.device)
        log.info("compiled %d eager decode launch shapes in %.1f s", len(launches),
                 time.perf_counter() - t0)
        return len(launches)

    @torch.inference_mode()
    def warm_prefill(self, max_batch_tokens: int, max_model_len: int) -> list[int]:
        """Run one eager prefill step per attention tile variant (chunks of at most 64 query
        rows, and more) and of one row (the GEMV) before serving, so their kernels compile now
        rather than stalling the first short and the first long prompt. It writes KV into pages that hold nothing yet
        and leaves the layer counter alone; and the fused MoE kernels' tile variants for up to
        ``max_batch_tokens`` rows (every MoE layer has the same shapes). Returns the chunk
        lengths run."""
        from disagg.model.moe import MoEMLP, warm

        moe = next((m for m in self.model.modules() if isinstance(m, MoEMLP)), None)
        if moe is not None:
            warm(moe, max_batch_tokens)
        hook, counter = self.layer_hook, self.counter
        self.layer_hook, self.counter = None, None
        lengths = sorted({min(n, max_batch_tokens, max_model_len) for n in (1, 8, 96)})
        try:
            for n in lengths:
                pages = -(-n // self.page_size)
                if pages <= self.num_pages:
                    chunk = SeqChunk(0, [0] * n, 0, list(range(pages)), True)
                    self.execute(StepPlan(0, [chunk], 0))
        finally:
            self.layer_hook, self.counter = hook, counter
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return lengths

    def check_plan(self, plan: StepPlan) -> None:
        """Bounds-check a plan before it touches the cache (it crossed a process boundary)."""
        flatten_plan(plan, self.page_size, self.num_pages, self.model.arch.vocab_size)

    def build(self, plan: StepPlan) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata,
                                             list[int], list[int]]:
        host = flatten_plan(plan, self.page_size, self.num_pages, self.model.arch.vocab_size)
        return (*self._to_device(host, plan.num_decodes), host.sample_rows, host.hidden_rows)

    def _to_device(self, host: HostStep, num_decodes: int
                   ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        dev = self.device

        def put(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(a).to(dev, non_blocking=True)

        meta = AttentionMetadata(
            slot_mapping=put(host.slots), block_tables=put(host.tables),
            seq_lens=put(host.seq_lens), cu_seqlens_q=put(host.cu), num_decodes=num_decodes,
            max_q_len=host.max_q_len, max_seq_len=max(host.max_seq_len, self.split_bound))
        return put(host.token_ids), put(host.positions), meta

    def _graphable(self, plan: StepPlan, host: HostStep) -> bool:
        if self.graphs is None or plan.num_decodes != len(plan.chunks):
            return False
        if host.max_q_len != 1 or len(host.sample_rows) != len(plan.chunks) or host.hidden_rows:
            return False
        return self.graphs.fits(len(plan.chunks), int(host.tables.shape[1]))

    def _spec_graph_step(self, plan: StepPlan, host: HostStep) -> Launched | None:
        """Replay a speculative decode graph for a step of decodes carrying drafts (each
        padded to the graph's rows), or None when the step does not fit one."""
        g = self.spec_graphs
        chunks = plan.chunks
        if g is None or host.hidden_rows or not any(c.num_draft for c in chunks):
            return None
        q = g.q_len
        lens = np.fromiter((len(c.token_ids) for c in chunks), dtype=np.int64, count=len(chunks))
        if (not all(c.sample and len(c.token_ids) == c.num_draft + 1 for c in chunks)
                or int(lens.max()) > q or not g.fits(len(chunks), int(host.tables.shape[1]))
                or int(host.positions.max()) + q > g.max_model_len):
            return None
        starts = host.positions[host.cu[:-1]]
        real = np.arange(q)[None, :] < lens[:, None]
        ids = np.zeros((len(chunks), q), dtype=np.int64)
        ids[real] = host.token_ids
        slots = np.full((len(chunks), q), -1, dtype=np.int64)
        slots[real] = host.slots
        positions = starts[:, None] + np.arange(q)[None, :]
        logits, _ = g.run(ids.ravel(), positions.ravel(), slots.ravel(), host.tables)
        rows = torch.from_numpy(np.flatnonzero(real.ravel())).to(self.device, non_blocking=True)
        return self._verify(logits.index_select(0, rows), list(chunks))

    def _rows_graph_step(self, plan: StepPlan, host: HostStep, fill: Fill | None,
                         waits: list[Any]) -> Launched | None:
        """Replay a decode graph for a small step with prompt chunks, each token a row
        (``cuda_graphs.rows_step``), or None when the step is not one."""
        from disagg.engine.cuda_graphs import rows_step

        g = self.graphs
        if g is None or (tables := rows_step(plan.chunks, host.positions, host.tables,
                                             host.hidden_rows, g.buckets[-1],
                                             g.max_pages)) is None:
            return None
        if waits:
            waits[-1].wait()  # a replay waits for the whole reload (its last layer)
        logits, greedy = g.run(host.token_ids, host.positions, host.slots, tables, fill)
        ctx = g.hidden_rows(host.hidden_rows) if host.hidden_rows else None
        sampled = [c for c in plan.chunks if c.sample]
        if not sampled:
            return Launched([], ctx)
        rows = torch.tensor(host.sample_rows, dtype=torch.int64).to(self.device,
                                                                    non_blocking=True)
        logits, greedy = logits.index_select(0, rows), greedy.index_select(0, rows)
        if any(c.late_mask for c in plan.chunks):
            return self._late_pick(plan.chunks, logits, greedy, fill, ctx)
        return self._pick(plan.chunks, sampled, logits, greedy, fill, ctx)

    def execute(self, plan: StepPlan) -> tuple[list[int], torch.Tensor | None, list[int] | None]:
        """Run one step and wait for it: ``launch(plan).wait()``."""
        return self.launch(plan).wait()

    def _follow_fill(self, plan: StepPlan, host: HostStep,
                     prev: tuple[torch.Tensor, dict[int, int]] | None
                     ) -> tuple[np.ndarray, np.ndarray, torch.Tensor] | None:
        """(input rows, source rows, the previous step's tokens) for the plan's follow chunks,
        or None without any. Raises ValueError for a slot the previous step did not sample."""
        follows = [i for i, c in enumerate(plan.chunks) if c.follow]
        if not follows:
            return None
        if self.drafter is not None or self.mtp_drafter is not None or self.spec_prefill:
            raise ValueError("follow chunks need a runner without speculative decoding")
        rows_of = {} if prev is None else prev[1]
        src = []
        for i in follows:
            if (row := rows_of.get(plan.chunks[i].slot)) is None:
                raise ValueError(f"slot {plan.chunks[i].slot}: follows a step that sampled no "
                                 "token for it")
            src.append(row)
        assert prev is not None
        return host.cu[follows].astype(np.int64), np.asarray(src, dtype=np.int64), prev[0]

    def _sampled(self, chunks: list[SeqChunk], tokens: torch.Tensor,
                 ctx: torch.Tensor | None = None) -> Launched:
        """Keep a step's device tokens for the next step's follow chunks and queue their copy
        to the host (CUDA: into one of two pinned buffers, behind an event)."""
        self._prev = (tokens, {c.slot: i for i, c in enumerate(chunks)})
        if tokens.device.type != "cuda":
            return Launched(tokens, ctx)
        n = int(tokens.shape[0])
        if not self._pinned or self._pinned[0].shape[0] < n:
            self._pinned = [torch.empty(max(n, 256), dtype=torch.int64).pin_memory()
                            for _ in range(2)]
        self._pinned.reverse()
        host = self._pinned[0][:n]
        host.copy_(tokens, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return Launched(host, ctx, event=event)

    @torch.inference_mode()
    def launch(self, plan: StepPlan) -> Launched:
        """Queue one step on the device; its ``Launched.wait()`` returns the sampled tokens of
        the chunks with ``sample=True`` (one each, or with drafts the 1 .. num_draft + 1 that
        verification emits: then ``counts`` says how many per chunk, else it is None) and the
        final hidden states ``[k, H]`` of the chunks with ``want_hidden`` (None when there are
        none). A follow chunk's token is the one its slot sampled in the previous step, filled
        in on the device. Decode steps without drafts leave the device working (CUDA); the
        others return done."""
        prev, self._prev = self._prev, None  # a failed step leaves nothing to follow
        if self.drafter is not None:  # its own runner bounds-checks what it computes
            plan = self.drafter.fill(plan)
        host = flatten_plan(plan, self.page_size, self.num_pages, self.model.arch.vocab_size)
        fill = self._follow_fill(plan, host, prev)
        if self.spec_prefill is not None:
            self.spec_prefill(plan)
        if self.counter is not None:
            self.counter.set_base(plan.counter_base)
        graphs_ok = self.mtp_drafter is None  # MTP needs every step's hidden rows
        waits = self.reload_events if plan.reload_wait else []
        if waits and graphs_ok and self.spec_graphs is not None:  # (tiers refuse drafts)
            waits[-1].wait()
        if graphs_ok and self.graphs is not None and self._graphable(plan, host):
            if waits:
                waits[-1].wait()  # a replay waits for the whole reload (its last layer)
            logits, greedy = self.graphs.run(host.token_ids, host.positions, host.slots,
                                             host.tables, fill)
            if any(c.late_mask for c in plan.chunks):
                return self._late_pick(plan.chunks, logits, greedy, fill)
            return self._pick(plan.chunks, plan.chunks, logits, greedy, fill)
        if graphs_ok and self.spec_graphs is not None and (
                out := self._spec_graph_step(plan, host)):
            return out
        if graphs_ok and self.drafter is None and (
                out := self._rows_graph_step(plan, host, fill, waits)):
            return out
        input_ids, positions, meta = self._to_device(host, plan.num_decodes)
        if fill is not None:
            at, src, last = fill
            input_ids.index_copy_(0, torch.from_numpy(at).to(self.device),
                                  last.index_select(0, torch.from_numpy(src).to(self.device)))
        hidden = self.model(input_ids, positions, self.kv, meta, self.backend, self.layer_hook,
                            (lambda i: waits[i].wait()) if waits else None)
        rows, hidden_rows = host.sample_rows, host.hidden_rows
        ctx = hidden[hidden_rows] if hidden_rows else None
        prompt = prompt_rows(self.model, plan, host.cu, hidden)
        sampled: list[SeqChunk] = [c for c in plan.chunks if c.sample]
        out = Launched([], ctx)
        if rows:
            logits = self.model.logits(hidden[rows])
            if len(rows) != len(sampled):
                out = self._verify(logits, sampled, ctx)
            elif any(c.late_mask for c in plan.chunks) and self.mtp_drafter is None:
                out = self._late_pick(plan.chunks, logits, None, fill, ctx)
            else:
                out = self._pick(plan.chunks, sampled, logits, None, fill, ctx,
                                 keep=self.mtp_drafter is None)
        out.prompt = prompt
        if self.mtp_drafter is not None:
            tokens, _, counts = out.wait()
            self.next_drafts = self.mtp_drafter.after_step(
                plan, hidden, emitted_per_chunk(tokens, counts, len(sampled)))
        return out

    def _pick(self, chunks: list[SeqChunk], sampled: list[SeqChunk], logits: torch.Tensor,
              argmax: torch.Tensor | None, fill: Fill | None, ctx: torch.Tensor | None = None,
              keep: bool = True) -> Launched:
        """``picking.pick``'s tokens and logprobs as a step on its way; ``keep``: kept for the
        next step's follow chunks (``_sampled``)."""
        tokens, logprobs = pick(logits, chunks, sampled, argmax, fill)
        if logprobs is not None:
            logprobs.stage()  # read behind the step's event, not after the next step
        out = self._sampled(sampled, tokens, ctx) if keep else Launched(tokens, ctx)
        out.logprobs = logprobs
        return out

    def _late_pick(self, chunks: list[SeqChunk], logits: torch.Tensor,
                   argmax: torch.Tensor | None, fill: Fill | None,
                   ctx: torch.Tensor | None = None) -> Launched:
        """A step with ``late_mask`` chunks, its forward pass queued: the tokens are picked
        (``_pick``, on the same logits) when ``Launched.with_masks`` brings the masks; a late
        chunk without one is picked unconstrained (its request ended: the token is dropped).
        Nothing may follow the step before that."""
        self._prev = None

        def picker(masks: Mapping[int, bytes | memoryview]) -> Launched:
            new = [msgspec.structs.replace(c, allowed=masks.get(c.slot, b""), late_mask=False)
                   if c.late_mask else c for c in chunks]
            with torch.inference_mode():
                return self._pick(new, [c for c in new if c.sample], logits, argmax, fill,
                                  ctx)

        out = Launched([], ctx)
        out.picker = picker
        if logits.is_cuda:  # (the executor answers a step whose forward was done first)
            out.forward = torch.cuda.Event()
            out.forward.record()
        return out

    def _verify(self, logits: torch.Tensor, sampled: list[SeqChunk],
                ctx: torch.Tensor | None = None) -> Launched:
        tokens, counts, logprobs = verify_rows(logits, sampled)
        out = Launched(tokens, ctx, counts)
        out.logprobs = logprobs
        return out


@torch.inference_mode()
def profile_peak_memory(model: Transformer, backend: AttentionBackend, page_size: int,
                        max_batch_tokens: int, max_running: int, max_model_len: int) -> int:
    """Peak bytes torch allocates on the model's CUDA device for the largest step the scheduler
    can send: ``max_batch_tokens`` prefill tokens (sequences of at most ``max_model_len``) on a
    throwaway cache, then logits for ``min(max_running, max_batch_tokens)`` rows."""
    dev = model.device
    arch = model.arch
    lens = []
    left = max_batch_tokens
    while left > 0:
        lens.append(min(left, max_model_len))
        left -= lens[-1]
    pages = [-(-n // page_size) for n in lens]
    kv = torch.zeros((arch.num_layers, sum(pages), arch.kv_parts, arch.num_kv_heads, page_size,
                      arch.head_dim), dtype=model.dtype, device=dev)
    chunks: list[SeqChunk] = []
    first = 0
    for n, p in zip(lens, pages, strict=True):
        chunks.append(SeqChunk(len(chunks), [1] * n, 0, list(range(first, first + p)), True))
        first += p
    runner = ModelRunner(model, kv, backend)
    host = flatten_plan(StepPlan(0, chunks, 0), page_size, sum(pages), arch.vocab_size)
    torch.cuda.synchronize(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    input_ids, positions, meta = runner._to_device(host, 0)
    hidden = model(input_ids, positions, kv, meta, backend)
    rows = min(max_running, max_batch_tokens)
    model.logits(hidden[:rows]).argmax(dim=-1)
    torch.cuda.synchronize(dev)
    peak = int(torch.cuda.max_memory_allocated(dev))
    del kv, hidden, runner
    torch.cuda.empty_cache()
    return peak
