"""What HTTP clients can hold of the gateway, bounded (aiohttp glue over the pure
``disagg.serving.http_limits``).

- ``ConnectionGate``: the listener's protocol factory. Under the cap a connection is admitted;
  at the cap the oldest idle one (no request in progress) is closed to make room, and with none
  idle the newcomer gets a 503 and is closed at once. The cap leaves file descriptors for the
  rest of the process (``connection_cap``).
- ``GatedSite``: an aiohttp site listening through the gate.
- Request heads: aiohttp's keep-alive timer, armed when a connection opens and after each
  response, closes a connection still without a complete head after ``header_timeout_s``.
- ``read_body``: a body larger than the limit its Content-Length declares is refused (413)
  before a byte of it is read; others are read as they arrive within ``body_timeout_s`` (408
  past it), never more than the limit, and within the budget of all bodies being read (503).
- ``send`` / ``deliver``: every write waits at most ``write_timeout_s`` for a client that reads
  nothing; past it the request is marked stalled, the handler ends (closing the node's stream
  aborts the request there) and ``deliver`` drops the connection without flushing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import struct
from typing import Any

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from disagg.serving.http_limits import BodyBudget, HttpLimits, pick_victim
from disagg.serving.openai_api import ApiError

log = logging.getLogger(__name__)

# a connection's kernel send buffer (the kernel doubles it), fixed: autotuned it grows to
# megabytes, so a client that reads nothing would take a whole stream before a write waits
SEND_BUFFER_BYTES = 64 << 10
LINGER_S = 2.0  # after an early answer, aiohttp reads (and drops) the rest of a body this long
STALLED = "disagg.stalled"  # request key: a write timed out, drop the connection
_REFUSED_BODY = (b'{"error": {"message": "too many HTTP connections", "type": "server_error", '
                 b'"param": null, "code": "overloaded"}}')
_REFUSED = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
            b"Retry-After: 1\r\nConnection: close\r\nContent-Length: %d\r\n\r\n%s"
            % (len(_REFUSED_BODY), _REFUSED_BODY))


class BodyError(ApiError):
    """A body refused or cut while reading it: answered, then the connection is closed."""


class _Refused(asyncio.Protocol):
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        transport.write(_REFUSED)  # fits the socket buffer: closing frees the fd at once
        transport.close()


class ConnectionGate:
    """Protocol factory: admit, make room (close the oldest idle connection), or refuse."""

    def __init__(self, server: web.Server, cap: int, busy: set[Any]):
        self.server = server
        self.cap = cap
        self.busy = busy  # protocols with a request in progress (the gateway's middleware)
        self.evicted = 0
        self.refused = 0

    def _idle(self, h: RequestHandler) -> bool:
        t = h.transport
        return h not in self.busy and t is not None and not t.get_write_buffer_size()

    def open_connections(self) -> list[RequestHandler]:
        """Open ones, oldest first (a closed one stays listed until its handler's task ends)."""
        return [h for h in self.server.connections if h.transport is not None]

    def __call__(self) -> asyncio.Protocol:
        conns = self.open_connections()
        admit, victim = pick_victim([self._idle(h) for h in conns], self.cap)
        if victim is not None:
            self.evicted += 1
            conns[victim].force_close()
        if not admit:
            self.refused += 1
            if self.refused & (self.refused - 1) == 0:  # 1, 2, 4, ...: not a line per refusal
                log.warning("HTTP connections at the cap (%d), all busy: refused %d so far",
                            self.cap, self.refused)
            return _Refused()
        return self.server()


class GatedSite(web.BaseSite):
    """A TCP listener whose connections go through a ``ConnectionGate``."""

    def __init__(self, runner: web.BaseRunner, host: str, port: int, gate: ConnectionGate,
                 backlog: int = 512):
        super().__init__(runner, backlog=backlog)
        self._host, self._port, self._gate = host, port, gate

    @property
    def name(self) -> str:
        return f"http://{self._host}:{self._port}"

    async def start(self) -> None:
        await super().start()
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(self._gate, self._host, self._port,
                                                backlog=self._backlog, reuse_address=True)
        for sock in self._server.sockets:  # accepted sockets inherit it (Linux)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)


async def read_body(request: web.Request, limits: HttpLimits, budget: BodyBudget) -> bytes:
    """The request's body, read within the limits (``BodyError`` otherwise)."""
    limit = limits.max_body_bytes
    declared = request.content_length
    if declared is not None and declared > limit:
        raise BodyError(413, f"the request body is larger than {limit} bytes")
    taken = 0
    if declared is not None:
        if not budget.take(declared):
            raise BodyError(503, "the gateway is reading too many request bodies; retry",
                            "server_error", code="overloaded")
        taken = declared
    buf = bytearray()
    try:
        async with asyncio.timeout(limits.body_timeout_s):
            async for chunk in request.content.iter_any():
                if len(buf) + len(chunk) > limit:
                    raise BodyError(413, f"the request body is larger than {limit} bytes")
                if declared is None:
                    if not budget.take(len(chunk)):
                        raise BodyError(503, "the gateway is reading too many request bodies;"
                                        " retry", "server_error", code="overloaded")
                    taken += len(chunk)
                buf += chunk
    except TimeoutError:
        raise BodyError(408, f"the request body did not arrive within "
                        f"{limits.body_timeout_s:g} s", code="timeout") from None
    finally:
        budget.give(taken)
    return bytes(buf)


class Stalled(ConnectionError):
    """The client took nothing for ``write_timeout_s``: treated as gone."""


async def send(request: web.Request, resp: web.StreamResponse, data: bytes | None,
               timeout: float) -> None:
    """Write ``data`` (None: end the response) within ``timeout``, else ``Stalled``."""
    try:
        async with asyncio.timeout(timeout):
            if data is None:
                await resp.write_eof()
            else:
                await resp.write(data)
    except TimeoutError:
        request[STALLED] = True
        raise Stalled(f"the client read nothing for {timeout:g} s") from None


async def deliver(request: web.Request, resp: web.StreamResponse, timeout: float) -> None:
    """Send a handler's response within ``timeout`` (a streamed one is already out); drop the
    connection of a stalled request without flushing what it did not read."""
    if not request.get(STALLED) and not resp.prepared:
        try:
            async with asyncio.timeout(timeout):
                await resp.prepare(request)
                await resp.write_eof()
        except TimeoutError:
            request[STALLED] = True
    if request.get(STALLED) and request.transport is not None:
        log.debug("dropping %s %s: its client read nothing for %g s", request.method,
                  request.path, timeout)
        sock = request.transport.get_extra_info("socket")
        if sock is not None:  # a reset, not a FIN after all it did not read
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        request.transport.abort()
