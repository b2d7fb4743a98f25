"""What an executor warms before ready, listed as independent jobs so their Triton kernels
compile in parallel (``disagg.kernels.warm_pool.run_parallel``).

``parallel_warmup`` runs, on a scratch KV cache of the real one's dtype and page shape (the KV
pool is sized after the profiling step, so it does not exist yet), one job per decode CUDA-graph
bucket (its eager forward, as ``DecodeGraphs.capture_all`` runs before capturing), one per eager
decode split count (``decode_split_launches``, as ``ModelRunner.pin_decode_splits``), the prefill
steps (``ModelRunner.warm_prefill``) and the profiling step's shape. Every kernel variant the
start's sequential warm-ups then launch on the real cache is compiled already (Triton keys a
variant on dtypes, constexprs and 16-divisibility and alignment, not on the page count); any it
missed they compile as before, and ``compile_watch`` still reports a compile after ready.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from disagg.config import NodeConfig, env
from disagg.engine.decode_splits import decode_split_launches
from disagg.kernels.interface import AttentionBackend
from disagg.kernels.warm_pool import WarmReport, run_parallel

if TYPE_CHECKING:
    from disagg.model.tp import TensorParallel
    from disagg.model.transformer import Transformer

log = logging.getLogger(__name__)

MAX_THREADS = 16  # compiles at once: about the cores of one lent GPU's host


def warm_threads(executors: int, cores: int | None = None) -> int:
    """Compile threads of one executor: the cores this process may use, shared among the
    node's executors, at most ``MAX_THREADS``, at least 1."""
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (
            os.cpu_count() or 1)
    return max(1, min(MAX_THREADS, cores // max(1, executors)))


def prefill_graphs(cfg: NodeConfig) -> bool:
    """Whether a prefill node captures the decode graphs too, to replay its small prompt steps
    as rows (``cuda_graphs.rows_step`` takes context rows; the graphs bump the layer counter).
    On unless ``DISAGG_PREFILL_GRAPHS=0`` (on an H200 a split 17-token prompt's TTFT went from
    36.8 to 16.2 ms, docs/BENCHMARKS.md). A prefill node that drafts (speculative prefill)
    stays eager either way."""
    return env("PREFILL_GRAPHS", "1") != "0" and not cfg.scheduler.speculative_method


def graphs_refusal(cfg: NodeConfig, tp: TensorParallel, backend: Any,
                   model: Any) -> str | None:
    """None when this executor captures decode CUDA graphs, else why not (a line to log; empty
    where they are off by role, device or ``--enforce-eager``)."""
    if not (cfg.devices[0].startswith("cuda") and cfg.executor.cuda_graphs
            and (cfg.role != "prefill" or prefill_graphs(cfg))):
        return ""
    if tp.size > 1:
        return "CUDA graphs are not used with --tp > 1 yet; running decode eagerly"
    if tp.ep is not None and tp.ep.size > 1:
        return ("CUDA graphs are not used with --expert-parallel over several ranks (the "
                "all-to-all's split sizes go through the host); running decode eagerly")
    if backend.name != "triton":
        return "CUDA graphs need the triton attention backend; running decode eagerly"
    if model.arch.moe is not None and model.dtype == torch.float32:
        return "CUDA graphs of MoE models need the fused kernel (bf16/fp16); eager decode"
    return None


def parallel_warmup(model: Transformer, backend: AttentionBackend, page_size: int,
                    kv_dtype: torch.dtype, max_batch: int, max_batch_tokens: int,
                    max_running: int, max_model_len: int, graphs: bool,
                    threads: int) -> WarmReport:
    """Compile, ``threads`` at a time, the kernels of the start's warm-ups (see the module
    docstring) on a scratch cache. ``graphs``: the decode buckets too. Afterwards the memory
    it used is handed back to the device (torch's cache emptied, the warm-up streams' cuBLAS
    workspaces dropped): the KV pool, sized next and allocated outside torch, needs it."""
    report = _warm(model, backend, page_size, kv_dtype, max_batch, max_batch_tokens,
                   max_running, max_model_len, graphs, threads)
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None and model.device.type == "cuda":
        clear()
    torch.cuda.empty_cache()
    log.info("parallel warm-up: %d jobs on %d threads in %.1f s, %d kernel variants compiled "
             "or loaded once each (%d launches waited for another's)%s", report.jobs, threads,
             report.seconds, len(report.compiled), report.waited,
             f"; failed: {report.failed}" if report.failed else "")
    return report


def _warm(model: Transformer, backend: AttentionBackend, page_size: int,
          kv_dtype: torch.dtype, max_batch: int, max_batch_tokens: int, max_running: int,
          max_model_len: int, graphs: bool, threads: int) -> WarmReport:
    """``parallel_warmup``'s jobs, run; every tensor they made is garbage on return."""
    from disagg.engine.cuda_graphs import DecodeGraphs
    from disagg.engine.kv_memory import KVLayout
    from disagg.engine.runner import ModelRunner, profile_peak_memory

    arch = model.arch
    pages = 2 + -(-min(96, max_batch_tokens, max_model_len) // page_size)  # warm_prefill's
    shape = KVLayout(arch.num_layers, pages, arch.num_kv_heads, page_size, arch.head_dim,
                     kv_dtype, arch.kv_parts).shape
    kv = torch.zeros(shape, dtype=kv_dtype, device=model.device)
    runner = ModelRunner(model, kv, backend)
    runner.split_bound = max_model_len  # as the real runner's, pinned before serving
    jobs: list[tuple[str, Callable[[], Any]]] = []
    if graphs:
        g = DecodeGraphs(model, kv, backend, max_batch, max_model_len)
        g._reset_inputs()
        jobs += [(f"decode bucket {b}", functools.partial(g._forward, b)) for b in g.buckets]
    jobs += decode_split_launches(runner, max_batch, max_model_len)
    jobs.append(("prefill steps", functools.partial(runner.warm_prefill, max_batch_tokens,
                                                    max_model_len)))
    jobs.append(("largest step", functools.partial(
        profile_peak_memory, model, backend, page_size, max_batch_tokens, max_running,
        max_model_len)))
    jobs.append(("sampling race", functools.partial(warm_race, arch.vocab_size, model.device)))
    return run_parallel(jobs, threads, model.device)


def warm_race(vocab: int, device: torch.device) -> None:
    """The seeded-sampling race kernel at the model's vocabulary (the logits' width and row
    stride), without and with top-p (its two compiles), so a node's first sampled request
    compiles nothing."""
    from disagg.kernels.sample_race import race

    x = torch.zeros((1, vocab), dtype=torch.float32, device=device)
    keys = torch.zeros(1, dtype=torch.int64, device=device)
    race(x, keys)
    race(x, keys, top_p=torch.full((1,), 0.5, dtype=torch.float32, device=device))
