"""What the scheduler does with each client frame (``ClientIntake``, an object the scheduler
owns): a generate request is admitted (limits per client and in total, duplicate ids, its
prompt checked, a long text tokenized off the event loop) into the fair queue, or refused; an
abort ends a live or tokenizing request; a stats request is answered; a client that left or
stopped reading has its requests ended.

The intake owns what is about client frames and admission: the fair queue of admitted
requests not handed to batching yet, the live count of each tenant, the tenants, the requests
being tokenized, and the frames of each client handled but not yet counted in a reply (acks).
A request's tenant (its unit of fairness) is its client key; without one, the
``GenerateRequest.tenant`` its sender named (a router or gateway's client: an API key's id, a
header's value); else its connection. While the node drains (``draining``) new requests are
refused ``unavailable``, so that a router sends them to another node.
The live requests are the scheduler's: the intake sees them, and replies, through
``IntakeHost``."""

from __future__ import annotations

import asyncio
import collections
import logging
import random
import time
from collections.abc import Callable, Coroutine
from typing import Annotated, Any, Protocol

import msgspec

from disagg import trace
from disagg.engine.grammar import GrammarBusy, GrammarError, Grammars, GrammarState
from disagg.engine.scheduling import Sequence
from disagg.model.tokenizer import Tokenizer
from disagg.protocol import (
    Abort,
    ClientMessage,
    Error,
    ErrorCode,
    Finished,
    GenerateRequest,
    NodeReply,
    Resume,
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


class IntakeHost(Protocol):
    """The scheduler as its intake sees it."""

    def live_request(self, key: tuple[bytes, str]) -> Sequence | None: ...

    def requests_of(self, identity: bytes) -> list[Sequence]: ...

    def make_live(self, identity: bytes, seq: Sequence, admitted_at: float,
                  resume: Resume | None = None) -> None: ...

    def next_slot(self) -> int: ...

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None: ...

    def usage(self, seq: Sequence) -> Usage: ...

    def stats(self) -> Stats: ...

    async def send(self, identity: bytes, msg: NodeReply) -> None: ...

    async def end(self, seq: Sequence, terminal: Finished | Error) -> None: ...


class ClientIntake:
    def __init__(self, host: IntakeHost, limits: Limits, counters: Counters,
                 tokenizer: Tokenizer | None, vocab_size: int, max_model_len: int,
                 raise_hint: str, grammars: Grammars | None = None):
        """``counters``: the scheduler's (the intake counts what it starts, refuses and ends);
        ``raise_hint``: what a user raises for longer contexts; ``grammars``: compiles the
        constraints of structured requests (None: such requests are refused)."""
        self.grammars = grammars
        self.host = host
        self.limits = limits
        self.counters = counters
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.raise_hint = raise_hint
        self.per_client: collections.Counter[bytes] = collections.Counter()  # live + tokenizing
        self.tenant_of: dict[bytes, bytes] = {}  # identity -> its tenant (a client key)
        # (identity, request id) -> the tenant it counts under, while it is counted
        self.unit_of: dict[tuple[bytes, str], bytes] = {}
        self.draining: str | None = None  # why new requests are refused (the node drains)
        self.queue: FairQueue[Sequence] = FairQueue()  # admitted, not handed to batching yet
        # requests being prepared off the event loop: tokenized, or their grammar compiled
        self.tokenizing: dict[tuple[bytes, str], GenerateRequest] = {}
        self._acks: dict[bytes, int] = {}  # client frames handled, not yet counted in a reply
        self._admit_ns: dict[tuple[bytes, str], int] = {}  # traced: when admission began
        self._in_vocab = msgspec.msgpack.Decoder(  # a client's prompt ids (FromClient.prompt)
            list[Annotated[int, msgspec.Meta(ge=0, lt=vocab_size)]])

    # ------------------------------------------------------------------ the scheduler's reads

    def take_acks(self, identity: bytes) -> int:
        """The frames of ``identity`` handled since its last reply (the reply now counts them)."""
        return self._acks.pop(identity, 0)

    def pop_acks(self) -> tuple[bytes, int] | None:
        """A client with handled frames no reply counted yet, and their number."""
        return self._acks.popitem() if self._acks else None

    def queued(self) -> int:
        return len(self.queue)

    def next_queued(self) -> Sequence | None:
        """The next queued request to hand to batching (round robin over tenants)."""
        return self.queue.pop()

    def expired(self, now: float) -> list[Sequence]:
        return self.queue.expired(now)

    def next_deadline(self) -> float | None:
        return self.queue.next_deadline()

    def has_tokenizing(self) -> bool:
        return bool(self.tokenizing)

    def waiting(self) -> int:
        """Admitted requests not handed to batching, tokenizing ones included (Stats)."""
        return len(self.queue) + len(self.tokenizing)

    def ended(self, identity: bytes, seq: Sequence) -> None:
        """A live request of ``identity`` ended: no longer counted, no longer queued."""
        unit = self._forget_client(identity, seq.request_id)
        self.queue.remove(unit, seq)

    # ------------------------------------------------------------------ client frames

    def _tenant(self, identity: bytes, req: GenerateRequest | None = None) -> bytes:
        """The unit of fairness of ``identity``'s request ``req``: its client key, else the
        tenant ``req`` names (a router's or gateway's client), else ``identity`` itself. The
        first bytes keep the three apart (NUL, STX: no routing id a client may choose)."""
        key = self.tenant_of.get(identity)
        if key is not None:
            return key
        if req is not None and req.tenant is not None:
            return b"\2" + req.tenant.encode()
        return identity

    async def handle(self, env: FromClient) -> None:
        """One client frame (counted as handled: the next reply to its client acks it)."""
        self._acks[env.identity] = self._acks.get(env.identity, 0) + 1
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
                seq = self.host.live_request(key)
                if key in self.tokenizing:  # dropped when its tokens come back
                    del self.tokenizing[key]
                    self._forget_client(env.identity, rid)
                    self.counters.aborted += 1
                    await self.host.send(env.identity, Finished(rid, "abort", Usage(0, 0)))
                    return
                if seq is None:
                    await self.host.send(env.identity, Error("unknown_request",
                                                             f"no live request {rid!r}", rid))
                    return
                await self.host.end(seq, Finished(rid, "abort", self.host.usage(seq)))
            case StatsRequest():
                await self.host.send(env.identity, self.host.stats())

    async def refuse_frame(self, env: FromClient, refuse: Callable[[ClientMessage], Error]
                           ) -> None:
        """Answer a frame with ``refuse``'s Error, unhandled (the node is stopping)."""
        self._acks[env.identity] = self._acks.get(env.identity, 0) + 1
        await self.host.send(env.identity, refuse(env.msg))

    async def _admit(self, identity: bytes, req: GenerateRequest,
                     encoded: memoryview | None = None, in_vocab: bool = False) -> None:
        """Make ``req`` live or refuse it (``encoded``: its prompt ids as they came, msgpack;
        ``in_vocab``: its prompt ids were checked against the vocabulary as they were decoded)."""
        key = (identity, req.request_id)
        trace.mark("r.in", req.request_id)
        if trace.tracing():  # its admission span starts here (ends when it is queued)
            if len(self._admit_ns) > 4096:  # refused ones are not taken out
                self._admit_ns.clear()
            self._admit_ns[key] = time.time_ns()
        if self.host.live_request(key) is not None or key in self.tokenizing:
            await self._refuse(identity, req, "duplicate_request",
                               f"request_id {req.request_id!r} is already live")
            return
        if self.draining is not None:
            await self._refuse(identity, req, "unavailable", self.draining)
            return
        tenant = self._tenant(identity, req)
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
        so = req.sampling.structured
        if so is not None:
            why = (self.grammars.unavailable(so.param) if self.grammars is not None
                   else f"{so.param}: this node does not sample, so it constrains nothing")
            if why is not None:
                await self._refuse(identity, req, "bad_request", why)
                return
        if req.prompt is not None and len(req.prompt) > INLINE_TOKENIZE_CHARS:
            if make_room:
                await self._give_way()
            self.tokenizing[key] = req  # counted live for its client from now on
            self.per_client[tenant] += 1
            self.unit_of[key] = tenant
            self.counters.started += 1
            self.host.spawn(self._tokenize_then_admit(identity, req))
            return
        try:
            ids = prepare_prompt(req, self.tokenizer, self.vocab_size, self.max_model_len,
                                 self.raise_hint, ids_in_vocab=in_vocab)
        except RequestRejected as e:
            await self._refuse(identity, req, e.code, str(e))
            return
        if make_room:
            await self._give_way()
        self.counters.started += 1
        self.per_client[tenant] += 1
        self.unit_of[key] = tenant
        if so is not None:  # its grammar is compiled off the event loop first
            self.tokenizing[key] = req
            self.host.spawn(self._compile_then_accept(identity, req, ids, encoded))
            return
        self._accept(identity, req, ids, encoded)

    async def _give_way(self) -> None:
        """The queue is full and a client below its share came: the newest queued request
        of the client holding the most ends ``overloaded`` to make room."""
        seq = self.queue.newest_of_largest()
        if seq is None:
            return
        await self.host.end(seq, Error(  # a request no longer live is not ended again
            "overloaded", f"{self.limits.queued} requests are queued (--max-queued-requests) "
            "and this client holds more than its share: its newest queued request gave way "
            "to another client's; retry later", seq.request_id))

    async def _refuse(self, identity: bytes, req: GenerateRequest, code: ErrorCode,
                      why: str) -> None:
        self.counters.rejected += 1
        await self.host.send(identity, Error(code, why, req.request_id))

    async def _tokenize_then_admit(self, identity: bytes, req: GenerateRequest) -> None:
        key = (identity, req.request_id)
        try:
            ids = await asyncio.to_thread(prepare_prompt, req, self.tokenizer,
                                          self.vocab_size, self.max_model_len,
                                          self.raise_hint)
        except RequestRejected as e:
            if self.tokenizing.pop(key, None) is not None:
                self._forget_client(identity, req.request_id)
                self.counters.errored += 1
                await self.host.send(identity, Error(e.code, str(e), req.request_id))
            return
        if req.sampling.structured is not None:
            await self._compile_then_accept(identity, req, ids)
            return
        if self.tokenizing.pop(key, None) is None:
            return  # aborted (or its client left) meanwhile
        self._accept(identity, req, ids)  # the loop hands it to batching

    async def _compile_then_accept(self, identity: bytes, req: GenerateRequest, ids: list[int],
                                   encoded: memoryview | None = None) -> None:
        """Compile ``req``'s constraint on the grammar threads within ``COMPILE_TIMEOUT_S``
        (fairly among tenants: ``Grammars.compile_bounded``), then accept it with its matcher;
        a constraint that fails (invalid, admits nothing, too slow to compile) ends it
        ``bad_request`` naming its parameter, one the node is too busy to compile now
        ``overloaded``."""
        key = (identity, req.request_id)
        so, grammars = req.sampling.structured, self.grammars
        assert so is not None and grammars is not None
        try:
            grammar = await grammars.compile_bounded(
                so, self.unit_of.get(key) or self._tenant(identity, req), req.cache_salt)
        except GrammarError as e:
            if self.tokenizing.pop(key, None) is not None:
                self._forget_client(identity, req.request_id)
                self.counters.errored += 1
                code: ErrorCode = "overloaded" if isinstance(e, GrammarBusy) else "bad_request"
                await self.host.send(identity, Error(code, str(e), req.request_id))
            return
        if self.tokenizing.pop(key, None) is None:
            return  # aborted (or its client left) meanwhile
        if req.resume is not None:  # the matcher goes through what was streamed already
            bad = next((t for t in req.resume.output_ids if not grammar.accept(t)), None)
            if bad is not None:
                self._forget_client(identity, req.request_id)
                self.counters.errored += 1
                await self.host.send(identity, Error(
                    "bad_request", f"resume.output_ids: token {bad} does not obey "
                    f"{so.param}", req.request_id))
                return
        self._accept(identity, req, ids, encoded, grammar)

    def _forget_client(self, identity: bytes, request_id: str) -> bytes:
        """``identity``'s request ``request_id`` is no longer counted; returns its tenant."""
        tenant = self.unit_of.pop((identity, request_id), None) or self._tenant(identity)
        self.per_client[tenant] -= 1
        if self.per_client[tenant] <= 0:
            del self.per_client[tenant]
        return tenant

    def _accept(self, identity: bytes, req: GenerateRequest, ids: list[int],
                encoded: memoryview | None = None, grammar: GrammarState | None = None) -> None:
        """Make a validated request live and queue it fairly among its client's others."""
        p = req.sampling
        seed = p.seed if p.seed is not None else random.getrandbits(63)
        slot = self.host.next_slot()
        seq = Sequence(slot, req.request_id, ids, p, seed, arrival=slot, prompt_msgpack=encoded,
                       cache_salt=req.cache_salt, grammar=grammar)
        if req.resume is not None:  # continued here: prefilled with the prompt, then sampled on
            seq.output_ids = list(req.resume.output_ids)
        if trace.tracing():  # a child of its sender's span: admission, then queue
            t0 = self._admit_ns.pop((identity, req.request_id), None)
            seq.trace = trace.Phases("request", req.traceparent, t0, request_id=req.request_id,
                                     prompt_tokens=len(ids), resumed=len(seq.output_ids))
            seq.trace.enter("admission", t0)
            seq.trace.enter("queue")
        now = time.monotonic()
        trace.mark("r.live", req.request_id)
        self.host.make_live(identity, seq, now, req.resume)
        unit = self.unit_of.get((identity, req.request_id)) or self._tenant(identity, req)
        self.queue.push(unit, seq, now + self.limits.queue_timeout_s)

    async def client_gone(self, msg: ClientGone) -> None:
        """End a vanished (or no longer reading) client's requests: nobody wants the tokens."""
        for key in [k for k in self.tokenizing if k[0] == msg.identity]:
            del self.tokenizing[key]
            self._forget_client(*key)
            self.counters.aborted += 1
        seqs = self.host.requests_of(msg.identity)
        if seqs:
            log.info("ending %d requests of client %r: %s", len(seqs), msg.identity, msg.reason)
        for seq in seqs:
            rid = seq.request_id
            if msg.reason == "stalled":
                await self.host.end(seq, Error("overloaded", "the client stopped reading its "
                                               "replies; its requests were ended", rid))
            else:
                await self.host.end(seq, Finished(rid, "abort", self.host.usage(seq)))
        self._acks.pop(msg.identity, None)
        self.tenant_of.pop(msg.identity, None)

    async def fail_tokenizing(self, code: ErrorCode, message: str) -> None:
        """End every request being tokenized with an Error (shutdown, executor failure)."""
        for identity, rid in list(self.tokenizing):
            del self.tokenizing[(identity, rid)]
            self._forget_client(identity, rid)
            self.counters.errored += 1
            await self.host.send(identity, Error(code, message, rid))
