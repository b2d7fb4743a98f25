"""The client-protocol socket across restarts: ``FrontDoor``.

A node's frontend (``actors/frontend/frontend.py``) is lent the bound ROUTER socket of ``--listen`` (and
its monitor) by a door instead of binding its own. The supervisor keeps one door for the life
of the process, so the socket and every client's connection to it outlive a node that fails:
while no node serves (the failed one stopping, the next one starting) ``refuse`` answers each
client frame itself, ``error unavailable`` with a retry-after hint in its message, where a closed
and re-bound port would lose every frame it had taken in or had in flight. A door a ``Node``
made for itself (embedded, no supervisor) closes with that node.

Receives: client frames while refusing (else the frontend reads them), and connection events
(drained). Sends: one ``Error`` per frame (``refusal``). Owns: its zmq context (with the CURVE
authenticator for the client socket when keys are configured), the socket, the monitor.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math

import msgspec
import zmq
import zmq.asyncio

from disagg.actors.frontend.frontend import READ_BATCH, decode_client_frames
from disagg.actors.sockets import CLIENT_FRAME_BYTES, disconnected_fds, listening, pending_frames
from disagg.protocol import Abort, ClientMessage, Error, ErrorCode, GenerateRequest
from disagg.serving import security

log = logging.getLogger(__name__)

FLUSH_MS = 1000  # on close, at most this long for the last replies to reach clients


def refusal(msg: ClientMessage | str, why: str, retry_after_s: float,
            code: ErrorCode = "unavailable") -> Error:
    """The answer to a client frame that no node will take: ``code`` naming ``why`` (with when
    to retry, in whole seconds, at least 1, for ``unavailable``), terminal for a
    ``GenerateRequest`` (its id), frame-level for an abort (the request it names was already
    ended) or a Stats request; ``bad_frame`` for a frame that does not decode (``msg`` is then
    why)."""
    if isinstance(msg, str):
        return Error("bad_frame", msg)
    hint = (f"{why}; retry after {max(1, math.ceil(retry_after_s))} s"
            if code == "unavailable" else why)
    if isinstance(msg, GenerateRequest):
        return Error(code, hint, msg.request_id)
    if isinstance(msg, Abort):
        return Error(code, f"abort of {msg.request_id!r} not taken: {hint}")
    return Error(code, hint)


class FrontDoor:
    """The bound client socket of ``listen``, bound on first ``lend`` and kept until ``close``."""

    def __init__(self, listen: str, curve_keys: str | None = None):
        self.listen = listen
        self.curve_keys = curve_keys  # a node's key directory (CURVE server), or None
        self.ctx: zmq.asyncio.Context | None = None
        self.sock: zmq.asyncio.Socket | None = None
        self.monitor: zmq.asyncio.Socket | None = None
        self.refused = 0  # frames answered while no node served
        self.retry_after_s = 1.0  # the hint in refusals: about how long a node takes to start
        self._refusing: asyncio.Task[None] | None = None
        self._enc = msgspec.msgpack.Encoder()

    async def lend(self) -> tuple[zmq.asyncio.Socket, zmq.asyncio.Socket]:
        """The socket and its monitor, for a node's frontend (the one reader from now on):
        binds them the first time, else stops refusing first."""
        await self._stop_refusing()
        if self.sock is None or self.monitor is None:
            self.ctx = zmq.asyncio.Context()
            keys = security.load_node(self.curve_keys) if self.curve_keys else None
            security.install(self.ctx, keys)
            try:
                self.sock, self.monitor = listening(self.ctx, self.listen,
                                                    max_frame=CLIENT_FRAME_BYTES, mandatory=True)
            except BaseException:
                self._destroy()
                raise
        return self.sock, self.monitor

    def refusal(self, msg: ClientMessage | str, why: str,
                code: ErrorCode = "unavailable") -> Error:
        """``refusal`` with this door's retry-after hint."""
        return refusal(msg, why, self.retry_after_s, code)

    def refuse(self, why: str) -> None:
        """From now until the next ``lend``, answer every client frame with ``refusal`` (no-op
        if the socket was never bound, or it already refuses)."""
        if self.sock is None or (self._refusing is not None and not self._refusing.done()):
            return
        self._refusing = asyncio.create_task(self._refuse(why))

    async def _refuse(self, why: str) -> None:
        """Loop: 1. wait for a client frame or a connection event; 2. answer each frame queued
        (a client that does not read, or is gone, loses only its answer); 3. drop the events."""
        assert self.sock is not None and self.monitor is not None
        log.info("refusing client frames until a node serves again: %s", why)
        poller = zmq.asyncio.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self.monitor, zmq.POLLIN)
        while True:
            events = dict(await poller.poll())
            if self.monitor in events:
                await disconnected_fds(self.monitor)  # logs failed handshakes
            if self.sock in events:
                async for frames in pending_frames(self.sock, READ_BATCH):
                    identity, msg = decode_client_frames([f.bytes for f in frames])
                    self.refused += 1
                    reply = self._enc.encode(self.refusal(msg, why))
                    try:
                        await self.sock.send_multipart([identity, reply], zmq.NOBLOCK)
                    except zmq.ZMQError as e:  # Again (not reading) or no route (gone)
                        log.debug("refusal to %r not sent: %s", identity, e)

    async def _stop_refusing(self) -> None:
        task, self._refusing = self._refusing, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def close(self) -> None:
        """Stop refusing, give the last replies up to ``FLUSH_MS`` to go out, release all."""
        await self._stop_refusing()
        if self.sock is not None:
            self.sock.setsockopt(zmq.LINGER, FLUSH_MS)
        self._destroy()

    def _destroy(self) -> None:
        if self.sock is not None:
            self.sock.disable_monitor()
        if self.monitor is not None:
            self.monitor.close()
        if self.sock is not None:
            self.sock.close()
        self.sock = self.monitor = None
        if self.ctx is not None:
            security.uninstall(self.ctx)
            self.ctx.term()
            self.ctx = None
