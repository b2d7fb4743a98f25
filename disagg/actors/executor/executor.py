"""Executor actor: one process per device.

Receives: ``StepPlan``, ``Masks``, ``GrammarDef`` (``late_masks``), ``Collect`` and ``Shutdown`` on
a DEALER socket connected to the main process.
Sends: ``ExecutorReady`` once (plus the KV memory fd over a unix socket, SCM_RIGHTS), then one
``StepResult`` per plan: at once, or for a deferred plan (``StepPlan.defer``, overlapped
decoding) when the next command arrives, after that command's step has been launched (the
order: ``disagg.actors.executor.step_order``, a plan held for the late masks of the step
before it included).
Owns: the model (shard), the KV cache allocation, the layer counter.

The main-process side is ``disagg.actors.executor.executor_group.ExecutorGroup``.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import signal
import socket
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
import torch
import zmq

from disagg import trace
from disagg.actors.executor.executor_group import ExecutorError, rendezvous_path
from disagg.actors.executor.late_masks import OwnMasks, awaits_masks, finish, mask_threads
from disagg.actors.executor.step_order import StepOrder
from disagg.config import NodeConfig, env
from disagg.engine.grammar_mirror import EXECUTOR_MASKS
from disagg.engine.start_phases import (
    StartPhases,
    boot_clock,
    process_started_at,
    spawn_and_imports,
)
from disagg.engine.warmup import graphs_refusal
from disagg.gc_tuning import freeze_startup_objects, keep_large_buffers
from disagg.model.ep import ExpertParallel
from disagg.model.tp import TensorParallel
from disagg.protocol.executor import (
    Collect,
    ExecutorCommand,
    ExecutorReady,
    GrammarDef,
    Masks,
    Shutdown,
    StepPlan,
    StepResult,
)

if TYPE_CHECKING:
    from disagg.engine.launched import Launched
    from disagg.engine.runner import ModelRunner

log = logging.getLogger(__name__)

POLL_MS = 1000  # idle wake-up to notice a dead parent; never a busy loop
# tests: every step takes this long more (a node busy in long steps: its scheduler answers Stats
# only between steps, its frontend Pongs at once)
STEP_DELAY_S = float(env("TEST_STEP_DELAY_S") or 0)


# ---------------------------------------------------------------------------- process side


def serve(cfg: NodeConfig, rank: int, control: str, fd_sock: socket.socket,
          phases: StartPhases | None = None) -> None:
    """The executor process: load, hand over the KV memory, then loop over plans.
    ``phases``: the start's, timed here on (``ExecutorReady.phases``).

    Loop: 1. wait (bounded) for a command; 2. run the step; 3. reply. Exits on ``Shutdown``
    or when the parent process is gone."""
    from disagg.engine import drafting
    from disagg.engine.attention import get_backend
    from disagg.engine.kv_memory import KVAllocation, KVLayout
    from disagg.engine.runner import ModelRunner
    from disagg.kernels import kv_quant

    parent = os.getppid()
    ecfg = cfg.executor
    phases = phases or StartPhases()
    torch.set_num_threads(cpu_threads(ecfg.threads, len(cfg.devices), torch.get_num_threads()))
    device = torch.device(cfg.devices[rank])
    if ecfg.model is None:
        raise ExecutorError("executor needs a resolved model directory")
    with phases.phase("cuda_init"):
        if device.type == "cuda":
            torch.cuda.set_device(device)
            torch.zeros(1, device=device)  # the CUDA context, now rather than in the weights
        tp = init_tensor_parallel(cfg, rank, control, device)
    t0 = time.perf_counter()
    mtp = cfg.scheduler.speculative_method == "mtp"  # prefill nodes compute its KV to ship
    with phases.phase("weights"):
        model = build_model(cfg, device, tp, mtp=mtp)
        draft = (build_model(cfg, device, model_dir=ecfg.draft_model)  # prefill nodes too
                 if ecfg.draft_model is not None else None)
    arch = model.arch
    if tp.ep is not None and tp.ep.size > 1 and arch.moe is not None:
        mine = tp.ep.experts(arch.moe.num_experts)
        log.info("expert parallel: rank %d of %d holds experts %d-%d of %d", tp.ep.rank,
                 tp.ep.size, mine.start, mine.stop - 1, arch.moe.num_experts)
    backend_name = ecfg.attention_backend
    if arch.mla is not None and backend_name == "flashinfer":  # auto: triton on CUDA, else torch
        raise ExecutorError("--attention-backend flashinfer: MLA models run on the triton (CUDA) "
                            "or torch backend (auto picks one)")
    kv_dtype = kv_quant.kv_dtype(cfg.cache.kv_cache_dtype, model.dtype)
    fp8_kv = kv_dtype == kv_quant.FP8_KV
    if fp8_kv and backend_name == "flashinfer":
        raise ExecutorError("--kv-cache-dtype fp8_e4m3 runs on the triton or torch attention "
                            "backend (flashinfer does not read its scales)")
    backend = get_backend(backend_name, device)
    max_model_len = cfg.scheduler.max_model_len or arch.max_position_embeddings
    log.info("model %s on %s in %.1f s (%s weights)", arch.architecture, device,
             time.perf_counter() - t0, "random" if ecfg.random_weights else "loaded")
    refusal = graphs_refusal(cfg, tp, backend, model)
    if device.type == "cuda" and backend.name == "triton" and tp.size == 1 and (
            tp.ep is None or tp.ep.size == 1):  # (ranks' collectives must not interleave)
        from disagg.engine.warmup import parallel_warmup, warm_threads

        s = cfg.scheduler
        with phases.phase("triton_warmup"):
            try:  # only a head start: the sequential warm-ups below compile what it missed
                parallel_warmup(model, backend, cfg.cache.page_size, kv_dtype,
                                min(s.max_running, s.max_batch_tokens), s.max_batch_tokens,
                                s.max_running, max_model_len, refusal is None,
                                warm_threads(len(cfg.devices)))
            except Exception:
                log.exception("parallel warm-up failed; the sequential warm-ups go on")
                torch.cuda.synchronize(device)
                torch.cuda.empty_cache()
    if cfg.cache.num_pages:
        num_pages = cfg.cache.num_pages
    elif device.type == "cuda":
        with phases.phase("kv_profile"):
            num_pages = drafting.share_with_draft(
                pages_from_free_memory(cfg, model, backend, max_model_len, kv_dtype), arch,
                draft)
    else:
        num_pages = drafting.share_with_draft(KVLayout.pages_for_budget(
            cfg.cache.kv_cache_mb << 20, arch.num_layers, arch.num_kv_heads, cfg.cache.page_size,
            arch.head_dim, kv_dtype, kv_parts=arch.kv_parts), arch, draft)
    layout = KVLayout(arch.num_layers, num_pages, arch.num_kv_heads, cfg.cache.page_size,
                      arch.head_dim, kv_dtype, arch.kv_parts)
    with phases.phase("kv_alloc"):
        alloc = KVAllocation.create(layout, device,
                                    drafting.spec_layout(layout, draft, model if mtp else None),
                                    kv_scales=model.kv_scales_id if fp8_kv else "",
                                    model_dtype=model.dtype)
        if alloc.fd is not None:
            socket.send_fds(fd_sock, [b"kv"], [alloc.fd])
        else:
            fd_sock.sendall(b"no")
    counter = None
    # only the lead rank (of each DP rank, --dp) keeps the layer counter
    if rank % tp.size == 0 and cfg.role == "prefill":
        from disagg.kernels.counter import LayerCounter

        counter = LayerCounter.create(device)
        counter.warm()
    runner = ModelRunner(model, alloc.tensor, backend, counter)
    log.info("loaded %s on %s: %d pages of %d tokens (%.1f MiB KV)", arch.architecture, device,
             num_pages, cfg.cache.page_size, layout.nbytes / 2**20)
    if refusal is None:
        with phases.phase("graph_capture"):
            try:
                s = cfg.scheduler
                runner.enable_cuda_graphs(
                    min(s.max_running, s.max_batch_tokens), max_model_len,
                    spec_tokens=s.num_speculative_tokens if s.speculative_method else 0)
            except Exception:  # the node still serves, only slower
                log.exception("CUDA graph capture failed; running decode eagerly")
                runner.graphs = None
    elif refusal:
        log.info(refusal)

    if mtp:
        from disagg.engine.mtp_drafting import MTPDrafter

        runner.mtp_drafter = MTPDrafter(runner, cfg.scheduler.num_speculative_tokens,
                                        alloc.spec_tensor)
    if draft is not None:
        assert alloc.spec_tensor is not None
        drafting.attach_draft(runner, draft, alloc.spec_tensor, backend_name,
                              graphs=runner.graphs is not None,
                              max_batch=min(cfg.scheduler.max_running,
                                            cfg.scheduler.max_batch_tokens),
                              max_model_len=max_model_len, prefill_only=cfg.role == "prefill")
    if device.type == "cuda":
        from disagg.kernels.compile_watch import arm

        t1 = time.perf_counter()
        with phases.phase("warm_eager"):
            if runner.graphs is None:
                runner.pin_decode_splits(min(cfg.scheduler.max_running,
                                             cfg.scheduler.max_batch_tokens), max_model_len)
            lengths = runner.warm_prefill(cfg.scheduler.max_batch_tokens, max_model_len)
        log.info("warmed prefill steps of %s tokens in %.1f s", lengths, time.perf_counter() - t1)
        arm(f"executor {rank}")
    freeze_startup_objects(f"executor {rank}")
    keep_large_buffers(f"executor {rank}")
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(control)
    enc = msgspec.msgpack.Encoder()
    dec = msgspec.msgpack.Decoder(ExecutorCommand)
    if device.type == "cuda" and cfg.cache.kv_host_cache_mb:  # the host tier's reloads
        runner.reload_events = [torch.cuda.Event(interprocess=True)
                                for _ in range(runner.kv.shape[0])]
    sock.send(enc.encode(ExecutorReady(rank, num_pages, alloc.info,
                                       None if counter is None else counter.handle(),
                                       [e.ipc_handle() for e in runner.reload_events],
                                       phases.ordered())))
    # hop marks (disagg.trace) of the lead rank's steps: x.* / s<id> on a prefill node,
    # dx.* / d<id> on the others
    tkey = ("s" if cfg.role == "prefill" else "d") if trace.enabled() and rank == 0 else ""
    tev = "x" if cfg.role == "prefill" else "dx"

    # the late grammar masks filled here (late_masks.OwnMasks; DISAGG_EXECUTOR_MASKS=0: by the
    # scheduler), on this executor's share of the host's threads
    own = OwnMasks(mask_threads(cfg), tkey, tev) if EXECUTOR_MASKS else None
    if own is not None and cfg.role != "prefill":  # (a prefill node never samples)
        own.warm()

    def answer(step_id: int, launched: Launched | Exception) -> None:
        frames = reply(enc, runner, step_id, launched)
        if own is not None:
            own.answered(step_id, launched)
        if tkey:  # (before the send: the scheduler may act on it before this process runs on)
            trace.mark(f"{tev}.replied", tkey, step_id)
        sock.send_multipart(frames)

    def launched(plan: StepPlan) -> Launched | Exception:
        if own is not None:
            own.launched(plan)
        out = launch(runner, plan)
        if own is not None:  # (masks that need no token in flight: filled now)
            out = own.picked(plan.step_id, out)
        if tkey:
            trace.mark(f"{tev}.launched", tkey, plan.step_id)
        return out

    order = StepOrder(launched, answer, awaits_masks, lambda ld: not isinstance(ld, Exception)
                      and ld.forward_done())  # answered first if done

    try:
        while True:
            if not sock.poll(POLL_MS):
                if os.getppid() != parent:
                    log.warning("parent process is gone; exiting")
                    return
                continue
            try:
                frames = sock.recv_multipart(copy=False)  # a Masks' rows: its second frame
                command = dec.decode(frames[0].buffer)
            except (msgspec.DecodeError, msgspec.ValidationError) as e:  # never fatal
                log.error("ignoring a malformed command: %s", e)
                continue
            match command:
                case StepPlan() as plan:
                    if tkey:
                        trace.mark(f"{tev}.plan_in", tkey, plan.step_id)
                    if STEP_DELAY_S:
                        time.sleep(STEP_DELAY_S)
                    order.plan(plan)  # (held while the step before waits for its masks)
                case Masks(step_id, slots, row_bytes):  # the deferred step's late masks
                    if tkey:
                        trace.mark(f"{tev}.masks_in", tkey, step_id)
                    rows = frames[1].buffer if len(frames) > 1 else memoryview(b"")
                    pick = functools.partial(finish, slots=slots, row_bytes=row_bytes, rows=rows)
                    if not order.masks(step_id, pick):
                        log.error("ignoring grammar masks for step %d, not in flight", step_id)
                case Collect():
                    order.collect()
                case GrammarDef() as grammar if own is not None:
                    own.define(grammar)
                case Shutdown():
                    return
            if own is not None:
                own.fill(order)
    finally:
        if own is not None:
            own.close()
        if counter is not None:
            counter.close()
        sock.close()
        ctx.term()


def launch(runner: ModelRunner, plan: StepPlan) -> Launched | Exception:
    """Queue a step on the device; a failure is kept for its reply (the executor serves on)."""
    try:
        if not plan.chunks:  # this DP rank has no work in the step (--dp)
            return idle(runner, plan)
        return runner.launch(plan)
    except Exception as e:  # noqa: BLE001
        log.exception("step %d failed", plan.step_id)
        return e


def idle(runner: ModelRunner, plan: StepPlan) -> Launched:
    """A step with no chunk for this DP rank: under expert parallelism the model still joins
    every MoE layer's all-to-all with zero rows (``Transformer.idle``); no token comes back.
    A prefill node's layer counter goes to the step's last layer (the messenger follows the
    least advanced DP rank)."""
    from disagg.engine.runner import Launched

    runner.model.idle()
    if runner.counter is not None:
        runner.counter.set_base(plan.counter_base)
        runner.counter.bump(runner.model.arch.num_layers)
    return Launched([])


def reply(enc: msgspec.msgpack.Encoder, runner: ModelRunner, step_id: int,
          launched: Launched | Exception) -> list[bytes]:
    """The frames answering a step: its ``StepResult`` once the device is done (and the hidden
    rows, when it has some), or the error that failed it."""
    try:
        if isinstance(launched, Exception):
            raise launched
        tokens, hidden, counts = launched.wait()
        logprobs, prompt_logprobs = launched.logprob_maps()
        frames = [b""] if hidden is None else [b"", tensor_bytes(hidden)]
        frames[0] = enc.encode(StepResult(step_id, tokens, hidden_rows=0 if hidden is None
                                          else int(hidden.shape[0]), counts=counts,
                                          drafts=runner.next_drafts, logprobs=logprobs,
                                          prompt_logprobs=prompt_logprobs,
                                          all_to_all_s=exchange_seconds(runner)))
        return frames
    except Exception as e:  # noqa: BLE001
        if not isinstance(launched, Exception):
            log.exception("step %d failed", step_id)
        return [enc.encode(StepResult(step_id, [], error=f"{type(e).__name__}: {e}"))]


def exchange_seconds(runner: ModelRunner) -> float:
    """Seconds spent in expert parallelism's all-to-alls since the last call (0 without)."""
    ep = runner.model.tp.ep
    return 0.0 if ep is None else ep.clock.take()[0]


