"""Frontend actor: the client-protocol socket.

Receives: client frames on a ROUTER socket (``--listen``); replies from the scheduler over
``inproc://`` (a ``ToClient`` header, then the encoded reply, forwarded untouched except
Stats, which get this actor's counters); connection events of the socket (its monitor).
Sends: decoded, well-formed ``FromClient`` messages to the scheduler, and ``ClientGone`` when a
client disconnects or stops reading; replies to clients; a ``Pong`` to each ``Ping`` itself, at
once (the heartbeat a router's liveness comes from: never behind a step).
Owns: the listening socket, the count of frames that did not decode, and the ``ClientBook``
(each client's frames in flight, replies a slow reader has not taken, its connection).

Nothing here waits on a client: replies that a client's connection will not take now wait in
its backlog (bounded), and the link to the scheduler never blocks (``Node._pair``).
"""

from __future__ import annotations

import collections
import logging

import msgspec
import zmq
import zmq.asyncio

from disagg.actors.sockets import (
    CLIENT_FRAME_BYTES,
    disconnected_fds,
    listening,
    peer_address,
    pending_frames,
    source_fd,
)
from disagg.config import env_ints
from disagg.protocol import (
    Abort,
    ClientMessage,
    Error,
    Finished,
    GenerateRequest,
    NodeReply,
    Ping,
    Pong,
    Stats,
    StatsRequest,
)
from disagg.protocol.inproc import ClientGone, FromClient, ToClient
from disagg.serving.admission import ClientBook, Reply
from disagg.serving.salting import SaltByTenant, TenantSalting
from disagg.serving.security import ClientKeyIds

log = logging.getLogger(__name__)

