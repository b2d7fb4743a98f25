"""Scheduler actor: admission, batch formation, stepping the executors, streaming results.

Receives: ``FromClient`` (generate / abort / stats) from the frontend over ``inproc://``.
Sends: ``ToClient`` (token chunks, finished, errors, stats) back to the frontend; ``StepPlan``
to the executors through ``ExecutorGroup``.
Owns: the page pool, the batch scheduler, every live request and its detokenizer.
"""

from __future__ import annotations

import itertools
import logging
import random
import time
from dataclasses import dataclass

import msgspec
import zmq
import zmq.asyncio

from disagg.actors.executor import ExecutorError, ExecutorGroup
from disagg.cache import PagePool
from disagg.model.config import ModelArch
from disagg.model.tokenizer import IncrementalDetokenizer, Tokenizer
from disagg.protocol import (
    Abort,
    Error,
    Finished,
    FromClient,
    GenerateRequest,
    MessengerStats,
    NodeReply,
    Stats,
    StatsRequest,
    StepPlan,
    StepResult,
    ToClient,
    TokenChunk,
    ToScheduler,
    Usage,
)
from disagg.scheduling import Batch, BatchScheduler, Sequence, SeqUpdate

log = logging.getLogger(__name__)

MAX_REQUEST_ID = 256
SLOW_STEP_S = 0.5  # a step slower than this is logged (compiles, stalls)


@dataclass
class Live:
    identity: bytes
    seq: Sequence
    detok: IncrementalDetokenizer


@dataclass
class Counters:
    started: int = 0
    finished: int = 0
    aborted: int = 0
    errored: int = 0
    rejected: int = 0


class RequestRejected(ValueError):
    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


def prepare_prompt(req: GenerateRequest, tokenizer: Tokenizer | None, vocab_size: int,
                   max_model_len: int) -> list[int]:
    """Validate a GenerateRequest and return its prompt token ids (pure; raises RequestRejected)."""
    if not 1 <= len(req.request_id) <= MAX_REQUEST_ID:
        raise RequestRejected("bad_request", f"request_id must have 1-{MAX_REQUEST_ID} characters")
    if (req.prompt is None) == (req.prompt_token_ids is None):
        raise RequestRejected("bad_request", "give exactly one of prompt and prompt_token_ids")
    problem = req.sampling.validate()
    if problem:
        raise RequestRejected("bad_request", problem)
    if req.prompt is not None:
        if tokenizer is None:
            raise RequestRejected("bad_request", "this model has no tokenizer; send prompt_token_ids")
        ids = tokenizer.encode(req.prompt)
    else:
        ids = list(req.prompt_token_ids or [])
    if not ids:
        raise RequestRejected("bad_request", "the prompt is empty")
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise RequestRejected("bad_request", f"token id {bad} is outside the vocabulary [0, {vocab_size})")
    if len(ids) >= max_model_len:
        raise RequestRejected(
            "bad_request",
            f"the prompt has {len(ids)} tokens but the context holds {max_model_len} "
            "(prompt + at least one output token); shorten it or raise --max-model-len",
        )
    return ids


