"""Where the router's requests go (``RouterPlacement``, a base of ``Router``): the first peer
of each, a peer it has not tried when one refuses it before its first token (restarting,
draining), and **migration** (``disagg.serving.migration``): a streaming request whose peer
dies, restarts or drains is resent to another as prompt + the tokens streamed (``Resume``),
under a new wire id, continuing from the exact token; one no peer takes waits, the poll trying
again, up to ``MIGRATION_WAIT_S``; past its bounds it ends ``unavailable`` saying why."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import msgspec
import zmq
import zmq.asyncio

from disagg import trace
from disagg.actors.router.router_front import Flight
from disagg.protocol import Error, Finished
from disagg.serving.advice import LatencyWindow
from disagg.serving.metrics import Metrics
from disagg.serving.migration import MIGRATION_WAIT_S, MigrationPolicy, Progress, with_seed
from disagg.serving.routing import LoadBalancer, prefix_keys

log = logging.getLogger("disagg.actors.router.router")

# a streaming request a peer ends with one of these migrates (its node stops or restarts)
MIGRATE_ON = frozenset({"unavailable", "shutting_down", "internal"})


class RouterPlacement:
    """The router's state this part works on is declared here and set up by ``Router``."""

    balancer: LoadBalancer
    migration: MigrationPolicy
    flights: dict[str, Flight]
    moving: dict[str, tuple[str, str, float]]
    moved: Any  # disagg_router_migrations_total{outcome}
    latency: LatencyWindow
    by_client: dict[tuple[bytes, str], Flight]
    peers: dict[str, zmq.asyncio.Socket]
    _enc: msgspec.msgpack.Encoder

    if TYPE_CHECKING:  # Router's
        async def _end(self, f: Flight, terminal: Finished | Error) -> None: ...

    async def _recover(self, f: Flight, addr: str, err: Error) -> bool:
        """``addr`` ended ``f`` with ``err``: a request that streamed nothing and was refused
        ``unavailable`` goes to a peer it has not tried; one ended because its node stops or
        restarts (``shutting_down``, ``internal``: its executor died; ``unavailable`` after a
        token) migrates, counted against ``--migration-limit`` (a request that kills every
        executor it runs on stops there; with ``--migration-limit 0`` it ends ``unavailable``
        saying migration is off, counted ``refused``, as when its node dies). False (the
        client gets ``err``) otherwise."""
        if not f.streamed and err.code == "unavailable":
            return await self._elsewhere(f, addr)
        if err.code not in MIGRATE_ON:
            return False
        self.balancer.on_end(addr)
        f.peer = None
        await self._migrate(f, addr, f"ended it{' mid-stream' if f.streamed else ''} "
                            f"({err.code}: {err.message})")
        return True

    async def _elsewhere(self, f: Flight, addr: str) -> bool:
        """``addr`` answered ``f`` with ``unavailable`` (restarting after an executor death, or
        draining): resend it to a live peer it has not tried, unless it has streamed a token.
        False (the client gets the error) when there is none."""
        keys = prefix_keys(f.req.prompt_token_ids, f.req.prompt, f.req.cache_salt)
        peer = None if f.streamed else self.balancer.pick(f.tried, keys)
        if peer is None:
            return False
        log.info("request %s: %s is unavailable, resent to %s", f.client_id, addr, peer)
        self.balancer.on_end(addr)
        f.peer = None
        await self._send_to(f, peer)
        return True

    async def _migrate(self, f: Flight, addr: str, why: str) -> None:
        """``f`` streamed part of its output on ``addr``, which lost it (``why``): continue it on
        another live peer from the exact token, under a new wire id (late replies of the old one
        are dropped), or end it ``unavailable`` saying why not."""
        wire = f"{f.key}.m{f.progress.migrations + 1}"
        nxt = f.progress.resume(f.req, wire)
        if isinstance(nxt, str):
            await self._not_moved(f, addr, why, nxt)
            return
        self.flights.pop(f.req.request_id, None)
        f.req = nxt
        self.flights[wire] = f
        self.moving[wire] = (addr, why, time.monotonic() + MIGRATION_WAIT_S)
        await self._place_moved(f)

    async def _place_moved(self, f: Flight) -> None:
        """Send a moving request to a live peer other than the one that lost it (that one if
        it is the only one); none accepting: it waits (the poll tries again) until
        ``MIGRATION_WAIT_S`` after its node lost it, then ends ``unavailable``."""
        addr, why, deadline = self.moving[f.req.request_id]
        keys = prefix_keys(f.req.prompt_token_ids, f.req.prompt, f.req.cache_salt)
        peer = self.balancer.pick({addr}, keys) or self.balancer.pick(frozenset(), keys)
        if peer is None:
            if time.monotonic() >= deadline:
                del self.moving[f.req.request_id]
                await self._not_moved(f, addr, why, "no decode node took it within "
                                      f"{MIGRATION_WAIT_S:g} s")
            return
        del self.moving[f.req.request_id]
        log.info("request %s: decode node %s %s; moved to %s after %d tokens (migration %d)",
                 f.client_id, addr, why, peer, f.progress.streamed, f.progress.migrations)
        self.moved.labels("moved").inc()
        trace.event(f.span, "migrated", tokens=f.progress.streamed, lost_by=addr)
        await self._send_to(f, peer)

    async def _not_moved(self, f: Flight, addr: str, why: str, reason: str) -> None:
        self.moved.labels("refused").inc()
        await self._end(f, Error("unavailable", f"decode node {addr} {why}; the request was "
                                 f"not moved: {reason}", f.client_id))

    async def _submit(self, f: Flight) -> None:
        """A new request: seeded if it may migrate, traced (its span the parent of its
        decoders'), placed."""
        f.req = with_seed(f.req, self.migration)  # a sampled stream continues the same noise
        f.progress = Progress(self.migration, f.req.resume)
        if trace.tracing():
            f.span = trace.start("router", f.req.traceparent, request_id=f.client_id)
            f.req = msgspec.structs.replace(f.req, traceparent=trace.traceparent(f.span))
        self.flights[f.req.request_id] = f
        self.latency.start(f.key, time.monotonic())
        if f.front_key is not None:
            self.by_client[f.front_key] = f
        await self._place(f)

    async def _place(self, f: Flight) -> None:
        """Send ``f`` to the least loaded live peer it has not tried, or end it."""
        keys = prefix_keys(f.req.prompt_token_ids, f.req.prompt, f.req.cache_salt)
        peer = self.balancer.place(f.tried, keys)
        if peer is None:
            await self._end(f, Error("unavailable", "no decode node is available", f.client_id))
            return
        await self._send_to(f, peer)

    async def _send_to(self, f: Flight, peer: str) -> None:
        """Send ``f`` to ``peer``; a send that fails (the connection dropped, and the monitor
        has not said so yet) goes to another live peer, one it has not tried first, each peer
        at most once; ``unavailable`` when none takes it."""
        failed: set[str] = set()
        why = ""
        frame = self._enc.encode(f.req)
        while True:
            f.peer = peer
            f.tried.add(peer)
            self.balancer.on_start(peer)
            try:
                await self.peers[peer].send(frame, zmq.NOBLOCK)
                trace.event(f.span, "sent", peer=peer)
                return
            except zmq.ZMQError as e:
                self.balancer.on_end(peer)
                f.peer = None
                failed.add(peer)
                why = str(e)
                log.warning("request %s: could not send to %s (%s)", f.client_id, peer, e)
            keys = prefix_keys(f.req.prompt_token_ids, f.req.prompt, f.req.cache_salt)
            nxt = self.balancer.pick(f.tried, keys) or self.balancer.pick(failed, keys)
            if nxt is None:
                await self._end(f, Error("unavailable", "could not send to "
                                         f"{', '.join(sorted(failed))}: {why}", f.client_id))
                return
            peer = nxt


def migration_counter(metrics: Metrics) -> Any:
    from prometheus_client import Counter

    return Counter("disagg_router_migrations", "Streaming requests whose decode node lost them: "
                   "moved to another (moved) or ended unavailable (refused).", ["outcome"],
                   registry=metrics.registry)
