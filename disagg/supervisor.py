"""Supervision: a node that fails (an executor process died) starts again, in this process and
on the same addresses, a bounded number of times.

``RestartPolicy`` is the rule (at most N restarts within any window), ``Supervisor`` runs one
``Node`` after another under it. A mixed or decode node's client socket stays bound throughout
(``actors/frontend/front_door.py``): while no node serves, every client frame is answered ``unavailable``
with a retry-after hint (about as long as the last start took), none is lost to a closed port.
A prefill node's peer socket is re-bound: decoders' DEALERs reconnect by themselves. The HTTP
gateway and metrics endpoint, clients of ``--listen``, stay up throughout.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import msgspec

from disagg.actors.frontend.front_door import FrontDoor
from disagg.config import ConfigError, NodeConfig
from disagg.node import Node
from disagg.serving.metrics import Metrics

if TYPE_CHECKING:
    from disagg.actors.executor.executor_group import EarlySpawn

log = logging.getLogger(__name__)


class RestartPolicy:
    """At most ``max_restarts`` restarts within any ``window_s`` seconds."""

    def __init__(self, max_restarts: int = 5, window_s: float = 600.0):
        if max_restarts < 0:
            raise ConfigError(f"--max-restarts must be >= 0, got {max_restarts}")
        if window_s <= 0:
            raise ConfigError(f"--restart-window must be > 0, got {window_s}")
        self.max_restarts = max_restarts
        self.window_s = window_s
        self._recent: list[float] = []  # when the restarts in the window happened

    def allow(self, now: float) -> bool:
        """Whether a restart at ``now`` (seconds, monotonic) stays within the budget; one
        that does is counted."""
        self._recent = [t for t in self._recent if now - t < self.window_s]
        if len(self._recent) >= self.max_restarts:
            return False
        self._recent.append(now)
        return True


def pin_listen(cfg: NodeConfig, address: str | None) -> NodeConfig:
    """``cfg`` listening on the address its node actually bound (``tcp://127.0.0.1:0`` becomes
    the port it got), so that a restarted node binds the same one."""
    if not address or address == cfg.listen:
        return cfg
    return msgspec.structs.replace(cfg, listen=address)


def release_frozen() -> None:
    """Hand what a stopped node froze out of the collector's way (``gc.freeze``) back to it and
    collect: its reference cycles (actors, tasks, the KV mappings they hold) are freed only so."""
    gc.unfreeze()
    gc.collect()


class Supervisor:
    """Runs a ``Node`` for ``cfg``; when it fails, stops it (its live requests end with an
    ``internal`` error naming the failure) and starts a new one while ``policy`` allows.
    Every node shares one ``Metrics``."""

    def __init__(self, cfg: NodeConfig, policy: RestartPolicy | None = None,
                 early: EarlySpawn | None = None):
        """``early``: the first node's executors, spawned already (``early_spawn``)."""
        self.cfg = cfg
        self.early = early
        self.policy = policy or RestartPolicy()
        self.metrics = Metrics()
        self.node: Node | None = None
        self.restarts = 0
        self.door = FrontDoor(cfg.listen, cfg.curve_keys)  # bound by the first node's frontend

    async def start(self, stop: asyncio.Event) -> Node | None:
        """Start a node (raises as ``Node.start`` does, the node stopped); None if ``stop``
        was set first."""
        node = Node(self.cfg, self.metrics, self.door, self.early)
        self.early = None  # a restart spawns its own
        t0 = time.monotonic()
        starting = asyncio.ensure_future(node.start())
        stopping = asyncio.ensure_future(stop.wait())
        try:
            await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopping.cancel()
        if not starting.done():
            starting.cancel()
        try:
            await starting
        except BaseException:
            await node.stop()
            if stop.is_set():
                return None
            raise
        self.node = node
        self.cfg = pin_listen(self.cfg, node.address)
        self.door.retry_after_s = time.monotonic() - t0
        return node

    async def run(self, stop: asyncio.Event,
                  on_restart: Callable[[Node], None] = lambda node: None) -> int:
        """Serve until ``stop`` is set (returns 0), restarting a failed node while the policy
        allows; 1 once it does not. ``on_restart`` sees each restarted node."""
        while True:
            assert self.node is not None, "start() first"
            failure = await self._failure(self.node, stop)
            if failure is None:
                return 0
            await self._stop_node()
            while self.node is None:
                self.door.refuse(f"the node is restarting after {failure}")
                if stop.is_set():
                    return 0
                if not self.policy.allow(time.monotonic()):
                    log.error("giving up: %d restarts within %.0f s already (--max-restarts, "
                              "--restart-window); last failure: %s", self.policy.max_restarts,
                              self.policy.window_s, failure)
                    return 1
                self.restarts += 1
                log.warning("restarting the node (restart %d) after %s", self.restarts, failure)
                release_frozen()
                try:
                    if await self.start(stop) is None:
                        return 0
                except Exception as e:
                    failure = f"a failed restart: {e}"
                    log.error("restart %d failed: %s", self.restarts, e)
            on_restart(self.node)

    @staticmethod
    async def _failure(node: Node, stop: asyncio.Event) -> str | None:
        """Until ``stop`` is set (None) or the node fails (what failed)."""
        failed = asyncio.ensure_future(node.wait())
        stopping = asyncio.ensure_future(stop.wait())
        await asyncio.wait({failed, stopping}, return_when=asyncio.FIRST_COMPLETED)
        stopping.cancel()
        if stop.is_set() or not failed.done():
            failed.cancel()
            with contextlib.suppress(BaseException):
                await failed
            return None
        e = failed.exception()
        return None if e is None else node.failure or repr(e)

    async def _stop_node(self) -> None:
        node, self.node = self.node, None
        if node is not None:
            await node.stop()

    async def stop(self) -> None:
        """Stop the running node, if any, and close the client socket."""
        await self._stop_node()
        await self.door.close()
