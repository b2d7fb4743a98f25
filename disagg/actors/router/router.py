"""Router actor: one front door spreading requests over decode nodes (``--role router``).

Receives: client-protocol frames on a ROUTER socket (``listen``, same protocol as a node);
in-process ``generate()`` / ``stats()`` calls (the HTTP gateway uses the router as its backend);
replies and Stats from each decode peer on one DEALER socket per peer.
Sends: each ``GenerateRequest`` to the least loaded live peer (``disagg.serving.routing``) under a
router-unique request id; ``Abort`` to the peer holding the request; a ``Ping`` to every peer
every ``poll_interval`` seconds, and a ``StatsRequest`` once its last one was answered; replies
back to clients under their own request ids.
Liveness (``LoadBalancer``): a peer is silent when it sent nothing, not even a ``Pong`` (its
frontend answers those however busy its scheduler is), for ``dead_after`` seconds, and dead at
once when its connection goes down; a draining peer (its ``Pong`` says so) or one answering
``unavailable`` (restarting) gets no new request. ``ready()`` (the gateway's ``/health``) is
true exactly while a new request would find a peer.
Owns: the in-flight table (router id -> client, peer); its client-protocol front (the frames
of ``listen``, salted by client key) is ``disagg.actors.router.router_front``. A peer silent for
``dead_after`` seconds is dead: its requests that have not streamed a token yet are resent to
another peer, the others migrate from the exact token, as do streaming requests a peer ends
because it stops or restarts (``disagg.actors.router.router_placement``). A dead peer that answers
again is used again. A request a peer refuses with ``unavailable`` (it is restarting after an
executor death) before any token goes to a peer it has not tried, if one is live.
``dns:NAME:PORT`` peers come and go (``disagg.actors.peer_discovery``): one that appears is
connected, one that vanishes is dead at once (as above), then forgotten.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import signal
import time
from collections.abc import AsyncIterator, Awaitable
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from disagg import trace
from disagg.actors.peer_discovery import PeerDiscovery
from disagg.actors.router.router_front import Flight, RouterFront
from disagg.actors.router.router_peers import RouterPeers
from disagg.actors.router.router_placement import RouterPlacement, migration_counter
from disagg.actors.sockets import CLIENT_FRAME_BYTES, dialing
from disagg.client import RequestError
from disagg.protocol import (
    Abort,
    Error,
    Finished,
    GenerateRequest,
    NodeReply,
    Ping,
    Pong,
    SamplingParams,
    Stats,
    StatsRequest,
    TokenChunk,
    Usage,
)
from disagg.remote.discovery import split_specs
from disagg.serving import security
from disagg.serving.advice import Advice, LatencyWindow, Slo, advise_from_stats
from disagg.serving.http_limits import HttpLimits
from disagg.serving.metrics import Metrics
from disagg.serving.migration import MigrationPolicy
from disagg.serving.routing import LoadBalancer
from disagg.serving.salting import SaltByTenant, TenantSalting

log = logging.getLogger(__name__)

class Router(RouterFront, RouterPlacement, RouterPeers):
    def __init__(self, decode_peers: list[str], listen: str | None = None,
                 ctx: zmq.asyncio.Context | None = None, metrics: Metrics | None = None,
                 poll_interval: float = 0.5, dead_after: float = 3.0,
                 resolve_interval: float = 10.0, slo: Slo | None = None,
                 salt_by_tenant: SaltByTenant = "auto", migration: MigrationPolicy | None = None):
        self.migration = migration or MigrationPolicy()
        static, names = split_specs(decode_peers, "--decode-peer")
        self.balancer = LoadBalancer(static, dead_after, dynamic=bool(names))
        self.discovery = PeerDiscovery(names, static, self._peers_changed, resolve_interval)
        self._peer_tasks: dict[str, asyncio.Task[None]] = {}
        self._own_ctx = ctx is None
        self.ctx = ctx or zmq.asyncio.Context()
        security.install(self.ctx, security.keys_from_env())
        self.key_ids = security.ClientKeyIds(self.ctx)  # client keys: salted, Stats redacted
        self.salting = TenantSalting(salt_by_tenant, self.key_ids.active)
        self.metrics = metrics or Metrics()
        self.poll_interval = poll_interval
        self.listen = listen
        self.address: str | None = None
        self.front: zmq.asyncio.Socket | None = None
        self.peers: dict[str, zmq.asyncio.Socket] = {}
        self.monitors: dict[str, zmq.asyncio.Socket] = {}  # each peer socket's connection events
        self._was_accepting: dict[str, bool] = {}  # for the log: last seen taking new requests
        self._leaving: set[str] = set()  # left the peer set while draining: forgotten once dead
        self.peer_stats: dict[str, Stats] = {}
        self.flights: dict[str, Flight] = {}  # by wire id (Flight.req.request_id)
        # wire id -> (the peer that lost it, why, deadline): migrating, no peer took it yet
        self.moving: dict[str, tuple[str, str, float]] = {}
        self.by_client: dict[tuple[bytes, str], Flight] = {}
        self.bad_frames = 0
        self.rejected = 0
        self._ids = itertools.count()
        self._enc = msgspec.msgpack.Encoder()
        self._reply_dec = msgspec.msgpack.Decoder(NodeReply)
        self._tasks: list[asyncio.Task[None]] = []
        self._any_alive = asyncio.Event()
        self.peer_up = _peer_gauge(self.metrics)
        self.moved = migration_counter(self.metrics)
        self.slo, self.latency = slo or Slo(), LatencyWindow()  # for advice()
        self.metrics.watch_advice(self.advice)

    # ------------------------------------------------------------------ lifecycle

    async def start(self, wait_for_peer: float = 60.0) -> None:
        """Connect to every peer, bind ``listen``; returns once a peer answered Stats (or after
        ``wait_for_peer`` seconds, with a warning)."""
        for addr in self.balancer.order:
            self._connect(addr)
        if self.discovery.names:
            self._tasks.append(asyncio.create_task(self._guard(self.discovery.run())))
        if self.listen is not None:
            self.front = self.ctx.socket(zmq.ROUTER)
            security.server(self.front)
            self.front.setsockopt(zmq.LINGER, 0)
            self.front.setsockopt(zmq.MAXMSGSIZE, CLIENT_FRAME_BYTES)
            self.front.bind(self.listen)
            self.address = self.front.getsockopt_string(zmq.LAST_ENDPOINT)
            self._tasks.append(asyncio.create_task(self._guard(self._from_clients())))
        self._tasks.append(asyncio.create_task(self._guard(self._poll())))
        try:
            await asyncio.wait_for(self._any_alive.wait(), wait_for_peer)
        except asyncio.TimeoutError:
            log.warning("no decode peer answered in %.0fs; serving anyway", wait_for_peer)

    async def stop(self) -> None:
        """Fail every live request, stop the loops, close the sockets."""
        for f in list(self.flights.values()):
            await self._end(f, Error("shutting_down", "the router is shutting down", f.client_id))
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(BaseException):
                await t
        for s in self.peers.values():
            s.disable_monitor()
            s.close()
        for m in self.monitors.values():
            m.close()
        if self.front is not None:
            self.front.close()
        if self._own_ctx:
            security.uninstall(self.ctx)
            self.ctx.destroy(linger=0)

    async def _guard(self, coro: Awaitable[None]) -> None:
        try:
            await coro
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("router loop failed")
            raise

    # ------------------------------------------------------------------ peers

    def _connect(self, addr: str) -> None:
        sock, monitor = dialing(self.ctx, addr, zmq.EVENT_DISCONNECTED)
        self.peers[addr] = sock
        self.monitors[addr] = monitor
        task = asyncio.create_task(self._guard(self._from_peer(addr, sock, monitor)))
        self._tasks.append(task)
        self._peer_tasks[addr] = task

    async def _poll(self) -> None:
        """Loop: 1. send a Ping to every peer, and a StatsRequest to those that answered the
        last one; 2. declare silent peers dead and move or fail their requests; 3. sleep
        ``poll_interval``."""
        ping, stats = self._enc.encode(Ping()), self._enc.encode(StatsRequest())
        while True:
            now = time.monotonic()
            for addr, sock in list(self.peers.items()):
                with contextlib.suppress(zmq.ZMQError):
                    await sock.send(ping, zmq.NOBLOCK)
                    if self.balancer.stats_due(addr, now):
                        await sock.send(stats, zmq.NOBLOCK)
            for addr in self.balancer.check(time.monotonic()):
                await self._peer_died(addr)
            for addr in [a for a in self._leaving if not self.balancer.peers[a].alive]:
                await self._forget(addr, "exited after draining")
            for wire in list(self.moving):  # requests whose node lost them, waiting for one
                await self._place_moved(self.flights[wire])
            await asyncio.sleep(self.poll_interval)

    async def _from_peer(self, addr: str, sock: zmq.asyncio.Socket,
                         monitor: zmq.asyncio.Socket) -> None:
        """Loop: 1. receive a reply from ``addr`` (a dropped connection kills the peer at once
        meanwhile); 2. a heartbeat's or Stats answer goes to the balancer, a request's to its
        flight."""
        poller = zmq.asyncio.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        while True:
            data = await self._next_reply(addr, sock, monitor, poller)
            try:
                msg = self._reply_dec.decode(data)
            except (msgspec.DecodeError, msgspec.ValidationError) as e:
                log.warning("undecodable reply from %s: %s", addr, e)
                continue
            if isinstance(msg, (Stats, Pong)) or msg.request_id is None:
                self._heartbeat(addr, msg)
                continue
            self._heard(addr, self.balancer.on_heard(addr, time.monotonic()))
            f = self.flights.get(msg.request_id)
            if f is None or f.peer != addr:
                continue  # late reply of an aborted or moved request
            if isinstance(msg, TokenChunk):
                if not f.streamed:
                    trace.event(f.span, "first_token")
                f.streamed = True
                f.progress.on_chunk(msg.token_ids, msg.text)
                self.latency.tokens(f.key, len(msg.token_ids), time.monotonic())
                if f.timer is not None:
                    f.timer.on_tokens(len(msg.token_ids))
                await f.deliver(msgspec.structs.replace(msg, request_id=f.client_id))
            elif not (isinstance(msg, Error) and await self._recover(f, addr, msg)):
                await self._end(f, msgspec.structs.replace(msg, request_id=f.client_id))

    async def _peer_died(self, addr: str, why: str = "") -> None:
        log.warning("decode peer %s %s: marked dead", addr,
                    why or f"sent nothing (no Pong) for {self.balancer.dead_after:.1f}s")
        self.peer_up.labels(addr).set(0)
        self.metrics.forget_node(addr)
        self.peer_stats.pop(addr, None)
        for f in [f for f in self.flights.values() if f.peer == addr]:
            self.balancer.on_end(addr)
            f.peer = None
            with contextlib.suppress(zmq.ZMQError):  # in case it is only slow
                await self.peers[addr].send(self._enc.encode(Abort(f.req.request_id)),
                                            zmq.NOBLOCK)
            if f.streamed:
                await self._migrate(f, addr, "stopped answering mid-stream")
            else:
                await self._place(f)

    async def _end(self, f: Flight, terminal: Finished | Error) -> None:
        if self.flights.pop(f.req.request_id, None) is None:
            return
        self.moving.pop(f.req.request_id, None)
        trace.end(f.span, outcome=terminal.reason if isinstance(terminal, Finished)
                  else terminal.code, migrations=f.progress.migrations)
        self.latency.finish(f.key, terminal, time.monotonic())
        if f.front_key is not None:
            self.by_client.pop(f.front_key, None)
        if f.peer is not None:
            self.balancer.on_end(f.peer)
        if f.timer is not None:
            if isinstance(terminal, Error):
                f.timer.finish("error", len(f.req.prompt_token_ids or []), terminal.code)
            else:
                f.timer.finish(terminal.reason, terminal.usage.prompt_tokens)
        await f.deliver(terminal)

    async def _abort(self, f: Flight) -> None:
        if f.req.request_id in self.moving:  # between two nodes: nothing runs it
            await self._end(f, Finished(f.client_id, "abort", Usage(
                len(f.req.prompt_token_ids or []), f.progress.streamed)))
        elif f.req.request_id in self.flights and f.peer is not None:
            with contextlib.suppress(zmq.ZMQError):
                await self.peers[f.peer].send(self._enc.encode(Abort(f.req.request_id)),
                                              zmq.NOBLOCK)

    def _new_key(self) -> str:
        return f"router-{next(self._ids)}"

    # ------------------------------------------------------------------ in-process clients

    async def generate(self, prompt: str | None = None, prompt_token_ids: list[int] | None = None,
                       sampling: SamplingParams | None = None, request_id: str | None = None,
                       timeout: float = 600.0, cache_salt: str | None = None,
                       tenant: str | None = None, traceparent: str | None = None
                       ) -> AsyncIterator[TokenChunk | Finished]:
        """As ``AsyncClient.generate``: stream ``TokenChunk``s, then the ``Finished``; raise
        ``RequestError`` on ``Error``. Closing the stream early aborts the request. ``tenant``
        goes on to the decoder (its fair queue)."""
        key = self._new_key()
        q: asyncio.Queue[NodeReply] = asyncio.Queue()

        async def deliver(msg: NodeReply) -> None:
            q.put_nowait(msg)

        req = GenerateRequest(request_id=key, prompt=prompt, prompt_token_ids=prompt_token_ids,
                              sampling=sampling or SamplingParams(), cache_salt=cache_salt,
                              tenant=tenant, traceparent=traceparent)
        f = Flight(key, request_id or key, req, deliver)
        await self._submit(f)
        try:
            while True:
                try:
                    msg = await asyncio.wait_for(q.get(), timeout)
                except asyncio.TimeoutError:
                    raise TimeoutError(f"no reply for request {f.client_id} in {timeout}s") from None
                if isinstance(msg, Error):
                    raise RequestError(msg)
                assert isinstance(msg, (TokenChunk, Finished))
                yield msg
                if isinstance(msg, Finished):
                    return
        finally:
            if f.req.request_id in self.flights:
                await self._abort(f)

    async def stats(self, timeout: float = 10.0) -> Stats:
        """The sum over live peers' last Stats (role ``router``); TimeoutError when none is."""
        live = [self.peer_stats[a] for a in self.balancer.alive() if a in self.peer_stats]
        if not live:
            raise TimeoutError("no decode node is live")
        return self._aggregate(live)

    def advice(self) -> Advice:
        """Prefill : decode advice from the live peers' last Stats and recent latencies."""
        live = [self.peer_stats[a] for a in self.balancer.alive() if a in self.peer_stats]
        return advise_from_stats(live, self.latency, self.slo, time.monotonic())

    def _aggregate(self, live: list[Stats]) -> Stats:
        """Every count summed over ``live``; the router's own refusals added."""
        sums: dict[str, Any] = {}
        for f in msgspec.structs.fields(Stats):
            if f.name not in ("role", "page_size", "v", "max_model_len") and f.type is int:
                sums[f.name] = sum(int(getattr(s, f.name)) for s in live)
        limits = [s.max_model_len for s in live if s.max_model_len > 0]
        sums["max_model_len"] = min(limits) if limits else 0  # what every decoder accepts
        sums["rejected"] += self.rejected
        sums["bad_frames"] += self.bad_frames
        return Stats(role="router", page_size=live[0].page_size if live else 0, **sums)


