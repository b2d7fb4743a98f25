"""A node wires actors together: executors, scheduler, frontend. Nothing here parses a CLI.

``Node(cfg)`` can be embedded in any asyncio program::

    node = Node(NodeConfig(listen="tcp://127.0.0.1:5555"))
    await node.start()          # returns once the node accepts requests
    await node.wait()           # until node.stop() or a fatal error
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import tempfile
from pathlib import Path

import msgspec
import zmq
import zmq.asyncio

from disagg.actors.executor import ExecutorGroup
from disagg.actors.frontend import FrontendActor
from disagg.actors.scheduler import SchedulerActor
from disagg.config import NodeConfig
from disagg.model.config import ModelArch
from disagg.model.tokenizer import Tokenizer

log = logging.getLogger(__name__)


def resolve_model(cfg: NodeConfig) -> NodeConfig:
    """Fill in the model directory: the given one, or the embedded default (converted once)."""
    if cfg.executor.model is not None:
        if not Path(cfg.executor.model, "config.json").is_file():
            raise FileNotFoundError(f"--model {cfg.executor.model}: no config.json there")
        return cfg
    from disagg.model.default import default_model_dir

    path = str(default_model_dir(progress=True))
    return msgspec.structs.replace(cfg, executor=msgspec.structs.replace(cfg.executor, model=path))


class Node:
    def __init__(self, cfg: NodeConfig):
        cfg.validate()
        self.cfg = cfg
        self.ctx = zmq.asyncio.Context()
        self.executors: ExecutorGroup | None = None
        self.scheduler: SchedulerActor | None = None
        self.frontend: FrontendActor | None = None
        self.address: str | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._run_dir: str | None = None
        self._done = asyncio.Event()
        self._error: BaseException | None = None

    async def start(self) -> None:
        cfg = await asyncio.to_thread(resolve_model, self.cfg)
        self.cfg = cfg
        model_dir = cfg.executor.model
        assert model_dir is not None
        arch = ModelArch.from_dir(model_dir)
        tokenizer = Tokenizer.from_dir(model_dir)
        self._run_dir = cfg.run_dir or tempfile.mkdtemp(prefix="disagg-")
        self.executors = ExecutorGroup(cfg, self._run_dir, self.ctx)
        try:
            await self.executors.start()
        except BaseException:
            await self._cleanup()
            raise
        inproc = f"inproc://scheduler-{id(self)}"
        sched_sock = self.ctx.socket(zmq.PAIR)
        sched_sock.bind(inproc)
        front_sock = self.ctx.socket(zmq.PAIR)
        front_sock.connect(inproc)
        s = cfg.scheduler
        self.scheduler = SchedulerActor(
            cfg.role, sched_sock, self.executors, arch, tokenizer, cfg.cache.page_size,
            s.max_batch_tokens, s.max_running, s.max_model_len or arch.max_position_embeddings,
        )
        self.frontend = FrontendActor(cfg.listen, front_sock, self.ctx)
        self.address = self.frontend.address
        self._tasks = [
            asyncio.create_task(self._guard(self.scheduler.run(), "scheduler")),
            asyncio.create_task(self._guard(self.frontend.run(), "frontend")),
        ]
        log.info("ready: %s node serving %s on %s (%d pages of %d tokens)", cfg.role,
                 arch.architecture, self.address, self.executors.num_pages, cfg.cache.page_size)

    async def _guard(self, coro: object, name: str) -> None:
        try:
            await coro  # type: ignore[misc]
        except asyncio.CancelledError:
            raise
        except BaseException as e:
            log.error("%s actor stopped: %s", name, e)
            self._error = e
            self._done.set()

    async def wait(self) -> None:
        """Until ``stop()`` is called or an actor fails (then re-raises its error)."""
        await self._done.wait()
        if self._error is not None:
            raise self._error

    async def stop(self) -> None:
        """Fail every live request, stop the actors and every executor process."""
        if self.scheduler is not None:
            self.scheduler.stop()
            with contextlib.suppress(Exception):
                await self.scheduler.fail_all("shutting_down", "the node is shutting down")
                if self.frontend is not None:  # flush the final replies to clients
                    await asyncio.wait_for(self.frontend._from_scheduler(), 1.0)
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(BaseException):
                await t
        await self._cleanup()
        self._done.set()

    async def _cleanup(self) -> None:
        if self.frontend is not None:
            self.frontend.close()
        if self.executors is not None:
            await self.executors.stop()
        self.ctx.destroy(linger=0)
        if self._run_dir and self.cfg.run_dir is None:
            shutil.rmtree(self._run_dir, ignore_errors=True)
