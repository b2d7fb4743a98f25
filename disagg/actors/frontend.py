"""Frontend actor: the client-protocol socket.

Receives: client frames on a ROUTER socket (``--listen``); ``ToClient`` replies from the
scheduler over ``inproc://``.
Sends: decoded, well-formed ``FromClient`` messages to the scheduler; replies to clients.
Owns: the listening socket and the count of frames that did not decode.
"""

from __future__ import annotations

import logging

import msgspec
import zmq
import zmq.asyncio

from disagg import security
from disagg.protocol import ClientMessage, Error, FromClient, Stats, ToClient

log = logging.getLogger(__name__)

MAX_FRAME_BYTES = 16 << 20

_CLIENT_DEC = msgspec.msgpack.Decoder(ClientMessage)


def decode_client_frames(frames: list[bytes]) -> tuple[bytes, ClientMessage | str]:
    """(identity, message) of a ROUTER's multipart client frame, or (identity, why it is not
    one) for the ``bad_frame`` error. Shared by every socket that speaks the client protocol."""
    identity, body = frames[0], frames[1:]
    if len(body) != 1:
        return identity, f"expected one message frame, got {len(body)}"
    try:
        return identity, _CLIENT_DEC.decode(body[0])
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        return identity, f"could not decode the frame: {e}"


class FrontendActor:
    def __init__(self, listen: str, scheduler: zmq.asyncio.Socket, ctx: zmq.asyncio.Context):
        self.sock = ctx.socket(zmq.ROUTER)
        security.server(self.sock)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        self.sock.bind(listen)
        self.address = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.scheduler = scheduler
        self.bad_frames = 0
        self._enc = msgspec.msgpack.Encoder()
        self._reply_dec = msgspec.msgpack.Decoder(ToClient)

    async def run(self) -> None:
        """Loop: 1. wait for a client frame or a scheduler reply; 2. forward it. Never exits on
        bad input."""
        poller = zmq.asyncio.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self.scheduler, zmq.POLLIN)
        while True:
            events = dict(await poller.poll())
            if self.sock in events:
                await self._from_clients()
            if self.scheduler in events:
                await self._from_scheduler()

    async def _from_clients(self) -> None:
        while True:
            try:
                frames = await self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            identity, msg = decode_client_frames(frames)
            if isinstance(msg, str):
                await self._reject(identity, msg)
                continue
            await self.scheduler.send(self._enc.encode(FromClient(identity, msg)))

    async def _from_scheduler(self) -> None:
        while True:
            try:
                data = await self.scheduler.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            out = self._reply_dec.decode(data)
            msg = out.msg
            if isinstance(msg, Stats):
                msg = msgspec.structs.replace(msg, bad_frames=self.bad_frames)
            await self._send(out.identity, msg)

    async def _reject(self, identity: bytes, message: str) -> None:
        self.bad_frames += 1
        log.debug("bad frame from %r: %s", identity, message)
        await self._send(identity, Error("bad_frame", message))

    async def _send(self, identity: bytes, msg: object) -> None:
        try:
            await self.sock.send_multipart([identity, self._enc.encode(msg)], zmq.NOBLOCK)
        except zmq.ZMQError as e:  # client gone or its queue full: drop, keep serving
            log.debug("could not reply to %r: %s", identity, e)

    def close(self) -> None:
        self.sock.close()


