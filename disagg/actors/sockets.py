"""ZeroMQ plumbing every actor shares: frame limits, socket set-up, draining without waiting,
and which connection a ROUTER's frames came on.

libzmq's ``ZMQ_ROUTER_NOTIFY`` is a draft option (not in the wheels we use), so a ROUTER
learns of disconnects from its monitor socket (``EVENT_DISCONNECTED``, whose value is the
connection's fd) and matches them to peers by the fd each received frame reports
(``zmq.SRCFD``, from ``recv_multipart(copy=False)``). NOTES.md has the details.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from typing import Any, Literal

import zmq
import zmq.asyncio

from disagg.serving import security

CLIENT_FRAME_BYTES = 16 << 20  # the client protocol (node frontend, router): one frame at most
PEER_FRAME_BYTES = 64 << 20  # a prefill node's peer socket (a PrefillRequest of a long prompt)
# a failed ZMTP/CURVE handshake (an impostor or a plain socket on a peer's address)
HANDSHAKE_FAILED = security.HANDSHAKE_FAILED
# ``readable``'s option and flag as plain ints: pyzmq's enums cost ~0.8 us a check in ``&``
# and lookups, and the drains check once per message (hundreds a decode step at batch 64)
_EVENTS = int(zmq.EVENTS)
_POLLIN = int(zmq.POLLIN)


def listening(ctx: zmq.asyncio.Context, address: str, *, max_frame: int,
              who: Literal["clients", "nodes"] = "clients",
              mandatory: bool = False) -> tuple[zmq.asyncio.Socket, zmq.asyncio.Socket]:
    """A bound ROUTER (CURVE server when keys are configured: ``who`` may connect) and the
    monitor socket of its disconnects and failed handshakes (``disconnected_fds`` logs
    those). ``mandatory``: a reply to a full or unknown route
    raises instead of being dropped silently."""
    sock = ctx.socket(zmq.ROUTER)
    security.server(sock, nodes_only=who == "nodes")
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, max_frame)
    if mandatory:
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED | HANDSHAKE_FAILED)
    sock.bind(address)
    return sock, monitor


def dialing(ctx: zmq.asyncio.Context, address: str,
            events: int = zmq.EVENT_DISCONNECTED | HANDSHAKE_FAILED,
            ) -> tuple[zmq.asyncio.Socket, zmq.asyncio.Socket]:
    """A DEALER connected to ``address`` (CURVE client when keys are configured) and the
    monitor socket of its connection ``events``."""
    sock = ctx.socket(zmq.DEALER)
    security.client(sock)
    sock.setsockopt(zmq.LINGER, 0)
    monitor = sock.get_monitor_socket(events)
    sock.connect(address)
    return sock, monitor


def readable(sock: zmq.asyncio.Socket) -> bool:
    """A message is queued on ``sock``: its ``recv(NOBLOCK)`` will not raise ``zmq.Again``.

    The drains below ask first because each ``Again`` a zmq.asyncio receive raises is a
    reference cycle (the exception, its traceback's frames, the receive's future), ~30 objects
    for the cyclic collector per empty drain: a node behind its HTTP gateway made ~1,000 per
    request, and with them a full collection every ~10 s (NOTES.md, "Garbage collector")."""
    return bool(int(sock.getsockopt(_EVENTS)) & _POLLIN)


async def pending(sock: zmq.asyncio.Socket) -> AsyncIterator[bytes]:
    """Every single-frame message already queued on ``sock``, without waiting."""
    while readable(sock):
        try:
            data = await sock.recv(zmq.NOBLOCK)
        except zmq.Again:
            return
        yield data


async def pending_frames(sock: zmq.asyncio.Socket, limit: int | None = None,
                         yield_every: int = 0) -> AsyncIterator[list[zmq.Frame]]:
    """Every multipart message already queued on ``sock`` (at most ``limit``), without
    waiting; frames uncopied so ``source_fd`` can tell their connection. ``yield_every``
    (> 0): let the event loop run its other ready callbacks after that many messages (a
    receive of a queued message never suspends, so a long drain holds the loop)."""
    n = 0
    while (limit is None or n < limit) and readable(sock):
        try:
            frames = await sock.recv_multipart(zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return
        n += 1
        yield frames
        if yield_every > 0 and n % yield_every == 0:
            await asyncio.sleep(0)


def source_fd(frame: zmq.Frame) -> int | None:
    """The connection (fd) a received frame came on, to match the monitor's disconnects."""
    try:
        return int(frame.get(zmq.SRCFD))
    except (zmq.ZMQError, AttributeError, TypeError, ValueError):
        return None


