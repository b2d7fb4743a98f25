"""The main-process side of the executors: ``ExecutorGroup`` spawns one executor process per
device (``disagg.actors.executor.executor``), waits for their handshake, maps their KV memory, watches
them (a death raises at once) and runs steps with a deadline: one at a time (``step``), or
overlapped (``submit`` a deferred plan, then ``result``; ``collect`` asks for a deferred
step's result without launching another). With ``--dp N`` each step is split by DP rank
(``disagg.engine.dp.split_plan``: every rank gets its part, an empty one included) and the
ranks' lead results merged (``merge_results``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import mmap
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from disagg.actors.sockets import LoopPoller
from disagg.config import NodeConfig
from disagg.engine.dp import merge_hidden, merge_results, split_plan
from disagg.engine.grammar_pass import MaskBlock
from disagg.engine.start_phases import StartPhases, boot_clock
from disagg.model.default import resolve_model
from disagg.protocol.executor import (
    Collect,
    ExecutorReady,
    ExecutorReply,
    GrammarDef,
    KVMemoryInfo,
    Masks,
    Shutdown,
    StepPlan,
    StepResult,
)

log = logging.getLogger(__name__)


class ExecutorError(RuntimeError):
    """An executor died, timed out, or failed to start."""


def exit_reason(returncode: int) -> str:
    """How a child process ended, from its ``Popen.returncode``: 'was killed by SIGKILL' or
    'exited with code 1'."""
    if returncode < 0:
        try:
            return f"was killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"was killed by signal {-returncode}"
    return f"exited with code {returncode}"


def rendezvous_path(control: str) -> str:
    """The file the tensor-parallel ranks meet in (next to the control socket)."""
    return control.removeprefix("ipc://") + ".tp-rendezvous"


@dataclasses.dataclass
class EarlySpawn:
    """Executors spawned before the node's main process imports the rest of it (torch's
    import alone takes seconds): theirs and the main process's then overlap. ``Node.start``
    adopts them (``ExecutorGroup(early=...)``) or, on a failure before that, stops them."""

    cfg: NodeConfig  # the model directory resolved: what the executors were given
    run_dir: str
    procs: list[subprocess.Popen[bytes]]
    fd_socks: list[socket.socket]
    at: float  # time.monotonic() of the spawn

    def stop(self) -> None:
        for proc in self.procs:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            proc.wait()
        for s in self.fd_socks:
            s.close()


def control_address(run_dir: str) -> str:
    return f"ipc://{run_dir}/executors.sock"


def spawn_executors(cfg: NodeConfig, control: str
                    ) -> tuple[list[subprocess.Popen[bytes]], list[socket.socket]]:
    """One executor process per device, each told ``control`` (the group's ROUTER, bound now
    or later: they connect until it is) and handed its end of a socket pair (its KV memory's
    fds come back over it)."""
    cfg_json = msgspec.json.encode(cfg).decode()
    with contextlib.suppress(FileNotFoundError):  # a dead group's, in a reused --run-dir
        os.unlink(rendezvous_path(control))
    procs, socks = [], []
    for rank in range(len(cfg.devices)):
        parent_sock, child_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        cmd = [sys.executable, "-m", "disagg.actors.executor.executor", "--config", cfg_json,
               "--rank", str(rank), "--control", control,
               "--fd-sock", str(child_sock.fileno()), "--spawned-at", repr(boot_clock())]
        procs.append(subprocess.Popen(cmd, pass_fds=(child_sock.fileno(),)))
        child_sock.close()
        socks.append(parent_sock)
    return procs, socks


def early_spawn(cfg: NodeConfig) -> EarlySpawn:
    """Resolve ``cfg``'s model directory and spawn its executors now (``EarlySpawn``)."""
    cfg = resolve_model(cfg)
    run_dir = cfg.run_dir or tempfile.mkdtemp(prefix="disagg-")
    at = time.monotonic()
    procs, socks = spawn_executors(cfg, control_address(run_dir))
    return EarlySpawn(cfg, run_dir, procs, socks, at)


