"""Python clients for the client protocol (see README): async and a thin sync one.

Every wait has a deadline (``timeout`` seconds per message, sending included: a DEALER with
no connection waits in its send); a request that times out is aborted on the node. A failed
CURVE handshake (a missing, wrong or revoked key), seen on the socket's monitor, ends every
wait at once with ``HandshakeError``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
import uuid
from collections.abc import AsyncGenerator, Iterator
from typing import Any

import msgspec
import zmq
import zmq.asyncio

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
)
from disagg.serving import security
from disagg.serving.fanout import SharedPromptLogprobs, choice_sampling, merged
from disagg.serving.security import CurveKeys


class HandshakeError(ConnectionError):
    """The node refused this client's handshake (``security.handshake_refusal`` says why)."""


class ClientClosed(ConnectionError):
    """The client was closed while this request streamed (the node aborts it: the client's
    connection is gone)."""


_MONITORED = security.HANDSHAKE_FAILED | zmq.EVENT_HANDSHAKE_SUCCEEDED


def _refusal_of(frames: list[bytes], current: str | None) -> str | None:
    """The handshake state after one monitor message: a refusal, or None once one succeeds."""
    from zmq.utils.monitor import parse_monitor_message

    event = parse_monitor_message(frames)
    if int(event["event"]) == zmq.EVENT_HANDSHAKE_SUCCEEDED:
        return None
    return security.handshake_refusal(int(event["event"]), int(event["value"])) or current


class RequestError(RuntimeError):
    """The node answered a request with ``Error``."""

    def __init__(self, error: Error):
        super().__init__(f"{error.code}: {error.message}")
        self.error = error


def _request(prompt: str | None, prompt_token_ids: list[int] | None, sampling: SamplingParams | None,
             request_id: str | None, cache_salt: str | None = None,
             tenant: str | None = None, traceparent: str | None = None) -> GenerateRequest:
    return GenerateRequest(request_id=request_id or uuid.uuid4().hex, prompt=prompt,
                           prompt_token_ids=prompt_token_ids, sampling=sampling or SamplingParams(),
                           cache_salt=cache_salt, tenant=tenant, traceparent=traceparent)


