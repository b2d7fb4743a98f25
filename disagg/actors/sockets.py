"""ZeroMQ plumbing every actor shares: frame limits, socket set-up, draining without waiting,
and which connection a ROUTER's frames came on.

libzmq's ``ZMQ_ROUTER_NOTIFY`` is a draft option (not in the wheels we use), so a ROUTER
learns of disconnects from its monitor socket (``EVENT_DISCONNECTED``, whose value is the
connection's fd) and matches them to peers by the fd each received frame reports
(``zmq.SRCFD``, from ``recv_multipart(copy=False)``). NOTES.md has the details.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Literal

import zmq
import zmq.asyncio

from disagg.serving import security

CLIENT_FRAME_BYTES = 16 << 20  # the client protocol (node frontend, router): one frame at most
PEER_FRAME_BYTES = 64 << 20  # a prefill node's peer socket (a PrefillRequest of a long prompt)
# a failed ZMTP/CURVE handshake (an impostor or a plain socket on a peer's address)
HANDSHAKE_FAILED = security.HANDSHAKE_FAILED


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


async def pending(sock: zmq.asyncio.Socket) -> AsyncIterator[bytes]:
    """Every single-frame message already queued on ``sock``, without waiting."""
    while True:
        try:
            data = await sock.recv(zmq.NOBLOCK)
        except zmq.Again:
            return
        yield data


async def pending_frames(sock: zmq.asyncio.Socket, limit: int | None = None,
                         ) -> AsyncIterator[list[zmq.Frame]]:
    """Every multipart message already queued on ``sock`` (at most ``limit``), without
    waiting; frames uncopied so ``source_fd`` can tell their connection."""
    n = 0
    while limit is None or n < limit:
        try:
            frames = await sock.recv_multipart(zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return
        n += 1
        yield frames


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