class ExecutorGroup:
    """Spawns and drives one executor process per device; each DP rank's first executor's
    result is authoritative (rank 0's without ``--dp``)."""

    def __init__(self, cfg: NodeConfig, run_dir: str, ctx: zmq.asyncio.Context,
                 early: EarlySpawn | None = None):
        """``early``: executors already spawned for ``cfg`` and ``run_dir`` (``early_spawn``),
        adopted: ``spawn`` then starts none."""
        self.bad_frames = 0
        self.foreign_frames = 0  # well-formed frames from an identity not of our executors
        self.cfg = cfg
        self.control = control_address(run_dir)
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(self.control)
        # the step results' wait: woken in one loop turn (a late grammar step's chain waits
        # on its predecessor's result; pyzmq's poll took several turns)
        self._results = LoopPoller()
        self._results.register(self.sock)
        self.procs: list[subprocess.Popen[bytes]] = []
        self._fd_socks: list[socket.socket] = []
        self.ready: list[ExecutorReady] = []
        self.kv_views: list[Any] = []  # (tensor, keepalive) per rank, main-process mappings
        self.kv_fds: list[int | None] = []  # the executors' KV memory fds, kept open here so a
        # transfer backend can share them (e.g. cuMem POSIX fds for same-host GPU peers)
        self._enc = msgspec.msgpack.Encoder()
        self._dec = msgspec.msgpack.Decoder(ExecutorReply)
        self._identities: list[bytes] = []
        self.dp = cfg.executor.dp
        self.tp = len(cfg.devices) // self.dp
        self._plans: dict[int, StepPlan] = {}  # steps split over DP ranks, until merged
        # ranks' results of steps after the one awaited (a rank may answer step N + 1 before
        # another answers N: an executor filling late masks itself answers both at once),
        # by step id, then rank identity: (result, its hidden-row frame)
        self._early: dict[int, dict[bytes, tuple[StepResult, bytes | None]]] = {}
        self.all_to_all_s = [0.0] * self.dp  # each DP rank's lead: MoE all-to-all seconds
        self.phases = StartPhases()  # the start's, the node's own included (Stats.start_phases_s)
        self._spawned = time.monotonic()
        if early is not None:
            self.procs, self._fd_socks, self._spawned = early.procs, early.fd_socks, early.at

    @property
    def num_pages(self) -> int:
        """Pages of one rank's KV pool (each DP rank has its own; ``--dp N`` has N of them)."""
        return min(r.num_pages for r in self.ready)

    async def start(self) -> None:
        """``spawn`` then ``wait_ready``."""
        self.spawn()
        await self.wait_ready()

    def spawn(self) -> None:
        """Start one executor process per device (they load while the caller does its own
        start-up work; ``wait_ready`` then waits for them); none when they were adopted."""
        if self.procs:
            return
        self._spawned = time.monotonic()
        self.procs, self._fd_socks = spawn_executors(self.cfg, self.control)

    async def wait_ready(self) -> None:
        """Until every executor spawned has handed over its KV memory (bounded by
        ``--startup-timeout``); their start phases then join ``phases``."""
        deadline = self._spawned + self.cfg.startup_timeout_s
        by_rank: dict[int, tuple[bytes, ExecutorReady]] = {}
        while len(by_rank) < len(self.procs):
            self._check_alive()
            if time.monotonic() > deadline:
                raise ExecutorError(f"executors not ready within {self.cfg.startup_timeout_s:.0f}s "
                                    "(--startup-timeout)")
            if await self.sock.poll(500):
                ident, msg = self._decode(await self.sock.recv_multipart())
                if isinstance(msg, ExecutorReady) and 0 <= msg.rank < len(self.procs):
                    by_rank[msg.rank] = (ident, msg)
        for rank in range(len(self.procs)):
            ident, ready = by_rank[rank]
            self._identities.append(ident)
            self.ready.append(ready)
            self.kv_views.append(self._map(rank, ready.kv))
        self.phases.merge([r.phases for r in self.ready])
        self.phases.add("executor_wait", time.monotonic() - self._spawned)

    def _map(self, rank: int, info: KVMemoryInfo) -> Any:
        from disagg.engine.kv_memory import map_kv

        sock = self._fd_socks[rank]
        sock.settimeout(30)
        msg, fds, _flags, _addr = socket.recv_fds(sock, 16, 1)
        if not fds:
            self.kv_fds.append(None)
            return None
        self.kv_fds.append(fds[0])
        return map_kv(info, fds[0])

    def _check_alive(self) -> None:
        for rank, p in enumerate(self.procs):
            if p.poll() is not None:
                raise ExecutorError(f"executor {rank} (pid {p.pid}) {exit_reason(p.returncode)}")

    async def watch(self) -> None:
        """Until an executor process exits, then raise ``ExecutorError`` naming it. Event-driven
        (a pidfd per process), so a death is noticed at once, even on an idle node; where
        pidfds are missing (not Linux >= 5.3) it looks twice a second."""
        loop = asyncio.get_running_loop()
        exited = asyncio.Event()
        fds: list[int] = []
        try:
            with contextlib.suppress(AttributeError, OSError):  # no pidfds: poll instead
                for p in self.procs:
                    fds.append(os.pidfd_open(p.pid))
                    loop.add_reader(fds[-1], exited.set)
            poll_s = None if len(fds) == len(self.procs) else 0.5
            while True:
                self._check_alive()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(exited.wait(), poll_s)
        finally:
            for fd in fds:
                loop.remove_reader(fd)
                os.close(fd)

    async def step(self, plan: StepPlan) -> tuple[StepResult, bytes | None]:
        """Send ``plan`` to every rank and wait (bounded) for every reply. Returns the lead
        rank's result and its hidden-state frame (when the plan asked for context rows)."""
        await self.submit(plan)
        return await self.result(plan.step_id)

    async def submit(self, plan: StepPlan) -> None:
        """Send ``plan`` to every rank (its result: ``result``; a deferred plan's comes after
        the next ``submit`` or ``collect``)."""
        if self.dp == 1:
            payload = self._enc.encode(plan)
            for ident in self._identities:
                await self.sock.send_multipart([ident, payload])
            return
        self._plans[plan.step_id] = plan
        for d, part in enumerate(split_plan(plan, self.num_pages, self.dp)):
            payload = self._enc.encode(part)
            for ident in self._identities[d * self.tp:(d + 1) * self.tp]:
                await self.sock.send_multipart([ident, payload])

    async def masks(self, step_id: int, block: MaskBlock) -> None:
        """Send every rank the grammar masks its deferred step ``step_id`` waits for
        (``late_mask``): a ``Masks`` message, the rows its own frame (not copied: ``block``
        is not written after)."""
        payload = self._enc.encode(Masks(step_id, block.slots, block.row_bytes))
        for ident in self._identities:
            await self.sock.send_multipart([ident, payload, block.words], copy=False)

    async def define(self, grammar: GrammarDef) -> None:
        """Send every rank a grammar later plans name (``disagg.engine.grammar_mirror``)."""
        payload = self._enc.encode(grammar)
        for ident in self._identities:
            await self.sock.send_multipart([ident, payload])

    async def collect(self) -> None:
        """Ask every rank for its deferred step's result."""
        payload = self._enc.encode(Collect())
        for ident in self._identities:
            await self.sock.send_multipart([ident, payload])

    async def result(self, step_id: int) -> tuple[StepResult, bytes | None]:
        """Wait (bounded by ``--step-timeout``) for every rank's result of step ``step_id``."""
        deadline = time.monotonic() + self.cfg.step_timeout_s
        for stale in [sid for sid in self._early if sid < step_id]:
            del self._early[stale]
        early = self._early.pop(step_id, {})
        results = {ident: r for ident, (r, _) in early.items()}
        frames_of = {ident: f for ident, (_, f) in early.items()}  # each rank's hidden rows
        while len(results) < len(self._identities):
            left = deadline - time.monotonic()
            if left <= 0:
                raise ExecutorError(f"step {step_id} exceeded {self.cfg.step_timeout_s:.0f}s "
                                    "(--step-timeout)")
            if await self._results.poll(int(min(left, 1.0) * 1000) + 1):
                frames = await self.sock.recv_multipart()
                ident, msg = self._decode(frames[:2])
                if msg is not None and ident not in self._identities:
                    self.foreign_frames += 1  # not one of ours: never taken as a result
                elif isinstance(msg, StepResult) and msg.step_id == step_id:
                    results[ident] = msg
                    frames_of[ident] = frames[2] if len(frames) > 2 else None
                elif isinstance(msg, StepResult) and msg.step_id > step_id:
                    self._early.setdefault(msg.step_id, {})[ident] = (
                        msg, frames[2] if len(frames) > 2 else None)
            else:
                self._check_alive()
        hidden = frames_of.get(self._identities[0])
        leads = [results[self._identities[d * self.tp]] for d in range(self.dp)]
        for d, lead in enumerate(leads):
            self.all_to_all_s[d] += lead.all_to_all_s
        plan = self._plans.pop(step_id, None)
        if plan is None:
            return leads[0], hidden
        merged = merge_results(plan, leads, self.num_pages)
        if merged.error is not None:
            return merged, None
        lead_ids = [self._identities[d * self.tp] for d in range(self.dp)]
        try:
            return merged, merge_hidden(plan, leads, [frames_of[i] for i in lead_ids],
                                        self.num_pages)
        except ValueError as e:
            return StepResult(step_id, [], error=str(e)), None

    def _decode(self, frames: list[bytes]) -> tuple[bytes, ExecutorReply | None]:
        """(identity, message) of a frame from an executor; a malformed one is counted and
        dropped (the socket is private, but a bad frame must never stop the node)."""
        if len(frames) < 2:
            self.bad_frames += 1
            return b"", None
        try:
            return frames[0], self._dec.decode(frames[1])
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            self.bad_frames += 1
            log.error("ignoring a malformed frame from an executor: %s", e)
            return frames[0], None

    async def stop(self, timeout: float = 10.0) -> None:
        """Ask every executor to stop; kill what has not exited by ``timeout``."""
        payload = self._enc.encode(Shutdown())
        for ident in self._identities:
            try:
                await self.sock.send_multipart([ident, payload], flags=zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
        deadline = time.monotonic() + (timeout if self._identities else 0.0)  # none asked
        for p in self.procs:
            while p.poll() is None and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            if p.poll() is None:
                p.kill()
                p.wait()
        for s in self._fd_socks:
            s.close()
        for fd in self.kv_fds:
            if fd is not None:
                os.close(fd)
        self.kv_fds.clear()
        for view in self.kv_views:  # an mmap is unmapped with its last reference; a CUDA
            if view is not None and not isinstance(view[1], mmap.mmap):  # import only by
                view[1].close()  # close() (so: after the transfer engine let go of it)
        self.kv_views.clear()
        self._results.close()
        self.sock.close()
