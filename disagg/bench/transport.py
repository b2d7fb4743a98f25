"""How ``disagg-bench serve`` reaches a node: a small ``Transport`` interface and its ZeroMQ
implementation over the client protocol (README). A second transport (HTTP) implements the
same three methods and plugs into ``make_transport``.

``generate`` yields ``TokenEvent``s timestamped on receipt, then one ``Done``; a node-side
error raises ``TransportError``; a missed deadline raises ``TimeoutError`` (and the request
is aborted on the node).
"""

from __future__ import annotations

import abc
import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import msgspec

from disagg.bench.workload import RequestSpec
from disagg.client import AsyncClient, RequestError
from disagg.protocol import Finished, SamplingParams, TokenChunk


@dataclass(frozen=True)
class TokenEvent:
    t: float  # time.perf_counter() when the chunk was received
    num_tokens: int  # tokens in the chunk (>= 1)
    token_ids: tuple[int, ...] = ()  # the tokens (client protocol; empty over HTTP)
    choice: int = 0  # which of the request's choices (n > 1 over HTTP: the event's index)


@dataclass(frozen=True)
class Done:
    t: float  # time.perf_counter() when the terminal message was received
    reason: str  # stop | length | abort
    prompt_tokens: int
    completion_tokens: int
    # TTFT phases in ms from node timestamps (decoder_queue, prefill_queue, prefill_compute,
    # transfer_tail, first_decode); empty while the node protocol carries none.
    breakdown: dict[str, float] = field(default_factory=dict)
    cached_tokens: int = 0  # prompt tokens the node took from its prefix cache


