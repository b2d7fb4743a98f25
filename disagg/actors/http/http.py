"""HTTP gateway actor: the OpenAI-compatible API in front of a node (or the router).

Receives: HTTP requests (aiohttp) on ``--http-listen``: ``POST /v1/completions``,
``POST /v1/chat/completions`` (JSON or SSE streams), ``GET /v1/models``, ``/health``,
``/metrics``; in front of the router also ``GET /v1/disagg/advice`` (``Router.advice``).
Sends: client-protocol ``GenerateRequest`` / ``Abort`` / ``StatsRequest`` through a ``Backend``
(``disagg.client.AsyncClient`` on a node's client address, or the router in-process); an
``Abort`` whenever an HTTP client goes away or a stop string matches.
Owns: the HTTP listener, the tokenizer (chat templates, prompt token counts), the process's
``Metrics`` (latency histograms from the streams it relays; gauges from Stats it polls).
What HTTP clients can hold of it (connections, header/body/write time, body bytes) is bounded
by ``HttpLimits`` (``disagg.actors.http.http_guard``).

Validation and response shapes are pure functions in ``disagg.serving.openai_api``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any, Protocol

import msgspec
from aiohttp import web

from disagg.actors.http.choices import Reported, Shaper, serve_many
from disagg.actors.http.events import Event, parse_listen
from disagg.actors.http.http_guard import (
    LINGER_S,
    BodyError,
    ConnectionGate,
    GatedSite,
    deliver,
    read_body,
    send,
)
from disagg.client import AsyncClient, RequestError
from disagg.protocol import Finished, SamplingParams, Stats, TokenChunk, Usage
from disagg.serving.health import Health
from disagg.serving.http_limits import (
    BodyBudget,
    HttpLimits,
    connection_cap,
    nofile_limit,
    open_fds,
)
from disagg.serving.metrics import CONTENT_TYPE, Metrics, RequestTimer
from disagg.serving.openai_api import (
    SSE_DONE,
    ApiError,
    ChatBody,
    CompletionBody,
    Prepared,
    StopMatcher,
    chat_chunk,
    chat_response,
    completion_chunk,
    completion_response,
    decode_body,
    new_id,
    node_error,
    prepare_chat,
    prepare_completion,
    sse,
    usage_chunk,
)
from disagg.serving.openai_logprobs import token_text_of
from disagg.serving.tenants import http_tenant
from disagg.serving.tool_calls import apply_tool_calls
from disagg.serving.tool_calls import finish_reason as tool_finish_reason
from disagg.serving.tool_stream import ToolStream
from disagg.trace import trace_header

log = logging.getLogger(__name__)

MAX_BODY_BYTES = HttpLimits().max_body_bytes
INLINE_BODY_BYTES = 64 << 10  # larger bodies are prepared on a worker thread
SHUTDOWN_S = 5.0  # stopping the gateway waits this long for running handlers, then cancels


class Backend(Protocol):
    """What the gateway needs from the serving side (``AsyncClient`` and ``Router`` fit)."""

    def generate(self, prompt: str | None = None, prompt_token_ids: list[int] | None = None,
                 sampling: SamplingParams | None = None, request_id: str | None = None,
                 timeout: float = 600.0, cache_salt: str | None = None,
                 tenant: str | None = None, traceparent: str | None = None
                 ) -> AsyncIterator[TokenChunk | Finished]: ...

    async def stats(self, timeout: float = 10.0) -> Stats: ...


class Gateway:
    def __init__(self, backend: Backend, http_listen: str, model_name: str, tokenizer: Any,
                 max_model_len: int, metrics: Metrics | None = None, stats_interval: float = 1.0,
                 request_timeout: float = 600.0, stats_label: str | None = "node",
                 on_stop: Callable[[], Awaitable[None]] | None = None,
                 limits: HttpLimits | None = None):
        self.backend = backend
        self.limits = (limits or HttpLimits()).validate()
        self._bodies = BodyBudget(self.limits.body_buffer_bytes)
        self._busy: set[Any] = set()  # connections with a request in progress
        self.gate: ConnectionGate | None = None
        self.host, self.port = parse_listen(http_listen)
        self.model_name = model_name
        self.tokenizer = tokenizer
        self.text_of = token_text_of(tokenizer)  # a token's own text, for logprobs
        self.max_model_len = max_model_len  # lowered to the node's own limit (Stats)
        self.configured_max_model_len = max_model_len
        self.metrics = metrics or Metrics()
        self.stats_interval = stats_interval
        self.request_timeout = request_timeout
        self.stats_label = stats_label
        self._on_stop = on_stop
        self._created = int(time.time())
        self._runner: web.AppRunner | None = None
        self._poller: asyncio.Task[None] | None = None
        self.app = web.Application(client_max_size=self.limits.max_body_bytes,
                                   middlewares=[self._guard, _errors])
        self.app.add_routes([
            web.post("/v1/completions", self.completions),
            web.post("/v1/chat/completions", self.chat_completions),
            web.get("/v1/models", self.models),
            web.get("/health", self.health),
            web.get("/metrics", self.prometheus),
        ])
        # /health: the router's ready() (a decode node takes requests), else the node's Stats
        self.health_state = Health(stats_interval, getattr(backend, "ready", None))
        self._advice = getattr(backend, "advice", None)  # the router's P:D advice
        if callable(self._advice):
            self.app.add_routes([web.get("/v1/disagg/advice", self.advice)])

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    async def start(self) -> None:
        """Poll Stats once (so /health and the gauges are live), then listen."""
        await self._poll_once()
        # handler_cancellation: a client that disconnects cancels its handler, which aborts
        # the request on the node; stopping waits at most SHUTDOWN_S for handlers still running
        # (aiohttp's default is 60 s), then cancels them
        # keepalive_timeout: armed at connect and after each response, it closes a connection
        # without a complete request head by then (idle, or a slowloris)
        self._runner = web.AppRunner(self.app, handler_cancellation=True, access_log=None,
                                     shutdown_timeout=SHUTDOWN_S, lingering_time=LINGER_S,
                                     keepalive_timeout=self.limits.header_timeout_s)
        await self._runner.setup()
        assert self._runner.server is not None
        cap = connection_cap(self.limits.max_connections, nofile_limit(), open_fds())
        if cap < self.limits.max_connections:
            log.warning("HTTP connections capped at %d (not %d): the fd limit is %d",
                        cap, self.limits.max_connections, nofile_limit())
        self.gate = ConnectionGate(self._runner.server, cap, self._busy)
        site = GatedSite(self._runner, self.host, self.port, self.gate)
        await site.start()
        if self.port == 0:
            self.port = int(self._runner.addresses[0][1])
        self._poller = asyncio.create_task(self._poll_stats())
        log.info("HTTP gateway ready on %s (model %s)", self.url, self.model_name)

    async def stop(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(BaseException):
                await self._poller
        if self._runner is not None:
            await self._runner.cleanup()
        if self._on_stop is not None:
            await self._on_stop()

    # ------------------------------------------------------------------ stats

    async def _poll_stats(self) -> None:
        """Loop: 1. ask the backend for Stats; 2. feed the gauges; 3. sleep."""
        while True:
            await asyncio.sleep(self.stats_interval)
            await self._poll_once()

    async def _poll_once(self) -> None:
        try:
            stats = await self.backend.stats(timeout=max(1.0, 2 * self.stats_interval))
        except (TimeoutError, asyncio.TimeoutError):
            return
        except RequestError as e:  # the node answers, but may refuse requests (restarting)
            self.health_state.on_error(e.error.code, e.error.message)
            return
        except Exception as e:  # keep polling whatever the backend does
            log.debug("stats poll failed: %s", e)
            return
        self.health_state.on_stats(stats, time.monotonic())
        if stats.max_model_len > 0:  # one limit everywhere: the node caps it by its KV pool
            self.max_model_len = min(self.configured_max_model_len, stats.max_model_len)
        if self.stats_label is not None:  # None: the backend feeds the gauges itself
            self.metrics.update_stats(stats, self.stats_label)

    def unhealthy(self) -> str | None:
        """None while a request would be served, else why not (``disagg.serving.health``)."""
        return self.health_state.unhealthy(time.monotonic())

    def healthy(self) -> bool:
        return self.unhealthy() is None

    @web.middleware
    async def _guard(self, request: web.Request,
                     handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                     ) -> web.StreamResponse:
        """Mark the connection busy (not closed to make room) while its request runs, and
        send the response within the write timeout."""
        proto = request.protocol
        self._busy.add(proto)
        try:
            resp = await handler(request)
            await deliver(request, resp, self.limits.write_timeout_s)
            return resp
        finally:
            self._busy.discard(proto)

    # ------------------------------------------------------------------ simple routes

    async def models(self, request: web.Request) -> web.Response:
        return _json({"object": "list", "data": [{
            "id": self.model_name, "object": "model", "created": self._created,
            "owned_by": "disagg", "max_model_len": self.max_model_len}]})

    async def health(self, request: web.Request) -> web.StreamResponse:
        why = self.unhealthy()
        if why is None:
            return _json({"status": "ok"})
        return _error(ApiError(503, why, "server_error", code="unavailable"))

    async def advice(self, request: web.Request) -> web.Response:
        assert self._advice is not None
        return _json(self._advice().to_json())

    async def prometheus(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), headers={"Content-Type": CONTENT_TYPE})

    # ------------------------------------------------------------------ generation

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=True)

    async def _serve(self, request: web.Request, chat: bool) -> web.StreamResponse:
        try:
            body = await read_body(request, self.limits, self._bodies)
            if len(body) > INLINE_BODY_BYTES:  # parse, template, tokenize off the event loop
                prep = await asyncio.to_thread(self._prepare, body, chat)
            else:
                prep = self._prepare(body, chat)
        except ApiError as e:
            self.metrics.observe_error(e.code, e.type)
            return _error(e)
        prep.tenant = http_tenant(request.headers, self.limits.tenant_header)
        prep.traceparent = trace_header(request.headers)  # W3C trace context (disagg.trace)
        rid = new_id("chatcmpl" if chat else "cmpl")
        timer = self.metrics.start_request()
        outcome, code, etype = "abort", None, None  # what a cancellation (client gone) leaves
        try:
            if prep.n > 1 or len(prep.all_prompts) > 1:  # one node request per choice
                resp, outcome = await serve_many(
                    self, request, prep, rid, chat,
                    lambda p, sub: self._relay(p, sub, timer))
                return resp
            async with contextlib.aclosing(self._relay(prep, rid, timer)) as events:
                if prep.stream:
                    resp, outcome = await self._stream(request, events, rid, chat, prep)
                else:
                    resp, outcome = await self._collect(events, rid, chat, prep)
            return resp
        except ApiError as e:
            outcome, code, etype = "error", e.code, e.type
            return _error(e)
        finally:
            timer.finish(outcome, len(prep.prompt_token_ids), code, error_type=etype)

    def _prepare(self, body: bytes, chat: bool) -> Prepared:
        if chat:
            return prepare_chat(decode_body(body, ChatBody), self.tokenizer, self.model_name,
                                self.max_model_len, self.limits.max_n,
                                self.limits.default_max_tokens)
        return prepare_completion(decode_body(body, CompletionBody), self.tokenizer,
                                  self.model_name, self.max_model_len, self.limits.max_n)

    async def _relay(self, prep: Prepared, rid: str, timer: RequestTimer
                     ) -> AsyncGenerator[Event, None]:
        """The node's stream as ``Event``s, stop strings applied. Closing it early (client gone,
        stop string) closes the backend stream, which sends ``Abort``."""
        matcher = StopMatcher(prep.stop)
        produced = 0
        stream = self.backend.generate(prompt_token_ids=prep.prompt_token_ids,
                                       sampling=prep.sampling, request_id=rid,
                                       timeout=self.request_timeout, cache_salt=prep.cache_salt,
                                       tenant=prep.tenant, traceparent=prep.traceparent)
        try:
            async with contextlib.aclosing(stream):  # type: ignore[type-var]
                async for msg in stream:
                    if isinstance(msg, TokenChunk):
                        n = len(msg.token_ids)
                        timer.on_tokens(n)
                        produced += n
                        text, hit = matcher.push(msg.text)
                        lps = (msg.logprobs, msg.prompt_logprobs)
                        if hit:
                            usage = Usage(len(prep.prompt_token_ids), produced)
                            yield Event(text, n, "stop", usage, *lps)
                            return
                        yield Event(text, n, None, None, *lps)
                    else:
                        yield Event(matcher.flush(), 0, msg.reason, msg.usage)
                        return
        except RequestError as e:
            raise node_error(e.error.code, e.error.message, prep.prompt_param) from None
        except TimeoutError as e:
            raise ApiError(504, str(e), "server_error", code="timeout") from None
        raise ApiError(502, "the node's stream ended without a finish", "server_error",
                       code="internal")

    async def _collect(self, events: AsyncIterator[Event], rid: str, chat: bool,
                       prep: Prepared) -> tuple[web.Response, str]:
        parts: list[str] = []
        shaper = Shaper(prep, chat, self.text_of, self.tokenizer)  # echo, logprobs
        async for ev in events:
            parts.append(ev.text)
            shaper.add(ev)
            if ev.finish_reason is not None:
                assert ev.usage is not None
                build = chat_response if chat else completion_response
                body = build(rid, self.model_name, shaper.text("".join(parts), True),
                             ev.finish_reason, ev.usage)
                body["choices"][0]["logprobs"] = shaper.final()
                if chat and prep.tools is not None:
                    apply_tool_calls(body["choices"][0], prep.tools)
                return _json(body), ev.finish_reason
        raise ApiError(502, "the node's stream ended without a finish", "server_error")

    async def _stream(self, request: web.Request, events: AsyncIterator[Event], rid: str,
                      chat: bool, prep: Prepared) -> tuple[web.StreamResponse, str]:
        # The first event comes before the 200 so a refusal by the node is a proper 4xx.
        first = await events.__anext__()
        created = int(time.time())
        model, usage_on = self.model_name, prep.include_usage
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache"})
        await resp.prepare(request)

        async def put(data: bytes | None) -> None:  # None: the end; Stalled past the timeout
            await send(request, resp, data, self.limits.write_timeout_s)

        shaper = Shaper(prep, chat, self.text_of, self.tokenizer)  # echo, logprobs
        tools = ToolStream(prep.tools) if chat and prep.tools is not None else None

        async def tool_deltas(deltas: list[dict[str, Any]]) -> None:
            for delta in deltas:
                await put(sse(chat_chunk(rid, model, created, delta, None, usage_on)))

        def chunk(text: str | None, reason: str | None = None,
                  lp: dict[str, Any] | None = None) -> bytes:
            if chat:
                delta = {} if text is None else {"content": text}
                out = chat_chunk(rid, model, created, delta, reason, usage_on)
            else:
                out = completion_chunk(rid, model, created, text or "", reason, usage_on)
            out["choices"][0]["logprobs"] = lp
            return sse(out)

        try:
            if chat:
                await put(sse(chat_chunk(rid, model, created,
                                         {"role": "assistant", "content": ""}, None,
                                         usage_on)))
            ev: Event | None = first
            while ev is not None:
                text, lp = shaper.text(ev.text, ev is first), shaper.chunk(ev)
                if tools is not None:  # content and calls as delta.tool_calls
                    await tool_deltas(tools.push(text))
                    text = ""
                if ev.finish_reason is not None:
                    assert ev.usage is not None
                    if text or lp is not None and ev.tokens:
                        await put(chunk(text, None, lp))
                    reason = ev.finish_reason
                    if tools is not None:
                        await tool_deltas(tools.finish())
                        reason = tool_finish_reason(reason, tools.called)
                    await put(chunk(None, reason))
                    if usage_on:
                        obj = "chat.completion.chunk" if chat else "text_completion"
                        await put(sse(usage_chunk(rid, model, created, obj, ev.usage)))
                    await put(SSE_DONE)
                    await put(None)
                    return resp, ev.finish_reason
                if text or lp is not None and ev.tokens:
                    await put(chunk(text, None, lp))
                ev = await anext(events, None)
        except ApiError as e:  # after the 200: report in-band, then end the stream
            with contextlib.suppress(ConnectionError):
                await put(sse(e.body()))
                await put(SSE_DONE)
            raise _Reported(resp, e) from None
        except ConnectionError:  # client gone or Stalled: closing the events aborts it
            return resp, "abort"
        return resp, "error"


_Reported = Reported  # an error already written into an SSE stream (choices.py)


_enc = msgspec.json.Encoder()


def _json(body: dict[str, Any], status: int = 200) -> web.Response:
    return web.Response(body=_enc.encode(body), status=status, content_type="application/json")


def _error(e: ApiError) -> web.StreamResponse:
    if isinstance(e, _Reported):
        return e.resp
    resp = _json(e.body(), e.status)
    if isinstance(e, BodyError):  # the rest of the body is not read: end the connection
        resp.force_close()
    return resp


@web.middleware
async def _errors(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                  ) -> web.StreamResponse:
    """Every failure in OpenAI's error shape: 404/405/413 from aiohttp, 500 for a bug."""
    try:
        return await handler(request)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        kind = "invalid_request_error" if e.status < 500 else "server_error"
        message = e.reason if e.status != 413 else \
            f"the request body is larger than {MAX_BODY_BYTES} bytes"
        if e.status == 404:
            message = f"no route {request.method} {request.path}"
        elif e.status == 405:
            message = f"method {request.method} is not allowed on {request.path}"
        return _json(ApiError(e.status, message, kind).body(), e.status)
    except (asyncio.CancelledError, ConnectionError):
        raise
    except Exception:
        log.exception("unhandled error on %s %s", request.method, request.path)
        return _json(ApiError(500, "internal error (see the server log)", "server_error",
                              code="internal").body(), 500)


