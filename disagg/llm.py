"""In-process offline engine: the scheduler and a model runner in one Python process.

The engine core the node runs across processes (``disagg.engine.core``), driven synchronously
over a ``ModelRunner``; handy for scripts, and the fastest way to test scheduling and model
parity.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass

import torch

from disagg.engine.attention import get_backend
from disagg.engine.cache import PagePool
from disagg.engine.core import EngineCore, drive
from disagg.engine.grammar import Grammars
from disagg.engine.kv_disk import identity
from disagg.engine.kv_memory import KVLayout
from disagg.engine.kv_tiers import KVTiers
from disagg.engine.prefix_tiers import TieredScheduler
from disagg.engine.runner import ModelRunner
from disagg.engine.scheduling import BatchScheduler, Sequence
from disagg.engine.speculative import Speculation
from disagg.engine.tier_copy import HostPool, SyncMover, open_disk, page_views
from disagg.kernels.kv_quant import kv_dtype
from disagg.model.tokenizer import Tokenizer
from disagg.model.transformer import Transformer
from disagg.protocol import SamplingParams, TokenLogprobs


@dataclass(frozen=True)
class Output:
    token_ids: list[int]
    finish_reason: str
    # SamplingParams.logprobs: one entry per token_ids; prompt_logprobs: one per prompt token
    # after the first; None when not asked
    logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs] | None = None
    cached_tokens: int = 0  # prompt tokens taken from the prefix cache


class LLM:
    def __init__(
        self,
        model: Transformer,
        num_pages: int = 256,
        page_size: int = 16,
        max_batch_tokens: int = 2048,
        max_running: int = 256,
        max_model_len: int | None = None,
        attention_backend: str = "auto",
        prefix_caching: bool = True,
        speculative: Speculation | None = None,
        draft_model: Transformer | None = None,
        overlap: bool = False,
        kv_cache_dtype: str = "auto",
        tokenizer: Tokenizer | None = None,
        kv_host_cache_mb: int = 0,
        kv_disk_cache_dir: str = "",
        kv_disk_cache_mb: int = 64,
        kv_host_cache_pages: int = 0,
    ):
        """``speculative``: drafting (``Speculation``); with method ``draft``, ``draft_model``
        is the draft (same vocabulary, on the same device); ``overlap``: launch each decode step
        before the previous one's tokens are taken (``disagg.engine.core``);
        ``kv_cache_dtype``: ``--kv-cache-dtype`` (``fp8_e4m3``: FP8 pages, ``kv_quant``);
        ``tokenizer``: the model's, for constrained requests (``SamplingParams.structured``,
        compiled here in the caller's thread; ``GrammarError`` for one that cannot be served);
        ``kv_host_cache_mb``: a host tier behind the prefix cache (``--kv-host-cache-mb``,
        copies done synchronously here: ``disagg.engine.tier_copy.SyncMover``), with a disk
        tier under it in ``kv_disk_cache_dir`` (``--kv-disk-cache-dir``, ``-mb``);
        ``kv_host_cache_pages``: the host tier's size in pages instead of MiB (tests)."""
        arch = model.arch
        kv_dt = kv_dtype(kv_cache_dtype, model.dtype)
        layout = KVLayout(arch.num_layers, num_pages, arch.num_kv_heads, page_size, arch.head_dim,
                          kv_dt, arch.kv_parts)
        kv = torch.zeros(layout.shape, dtype=kv_dt, device=model.device)
        self.runner = ModelRunner(model, kv, get_backend(attention_backend, model.device))
        if speculative is not None and speculative.method == "mtp":
            from disagg.engine.mtp_drafting import MTPDrafter

            self.runner.mtp_drafter = MTPDrafter(self.runner, speculative.tokens)
        if draft_model is not None:
            from disagg.engine.drafting import attach_draft, spec_layout

            spec = spec_layout(layout, draft_model, None)
            attach_draft(self.runner, draft_model,
                         torch.zeros(spec.shape, dtype=spec.dtype, device=model.device),
                         attention_backend, graphs=False, max_batch=1,
                         max_model_len=max_model_len or arch.max_position_embeddings)
        self.pool = PagePool(num_pages)
        args = (self.pool, page_size, max_batch_tokens, max_running,
                max_model_len or arch.max_position_embeddings, arch.eos_token_ids)
        kwargs = dict(prefix_caching=prefix_caching, cache_salt=arch.identity(str(kv_dt)),
                      **(speculative.scheduler_args() if speculative else {}))
        self.tiers: KVTiers | None = None
        if (kv_host_cache_mb or kv_host_cache_pages) and prefix_caching:
            views = page_views([kv], arch.num_layers, num_pages, layout.page_bytes)
            pin = model.device.type == "cuda"
            host = (HostPool(1, arch.num_layers, kv_host_cache_pages, layout.page_bytes, pin)
                    if kv_host_cache_pages else
                    HostPool.create(kv_host_cache_mb, 1, arch.num_layers, layout.page_bytes, pin))
            salt = arch.identity(str(kv_dt))
            ident = identity(salt, layout.page_bytes, (1, arch.num_layers, *layout.shape[2:]))
            store, slots, on_disk = (open_disk(kv_disk_cache_dir, kv_disk_cache_mb << 20, ident,
                                               arch.num_layers * layout.page_bytes)
                                     if kv_disk_cache_dir else (None, 0, []))
            if pin:  # reloads issued layer by layer; the runner's steps wait per layer
                self.runner.reload_events = [torch.cuda.Event() for _ in range(arch.num_layers)]
            mover = SyncMover(views, host, store, [self.runner.reload_events])
            self.tiers = KVTiers(host.num_slots, mover, slots, on_disk)
            self.scheduler: BatchScheduler = TieredScheduler(*args, tiers=self.tiers, **kwargs)
        else:
            self.scheduler = BatchScheduler(*args, **kwargs)
        self.core = EngineCore(self.scheduler, overlap)
        self.grammars = Grammars(tokenizer, arch.vocab_size, arch.eos_token_ids, refuse=(
            None if speculative is None else "not served with speculative decoding"))
        self._slots = itertools.count()

    def generate(
        self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]
    ) -> list[Output]:
        plist = params if isinstance(params, list) else [params] * len(prompts)
        seqs = []
        for prompt, p in zip(prompts, plist, strict=True):
            seed = p.seed if p.seed is not None else random.getrandbits(63)
            slot = next(self._slots)
            grammar = self.grammars.compile(p.structured) if p.structured is not None else None
            seq = Sequence(slot, str(slot), list(prompt), p, seed, arrival=slot, grammar=grammar)
            self.scheduler.add(seq)
            seqs.append(seq)
        logprobs: dict[int, list[TokenLogprobs]] = {}
        for update in drive(self.core, self.runner):
            if update.logprobs:
                logprobs.setdefault(update.seq.slot, []).extend(update.logprobs)
        if isinstance(self.scheduler, TieredScheduler):
            self.scheduler.settle()  # the last pages freed go to the host tier now
        return [Output(s.output_ids, s.finish_reason or "",
                       logprobs.get(s.slot, []) if s.params.logprobs is not None else None,
                       s.prompt_lps if s.params.prompt_logprobs is not None else None,
                       s.cached_tokens)
                for s in seqs]
