"""Python clients for the client protocol (see README): async and a thin sync one.

Every wait has a deadline (``timeout`` seconds per message); a request that times out is
aborted on the node.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Iterator
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
    SamplingParams,
    Stats,
    StatsRequest,
    TokenChunk,
)
from disagg.serving import security
from disagg.serving.security import CurveKeys


class RequestError(RuntimeError):
    """The node answered a request with ``Error``."""

    def __init__(self, error: Error):
        super().__init__(f"{error.code}: {error.message}")
        self.error = error


def _request(prompt: str | None, prompt_token_ids: list[int] | None, sampling: SamplingParams | None,
             request_id: str | None, cache_salt: str | None = None) -> GenerateRequest:
    return GenerateRequest(request_id=request_id or uuid.uuid4().hex, prompt=prompt,
                           prompt_token_ids=prompt_token_ids, sampling=sampling or SamplingParams(),
                           cache_salt=cache_salt)


class AsyncClient:
    """Many concurrent requests over one DEALER socket; replies are routed by request id."""

    def __init__(self, address: str, ctx: zmq.asyncio.Context | None = None,
                 curve_keys: CurveKeys | None = None):
        self._own_ctx = ctx is None
        self.ctx = ctx or zmq.asyncio.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        security.client(self.sock, curve_keys or security.keys_from_env())
        self.sock.connect(address)
        self._enc = msgspec.msgpack.Encoder()
        self._dec = msgspec.msgpack.Decoder(NodeReply)
        self._queues: dict[str | None, asyncio.Queue[Any]] = {}
        self._stats: asyncio.Queue[Stats | Error] = asyncio.Queue()
        self._stats_waiting = 0
        self._reader: asyncio.Task[None] | None = None

    def _ensure_reader(self) -> None:
        if self._reader is None:
            self._reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        while True:
            msg = self._dec.decode(await self.sock.recv())
            if isinstance(msg, Stats):
                self._stats.put_nowait(msg)
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
    ) -> AsyncIterator[TokenChunk | Finished]:
        """Stream ``TokenChunk``s, then the ``Finished``. Raises ``RequestError`` on ``Error``.
        ``cache_salt``: share cached prompt prefixes only with requests of the same salt."""
        req = _request(prompt, prompt_token_ids, sampling, request_id, cache_salt)
        self._ensure_reader()
        q: asyncio.Queue[Any] = asyncio.Queue()
        self._queues[req.request_id] = q
        finished = False
        try:
            await self.sock.send(self._enc.encode(req))
            while True:
                try:
                    msg = await asyncio.wait_for(q.get(), timeout)
                except asyncio.TimeoutError:
                    raise TimeoutError(f"no reply for request {req.request_id} in {timeout}s") from None
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
                with contextlib.suppress(zmq.ZMQError):
                    await self.sock.send(self._enc.encode(Abort(req.request_id)))

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

    async def abort(self, request_id: str) -> None:
        await self.sock.send(self._enc.encode(Abort(request_id)))

    async def stats(self, timeout: float = 10.0) -> Stats:
        self._ensure_reader()
        await self.sock.send(self._enc.encode(StatsRequest()))
        self._stats_waiting += 1
        try:
            msg = await asyncio.wait_for(self._stats.get(), timeout)
        except asyncio.TimeoutError:
            raise TimeoutError(f"no Stats reply in {timeout}s") from None
        finally:
            self._stats_waiting -= 1
        if isinstance(msg, Error):
            raise RequestError(msg)
        return msg

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(BaseException):
                await self._reader
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
        self.sock.connect(address)
        self._enc = msgspec.msgpack.Encoder()
        self._dec = msgspec.msgpack.Decoder(NodeReply)

    def _recv(self, timeout: float) -> NodeReply:
        if not self.sock.poll(int(timeout * 1000)):
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
    ) -> Iterator[TokenChunk | Finished]:
        req = _request(prompt, prompt_token_ids, sampling, request_id, cache_salt)
        self.sock.send(self._enc.encode(req))
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
                self.sock.send(self._enc.encode(Abort(req.request_id)))

    def stats(self, timeout: float = 10.0) -> Stats:
        self.sock.send(self._enc.encode(StatsRequest()))
        while True:
            msg = self._recv(timeout)
            if isinstance(msg, Stats):
                return msg

    def close(self) -> None:
        self.sock.close()
        self.ctx.term()