class SchedulerActor:
    def __init__(
        self,
        role: str,
        inbox: zmq.asyncio.Socket | None,
        executors: ExecutorGroup,
        arch: ModelArch,
        tokenizer: Tokenizer | None,
        page_size: int,
        max_batch_tokens: int,
        max_running: int,
        max_model_len: int,
    ):
        self.role = role
        self.inbox = inbox
        self.executors = executors
        self.arch = arch
        self.tokenizer = tokenizer
        self.page_size = page_size
        self.pool = PagePool(executors.num_pages)
        capacity = self.pool.num_pages * page_size
        if max_model_len > capacity:
            log.info("max model length %d exceeds the KV pool (%d tokens); capping it",
                        max_model_len, capacity)
            max_model_len = capacity
        self.max_model_len = max_model_len
        self.sched = BatchScheduler(self.pool, page_size, max_batch_tokens, max_running,
                                    max_model_len, arch.eos_token_ids)
        self.live: dict[tuple[bytes, str], Live] = {}
        self.by_slot: dict[int, tuple[bytes, str]] = {}
        self.counters = Counters()
        self._slots = itertools.count()
        self._steps = itertools.count()
        self._enc = msgspec.msgpack.Encoder()
        self._dec = msgspec.msgpack.Decoder(FromClient)
        self._stopping = False
        self.mbox: zmq.asyncio.Socket | None = None  # messenger link (prefill/decode roles)
        self._mdec = msgspec.msgpack.Decoder(ToScheduler)
        self.messenger_stats = MessengerStats()

    # ------------------------------------------------------------------ loop

    async def run(self) -> None:
        """Loop: 1. drain the inbox (admit, abort, stats); 2. schedule one step; 3. run it on
        the executors; 4. stream tokens and finishes. Idle: block on the inbox."""
        try:
            while not self._stopping:
                await self._drain(block=not self.sched.has_work())
                batch = self.sched.schedule()
                if batch is None:
                    if self.sched.has_work():  # nothing fits now: wait for a change, bounded
                        await self._drain(block=True, timeout_ms=50)
                    continue
                step_id = next(self._steps)
                plan = StepPlan(step_id, [c.to_wire() for c in batch.chunks], batch.num_decodes,
                                counter_base=step_id * (self.arch.num_layers + 1))
                await self.before_step(plan, batch)
                started = time.monotonic()
                result, hidden = await self.executors.step(plan)
                took = time.monotonic() - started
                if took > SLOW_STEP_S:
                    log.warning("slow step %d: %.0f ms for %d tokens (%d decodes, %d chunks)",
                                step_id, 1000 * took, batch.num_tokens, batch.num_decodes,
                                len(batch.chunks) - batch.num_decodes)
                await self.after_step(plan, batch, result, hidden)
                if result.error is not None:
                    for c in batch.chunks:
                        await self.step_failed(c.seq, result.error)
                    continue
                for update in self.sched.update(batch, result.token_ids):
                    await self._emit(update)
        except ExecutorError as e:
            log.error("executor failure: %s", e)
            await self.fail_all("internal", f"executor failure: {e}")
            raise

    async def _drain(self, block: bool, timeout_ms: int | None = None) -> None:
        """Handle every queued client and messenger message; when ``block``, first wait
        (up to ``timeout_ms``, None = forever) for one to arrive."""
        socks = [s for s in (self.inbox, self.mbox) if s is not None]
        if block:
            poller = zmq.asyncio.Poller()
            for sock in socks:
                poller.register(sock, zmq.POLLIN)
            if not await poller.poll(timeout_ms):
                return
        for sock in socks:
            while True:
                try:
                    data = await sock.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                if sock is self.inbox:
                    await self.handle(self._dec.decode(data))
                else:
                    await self.handle_messenger(self._mdec.decode(data))

    # ------------------------------------------------------------------ role hooks

    async def before_step(self, plan: StepPlan, batch: Batch) -> None:
        """Called before the step is sent to the executors (prefill: announce chunks)."""

    async def after_step(self, plan: StepPlan, batch: Batch, result: StepResult,
                         hidden: bytes | None) -> None:
        """Called when the executors answered, before tokens are applied."""

    async def step_failed(self, seq: Sequence, error: str) -> None:
        await self._end(seq, Error("internal", f"step failed: {error}", seq.request_id))

    async def handle_messenger(self, msg: ToScheduler) -> None:
        if isinstance(msg, MessengerStats):
            self.messenger_stats = msg

    async def handle(self, env: FromClient) -> None:
        match env.msg:
            case GenerateRequest() as req:
                await self._admit(env.identity, req)
            case Abort(request_id=rid):
                live = self.live.get((env.identity, rid))
                if live is None:
                    await self._send(env.identity, Error("unknown_request",
                                                         f"no live request {rid!r}", rid))
                    return
                await self._end(live.seq, Finished(rid, "abort", self._usage(live.seq)))
            case StatsRequest():
                await self._send(env.identity, self.stats())

    async def _admit(self, identity: bytes, req: GenerateRequest) -> None:
        key = (identity, req.request_id)
        if key in self.live:
            self.counters.rejected += 1
            await self._send(identity, Error("duplicate_request",
                                             f"request_id {req.request_id!r} is already live",
                                             req.request_id))
            return
        try:
            ids = prepare_prompt(req, self.tokenizer, self.arch.vocab_size, self.max_model_len)
        except RequestRejected as e:
            self.counters.rejected += 1
            await self._send(identity, Error(e.code, str(e), req.request_id))
            return
        p = req.sampling
        seed = p.seed if p.seed is not None else random.getrandbits(63)
        slot = next(self._slots)
        seq = Sequence(slot, req.request_id, ids, p, seed, arrival=slot)
        self.live[key] = Live(identity, seq, IncrementalDetokenizer(self.tokenizer, ids))
        self.by_slot[slot] = key
        self.counters.started += 1
        await self.enqueue(seq)

    async def enqueue(self, seq: Sequence) -> None:
        """Hand an admitted sequence to batching (a decode node may prefill it remotely)."""
        self.sched.add(seq)

    async def _emit(self, update: SeqUpdate) -> None:
        seq = update.seq
        key = self.by_slot.get(seq.slot)
        if key is None:
            return
        live = self.live[key]
        text = live.detok.push(update.new_token_ids)
        await self._send(live.identity, TokenChunk(seq.request_id, update.new_token_ids, text))
        if update.finish_reason is not None:
            await self._end(seq, Finished(seq.request_id, update.finish_reason, self._usage(seq),
                                          timings=self.timings_of(seq)))

    async def _end(self, seq: Sequence, terminal: Finished | Error) -> None:
        """Make ``terminal`` the request's last message, free its pages, count it."""
        key = self.by_slot.pop(seq.slot, None)
        if key is None:
            return
        live = self.live.pop(key)
        await self.release(seq)
        if isinstance(terminal, Error):
            self.counters.errored += 1
        elif terminal.reason == "abort":
            self.counters.aborted += 1
        else:
            self.counters.finished += 1
        await self._send(live.identity, terminal)

    def timings_of(self, seq: Sequence) -> dict[str, float] | None:
        """The TTFT breakdown of a finishing request (decode role: remote prefills)."""
        return None

    async def release(self, seq: Sequence) -> None:
        """Take an ended sequence out of batching and free its pages."""
        self.sched.remove(seq)

    async def fail_all(self, code: str, message: str) -> None:
        """End every live request with an Error (shutdown, executor failure)."""
        for live in list(self.live.values()):
            await self._end(live.seq, Error(code, message, live.seq.request_id))

    def stop(self) -> None:
        self._stopping = True

    # ------------------------------------------------------------------ replies

    def stats(self) -> Stats:
        c = self.counters
        return Stats(
            role=self.role, pages_total=self.pool.num_pages, pages_free=self.pool.num_free,
            page_size=self.page_size, running=len(self.sched.running),
            waiting=len(self.sched.waiting), started=c.started, finished=c.finished,
            aborted=c.aborted, errored=c.errored, rejected=c.rejected, bad_frames=0,
            preemptions=self.sched.num_preemptions,
            waiting_for_kv=self.waiting_for_kv(), pages_fenced=self.pages_fenced(),
            **msgspec.structs.asdict(self.messenger_stats),
        )

    def pages_fenced(self) -> int:
        return 0

    def waiting_for_kv(self) -> int:
        return len(self.sched.remote)

    @staticmethod
    def _usage(seq: Sequence) -> Usage:
        return Usage(len(seq.prompt_ids), len(seq.output_ids))

    async def _send(self, identity: bytes, msg: NodeReply) -> None:
        if self.inbox is None:  # a prefill node has no clients
            return
        await self.inbox.send(self._enc.encode(ToClient(identity, msg)))