class AsyncClient:
    """Many concurrent requests over one DEALER socket; replies are routed by request id."""

    def __init__(self, address: str, ctx: zmq.asyncio.Context | None = None,
                 curve_keys: CurveKeys | None = None):
        self._own_ctx = ctx is None
        self.ctx = ctx or zmq.asyncio.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        security.client(self.sock, curve_keys or security.keys_from_env())
        self.address = address
        self.monitor = self.sock.get_monitor_socket(_MONITORED)
        self.sock.connect(address)
        self._enc = msgspec.msgpack.Encoder()
        self._dec = msgspec.msgpack.Decoder(NodeReply)
        self._queues: dict[str | None, asyncio.Queue[Any]] = {}
        self._stats: asyncio.Queue[Stats | Error | HandshakeError] = asyncio.Queue()
        self._stats_waiting = 0
        self._reader: asyncio.Task[None] | None = None
        self._watcher: asyncio.Task[None] | None = None
        self.refused: str | None = None  # why the last handshake failed, until one succeeds
        self._refused = asyncio.Event()

    def _ensure_reader(self) -> None:
        if self._reader is None:
            self._reader = asyncio.create_task(self._read())
            self._watcher = asyncio.create_task(self._watch())

    async def _watch(self) -> None:
        """Loop: 1. read a connection event; 2. on a failed handshake fail every waiter."""
        while True:
            self.refused = _refusal_of(await self.monitor.recv_multipart(), self.refused)
            if self.refused is None:
                self._refused.clear()
                continue
            self._refused.set()
            err = HandshakeError(f"{self.address}: {self.refused}")
            for q in self._queues.values():
                q.put_nowait(err)
            if self._stats_waiting:
                self._stats.put_nowait(err)

    def _check_refused(self) -> None:
        if self.refused is not None:
            raise HandshakeError(f"{self.address}: {self.refused}")

    async def _send(self, frame: bytes, timeout: float) -> None:
        """Send within ``timeout`` (TimeoutError: no connection), or HandshakeError."""
        self._check_refused()
        send = asyncio.ensure_future(self.sock.send(frame))
        refused = asyncio.ensure_future(self._refused.wait())
        done, _ = await asyncio.wait({send, refused}, timeout=timeout,
                                     return_when=asyncio.FIRST_COMPLETED)
        refused.cancel()
        if send in done:
            send.result()
            return
        send.cancel()
        self._check_refused()
        raise TimeoutError(f"could not send to {self.address} in {timeout}s: no connection "
                           "to the node (is it up, and listening there?)")

    async def _read(self) -> None:
        while True:
            msg = self._dec.decode(await self.sock.recv())
            if isinstance(msg, Stats):
                self._stats.put_nowait(msg)
                continue
            if isinstance(msg, Pong):  # an answer to a heartbeat: no request's
                continue
            q = self._queues.get(msg.request_id)
            if q is None and isinstance(msg, Error) and msg.request_id is None:
                # a Stats or Abort frame of ours was refused (too many frames in flight, or
                # the node restarts)
                if msg.code in ("overloaded", "unavailable"):
                    if self._stats_waiting:
                        self._stats.put_nowait(msg)
                    continue
                for q in self._queues.values():  # a frame-level error: tell everyone waiting
                    q.put_nowait(msg)
                continue
            if q is not None:
                q.put_nowait(msg)

    async def generate(
        self,
        prompt: str | None = None,
        prompt_token_ids: list[int] | None = None,
        sampling: SamplingParams | None = None,
        request_id: str | None = None,
        timeout: float = 600.0,
        cache_salt: str | None = None,
        tenant: str | None = None,
        traceparent: str | None = None,
    ) -> AsyncGenerator[TokenChunk | Finished, None]:
        """Stream ``TokenChunk``s, then the ``Finished``. Raises ``RequestError`` on ``Error``.
        ``cache_salt``: share cached prompt prefixes only with requests of the same salt;
        ``tenant``: the unit of fairness it counts under on the node (``GenerateRequest``);
        ``traceparent``: the caller's W3C trace context (a tracing node's spans join it)."""
        req = _request(prompt, prompt_token_ids, sampling, request_id, cache_salt, tenant,
                       traceparent)
        self._ensure_reader()
        q: asyncio.Queue[Any] = asyncio.Queue()
        self._queues[req.request_id] = q
        finished = False
        try:
            await self._send(self._enc.encode(req), timeout)
            while True:
                try:
                    msg = await asyncio.wait_for(q.get(), timeout)
                except asyncio.TimeoutError:
                    raise TimeoutError(f"no reply for request {req.request_id} in {timeout}s") from None
                if isinstance(msg, ConnectionError):  # refused handshake, or closed
                    finished = True
                    raise msg
                if isinstance(msg, Error):
                    finished = True
                    raise RequestError(msg)
                yield msg
                if isinstance(msg, Finished):
                    finished = True
                    return
        finally:
            self._queues.pop(req.request_id, None)
            if not finished:
                with contextlib.suppress(zmq.ZMQError):  # Again: no connection to tell
                    await self.sock.send(self._enc.encode(Abort(req.request_id)), zmq.NOBLOCK)

    async def choices(
        self,
        n: int,
        prompt: str | None = None,
        prompt_token_ids: list[int] | None = None,
        sampling: SamplingParams | None = None,
        request_id: str | None = None,
        timeout: float = 600.0,
        cache_salt: str | None = None,
        tenant: str | None = None,
        traceparent: str | None = None,
    ) -> AsyncGenerator[tuple[int, TokenChunk | Finished], None]:
        """``n`` choices of one prompt (``disagg.serving.fanout``, as the HTTP gateway serves
        ``n``): choice ``j`` is request ``<request_id>-<j>``, seeded ``choice_seed(seed, j)``
        when ``sampling.seed`` is set; choice 0 goes first and the others once it has its
        first token (one prefill: they take its pages from the prefix cache; only choice 0
        asks ``prompt_logprobs``, the others' first chunk carries a copy). Yields
        ``(j, TokenChunk | Finished)`` as they come, until every choice finished; a choice's
        ``Error`` raises ``RequestError`` and aborts the others, as leaving early does."""
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        rid = request_id or uuid.uuid4().hex
        base = sampling or SamplingParams()
        relays = [functools.partial(self.generate, prompt, prompt_token_ids,
                                    choice_sampling(base, j), f"{rid}-{j}", timeout, cache_salt,
                                    tenant, traceparent) for j in range(n)]
        async with contextlib.aclosing(merged(relays, n)) as items:
            async for item in items:
                yield item

    async def complete_choices(self, n: int, **kw: Any
                               ) -> list[tuple[list[int], str, Finished]]:
        """Run ``n`` choices to the end (``choices``): (token ids, text, Finished) of each, in
        choice order."""
        ids: list[list[int]] = [[] for _ in range(n)]
        texts: list[list[str]] = [[] for _ in range(n)]
        ends: dict[int, Finished] = {}
        async for j, msg in self.choices(n, **kw):
            if isinstance(msg, TokenChunk):
                ids[j].extend(msg.token_ids)
                texts[j].append(msg.text)
            else:
                ends[j] = msg
        if len(ends) != n:
            raise RuntimeError("a choice's stream ended without Finished")
        return [(ids[j], "".join(texts[j]), ends[j]) for j in range(n)]

    async def complete(self, **kw: Any) -> tuple[list[int], str, Finished]:
        """Run a request to the end: (token ids, text, the Finished message)."""
        ids: list[int] = []
        text: list[str] = []
        async for msg in self.generate(**kw):
            if isinstance(msg, TokenChunk):
                ids.extend(msg.token_ids)
                text.append(msg.text)
            else:
                return ids, "".join(text), msg
        raise RuntimeError("stream ended without Finished")

    async def abort(self, request_id: str, timeout: float = 10.0) -> None:
        await self._send(self._enc.encode(Abort(request_id)), timeout)

    async def stats(self, timeout: float = 10.0) -> Stats:
        self._ensure_reader()
        await self._send(self._enc.encode(StatsRequest()), timeout)
        self._stats_waiting += 1
        try:
            msg = await asyncio.wait_for(self._stats.get(), timeout)
        except asyncio.TimeoutError:
            raise TimeoutError(f"no Stats reply in {timeout}s") from None
        finally:
            self._stats_waiting -= 1
        if isinstance(msg, HandshakeError):
            raise msg
        if isinstance(msg, Error):
            raise RequestError(msg)
        return msg

    async def close(self) -> None:
        """Stop reading and close the socket (again: nothing); a stream still open raises
        ``ClientClosed``."""
        for q in self._queues.values():
            q.put_nowait(ClientClosed(f"{self.address}: the client was closed"))
        for task in (self._reader, self._watcher):
            if task is not None:
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
        if self.sock.closed:
            return
        self.sock.disable_monitor()
        self.monitor.close()
        self.sock.close()
        if self._own_ctx:
            self.ctx.term()


