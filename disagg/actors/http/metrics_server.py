"""Metrics endpoint of a node (``--metrics-listen HOST:PORT``): Prometheus text on /metrics.

Receives: the node's ``Stats`` (polled over its own client or peer socket, so it works for
every role) and the observations the messengers feed into the node's ``Metrics`` (KV bytes and
writes, transfer latency, layer lag). Serves: ``/metrics`` and ``/health``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from aiohttp import web

from disagg.client import AsyncClient, RequestError
from disagg.serving.metrics import CONTENT_TYPE, Metrics

log = logging.getLogger(__name__)


class MetricsServer:
    def __init__(self, node_address: str, listen: str, metrics: Metrics, interval_s: float = 1.0):
        host, _, port = listen.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"--metrics-listen must be HOST:PORT, got {listen!r}")
        self.host, self.port = host, int(port)
        self.metrics = metrics
        self.interval_s = interval_s
        self.client = AsyncClient(node_address)
        self.node_address = node_address
        self._runner: web.AppRunner | None = None
        self._poll: asyncio.Task[None] | None = None

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/health", self._health)
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

    async def stop(self) -> None:
        if self._poll is not None:
            self._poll.cancel()
            with contextlib.suppress(BaseException):
                await self._poll
        if self._runner is not None:
            await self._runner.cleanup()
        await self.client.close()