READ_BATCH = 512  # client frames read per wake-up before replies get their turn
FLUSH_MS = 20  # retry period for replies waiting on a slow reader
# replies relayed between turns of the event loop (0: all at once): a step's 64 token chunks
# relayed in one go held the loop ~1.5 ms, and a late grammar step's masks, filled meanwhile
# on the pass's threads, waited behind them (NOTES.md, "late masks")
RELAY_YIELD = (env_ints("RELAY_YIELD", 1, "replies relayed between yields, an integer") or (8,))[0]

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
    def __init__(self, listen: str, scheduler: zmq.asyncio.Socket, ctx: zmq.asyncio.Context,
                 max_inflight: int = 8192, max_backlog: int = 4096,
                 max_conns_per_address: int = 1024,
                 salt_by_tenant: SaltByTenant = "auto",
                 lent: tuple[zmq.asyncio.Socket, zmq.asyncio.Socket] | None = None):
        # ``lent``: the bound ROUTER of ``listen`` and its monitor on ``ctx``, lent by a
        # FrontDoor (actors/frontend/front_door.py) that keeps them across restarts and closes them
        self.lent = lent is not None
        self.sock, self.monitor = lent or listening(ctx, listen, max_frame=CLIENT_FRAME_BYTES,
                                                    mandatory=True)
        # cache salts by client key (disagg.serving.salting); Stats replies owed to client
        # keys, whose prefix counters read 0
        self.key_ids = ClientKeyIds(ctx)
        self.salting = TenantSalting(salt_by_tenant, self.key_ids.active)
        self._redact: collections.Counter[bytes] = collections.Counter()
        self.address = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.scheduler = scheduler
        self.book = ClientBook(max_inflight, max_backlog,
                               max_conns_per_address=max_conns_per_address)
        self.bad_frames = 0
        self.overloaded_frames = 0
        self.draining = False  # said in every Pong (the node's drain sets it)
        self._enc = msgspec.msgpack.Encoder()
        self._header_dec = msgspec.msgpack.Decoder(ToClient)
        self._stats_dec = msgspec.msgpack.Decoder(Stats)

    async def run(self) -> None:
        """Loop: 1. wait for a client frame, a scheduler reply or a connection event (or the
        retry period while a slow reader has replies waiting); 2. handle them; 3. retry the
        waiting replies. Never exits on bad input."""
        poller = zmq.asyncio.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self.scheduler, zmq.POLLIN)
        poller.register(self.monitor, zmq.POLLIN)
        while True:
            timeout = FLUSH_MS if self.book.backlog_size else None
            events = dict(await poller.poll(timeout))
            if self.monitor in events:  # first: a reused connection's fd is known gone
                await self._connection_events()
            if self.sock in events:
                await self._from_clients()
            if self.scheduler in events:
                await self.relay_replies()
            elif self.book.backlog_size:
                await self.flush()

    async def _from_clients(self) -> None:
        async for frames in pending_frames(self.sock, READ_BATCH):
            identity = frames[0].bytes
            if self.book.is_stalled(identity):
                continue  # it reads nothing: its requests were ended
            identity, msg = decode_client_frames([f.bytes for f in frames])
            if isinstance(msg, str):
                await self._reject(identity, msg)
                continue
            if isinstance(msg, Ping):  # answered here, not counted in flight
                await self._deliver(identity, Pong(self.draining))
                continue
            nbytes = len(frames[-1])
            fd = source_fd(frames[0])
            if fd is not None and self.book.fd_of(identity) != fd:
                # a new connection may reuse a closed one's fd: the monitor reported that
                # close before this frame could arrive, so take it in first
                await self._connection_events()
            if not self.book.connection_allowed(fd, peer_address(frames[-1])):
                self.overloaded_frames += 1
                await self._deliver(identity, Error(
                    "overloaded", f"too many connections from this address (at most "
                    f"{self.book.max_conns_per_address}, --max-connections-per-address); "
                    "send on one already open",
                    msg.request_id if isinstance(msg, GenerateRequest) else None))
                continue
            if not self.book.arrived(identity, fd, nbytes):
                self.overloaded_frames += 1
                rid = msg.request_id if isinstance(msg, GenerateRequest) else None
                what = f"abort of {msg.request_id!r}" if isinstance(msg, Abort) else "frame"
                await self._deliver(identity, Error(
                    "overloaded", f"{what} refused: too many frames of this client are still "
                    f"being handled (at most {self.book.max_inflight} frames, "
                    f"{self.book.max_inflight_bytes >> 20} MiB); retry later", rid))
                continue
            key = self.key_ids.tenant(frames[-1])  # a client key: the unit of fairness
            if self.salting.enabled:
                msg = self._salted(identity, msg, key)
            await self.scheduler.send(self._enc.encode(
                FromClient.of(identity, msg, None if key is None else key.encode())))

    async def relay_replies(self) -> None:
        """Route every reply the scheduler has queued (the reply bytes as they are), then
        retry the replies waiting for slow readers."""
        async for frames in pending_frames(self.scheduler, yield_every=RELAY_YIELD):
            out = self._header_dec.decode(frames[0].buffer)
            if out.frames:
                self.book.handled(out.identity, out.frames)
            if out.reply == "none" or len(frames) < 2:
                continue
            payload = frames[1].bytes
            if out.reply == "stats":
                stats = msgspec.structs.replace(self._stats_dec.decode(payload),
                                                bad_frames=self.bad_frames,
                                                replies_dropped=self.book.dropped)
                if self._redact[out.identity] > 0:
                    self._redact[out.identity] -= 1
                    stats = self.salting.stats(stats, tenant=True)
                if not self._redact[out.identity]:
                    del self._redact[out.identity]
                payload = self._enc.encode(stats)
            await self._route(out.identity, payload, out.reply == "terminal")
        if self.book.backlog_size:
            await self.flush()

    def _salted(self, identity: bytes, msg: ClientMessage, tenant: str | None) -> ClientMessage:
        """A client key's request salted by its key; its Stats request noted for redaction."""
        if tenant is None:
            return msg
        if isinstance(msg, GenerateRequest):
            return self.salting.request(msg, tenant)
        if isinstance(msg, StatsRequest):
            self._redact[identity] += 1
        return msg

    async def _reject(self, identity: bytes, message: str) -> None:
        self.bad_frames += 1
        log.debug("bad frame from %r: %s", identity, message)
        await self._deliver(identity, Error("bad_frame", message))

    async def _deliver(self, identity: bytes, msg: NodeReply) -> None:
        """Reply with a message of this actor's own (a refusal)."""
        terminal = isinstance(msg, Finished) or (isinstance(msg, Error)
                                                 and msg.request_id is not None)
        await self._route(identity, self._enc.encode(msg), terminal)

    async def _route(self, identity: bytes, payload: bytes, terminal: bool) -> None:
        """Send now, or keep it behind the client's waiting replies; a client whose waiting
        replies pass the bound is stalled: the scheduler ends its requests."""
        reply = Reply(payload, terminal)
        if not self.book.must_queue(identity):
            try:
                await self.sock.send_multipart([identity, payload], zmq.NOBLOCK)
                return
            except zmq.Again:
                pass
            except zmq.ZMQError as e:  # no route: the client is gone
                log.debug("client %r unreachable: %s", identity, e)
                await self._gone(identity, "disconnected")
                return
        if self.book.queue(identity, reply):
            log.warning("client %r stopped reading (%d replies waiting); ending its requests",
                        identity, self.book.max_backlog)
            await self._tell_scheduler(ClientGone(identity, "stalled"))

    async def flush(self) -> None:
        """Retry the replies that wait for slow readers, oldest first, per client."""
        for identity, queue in self.book.pending():
            while queue:
                try:
                    await self.sock.send_multipart([identity, queue[0].payload], zmq.NOBLOCK)
                except zmq.Again:
                    break
                except zmq.ZMQError:
                    await self._gone(identity, "disconnected")
                    break
                queue.popleft()
            self.book.drained(identity)

    async def _connection_events(self) -> None:
        for fd in await disconnected_fds(self.monitor):
            for identity in self.book.disconnected(fd):
                await self._tell_scheduler(ClientGone(identity, "disconnected"))

    async def _gone(self, identity: bytes, reason: str) -> None:
        if identity in self.book.clients:
            self.book.forget(identity)
            await self._tell_scheduler(ClientGone(identity, reason))

    async def _tell_scheduler(self, msg: ClientGone) -> None:
        await self.scheduler.send(self._enc.encode(msg))

    def close(self) -> None:
        if self.lent:  # the door's
            return
        self.sock.disable_monitor()
        self.monitor.close()
        self.sock.close()