def peer_address(frame: zmq.Frame) -> str | None:
    """The address of the peer a received frame came from (libzmq's ``Peer-Address``
    property: the IP of a tcp peer), or None when unknown (ipc, inproc)."""
    try:
        address = frame.get("Peer-Address")
    except (zmq.ZMQError, AttributeError, TypeError, ValueError):
        return None
    return address if isinstance(address, str) and address else None


def peer_key(frame: zmq.Frame) -> bytes | None:
    """The CURVE public key (z85, as the ZAP handler names it: ``User-Id``) of the peer a
    received frame came from, or None without CURVE."""
    try:
        user = frame.get("User-Id")
    except (zmq.ZMQError, AttributeError, TypeError, ValueError):
        return None
    return user.encode() if isinstance(user, str) and user else None


async def monitor_events(monitor: zmq.asyncio.Socket) -> list[tuple[int, int]]:
    """Drain a monitor socket (without waiting): (event, value) of each connection event."""
    from zmq.utils.monitor import parse_monitor_message

    out: list[tuple[int, int]] = []
    async for frames in pending_frames(monitor):
        event = parse_monitor_message([f.bytes for f in frames])
        out.append((int(event["event"]), int(event["value"])))
    return out


async def disconnected_fds(monitor: zmq.asyncio.Socket) -> list[int]:
    """Drain a listening socket's monitor (without waiting): the fds of connections that went
    down. Failed handshakes are noted in ``security.REFUSALS`` (a rate-limited warning); those
    the ZAP handler refused (``AUTH``) it noted already, naming the key."""
    fds = []
    for event, value in await monitor_events(monitor):
        if event == zmq.EVENT_DISCONNECTED:
            fds.append(value)
        elif event & HANDSHAKE_FAILED and event != zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            security.REFUSALS.note(f"a client's handshake failed ({zmq.Event(event).name}: "
                                   "no CURVE keys, the wrong server key, or not ZeroMQ)")
    return fds


class LoopPoller:
    """``zmq.asyncio.Poller`` for ``POLLIN`` only, waking its waiter in one turn of the loop.
    pyzmq's poller resolves through several loop turns (a watcher future per socket, its
    callback, then the poll's future), 0.3-0.4 ms per hand-over between two actors of a node
    in traces (docs/BENCHMARKS.md); here the loop watches a dup of each socket's ``zmq.FD``
    (a dup: pyzmq keeps its own reader on the fd itself) and the waiter's future is set in
    the reader's callback. libzmq's fd only signals a change, so the sockets' ``EVENTS`` are
    read before waiting and on every wake-up. One ``poll`` at a time; ``close`` when done."""

    def __init__(self) -> None:
        self._fds: dict[Any, int] = {}  # socket -> our dup of its zmq.FD

    def register(self, sock: Any, flags: int = zmq.POLLIN) -> None:
        if flags != zmq.POLLIN:
            raise ValueError("LoopPoller waits for POLLIN only")
        if sock not in self._fds:
            self._fds[sock] = os.dup(sock.getsockopt(zmq.FD))

    def unregister(self, sock: Any) -> None:
        fd = self._fds.pop(sock, None)
        if fd is not None:
            try:  # a poll in flight stops watching it (its later removal finds nothing)
                asyncio.get_running_loop().remove_reader(fd)
            except RuntimeError:  # no loop running
                pass
            os.close(fd)

    def close(self) -> None:
        for sock in list(self._fds):
            self.unregister(sock)

    def ready(self) -> list[tuple[Any, int]]:
        """The registered sockets with a message to read now."""
        return [(s, zmq.POLLIN) for s in self._fds if s.getsockopt(zmq.EVENTS) & zmq.POLLIN]

    async def poll(self, timeout: int | None = None) -> list[tuple[Any, int]]:
        """The sockets readable now, else the first to become readable within ``timeout``
        ms (None or negative: no limit; ``[]`` when it passes)."""
        ready = self.ready()
        if ready or timeout == 0:
            return ready
        loop = asyncio.get_running_loop()
        woke: asyncio.Future[list[tuple[Any, int]]] = loop.create_future()

        def check() -> None:
            if not woke.done() and (r := self.ready()):
                woke.set_result(r)

        fds = list(self._fds.values())
        for fd in fds:
            loop.add_reader(fd, check)
        def expire() -> None:
            if not woke.done():
                woke.set_result([])

        timer = None if timeout is None or timeout < 0 else loop.call_later(timeout / 1000,
                                                                             expire)
        try:
            check()  # a message that came between the first look and the readers
            return await woke
        finally:
            for fd in fds:
                loop.remove_reader(fd)
            if timer is not None:
                timer.cancel()