def _peer_gauge(metrics: Metrics) -> Any:
    from prometheus_client import Gauge

    return Gauge("disagg_router_peer_up", "1 while the decode peer answers Stats, else 0.",
                 ["peer"], registry=metrics.registry)


# ------------------------------------------------------------------ entry points


async def start_router(listen: str | None, decode_peers: list[str], http_listen: str | None = None,
                       model_dir: str | None = None, model_name: str | None = None,
                       max_model_len: int | None = None, poll_interval: float = 0.5,
                       dead_after: float = 3.0, wait_for_peer: float = 60.0,
                       resolve_interval: float = 10.0, slo: Slo | None = None,
                       salt_by_tenant: SaltByTenant = "auto",
                       http_limits: HttpLimits | None = None,
                       migration: MigrationPolicy | None = None) -> tuple[Router, Any]:
    """Start a router (and its HTTP gateway when ``http_listen`` is set). Returns
    ``(router, gateway or None)``; stop the gateway first, then the router."""
    from disagg.actors.http.http import Gateway

    router = Router(decode_peers, listen, poll_interval=poll_interval, dead_after=dead_after,
                    resolve_interval=resolve_interval, slo=slo, salt_by_tenant=salt_by_tenant,
                    migration=migration)
    await router.start(wait_for_peer)
    gateway = None
    if http_listen is not None:
        try:
            if model_dir is None:
                from disagg.model.default import default_model_dir

                model_dir = str(await asyncio.to_thread(default_model_dir))
            from disagg.model.config import ModelArch
            from disagg.model.default import served_model_name
            from disagg.model.tokenizer import Tokenizer

            tok = Tokenizer.from_dir(model_dir)
            mml = max_model_len or ModelArch.from_dir(model_dir).max_position_embeddings
            gateway = Gateway(router, http_listen, model_name or served_model_name(model_dir), tok, mml,
                              router.metrics, stats_interval=poll_interval * 2, stats_label=None,
                              limits=http_limits)
            await gateway.start()
        except BaseException:
            await router.stop()
            raise
    return router, gateway


async def run_router(listen: str, decode_peers: list[str], http_listen: str | None = None,
                     model_dir: str | None = None, model_name: str | None = None,
                     max_model_len: int | None = None, poll_interval: float = 0.5,
                     dead_after: float = 3.0, resolve_interval: float = 10.0,
                     slo: Slo | None = None, salt_by_tenant: SaltByTenant = "auto",
                     http_limits: HttpLimits | None = None,
                     migration: MigrationPolicy | None = None) -> int:
    """``disagg-node --role router``: serve until SIGINT/SIGTERM. Returns an exit code."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        router, gateway = await start_router(listen, decode_peers, http_listen, model_dir,
                                             model_name, max_model_len, poll_interval, dead_after,
                                             resolve_interval=resolve_interval, slo=slo,
                                             salt_by_tenant=salt_by_tenant,
                                             http_limits=http_limits, migration=migration)
    except Exception as e:
        log.error("could not start: %s", e)
        return 1
    log.info("ready: router on %s over %d decode peers%s", router.address, len(decode_peers),
             f", HTTP on {gateway.url}" if gateway is not None else "")
    await stop.wait()
    log.info("stopping")
    if gateway is not None:
        await gateway.stop()
    await router.stop()
    log.info("stopped")
    return 0
