"""The router's peers (``RouterPeers``, a base of ``Router``): their liveness and whether they
take requests, from what each sends (``disagg.serving.routing.LoadBalancer`` decides): a
``Pong`` (answered by the peer's frontend however busy it is), Stats, a frame-level refusal
(restarting), a dropped connection (dead at once); ``ready()``, what the gateway's
``/health`` says; peers that discovery adds and removes, a draining one kept until it exits."""

from __future__ import annotations

import contextlib
import logging
import time
from typing import TYPE_CHECKING, Any

import zmq
import zmq.asyncio

from disagg.actors.router.router_front import Flight
from disagg.actors.sockets import monitor_events, readable
from disagg.protocol import Error, Pong, Stats
from disagg.serving.metrics import Metrics
from disagg.serving.routing import LoadBalancer

log = logging.getLogger("disagg.actors.router.router")


class RouterPeers:
    """The router's state this part works on is declared here and set up by ``Router``."""

    balancer: LoadBalancer
    flights: dict[str, Flight]
    peers: dict[str, zmq.asyncio.Socket]
    monitors: dict[str, zmq.asyncio.Socket]
    peer_stats: dict[str, Stats]
    metrics: Metrics
    peer_up: Any  # disagg_router_peer_up{peer}
    _peer_tasks: dict[str, Any]
    _tasks: list[Any]
    _was_accepting: dict[str, bool]
    _leaving: set[str]
    _any_alive: Any  # asyncio.Event

    if TYPE_CHECKING:  # Router's
        def _connect(self, addr: str) -> None: ...
        async def _peer_died(self, addr: str, why: str = "") -> None: ...

    async def _peers_changed(self, appeared: list[str], vanished: list[str]) -> None:
        """Discovery: connect the peers that appeared; those that vanished die at once (their
        requests moved or ended as for a silent peer), then are forgotten, except a draining
        one still streaming ours (a pod scaled in leaves the DNS as its drain starts): it is
        kept, chosen for nothing, until it dies (exits), then forgotten."""
        for addr in appeared:
            self._leaving.discard(addr)
            if self.balancer.add(addr):
                self._connect(addr)
        for addr in vanished:
            if addr not in self.peers:
                continue
            p = self.balancer.peers[addr]
            if p.alive and not p.accepting and any(f.peer == addr
                                                   for f in self.flights.values()):
                log.info("decode peer %s left the peer set while draining: kept until it exits",
                         addr)
                self._leaving.add(addr)
                continue
            await self._forget(addr, "left the peer set")

    async def _forget(self, addr: str, why: str) -> None:
        """``addr`` is no peer any more: dead (its requests moved or ended), then forgotten."""
        self._leaving.discard(addr)
        if self.balancer.peers[addr].alive:
            self.balancer.vanished(addr)
            await self._peer_died(addr, why)
        self.balancer.remove(addr)
        task = self._peer_tasks.pop(addr)
        task.cancel()
        self._tasks.remove(task)
        sock = self.peers.pop(addr)
        sock.disable_monitor()
        sock.close(linger=500)  # the Aborts just sent, if it is there
        self.monitors.pop(addr).close()
        with contextlib.suppress(KeyError):
            self.peer_up.remove(addr)

    async def _next_reply(self, addr: str, sock: zmq.asyncio.Socket,
                          monitor: zmq.asyncio.Socket, poller: zmq.asyncio.Poller) -> bytes:
        """The next frame from ``addr``; a connection of its that went down meanwhile (its
        process is gone, and with it what it held of ours) kills it at once."""
        while True:
            if readable(sock):  # (an Again would leave a reference cycle: sockets.readable)
                try:
                    return await sock.recv(zmq.NOBLOCK)
                except zmq.Again:
                    pass
            events = dict(await poller.poll())
            if monitor in events:
                for event, _ in await monitor_events(monitor):
                    if event == zmq.EVENT_DISCONNECTED and self.balancer.on_down(addr):
                        await self._peer_died(addr, "closed its connection")

    def _heartbeat(self, addr: str, msg: Stats | Pong | Error) -> None:
        """A Pong, a Stats reply or a frame-level Error (a Ping or Stats refused) from
        ``addr``: it is live; whether it takes new requests (draining, restarting)."""
        now = time.monotonic()
        if isinstance(msg, Pong):
            revived = self.balancer.on_pong(addr, msg.draining, now)
        elif isinstance(msg, Stats):
            self.peer_stats[addr] = msg
            self.metrics.update_stats(msg, addr)
            revived = self.balancer.on_stats(addr, msg.running, msg.waiting, now,
                                             bool(msg.draining), len(msg.dp_ranks) or 1)
        elif msg.code == "unavailable":  # restarting: its door refuses every frame
            revived = self.balancer.on_refused(addr, now)
        else:
            log.warning("frame-level error from %s: %s", addr, msg)
            revived = self.balancer.on_heard(addr, now)
        self._heard(addr, revived)
        accepting = self.balancer.peers[addr].accepting
        if accepting != self._was_accepting.get(addr, True):
            log.info("decode peer %s %s", addr, "takes new requests again" if accepting else (
                f"refuses new requests ({msg.message})" if isinstance(msg, Error)
                else "is draining: no new request goes to it"))
        self._was_accepting[addr] = accepting

    def _heard(self, addr: str, revived: bool) -> None:
        if revived:
            log.info("decode peer %s is live", addr)
            self.peer_up.labels(addr).set(1)
        self._any_alive.set()

    def ready(self) -> str | None:
        """None while a new request would find a decode node, else why not (``/health``)."""
        if self.balancer.serving():
            return None
        alive = self.balancer.alive()
        return ("no decode node is available" + (
            f": {len(alive)} live, all draining or restarting" if alive else ""))