def plain(obj: Any) -> Any:
    """``obj`` with every msgspec Struct in it (nested in dicts, lists and tuples too) turned
    into a dict of its fields by name, array_like ones included (``Stats.dp_ranks``'
    ``DPRankStats``): what a node's Stats look like in ``disagg-bench serve``'s JSON."""
    if isinstance(obj, msgspec.Struct):
        return {f: plain(getattr(obj, f)) for f in obj.__struct_fields__}
    if isinstance(obj, dict):
        return {k: plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [plain(v) for v in obj]
    return obj


class TransportError(RuntimeError):
    """The node refused or failed the request; ``code`` is the protocol's error code."""

    def __init__(self, code: str, message: str):
        super().__init__(f"{code}: {message}")
        self.code = code


class Transport(abc.ABC):
    """One node endpoint. Many ``generate`` calls may run concurrently on one transport."""

    address: str

    @abc.abstractmethod
    def generate(self, spec: RequestSpec, request_id: str, sampling: SamplingParams,
                 timeout: float) -> AsyncIterator[TokenEvent | Done]:
        """Send one request; yield its token events, then one ``Done``. ``timeout`` bounds
        each wait for a message."""

    @abc.abstractmethod
    async def stats(self, timeout: float) -> dict[str, Any] | None:
        """The node's counters as a dict (None where the transport has none)."""

    @abc.abstractmethod
    async def close(self) -> None: ...


class ZmqTransport(Transport):
    """The client protocol over a ZeroMQ DEALER socket (``disagg.client.AsyncClient``)."""

    def __init__(self, address: str):
        self.address = address
        self._client = AsyncClient(address)

    async def generate(self, spec: RequestSpec, request_id: str, sampling: SamplingParams,
                       timeout: float) -> AsyncIterator[TokenEvent | Done]:
        try:
            async for msg in self._client.generate(prompt_token_ids=spec.prompt_token_ids,
                                                   sampling=sampling, request_id=request_id,
                                                   timeout=timeout):
                now = time.perf_counter()
                if isinstance(msg, TokenChunk):
                    if msg.token_ids:
                        yield TokenEvent(now, len(msg.token_ids), tuple(msg.token_ids))
                elif isinstance(msg, Finished):
                    yield Done(now, msg.reason, msg.usage.prompt_tokens,
                               msg.usage.completion_tokens, dict(msg.timings or {}),
                               msg.usage.cached_tokens)
        except RequestError as e:
            raise TransportError(e.error.code, e.error.message) from None

    async def stats(self, timeout: float) -> dict[str, Any] | None:
        stats: dict[str, Any] = plain(await self._client.stats(timeout))
        return stats

    async def close(self) -> None:
        await self._client.close()


class HttpTransport(Transport):
    """The OpenAI-compatible HTTP API (``--http-listen``): streaming ``/v1/completions`` with
    the prompt as token ids, ``ignore_eos`` and ``stream_options.include_usage``.

    SSE carries no token counts per event, so each event counts one token; the final usage
    gives the true count (the gateway sends no event for a token whose text delta is empty, so
    per-token timings need a model with a tokenizer). The API carries no TTFT breakdown."""

    def __init__(self, url: str, n: int = 1):
        import aiohttp

        self.address = url.rstrip("/")
        self.n = n  # completions per request (each choice's event with text: a token of it)
        self._session = aiohttp.ClientSession()
        self._model: str | None = None

    async def _model_id(self, timeout: float) -> str:
        if self._model is None:
            import aiohttp

            async with self._session.get(f"{self.address}/v1/models",
                                         timeout=aiohttp.ClientTimeout(total=timeout)) as r:
                r.raise_for_status()
                self._model = str((await r.json())["data"][0]["id"])
        return self._model

    async def generate(self, spec: RequestSpec, request_id: str, sampling: SamplingParams,
                       timeout: float) -> AsyncIterator[TokenEvent | Done]:
        import aiohttp

        body = {
            "model": await self._model_id(timeout), "prompt": list(spec.prompt_token_ids),
            "max_tokens": spec.output_len, "temperature": sampling.temperature, "stream": True,
            "ignore_eos": sampling.ignore_eos, "stream_options": {"include_usage": True},
        }
        if sampling.top_p < 1.0:
            body["top_p"] = sampling.top_p
        if sampling.top_k > 0:
            body["top_k"] = sampling.top_k
        if self.n > 1:
            body["n"] = self.n
        if sampling.structured is not None:
            body["guided_json"] = msgspec.json.decode(sampling.structured.spec)
        if sampling.logprobs is not None:
            body["logprobs"] = sampling.logprobs
        reason = ""
        try:
            async with self._session.post(
                    f"{self.address}/v1/completions", json=body,
                    timeout=aiohttp.ClientTimeout(total=None, sock_read=timeout)) as r:
                if r.status != 200:
                    err = (await r.json()).get("error", {})
                    raise TransportError(str(err.get("code") or r.status), str(err.get("message")))
                async for raw in r.content:
                    line = raw.decode().strip()
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    event = msgspec.json.decode(data)
                    now = time.perf_counter()
                    for choice in event.get("choices") or []:
                        reason = choice.get("finish_reason") or reason
                        # a token whose text is held back (an incomplete character, an id
                        # the tokenizer has no text for) has no event unless logprobs were
                        # asked: then each event lists its tokens
                        lp = choice.get("logprobs")
                        n = len(lp.get("tokens") or []) if isinstance(lp, dict) else 0
                        if n or choice.get("text"):  # a closing event: only the reason
                            yield TokenEvent(now, n or 1, choice=int(choice.get("index") or 0))
                    usage = event.get("usage")
                    if usage:
                        details = usage.get("prompt_tokens_details") or {}
                        yield Done(now, reason or "length", int(usage["prompt_tokens"]),
                                   int(usage["completion_tokens"]),
                                   cached_tokens=int(details.get("cached_tokens") or 0))
                        return
        except asyncio.TimeoutError:
            raise TimeoutError(f"no event for request {request_id} in {timeout}s") from None
        except aiohttp.ClientError as e:
            raise TransportError("http", str(e)) from None
        raise TransportError("http", "stream ended without usage")

    async def stats(self, timeout: float) -> dict[str, Any] | None:
        import aiohttp

        try:
            await self._model_id(timeout)  # answers once the gateway is up
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            raise TimeoutError(f"{self.address}: {e}") from None
        return None

    async def close(self) -> None:
        await self._session.close()


def make_transport(address: str, n: int = 1) -> Transport:
    """``tcp://``, ``ipc://`` and ``inproc://`` addresses speak the ZeroMQ client protocol;
    ``http://`` and ``https://`` URLs the OpenAI-compatible HTTP API (``n`` completions per
    request)."""
    if address.startswith(("tcp://", "ipc://", "inproc://")):
        return ZmqTransport(address)
    if address.startswith(("http://", "https://")):
        return HttpTransport(address, n)
    raise ValueError(f"--connect {address!r}: expected a tcp:// or ipc:// ZeroMQ address or an "
                     "http:// URL")
