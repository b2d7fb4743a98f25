"""Which connection a ROUTER's frames came on, and which connections went down.

libzmq's ``ZMQ_ROUTER_NOTIFY`` is a draft option (not in the wheels we use), so a ROUTER
learns of disconnects from its monitor socket (``EVENT_DISCONNECTED``, whose value is the
connection's fd) and matches them to peers by the fd each received frame reports
(``zmq.SRCFD``, from ``recv_multipart(copy=False)``). NOTES.md has the details.
"""

from __future__ import annotations

import zmq
import zmq.asyncio


def source_fd(frame: zmq.Frame) -> int | None:
    """The connection (fd) a received frame came on, to match the monitor's disconnects."""
    try:
        return int(frame.get(zmq.SRCFD))
    except (zmq.ZMQError, AttributeError, TypeError, ValueError):
        return None


async def disconnected_fds(monitor: zmq.asyncio.Socket) -> list[int]:
    """Drain a monitor socket (without waiting): the fds of connections that went down."""
    from zmq.utils.monitor import parse_monitor_message

    gone: list[int] = []
    while True:
        try:
            frames = await monitor.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            return gone
        event = parse_monitor_message(frames)
        if event["event"] == zmq.EVENT_DISCONNECTED:
            gone.append(int(event["value"]))
