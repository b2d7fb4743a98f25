"""What the scheduler does with each client frame (``ClientIntake``, a base of
``SchedulerActor``): a generate request is admitted (limits per client and in total, duplicate
ids, its prompt checked, a long text tokenized off the event loop) into the fair queue, or
refused; an abort ends a live or tokenizing request; a stats request is answered; a client that
left or stopped reading has its requests ended."""

from __future__ import annotations

import asyncio
import collections
import logging
import random
import time
from collections.abc import Coroutine, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec

from disagg.engine.scheduling import Sequence
from disagg.model.config import ModelArch
from disagg.model.tokenizer import IncrementalDetokenizer, Tokenizer
from disagg.protocol import (
    Abort,
    Error,
    ErrorCode,
    Finished,
    GenerateRequest,
    NodeReply,
    Stats,
    StatsRequest,
    Usage,
)
from disagg.protocol.inproc import ClientGone, FromClient
from disagg.serving.admission import (
    Counters,
    FairQueue,
    Limits,
    RequestRejected,
    prepare_prompt,
    prompt_size_problem,
)

log = logging.getLogger("disagg.actors.scheduler.scheduler")

INLINE_TOKENIZE_CHARS = 16 << 10  # longer prompt texts are tokenized on a worker thread


@dataclass
class Live:
    identity: bytes
    seq: Sequence
    detok: IncrementalDetokenizer
    admitted_at: float = 0.0  # monotonic


