"""The router's client-protocol front (``RouterFront``, a base of ``Router``): each frame on
its ROUTER socket is decoded, a generate request checked (id length, duplicates) and placed,
an abort forwarded, a stats request answered with the peers' sum, a ping with a pong; a
request under a CURVE client key is salted by that key first and counts under it as its
``tenant`` on the decoders (their fair queue), and that key's Stats have the prefix counters
at 0 (``disagg.serving.salting``). Also ``Flight``, one request's state in the router."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec
import zmq
import zmq.asyncio

from disagg.actors.frontend.frontend import decode_client_frames
from disagg.protocol import (
    Abort,
    Error,
    GenerateRequest,
    NodeReply,
    Ping,
    Pong,
    Stats,
    StatsRequest,
)
from disagg.serving.admission import MAX_REQUEST_ID
from disagg.serving.metrics import Metrics, RequestTimer
from disagg.serving.migration import MigrationPolicy, Progress
from disagg.serving.routing import LoadBalancer
from disagg.serving.salting import TenantSalting
from disagg.serving.security import ClientKeyIds

log = logging.getLogger("disagg.actors.router.router")


@dataclass
class Flight:
    """One request live through the router."""

    key: str  # router-unique request id
    client_id: str  # the request id the client chose
    # as sent to the peer, under its wire id (request_id: the key, "KEY.mN" after N
    # migrations); kept to resend before the first token and to migrate after
    req: GenerateRequest
    deliver: Callable[[NodeReply], Awaitable[None]]  # replies, under client_id
    front_key: tuple[bytes, str] | None = None  # (identity, client_id) on the ROUTER socket
    timer: RequestTimer | None = None
    peer: str | None = None
    streamed: bool = False
    tried: set[str] = field(default_factory=set)
    progress: Progress = field(default_factory=lambda: Progress(MigrationPolicy(limit=0)))
    span: Any = None  # its span here (disagg.trace) while traces are exported


class RouterFront:
    """The router's state this part works on is declared here and set up by ``Router``."""

    front: zmq.asyncio.Socket | None
    key_ids: ClientKeyIds
    salting: TenantSalting
    by_client: dict[tuple[bytes, str], Flight]
    balancer: LoadBalancer
    peer_stats: dict[str, Stats]
    metrics: Metrics
    bad_frames: int
    rejected: int
    _enc: msgspec.msgpack.Encoder

    if TYPE_CHECKING:  # Router's
        def _aggregate(self, live: list[Stats]) -> Stats: ...
        async def _abort(self, f: Flight) -> None: ...
        async def _submit(self, f: Flight) -> None: ...
        def _new_key(self) -> str: ...

    async def _from_clients(self) -> None:
        """Loop: 1. receive a client frame; 2. place, abort or answer it. Bad input gets an
        ``Error`` and never stops the loop."""
        assert self.front is not None
        while True:
            frames = await self.front.recv_multipart(copy=False)
            identity, msg = decode_client_frames([f.bytes for f in frames])
            if isinstance(msg, str):
                await self._reject(identity, msg)
                continue
            key = self.key_ids.tenant(frames[-1])  # a client key: its tenant on the decoders
            tenant = key if self.salting.enabled else None
            match msg:
                case GenerateRequest() as req:
                    if key is not None:
                        req = msgspec.structs.replace(req, tenant=key)
                    await self._front_generate(identity, self.salting.request(req, tenant))
                case Abort(request_id=rid):
                    f = self.by_client.get((identity, rid))
                    if f is None:
                        await self._to_client(identity, Error("unknown_request",
                                                              f"no live request {rid!r}", rid))
                    else:
                        await self._abort(f)
                case StatsRequest():
                    live = [self.peer_stats[a] for a in self.balancer.alive()
                            if a in self.peer_stats]
                    await self._to_client(identity, self.salting.stats(self._aggregate(live),
                                                                       tenant is not None))
                case Ping():
                    await self._to_client(identity, Pong())

    async def _front_generate(self, identity: bytes, req: GenerateRequest) -> None:
        rid = req.request_id
        problem = None
        if not 1 <= len(rid) <= MAX_REQUEST_ID:
            problem = Error("bad_request", f"request_id must have 1-{MAX_REQUEST_ID} characters",
                            rid)
        elif (identity, rid) in self.by_client:
            problem = Error("duplicate_request", f"request_id {rid!r} is already live", rid)
        if problem is not None:
            self.rejected += 1
            self.metrics.observe_error(problem.code)
            await self._to_client(identity, problem)
            return

        async def deliver(msg: NodeReply) -> None:
            await self._to_client(identity, msg)

        key = self._new_key()
        f = Flight(key, rid, msgspec.structs.replace(req, request_id=key), deliver,
                   front_key=(identity, rid), timer=self.metrics.start_request())
        await self._submit(f)

    async def _reject(self, identity: bytes, message: str) -> None:
        self.bad_frames += 1
        await self._to_client(identity, Error("bad_frame", message))

    async def _to_client(self, identity: bytes, msg: Any) -> None:
        assert self.front is not None
        try:
            await self.front.send_multipart([identity, self._enc.encode(msg)], zmq.NOBLOCK)
        except zmq.ZMQError as e:
            log.debug("could not reply to %r: %s", identity, e)