class Client:
    """Blocking client, one request at a time."""

    def __init__(self, address: str, curve_keys: CurveKeys | None = None):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        security.client(self.sock, curve_keys or security.keys_from_env())
        self.address = address
        self.monitor = self.sock.get_monitor_socket(_MONITORED)
        try:
            self.sock.connect(address)
        except zmq.ZMQError:  # not an address zmq takes ("Invalid argument" and the like)
            self.close()
            raise
        self._enc = msgspec.msgpack.Encoder()
        self._dec = msgspec.msgpack.Decoder(NodeReply)
        self.refused: str | None = None  # why the last handshake failed, until one succeeds

    def _check_refused(self) -> None:
        while self.monitor.poll(0):
            self.refused = _refusal_of(self.monitor.recv_multipart(), self.refused)
        if self.refused is not None:
            raise HandshakeError(f"{self.address}: {self.refused}")

    def _wait(self, event: int, timeout: float) -> bool:
        """Wait until the socket has ``event`` (True) or ``timeout`` passes (False); raise
        HandshakeError as soon as a handshake fails."""
        deadline = time.monotonic() + timeout
        poller = zmq.Poller()
        poller.register(self.sock, event)
        poller.register(self.monitor, zmq.POLLIN)
        while True:
            self._check_refused()
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            ready = dict(poller.poll(int(left * 1000) + 1))
            if self.monitor in ready:
                continue
            if self.sock in ready:
                return True

    def _send(self, frame: bytes, timeout: float) -> None:
        if not self._wait(zmq.POLLOUT, timeout):
            raise TimeoutError(f"could not send to {self.address} in {timeout}s: no connection "
                               "to the node (is it up, and listening there?)")
        self.sock.send(frame, zmq.NOBLOCK)

    def _recv(self, timeout: float) -> NodeReply:
        if not self._wait(zmq.POLLIN, timeout):
            raise TimeoutError(f"no reply from the node in {timeout}s")
        return self._dec.decode(self.sock.recv())

    def generate(
        self,
        prompt: str | None = None,
        prompt_token_ids: list[int] | None = None,
        sampling: SamplingParams | None = None,
        request_id: str | None = None,
        timeout: float = 600.0,
        cache_salt: str | None = None,
        tenant: str | None = None,
    ) -> Iterator[TokenChunk | Finished]:
        """As ``AsyncClient.generate``, blocking: ``tenant`` is the unit of fairness the
        request counts under on the node (ignored from a CURVE client key, its own tenant)."""
        req = _request(prompt, prompt_token_ids, sampling, request_id, cache_salt, tenant)
        self._send(self._enc.encode(req), timeout)
        done = False
        try:
            while True:
                msg = self._recv(timeout)
                if isinstance(msg, Error) and msg.request_id in (None, req.request_id):
                    done = True
                    raise RequestError(msg)
                if isinstance(msg, (TokenChunk, Finished)) and msg.request_id == req.request_id:
                    yield msg
                    if isinstance(msg, Finished):
                        done = True
                        return
        finally:
            if not done:
                with contextlib.suppress(zmq.ZMQError):  # Again: no connection to tell
                    self.sock.send(self._enc.encode(Abort(req.request_id)), zmq.NOBLOCK)

    def choices(
        self,
        n: int,
        prompt: str | None = None,
        prompt_token_ids: list[int] | None = None,
        sampling: SamplingParams | None = None,
        request_id: str | None = None,
        timeout: float = 600.0,
        cache_salt: str | None = None,
    ) -> Iterator[tuple[int, TokenChunk | Finished]]:
        """``n`` choices of one prompt, as ``AsyncClient.choices`` sends them (choice 0 first,
        the others once it has its first reply): ``(j, TokenChunk | Finished)`` until every
        choice finished; an ``Error`` raises ``RequestError`` and aborts the others."""
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        rid = request_id or uuid.uuid4().hex
        base = sampling or SamplingParams()
        reqs = [_request(prompt, prompt_token_ids, choice_sampling(base, j), f"{rid}-{j}",
                         cache_salt) for j in range(n)]
        index = {r.request_id: j for j, r in enumerate(reqs)}
        shared = SharedPromptLogprobs(n)  # choice 0's prompt logprobs for the others
        self._send(self._enc.encode(reqs[0]), timeout)
        live, held = {reqs[0].request_id}, reqs[1:]  # held: sent once choice 0 replies
        try:
            while live:
                msg = self._recv(timeout)
                if isinstance(msg, Error) and (msg.request_id is None or msg.request_id in live):
                    live.discard(msg.request_id or "")
                    raise RequestError(msg)
                if not isinstance(msg, (TokenChunk, Finished)) or msg.request_id not in live:
                    continue
                if isinstance(msg, Finished):
                    live.discard(msg.request_id)
                for r in held:
                    self._send(self._enc.encode(r), timeout)
                    live.add(r.request_id)
                held = []
                j = index[msg.request_id]
                yield j, shared.share(j, msg)
        finally:
            for request_id in live:
                with contextlib.suppress(zmq.ZMQError):  # Again: no connection to tell
                    self.sock.send(self._enc.encode(Abort(request_id)), zmq.NOBLOCK)

    def stats(self, timeout: float = 10.0) -> Stats:
        self._send(self._enc.encode(StatsRequest()), timeout)
        while True:
            msg = self._recv(timeout)
            if isinstance(msg, Stats):
                return msg

    def ping(self, timeout: float = 10.0) -> Pong:
        """One ``Pong`` (answered by the node's frontend at once, however busy it is), or
        ``RequestError`` where it answers a frame-level ``Error`` instead (a node restarting:
        ``unavailable``); TimeoutError where nothing answers within ``timeout``."""
        self._send(self._enc.encode(Ping()), timeout)
        while True:
            msg = self._recv(timeout)
            if isinstance(msg, Pong):
                return msg
            if isinstance(msg, Error) and msg.request_id is None:
                raise RequestError(msg)

    def close(self) -> None:
        """Close the socket (again: nothing)."""
        if self.sock.closed:
            return
        self.sock.disable_monitor()
        self.monitor.close()
        self.sock.close()
        self.ctx.term()
