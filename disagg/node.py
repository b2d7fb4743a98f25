"""A node wires actors together: executors, scheduler, frontend. Nothing here parses a CLI.

``Node(cfg)`` can be embedded in any asyncio program::

    node = Node(NodeConfig(listen="tcp://127.0.0.1:5555"))
    await node.start()          # returns once the node accepts requests
    await node.wait()           # until node.stop() or a fatal error (an executor died)
    await node.stop()

A Node runs once; ``disagg.supervisor.Supervisor`` starts a new one on the same addresses when
one fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import shutil
import tempfile
import time
from typing import Any

import torch
import zmq
import zmq.asyncio

from disagg.actors.executor.executor_group import EarlySpawn, ExecutorGroup
from disagg.actors.frontend.front_door import FrontDoor
from disagg.actors.frontend.frontend import FrontendActor
from disagg.actors.scheduler.scheduler import SchedulerActor, SchedulerSetup
from disagg.config import ConfigError, NodeConfig
from disagg.engine.kv_tiers import KVTiers
from disagg.engine.speculative import speculation
from disagg.gc_tuning import freeze_startup_objects, keep_large_buffers, set_switch_interval
from disagg.model.config import ModelArch
from disagg.model.default import resolve_model
from disagg.model.ep import ExpertParallel, check_layout
from disagg.model.tokenizer import Tokenizer
from disagg.model.tp import TensorParallel
from disagg.protocol import ErrorCode
from disagg.protocol.peer import KVLayoutDesc
from disagg.remote.transfer_plan import shard_kv_heads
from disagg.serving import security
from disagg.serving.admission import Limits
from disagg.serving.metrics import Metrics
from disagg.transfer import TransferEngine

log = logging.getLogger(__name__)

DRAIN_POLL_S = 0.1  # while draining: how often to look whether every request has ended

class Node:
    def __init__(self, cfg: NodeConfig, metrics: Metrics | None = None,
                 door: FrontDoor | None = None, early: EarlySpawn | None = None):
        """``early``: this node's executors, spawned already for ``cfg`` (``early_spawn``)."""
        cfg.validate()
        if cfg.role == "router":
            raise ConfigError("--role router runs a router (disagg.actors.router.router), not a Node")
        self.cfg = cfg
        self.ctx = zmq.asyncio.Context()
        # the client socket of --listen: the supervisor's (kept across restarts), else our own
        self.door = door if door is not None else FrontDoor(cfg.listen, cfg.curve_keys)
        self._own_door = door is None
        self.executors: ExecutorGroup | None = None
        self.early = early
        self.scheduler: SchedulerActor | None = None
        self.frontend: FrontendActor | None = None
        self.messenger: Any = None  # PrefillMessenger | DecodeMessenger
        self.transfer: TransferEngine | None = None
        self.counter: Any = None
        self.host_pool: Any = None  # the host KV tier's memory (disagg.engine.tier_copy)
        self.tiers: KVTiers | None = None
        # fed by the messengers; served by --metrics-listen / the gateway (shared by restarts)
        self.metrics = metrics if metrics is not None else Metrics()
        self.address: str | None = None
        self.summary = ""  # what serves where, once started
        self.failure: str | None = None  # which actor failed and why
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._run_dir: str | None = None
        self._done = asyncio.Event()
        self._error: BaseException | None = None

    async def start(self) -> None:
        t0 = time.monotonic()
        if self.early is not None:  # spawned before this process's imports (cli.node.launch)
            cfg, self._run_dir = self.early.cfg, self.early.run_dir
            security.install(self.ctx, security.load_node(cfg.curve_keys) if cfg.curve_keys
                             else None)
            self.executors = ExecutorGroup(cfg, self._run_dir, self.ctx, self.early)
            self.early = None  # adopted (until then a failure here stops them: _cleanup)
        else:
            cfg = await asyncio.to_thread(resolve_model, self.cfg)
        self.cfg = cfg
        model_dir = cfg.executor.model
        assert model_dir is not None
        arch = ModelArch.from_dir(model_dir)
        ex = cfg.executor
        check_layout(lambda tp: TensorParallel(0, tp, ep=ExpertParallel(
            0, len(cfg.devices)) if ex.expert_parallel else None).check(arch),
            arch.moe.num_experts if arch.moe else None, len(cfg.devices), ex.dp,
            ex.expert_parallel)
        if ex.dp > 1 and cfg.cache.kv_host_cache_mb:
            raise ConfigError(f"--dp {ex.dp} with --kv-host-cache-mb: the KV tiers hold one "
                              "rank's pages, not yet one pool per rank; drop one of them")
        if self.executors is None:
            security.install(self.ctx, security.load_node(cfg.curve_keys) if cfg.curve_keys
                             else None)
            self._run_dir = cfg.run_dir or tempfile.mkdtemp(prefix="disagg-")
            self.executors = ExecutorGroup(cfg, self._run_dir, self.ctx)
        phases = self.executors.phases
        phases.add("node_setup", time.monotonic() - t0)
        try:
            self.executors.spawn()  # they load while the tokenizer does
            tokenizer = await asyncio.to_thread(Tokenizer.from_dir, model_dir)
            await self.executors.wait_ready()
        except BaseException:
            await self._cleanup()
            raise
        t1 = time.monotonic()
        s = cfg.scheduler
        setup = SchedulerSetup(self.executors, arch, tokenizer, cfg.cache.page_size,
                               s.max_batch_tokens, s.max_running * ex.dp,  # seats per rank
                               s.max_model_len or arch.max_position_embeddings,
                               Limits(s.max_requests_per_client, s.max_queued_requests,
                                      s.queue_timeout_s),
                               prefix_caching=cfg.cache.prefix_caching,
                               cache_salt=arch.identity(self.executors.ready[0].kv.dtype),
                               speculative=(speculation(s) if cfg.role != "prefill"
                                            or s.speculative_method == "mtp" else None),
                               overlap=cfg.role != "prefill" and (
                                   s.overlap_schedule == "on" or s.overlap_schedule == "auto"
                                   and all(d.startswith("cuda") for d in cfg.devices)),
                               tiers=self._tiers(cfg, arch), grammar_threads=s.grammar_threads)
        actors: list[tuple[str, Any]] = [("executor", self.executors.watch)]  # (name, run)
        if cfg.role == "prefill":
            await self._start_prefill(cfg, arch, setup, actors)
        else:
            front_sock, sched_sock = self._pair("frontend")
            if cfg.role == "decode":
                await self._start_decode(cfg, arch, sched_sock, setup, actors)
            else:
                self.scheduler = SchedulerActor(cfg.role, setup, sched_sock)
            lent = await self.door.lend()  # binds --listen the first time
            assert self.door.ctx is not None
            self.frontend = FrontendActor(cfg.listen, front_sock, self.door.ctx,
                                          max_inflight=s.max_frames_per_client,
                                          max_conns_per_address=s.max_connections_per_address,
                                          salt_by_tenant=cfg.cache.salt_by_tenant,
                                          lent=lent)
            self.address = self.frontend.address
            actors.append(("frontend", self.frontend.run))
        assert self.scheduler is not None
        actors.append(("scheduler", self.scheduler.run))
        self._tasks = {name: asyncio.create_task(self._guard(run(), name)) for name, run in actors}
        freeze_startup_objects(f"{cfg.role} node")
        keep_large_buffers(f"{cfg.role} node")
        set_switch_interval(f"{cfg.role} node")
        phases.add("node_actors", time.monotonic() - t1)
        log.info("start phases: %s (%.1f s in all)", phases.line(), time.monotonic() - t0)
        self.summary = (f"{cfg.role} node serving {arch.architecture} on {self.address} "
                        f"({self.executors.num_pages * self.executors.dp} pages of "
                        f"{cfg.cache.page_size} tokens"
                        + (f": {self.executors.dp} DP ranks of {self.executors.num_pages}"
                           if self.executors.dp > 1 else "") + ")")
        log.info("started: %s", self.summary)

    def _pair(self, name: str) -> tuple[zmq.asyncio.Socket, zmq.asyncio.Socket]:
        """Two ends of an inproc PAIR link between actors, unbounded both ways: a send never
        waits, so two actors sending to each other can never wait on each other. What bounds
        the queues is upstream: frames in flight per client (frontend), one Stats query in
        flight per peer and the job limit (prefill messenger)."""
        addr = f"inproc://{name}-{id(self)}"
        a = self.ctx.socket(zmq.PAIR)
        b = self.ctx.socket(zmq.PAIR)
        for sock in (a, b):
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.setsockopt(zmq.RCVHWM, 0)
        a.bind(addr)
        b.connect(addr)
        return a, b

    def _layout(self, arch: ModelArch) -> KVLayoutDesc:
        assert self.executors is not None
        info = self.executors.ready[0].kv
        dtype = getattr(torch, info.dtype)
        tp = len(self.cfg.devices) // self.cfg.executor.dp  # one DP rank's (--dp: each alike)
        per_rank, replicas = shard_kv_heads(arch.num_kv_heads, tp)
        size = torch.empty((), dtype=dtype).element_size()
        model_dtype = info.model_dtype or info.dtype  # the spec region's, the hidden rows'
        model_size = torch.empty((), dtype=getattr(torch, model_dtype)).element_size()
        spec = None
        if info.spec_shape:  # a draft model's / the MTP layers' KV after the model's
            layers, pages, parts, heads, page, dim = info.spec_shape
            spec = KVLayoutDesc(num_layers=layers, num_pages=pages, num_kv_heads=heads,
                                page_size=page, head_dim=dim, dtype=model_dtype,
                                element_size=model_size, hidden_size=0,
                                kind="gqa" if parts == 2 else "mla", kv_parts=parts)
        return KVLayoutDesc(
            num_layers=arch.num_layers, num_pages=self.executors.num_pages,
            num_kv_heads=per_rank, page_size=self.cfg.cache.page_size,
            head_dim=arch.head_dim, dtype=info.dtype, element_size=size,
            hidden_size=arch.hidden_size, tp_size=tp, kv_replicas=replicas,
            kind=arch.layout_kind, kv_parts=arch.kv_parts, kv_scales=info.kv_scales,
            context_element_size=model_size if model_size != size else 0,
            moe=arch.moe_shape,
            spec_method=(self.cfg.scheduler.speculative_method or "") if spec is not None else "",
            spec=spec)

    def _transfer(self) -> TransferEngine:
        d = self.cfg.disagg
        device = torch.device(self.cfg.devices[0])
        self.transfer = TransferEngine(d.transfer_backend, d.fabric_provider,
                                       timeout_s=d.prefill_timeout_s, device=device,
                                       lanes=d.fabric_lanes,
                                       stripe_bytes=d.fabric_stripe_bytes,
                                       mr_per_attempt=d.fabric_mr_per_attempt,
                                       address=d.fabric_address).start()
        return self.transfer

    def _tiers(self, cfg: NodeConfig, arch: ModelArch) -> KVTiers | None:
        """The host tier behind the prefix cache (``--kv-host-cache-mb``) and the disk tier
        under it (``--kv-disk-cache-dir``), or None."""
        c = cfg.cache
        if not (c.kv_host_cache_mb and c.prefix_caching):
            return None
        if cfg.executor.draft_model is not None or cfg.scheduler.speculative_method == "mtp":
            raise ConfigError("--kv-host-cache-mb is not served with a draft model or MTP yet "
                              "(their KV beside the model's is not kept in the tiers)")
        from disagg.engine.tier_copy import node_tiers

        assert self.executors is not None
        info = self.executors.ready[0].kv
        kv = self._kv_tensors()
        events = [[torch.cuda.Event.from_ipc_handle(t.device, h) for h in r.reload_events]
                  for r, t in zip(self.executors.ready, kv, strict=True)]
        try:
            tiers, self.host_pool = node_tiers(
                kv, info.shape, info.dtype, c.kv_host_cache_mb, c.kv_disk_cache_dir,
                c.kv_disk_cache_mb, arch.identity(info.dtype),
                events if all(events) else None)
        except ValueError as e:
            raise ConfigError(str(e)) from e
        self.tiers = tiers
        return tiers

    def _kv_tensors(self) -> list[torch.Tensor]:
        """Every rank's KV cache, mapped into this process (one transfer engine drives all)."""
        assert self.executors is not None
        if any(view is None for view in self.executors.kv_views):
            raise RuntimeError("an executor's KV memory is not mapped into the main process")
        return [view[0] for view in self.executors.kv_views]

    async def _start_prefill(self, cfg: NodeConfig, arch: ModelArch, setup: SchedulerSetup,
                             actors: list) -> None:
        from disagg.actors.prefill_messenger.layer_poller import LeastCounter
        from disagg.actors.prefill_messenger.prefill_messenger import PrefillMessenger
        from disagg.actors.scheduler.prefill_scheduler import PrefillSide
        from disagg.kernels.counter import LayerCounter

        assert self.executors is not None
        tp = len(cfg.devices) // cfg.executor.dp  # each DP rank's lead keeps a counter
        handles = [r.counter for r in self.executors.ready[::tp]]
        if any(h is None for h in handles):
            raise RuntimeError("a lead executor did not share a layer counter")
        counters = [LayerCounter.attach(h) for h in handles if h is not None]
        self.counter = counters[0] if len(counters) == 1 else LeastCounter(counters)
        m_sock, s_sock = self._pair("messenger")
        self.scheduler = SchedulerActor("prefill", setup, None, s_sock, side=PrefillSide)
        self.messenger = PrefillMessenger(
            cfg.listen, self.ctx, m_sock, self._transfer(), self._layout(arch), self._kv_tensors(),
            self.counter, vocab_size=arch.vocab_size, kv_fds=self.executors.kv_fds,
            peer_share=cfg.disagg.peer_share, ownership_timeout_s=cfg.disagg.ownership_timeout_s,
            metrics=self.metrics, layerwise_min_tokens=cfg.disagg.layerwise_min_tokens,
            host_kv=self.host_pool.tensors if self.host_pool is not None else None,
            dp=cfg.executor.dp)
        self.address = self.messenger.address
        actors.append(("messenger", self.messenger.run))

    async def _start_decode(self, cfg: NodeConfig, arch: ModelArch, sched_sock: zmq.asyncio.Socket,
                            setup: SchedulerSetup, actors: list) -> None:
        from disagg.actors.decode_messenger.decode_messenger import DecodeMessenger
        from disagg.actors.scheduler.decode_scheduler import DecodeSide

        d = cfg.disagg
        m_sock, s_sock = self._pair("messenger")
        self.scheduler = SchedulerActor("decode", setup, sched_sock, s_sock, side=functools.partial(
            DecodeSide, local_prefill_max_tokens=d.local_prefill_max_tokens,
            on_failure=d.on_prefill_failure, prefill_timeout_s=d.prefill_timeout_s,
            peer_timeout_s=d.peer_timeout_s))
        self.messenger = DecodeMessenger(
            d.prefill_peers, self.ctx, m_sock, self._transfer(), self._layout(arch),
            self._kv_tensors(), max_slots=2 * cfg.scheduler.max_running,
            timeout_s=d.prefill_timeout_s, heartbeat_s=d.heartbeat_s,
            peer_timeout_s=d.peer_timeout_s,
            kv_fds=self.executors.kv_fds if self.executors else None, metrics=self.metrics,
            resolve_interval_s=d.peer_resolve_interval_s, dp=cfg.executor.dp)
        actors.append(("messenger", self.messenger.run))

    async def _guard(self, coro: object, name: str) -> None:
        try:
            await coro  # type: ignore[misc]
        except asyncio.CancelledError:
            raise
        except BaseException as e:
            log.error("%s actor stopped: %s", name, e)
            if self._error is None:
                self._error = e
                self.failure = f"{name} failure: {e}"
            self._done.set()

    async def drain(self, timeout_s: float) -> bool:
        """Stop admitting (new requests end ``unavailable``, so a router sends them elsewhere;
        Pongs and Stats say draining, so it chooses this node no more) and wait, at most
        ``timeout_s`` seconds, until every live request has ended; True when they all did.
        Those left then end ``unavailable`` (a router resends or migrates them). The caller
        stops the node next. A prefill node has nothing to drain here: True at once."""
        if self.scheduler is None or self.frontend is None:
            return True
        why = (f"the node is draining (it stops within {timeout_s:g} s); send the request to "
               "another node")
        self.frontend.draining = True
        self.scheduler.drain(why)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        log.info("draining: admitting nothing new, %d live requests to finish within %g s",
                 len(self.scheduler.live), timeout_s)
        while self.scheduler.busy() and loop.time() < deadline and not self._done.is_set():
            await asyncio.sleep(DRAIN_POLL_S)
        left = len(self.scheduler.live)
        if left:
            log.warning("drain timeout: %d live requests end unavailable", left)
            await self.scheduler.fail_all("unavailable", f"the node drained for {timeout_s:g} s "
                                          "(--drain-timeout) and stopped; retry on another node")
        else:
            log.info("drained: every live request ended")
        return not left

    async def wait(self) -> None:
        """Until ``stop()`` is called or an actor fails (then re-raises its error)."""
        await self._done.wait()
        if self._error is not None:
            raise self._error

    async def stop(self) -> None:
        """Fail every live request (``internal`` naming the failure after one, else
        ``shutting_down``) and answer every client frame not taken yet (``unavailable``
        after a failure, else ``shutting_down``); stop the actors and every executor
        process, release the KV memory, its registrations, the sockets (the door's stays
        bound while a supervisor keeps it) and the run directory."""
        code: ErrorCode = "internal" if self.failure is not None else "shutting_down"
        message = self.failure or "the node is shutting down"
        refused: ErrorCode
        why, refused = ((f"the node is stopping after {self.failure}", "unavailable")
                        if self.failure is not None else (message, "shutting_down"))
        frontend = self._tasks.pop("frontend", None)
        if frontend is not None:  # first: frames from now on wait in the door's socket
            frontend.cancel()
            with contextlib.suppress(BaseException):
                await frontend
        if self.scheduler is not None:
            self.scheduler.stop()
            with contextlib.suppress(Exception):
                await self.scheduler.fail_all(code, message)
                await self.scheduler.refuse_inbox(
                    functools.partial(self.door.refusal, why=why, code=refused))
                if self.frontend is not None:  # flush the final replies to clients
                    await asyncio.wait_for(self.frontend.relay_replies(), 1.0)
        for t in self._tasks.values():
            t.cancel()
        for t in self._tasks.values():
            with contextlib.suppress(BaseException):
                await t
        await self._cleanup()
        self._done.set()

    async def _cleanup(self) -> None:
        if self._own_door:  # the final replies go out before the socket goes
            await self.door.close()
        if self.messenger is not None:
            self.messenger.close()
        if self.transfer is not None:
            with contextlib.suppress(Exception):
                await self.transfer.close()
        if self.counter is not None:
            self.counter.close()
        if self.tiers is not None:  # its copies read the KV mappings: done before they go
            close = getattr(self.tiers.mover, "close", None)
            if close is not None:
                await asyncio.to_thread(close)
            self.tiers = self.host_pool = None  # a restarted node pins its own
        if self.executors is not None:
            await self.executors.stop()
        if self.early is not None:  # stopped before its start adopted them
            await asyncio.to_thread(self.early.stop)
            self.early = None
        security.uninstall(self.ctx)
        self.ctx.destroy(linger=0)
        if self._run_dir and self.cfg.run_dir is None:
            shutil.rmtree(self._run_dir, ignore_errors=True)
        # a stopped node holds nothing of what it ran (whoever still holds the node: the
        # launcher does): the actors and through them the KV mappings and registrations
        self.frontend = self.scheduler = self.messenger = self.transfer = None
        self.counter = self.executors = None
        self._tasks = {}
        if self._error is not None:  # its traceback holds the frames that failed
            self._error = self._error.with_traceback(None)