# ------------------------------------------------------------------ entry point


async def start_http_gateway(node_client_address: str, http_listen: str, model_dir: str,
                             model_name: str | None = None, max_model_len: int | None = None,
                             metrics: Metrics | None = None, stats_interval: float = 1.0,
                             request_timeout: float = 600.0,
                             limits: HttpLimits | None = None) -> Gateway:
    """Serve the OpenAI API on ``http_listen`` for the node at ``node_client_address``.

    ``model_dir`` gives the tokenizer (chat template, prompt lengths) and, unless
    ``max_model_len`` is set, the context limit. ``model_name`` defaults to the directory's
    name (``SmolLM2-135M-Instruct`` for the embedded model). ``await gateway.stop()`` closes the listener and the node connection."""
    from disagg.model.config import ModelArch
    from disagg.model.default import served_model_name
    from disagg.model.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(model_dir)
    if max_model_len is None:
        max_model_len = ModelArch.from_dir(model_dir).max_position_embeddings
    client = AsyncClient(node_client_address)
    gateway = Gateway(client, http_listen, model_name or served_model_name(model_dir), tokenizer,
                      max_model_len, metrics, stats_interval, request_timeout,
                      stats_label=node_client_address, on_stop=client.close, limits=limits)
    try:
        await gateway.start()
    except BaseException:
        await client.close()
        raise
    return gateway
