"""Metrics endpoint of a node (``--metrics-listen HOST:PORT``): Prometheus text on /metrics.

Receives: the node's ``Stats`` (polled over its own client or peer socket, so it works for
every role) and the observations the messengers feed into the node's ``Metrics`` (KV bytes and
writes, transfer latency, layer lag). Serves: ``/metrics``, ``/health`` and ``POST /drain``
(from loopback only: a pod's preStop hook, ``disagg-node drain``), which starts the node's
drain (``disagg.node.Node.drain``) and answers 202 at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
from collections.abc import Callable

from aiohttp import web

from disagg.client import AsyncClient, RequestError
from disagg.serving.metrics import CONTENT_TYPE, Metrics

log = logging.getLogger(__name__)


class MetricsServer:
    def __init__(self, node_address: str, listen: str, metrics: Metrics, interval_s: float = 1.0,
                 on_drain: Callable[[], float] | None = None):
        """``on_drain``: starts the node's drain (a no-op when it drains already); returns its
        timeout in seconds. None: ``POST /drain`` answers 404."""
        host, _, port = listen.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"--metrics-listen must be HOST:PORT, got {listen!r}")
        self.host, self.port = host, int(port)
        self.metrics = metrics
        self.interval_s = interval_s
        self.client = AsyncClient(node_address)
        self.node_address = node_address
        self.on_drain = on_drain
        self._runner: web.AppRunner | None = None
        self._poll: asyncio.Task[None] | None = None

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/health", self._health)
        app.router.add_post("/drain", self._drain)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        await web.TCPSite(self._runner, self.host, self.port).start()
        self._poll = asyncio.create_task(self._poll_stats())
        log.info("metrics on http://%s:%d/metrics", self.host, self.port)

    async def _poll_stats(self) -> None:
        """Loop: ask the node for Stats (bounded wait), record them, sleep one interval. No
        answer, or an Error (``unavailable`` while the node restarts), skips one interval."""
        while True:
            with contextlib.suppress(TimeoutError, RequestError):
                self.metrics.update_stats(await self.client.stats(timeout=5.0), self.node_address)
            await asyncio.sleep(self.interval_s)

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), headers={"Content-Type": CONTENT_TYPE})

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def _drain(self, request: web.Request) -> web.Response:
        if self.on_drain is None:
            return web.json_response({"error": "this node does not drain"}, status=404)
        if not _loopback(request.remote):
            return web.json_response({"error": "POST /drain is taken from loopback only"},
                                     status=403)
        timeout_s = self.on_drain()
        return web.json_response({"status": "draining", "drain_timeout_s": timeout_s},
                                 status=202)

    async def stop(self) -> None:
        if self._poll is not None:
            self._poll.cancel()
            with contextlib.suppress(BaseException):
                await self._poll
        if self._runner is not None:
            await self._runner.cleanup()
        await self.client.close()


def _loopback(remote: str | None) -> bool:
    """Whether a request came from this host (``request.remote``: the peer's address)."""
    try:
        return remote is not None and ipaddress.ip_address(remote).is_loopback
    except ValueError:
        return False