class ClientIntake:
    """Admission and the other client frames; the scheduler's state it works on is declared
    here and set up by ``SchedulerActor``."""

    limits: Limits
    arch: ModelArch
    tokenizer: Tokenizer | None
    max_model_len: int
    raise_hint: str
    live: dict[tuple[bytes, str], Live]
    by_slot: dict[int, tuple[bytes, str]]
    per_client: collections.Counter[bytes]  # live + tokenizing, per tenant
    tenant_of: dict[bytes, bytes]  # identity -> its tenant (a client key), as first seen
    queue: FairQueue[Sequence]  # admitted, not handed to batching yet
    tokenizing: dict[tuple[bytes, str], GenerateRequest]
    counters: Counters
    _acks: dict[bytes, int]
    _slots: Iterator[int]
    _in_vocab: msgspec.msgpack.Decoder[list[int]]

    if TYPE_CHECKING:  # SchedulerActor's
        def spawn(self, coro: Coroutine[Any, Any, None]) -> None: ...
        def stats(self) -> Stats: ...
        def _usage(self, seq: Sequence) -> Usage: ...
        async def _send(self, identity: bytes, msg: NodeReply) -> None: ...
        async def _end(self, seq: Sequence, terminal: Finished | Error) -> None: ...

    def _tenant(self, identity: bytes) -> bytes:
        """The unit of fairness of ``identity``'s requests: its client key, else itself."""
        return self.tenant_of.get(identity, identity)

    async def handle(self, env: FromClient) -> None:
        if env.tenant is not None and env.identity not in self.tenant_of:
            # a NUL first byte: no routing id a client may choose (libzmq reserves those)
            self.tenant_of[env.identity] = b"\0" + env.tenant
        match env.msg:
            case GenerateRequest():
                try:  # the ids decoded and checked against the vocabulary in one pass
                    req, in_vocab = env.generate_request(self._in_vocab), env.prompt is not None
                except msgspec.ValidationError:  # one is not: admission names it
                    req, in_vocab = env.generate_request(), False
                await self._admit(env.identity, req, env.prompt, in_vocab)
            case Abort(request_id=rid):
                key = (env.identity, rid)
                live = self.live.get(key)
                if key in self.tokenizing:  # dropped when its tokens come back
                    del self.tokenizing[key]
                    self._forget_client(env.identity)
                    self.counters.aborted += 1
                    await self._send(env.identity, Finished(rid, "abort", Usage(0, 0)))
                    return
                if live is None:
                    await self._send(env.identity, Error("unknown_request",
                                                         f"no live request {rid!r}", rid))
                    return
                await self._end(live.seq, Finished(rid, "abort", self._usage(live.seq)))
            case StatsRequest():
                await self._send(env.identity, self.stats())

    async def _admit(self, identity: bytes, req: GenerateRequest,
                     encoded: memoryview | None = None, in_vocab: bool = False) -> None:
        """Make ``req`` live or refuse it (``encoded``: its prompt ids as they came, msgpack;
        ``in_vocab``: its prompt ids were checked against the vocabulary as they were decoded)."""
        key = (identity, req.request_id)
        if key in self.live or key in self.tokenizing:
            await self._refuse(identity, req, "duplicate_request",
                               f"request_id {req.request_id!r} is already live")
            return
        tenant = self._tenant(identity)
        why, make_room = self.limits.admission(
            self.per_client[tenant], len(self.queue), self.queue.count(tenant),
            self.queue.clients(tenant), self.queue.largest())
        if why is not None:
            await self._refuse(identity, req, "overloaded", why)
            return
        if req.prompt is not None:
            why = prompt_size_problem(req.prompt, self.tokenizer, self.max_model_len)
            if why is not None:
                await self._refuse(identity, req, "bad_request", why)
                return
        if req.prompt is not None and len(req.prompt) > INLINE_TOKENIZE_CHARS:
            if make_room:
                await self._give_way()
            self.tokenizing[key] = req  # counted live for its client from now on
            self.per_client[tenant] += 1
            self.counters.started += 1
            self.spawn(self._tokenize_then_admit(identity, req))
            return
        try:
            ids = prepare_prompt(req, self.tokenizer, self.arch.vocab_size, self.max_model_len,
                                 self.raise_hint, ids_in_vocab=in_vocab)
        except RequestRejected as e:
            await self._refuse(identity, req, e.code, str(e))
            return
        if make_room:
            await self._give_way()
        self.counters.started += 1
        self.per_client[tenant] += 1
        self._accept(identity, req, ids, encoded)

    async def _give_way(self) -> None:
        """The queue is full and a client below its share came: the newest queued request
        of the client holding the most ends ``overloaded`` to make room."""
        seq = self.queue.newest_of_largest()
        key = self.by_slot.get(seq.slot) if seq is not None else None
        if seq is None or key is None:
            return
        await self._end(seq, Error(
            "overloaded", f"{self.limits.queued} requests are queued (--max-queued-requests) "
            "and this client holds more than its share: its newest queued request gave way "
            "to another client's; retry later", seq.request_id))

    async def _refuse(self, identity: bytes, req: GenerateRequest, code: ErrorCode,
                      why: str) -> None:
        self.counters.rejected += 1
        await self._send(identity, Error(code, why, req.request_id))

    async def _tokenize_then_admit(self, identity: bytes, req: GenerateRequest) -> None:
        key = (identity, req.request_id)
        try:
            ids = await asyncio.to_thread(prepare_prompt, req, self.tokenizer,
                                          self.arch.vocab_size, self.max_model_len,
                                          self.raise_hint)
        except RequestRejected as e:
            if self.tokenizing.pop(key, None) is not None:
                self._forget_client(identity)
                self.counters.errored += 1
                await self._send(identity, Error(e.code, str(e), req.request_id))
            return
        if self.tokenizing.pop(key, None) is None:
            return  # aborted (or its client left) meanwhile
        self._accept(identity, req, ids)  # the loop hands it to batching

    def _forget_client(self, identity: bytes) -> None:
        tenant = self._tenant(identity)
        self.per_client[tenant] -= 1
        if self.per_client[tenant] <= 0:
            del self.per_client[tenant]

    def _accept(self, identity: bytes, req: GenerateRequest, ids: list[int],
                encoded: memoryview | None = None) -> None:
        """Make a validated request live and queue it fairly among its client's others."""
        key = (identity, req.request_id)
        p = req.sampling
        seed = p.seed if p.seed is not None else random.getrandbits(63)
        slot = next(self._slots)
        seq = Sequence(slot, req.request_id, ids, p, seed, arrival=slot, prompt_msgpack=encoded,
                       cache_salt=req.cache_salt)
        now = time.monotonic()
        self.live[key] = Live(identity, seq, IncrementalDetokenizer(self.tokenizer, ids), now)
        self.by_slot[slot] = key
        self.queue.push(self._tenant(identity), seq, now + self.limits.queue_timeout_s)

    async def client_gone(self, msg: ClientGone) -> None:
        """End a vanished (or no longer reading) client's requests: nobody wants the tokens."""
        for key in [k for k in self.tokenizing if k[0] == msg.identity]:
            del self.tokenizing[key]
            self._forget_client(msg.identity)
            self.counters.aborted += 1
        lives = [live for key, live in self.live.items() if key[0] == msg.identity]
        if lives:
            log.info("ending %d requests of client %r: %s", len(lives), msg.identity, msg.reason)
        for live in lives:
            rid = live.seq.request_id
            if msg.reason == "stalled":
                await self._end(live.seq, Error("overloaded", "the client stopped reading its "
                                                "replies; its requests were ended", rid))
            else:
                await self._end(live.seq, Finished(rid, "abort", self._usage(live.seq)))
        self._acks.pop(msg.identity, None)
        self.tenant_of.pop(msg.identity, None)
