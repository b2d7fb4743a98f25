"""How ``disagg-bench serve`` reaches a node: a small ``Transport`` interface and its ZeroMQ
implementation over the client protocol (README). A second transport (HTTP) implements the
same three methods and plugs into ``make_transport``.

``generate`` yields ``TokenEvent``s timestamped on receipt, then one ``Done``; a node-side
error raises ``TransportError``; a missed deadline raises ``TimeoutError`` (and the request
is aborted on the node).
"""

from __future__ import annotations

import abc
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


@dataclass(frozen=True)
class Done:
    t: float  # time.perf_counter() when the terminal message was received
    reason: str  # stop | length | abort
    prompt_tokens: int
    completion_tokens: int
    # TTFT phases in ms from node timestamps (decoder_queue, prefill_queue, prefill_compute,
    # transfer_tail, first_decode); empty while the node protocol carries none.
    breakdown: dict[str, float] = field(default_factory=dict)


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
                        yield TokenEvent(now, len(msg.token_ids))
                elif isinstance(msg, Finished):
                    yield Done(now, msg.reason, msg.usage.prompt_tokens,
                               msg.usage.completion_tokens, dict(msg.timings or {}))
        except RequestError as e:
            raise TransportError(e.error.code, e.error.message) from None

    async def stats(self, timeout: float) -> dict[str, Any] | None:
        return dict(msgspec.structs.asdict(await self._client.stats(timeout)))

    async def close(self) -> None:
        await self._client.close()


def make_transport(address: str) -> Transport:
    """``tcp://``, ``ipc://`` and ``inproc://`` addresses speak the ZeroMQ client protocol."""
    if address.startswith(("tcp://", "ipc://", "inproc://")):
        return ZmqTransport(address)
    raise ValueError(f"--connect {address!r}: expected a tcp:// or ipc:// ZeroMQ address "
                     "(an HTTP transport is not implemented yet)")