def cpu_threads(requested: int, executors: int, torch_default: int) -> int:
    """Torch intra-op threads of one executor: ``--threads`` when given, else torch's default
    (the cores this process may use) less one for the node's main process (scheduler,
    detokenizing, sockets), shared among the node's executors, so that ``--tp N`` on the CPU
    does not run N times as many threads as there are cores. On 2 cores that is 1: with all
    cores busy, torch's spinning threads made decode steps 10-20x slower (docs/NOTES.md)."""
    if requested > 0:
        return requested
    return max(1, (torch_default - 1) // max(1, executors))


def init_tensor_parallel(cfg: NodeConfig, rank: int, control: str,
                         device: torch.device) -> TensorParallel:
    """One executor per device; with several, join them in a torch.distributed group (gloo on
    CPU, NCCL on CUDA) rendezvousing through a file in the node's private run directory.
    Executor ``rank`` is TP rank ``rank % tp`` of DP rank ``rank // tp`` (``--dp``); each DP
    rank's executors form a TP group, and with ``--expert-parallel`` every executor of the
    node is one EP group (``disagg.model.ep``)."""
    size = len(cfg.devices)
    dp = cfg.executor.dp
    tp = size // dp
    ep = ExpertParallel() if cfg.executor.expert_parallel and size == 1 else None
    if size == 1:
        return TensorParallel(ep=ep)
    import datetime

    import torch.distributed as dist

    dist.init_process_group(
        backend="nccl" if device.type == "cuda" else "gloo",
        init_method="file://" + rendezvous_path(control),
        rank=rank, world_size=size,
        timeout=datetime.timedelta(seconds=cfg.startup_timeout_s))
    group = None
    if dp > 1:  # every rank creates every group, in the same order
        groups = [dist.new_group(list(range(d * tp, (d + 1) * tp))) for d in range(dp)]
        group = groups[rank // tp]
    if cfg.executor.expert_parallel:
        ep = ExpertParallel(rank, size)
    return TensorParallel(rank % tp, tp, group, ep)


def build_model(cfg: NodeConfig, device: torch.device, tp: TensorParallel | None = None,
                model_dir: str | None = None, mtp: bool = False) -> Any:
    """Load the model directory's weights (this rank's shard under TP), or draw them from the
    seed with ``random_weights`` (then only ``config.json`` is read, and the weights are
    generated on ``device``). ``model_dir``: another directory (the draft model)."""
    ecfg = cfg.executor
    path = model_dir or ecfg.model
    assert path is not None
    if ecfg.random_weights:
        from disagg.model.config import ModelArch
        from disagg.model.fp8 import Fp8Format
        from disagg.model.loader import FP8_BLOCK, random_model

        fp8 = Fp8Format.from_config(json.loads((Path(path) / "config.json").read_text()))
        if fp8 is None and ecfg.quantization == "fp8":
            fp8 = Fp8Format("fp8", FP8_BLOCK)
        return random_model(ModelArch.from_dir(path), ecfg.dtype, device, ecfg.seed, tp, mtp,
                            fp8)
    from disagg.model.loader import load_model

    return load_model(path, ecfg.dtype, device, tp, mtp, ecfg.quantization)


def pages_from_free_memory(cfg: NodeConfig, model: Any, backend: Any, max_model_len: int,
                           kv_dtype: torch.dtype | None = None) -> int:
    """KV pages that fit in ``gpu_memory_utilization`` of the GPU after a profiling step.

    The profiling step is the largest the scheduler can send (``max_batch_tokens`` tokens of
    prefill in sequences of at most ``max_model_len``, then logits for ``max_running`` rows) on a
    throwaway cache; its peak torch allocation covers weights and activations. Memory outside
    torch (CUDA context, cuBLAS workspaces, other processes) is what the device reports in use
    beyond torch's reservations. CUDA graphs get the activation peak again as headroom."""
    from disagg.engine.kv_memory import KVLayout
    from disagg.engine.runner import profile_peak_memory

    arch = model.arch
    device = model.device
    weights = torch.cuda.memory_allocated(device)
    peak = profile_peak_memory(model, backend, cfg.cache.page_size,
                               cfg.scheduler.max_batch_tokens, cfg.scheduler.max_running,
                               max_model_len)
    free, total = torch.cuda.mem_get_info(device)
    non_torch = total - free - torch.cuda.memory_reserved(device)
    graphs = (peak - weights) + (256 << 20) if cfg.executor.cuda_graphs else 0
    budget = int(total * cfg.executor.gpu_memory_utilization) - non_torch - peak - graphs
    pages = KVLayout.pages_for_budget(max(budget, 0), arch.num_layers, arch.num_kv_heads,
                                      cfg.cache.page_size, arch.head_dim,
                                      kv_dtype or model.dtype, kv_parts=arch.kv_parts)
    log.info("memory: total %.1f GiB, weights %.1f GiB, profile peak %.1f GiB, outside torch "
             "%.1f GiB, graph headroom %.1f GiB -> KV %.1f GiB (%d pages)", total / 2**30,
             weights / 2**30, peak / 2**30, non_torch / 2**30, graphs / 2**30, budget / 2**30,
             pages)
    if pages < 1:
        raise ExecutorError(
            f"no GPU memory left for the KV cache at --gpu-memory-utilization "
            f"{cfg.executor.gpu_memory_utilization} (weights {weights / 2**30:.1f} GiB, "
            f"activation peak {(peak - weights) / 2**30:.1f} GiB): raise it, lower "
            "--max-batch-tokens, or give --num-pages")
    return pages


def tensor_bytes(t: torch.Tensor) -> bytes:
    """Raw bytes of a tensor (moved to the host), for an out-of-band zmq frame."""
    return t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()


def main(argv: list[str] | None = None) -> None:
    from disagg.log import setup_logging

    ap = argparse.ArgumentParser(prog="disagg-executor")
    ap.add_argument("--config", required=True, help="NodeConfig as JSON")
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--control", required=True, help="ipc:// address of the main process")
    ap.add_argument("--fd-sock", type=int, required=True, help="inherited unix socket fd")
    ap.add_argument("--spawned-at", type=float, default=None,
                    help="when the main process spawned this one (start_phases.boot_clock)")
    args = ap.parse_args(argv)
    phases = StartPhases()
    if args.spawned_at is not None:
        phases.merge([spawn_and_imports(args.spawned_at, process_started_at(), boot_clock())])
    cfg = msgspec.json.decode(args.config, type=NodeConfig)
    setup_logging("executor", args.rank)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the main process decides when we stop
    fd_sock = socket.socket(fileno=args.fd_sock)
    serve(cfg, args.rank, args.control, fd_sock, phases)


if __name__ == "__main__":
    main()
