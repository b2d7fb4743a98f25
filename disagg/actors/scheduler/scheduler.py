"""Scheduler actor: admission, batch formation, stepping the executors, streaming results.

Receives: ``FromClient`` (generate / abort / stats) and ``ClientGone`` from the frontend over
``inproc://``.
Sends: ``ToClient`` (token chunks, finished, errors, stats; each counts the client frames it
finishes handling) back to the frontend; ``StepPlan`` to the executors through ``ExecutorGroup``.
Owns: the page pool, the batch scheduler, every live request and its detokenizer, and its
intake (``disagg.actors.scheduler.intake.ClientIntake``): the client frames, admission bounded
per client and in total (``overloaded``), long prompt texts tokenized off the event loop, and
the fair queue of admitted requests that have not started (round robin over clients, each
entry with its deadline).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, Literal

import msgspec
import zmq
import zmq.asyncio

from disagg import trace
from disagg.actors.executor.executor_group import ExecutorError, ExecutorGroup
from disagg.actors.scheduler.intake import ClientIntake
from disagg.actors.scheduler.sides import SchedulerSide
from disagg.actors.scheduler.stepping import Stepper
from disagg.actors.sockets import LoopPoller, pending
from disagg.engine.core import EngineCore
from disagg.engine.dp import make_pool, rank_stats
from disagg.engine.grammar import Grammars
from disagg.engine.grammar_mirror import EXECUTOR_MASKS, MirrorBook
from disagg.engine.grammar_pass import GrammarPass
from disagg.engine.kv_tiers import KVTiers
from disagg.engine.prefix_tiers import TieredScheduler
from disagg.engine.scheduling import BatchScheduler, Sequence, SeqUpdate
from disagg.engine.speculative import Speculation
from disagg.model.config import ModelArch
from disagg.model.tokenizer import IncrementalDetokenizer, Tokenizer
from disagg.protocol import (
    ClientMessage,
    Error,
    ErrorCode,
    Finished,
    NodeReply,
    Resume,
    Stats,
    TokenChunk,
    Usage,
)
from disagg.protocol.inproc import (
    ClientGone,
    MessengerStats,
    SchedulerInbox,
    ToClient,
    ToScheduler,
)
from disagg.serving.admission import Counters, Limits

log = logging.getLogger(__name__)


@dataclass
class Live:
    identity: bytes
    seq: Sequence
    detok: IncrementalDetokenizer
    admitted_at: float = 0.0  # monotonic


@dataclass(frozen=True)
class SchedulerSetup:
    """What every scheduler is built from (``Node`` fills it from the config)."""

    executors: ExecutorGroup
    arch: ModelArch
    tokenizer: Tokenizer | None
    page_size: int
    max_batch_tokens: int
    max_running: int
    max_model_len: int
    limits: Limits = Limits()
    prefix_caching: bool = False  # reuse cached full pages of prompt prefixes
    cache_salt: bytes = b""  # the model's identity: parent of every first page hash
    speculative: Speculation | None = None  # drafting for speculative decoding
    overlap: bool = False  # overlapped decoding (disagg.engine.core)
    tiers: KVTiers | None = None  # KV tiers behind the prefix cache (disagg.engine.kv_tiers)
    grammar_threads: int = 0  # the late grammar masks' pass (disagg.engine.grammar_pass); 0: auto


class SchedulerActor:
    def __init__(self, role: str, setup: SchedulerSetup, inbox: zmq.asyncio.Socket | None = None,
                 mbox: zmq.asyncio.Socket | None = None,
                 side: Callable[[SchedulerActor], SchedulerSide] | None = None):
        """``inbox``: the frontend link (None on a prefill node: it has no clients);
        ``mbox``: the messenger link; ``side``: builds what a prefill or decode node adds
        (``disagg.actors.scheduler.sides``; None on a mixed node)."""
        self.role = role
        self.limits = setup.limits
        self.inbox = inbox
        self.executors = executors = setup.executors
        self.arch = arch = setup.arch
        self.tokenizer = setup.tokenizer
        self.page_size = page_size = setup.page_size
        max_model_len, max_batch_tokens = setup.max_model_len, setup.max_batch_tokens
        max_running = setup.max_running
        # one pool over every DP rank's pages (--dp: disagg.engine.dp; one rank: a PagePool)
        self.pool = make_pool(executors.num_pages, executors.dp, lambda: self.sched.running)
        capacity = executors.num_pages * page_size  # one rank's: a sequence stays on its rank
        self.raise_hint = "--max-model-len"  # what a user raises for longer contexts
        if max_model_len > capacity:
            log.info("max model length %d exceeds the KV pool (%d tokens); capping it",
                        max_model_len, capacity)
            max_model_len = capacity
            self.raise_hint = "the KV pool (--num-pages or --kv-cache-mb)"
        self.max_model_len = max_model_len
        args = (self.pool, page_size, max_batch_tokens, max_running, max_model_len,
                arch.eos_token_ids)
        kwargs: dict[str, Any] = dict(
            prefix_caching=setup.prefix_caching, cache_salt=setup.cache_salt,
            **(setup.speculative.scheduler_args() if setup.speculative else {}))
        self.tiers = setup.tiers
        self.sched = (BatchScheduler(*args, **kwargs) if setup.tiers is None
                      else TieredScheduler(*args, tiers=setup.tiers, **kwargs))
        self.live: dict[tuple[bytes, str], Live] = {}
        self.by_slot: dict[int, tuple[bytes, str]] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self.counters = Counters()
        self._slots = itertools.count()
        spec = setup.speculative
        grammars = Grammars(self.tokenizer, arch.vocab_size, arch.eos_token_ids, refuse=(
            None if spec is None else "constrained decoding is not served with speculative "
            f"decoding (--speculative-method {spec.method}); use a node without it"))
        self.intake = ClientIntake(self, self.limits, self.counters, self.tokenizer,
                                   arch.vocab_size, max_model_len, self.raise_hint, grammars)
        # the engine core plans and applies every step (a step spans layers + 1 counter values)
        self.core = EngineCore(self.sched, setup.overlap, arch.num_layers + 1,
                               GrammarPass(setup.grammar_threads),
                               MirrorBook(grammars.vocab_json) if EXECUTOR_MASKS else None)
        self.stepper = Stepper(self)
        self._enc = msgspec.msgpack.Encoder()
        self._dec = msgspec.msgpack.Decoder(SchedulerInbox)
        self._stopping = False
        self._waiter = LoopPoller()  # the inbox's and messenger's, registered for a run
        self.mbox = mbox
        self._mdec = msgspec.msgpack.Decoder(ToScheduler)
        self.messenger_stats = MessengerStats()
        self.side = side(self) if side is not None else SchedulerSide(self)

    # ------------------------------------------------------------------ loop

    async def run(self) -> None:
        """Loop: 1. drain the inbox (admit, abort, stats); 2. the engine core's next command
        (``disagg.engine.core``: one step, or with a step in flight its successor or
        ``Collect``); 3. run it on the executors (``disagg.actors.scheduler.stepping``); 4. stream
        tokens and finishes. Idle: block on the inbox."""
        # one waiter for the run, woken in one loop turn (pyzmq's takes several); not one
        # per wait: a node's open fds stay flat
        for sock in (self.inbox, self.mbox):
            if sock is not None:
                self._waiter.register(sock, zmq.POLLIN)
        try:
            while not self._stopping:
                idle = not self.core.has_work()
                await self._drain(block=idle, timeout_ms=self._idle_timeout_ms() if idle else None)
                await self._expire(time.monotonic())
                await self._feed()
                # after feeding: a remote prefill's request reaches the messenger before the
                # frontend's turn for the acks (its wake-up would come first in the loop)
                await self._flush_acks()
                cmd = self.core.next()
                if cmd is None:
                    if self.sched.has_work():  # nothing fits now: wait for a change, bounded
                        # (a tier's copy in flight: look again soon, it lands without a message)
                        await self._drain(block=True, timeout_ms=1 if self.tiers is not None
                                          and self.tiers.busy() else 50)
                    continue
                await self.stepper.run(cmd)
        except ExecutorError as e:
            log.error("executor failure: %s", e)
            self.stepper.abandon()
            await self.fail_all("internal", f"executor failure: {e}")
            raise
        finally:
            self._waiter.close()

    async def _drain(self, block: bool, timeout_ms: int | None = None) -> None:
        """Handle every queued client and messenger message; when ``block``, first wait
        (up to ``timeout_ms``, None = forever) for one to arrive."""
        socks = [s for s in (self.inbox, self.mbox) if s is not None]
        if block and not await self._waiter.poll(timeout_ms):
            return
        for sock in socks:
            async for data in pending(sock):
                if sock is self.inbox:
                    msg = self._dec.decode(data)
                    if isinstance(msg, ClientGone):
                        await self.intake.client_gone(msg)
                        continue
                    await self.intake.handle(msg)
                else:
                    await self.handle_messenger(self._mdec.decode(data))
        await self.pages_changed()

    def _idle_timeout_ms(self) -> int | None:
        """How long an idle loop may block: until the next queue deadline, at most 1 s while
        anything is queued (None: nothing waits on a clock)."""
        if self.intake.has_tokenizing():  # a worker thread's result: no socket event
            return 20  # look again soon
        nxt = self.next_deadline()
        if nxt is None:
            return None
        return max(1, min(1000, int(1000 * (nxt - time.monotonic())) + 1))

    def next_deadline(self) -> float | None:
        heads = [d for d in (self.intake.next_deadline(), self.side.next_deadline())
                 if d is not None]
        return min(heads) if heads else None

    async def _feed(self) -> None:
        """Hand queued requests to batching, round robin over clients, while seats are free
        (a short hand-off keeps a late client's request from waiting behind a flood)."""
        while self.intake.queued() and self.in_flight() < self.sched.max_running:
            seq = self.intake.next_queued()
            assert seq is not None
            await self.enqueue(seq)

    def in_flight(self) -> int:
        """Sequences handed to batching and not finished (seats taken or about to be)."""
        return len(self.sched.running) + len(self.sched.waiting) + self.side.in_flight()

    async def _expire(self, now: float) -> None:
        for seq in self.intake.expired(now):
            await self._timeout(seq)
        await self.side.expire(now)

    async def _timeout(self, seq: Sequence) -> None:
        waited = self.limits.queue_timeout_s
        await self._end(seq, Error("timeout", f"the request waited {waited:g}s without "
                                   "starting (--queue-timeout)", seq.request_id))

    async def pages_changed(self) -> None:
        """Pages may have returned to the pool (decode: reserve pages for queued prompts)."""
        await self.side.pages_changed()

    async def _flush_acks(self) -> None:
        """Count handled frames that no reply carried (an admitted request, say)."""
        while (acks := self.intake.pop_acks()) is not None:
            identity, n = acks
            await self._to_frontend(ToClient(identity, n))

    async def step_failed(self, seq: Sequence, error: str) -> None:
        if not await self.side.step_failed(seq, error):
            await self._end(seq, Error("internal", f"step failed: {error}", seq.request_id))

    async def handle_messenger(self, msg: ToScheduler) -> None:
        if isinstance(msg, MessengerStats):
            self.messenger_stats = msg
        else:
            await self.side.handle_messenger(msg)

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        """Run ``coro`` as a task of this actor (cancelled when it stops)."""
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def enqueue(self, seq: Sequence) -> None:
        """Hand an admitted sequence to batching (a decode node may prefill it remotely); a
        resumed one whose streamed tokens already end it (its node died before its Finished)
        finishes at once."""
        if seq.output_ids and (reason := self._resumed_end(seq)) is not None:
            await self._end(seq, Finished(seq.request_id, reason, self.usage(seq)))
            return
        if not await self.side.enqueue(seq):
            if seq.trace is not None:
                seq.trace.enter("prefill")  # here, in mixed steps
            self.sched.add(seq)

    async def emit(self, update: SeqUpdate) -> None:
        seq = update.seq
        key = self.by_slot.get(seq.slot)
        if key is None:
            return
        live = self.live[key]
        self.side.emitting(seq)
        if seq.trace is not None and seq.trace.name != "stream":  # its first token is out
            seq.trace.enter("stream")
        first = len(seq.output_ids) == len(update.new_token_ids)  # its first chunk
        if first:
            trace.mark("r.first", seq.request_id)
        text = live.detok.push(update.new_token_ids)
        prompt_lps = seq.prompt_lps if first and seq.params.prompt_logprobs is not None else None
        await self.send(live.identity, TokenChunk(seq.request_id, update.new_token_ids, text,
                                                  logprobs=update.logprobs,
                                                  prompt_logprobs=prompt_lps))
        if update.finish_reason is not None and not await self.side.hold_finish(
                seq, update.finish_reason):
            await self._end(seq, Finished(seq.request_id, update.finish_reason, self.usage(seq),
                                          timings=self.side.timings_of(seq)))

    def _resumed_end(self, seq: Sequence) -> str | None:
        """Why a resumed sequence is finished already by its last streamed token (as
        ``BatchScheduler.update`` would have said), or None."""
        p, n, last = seq.params, len(seq.output_ids), seq.output_ids[-1]
        if seq.grammar is not None and seq.grammar.terminated:
            return "stop"
        if n >= p.min_tokens and (last in p.stop_token_ids or (
                not p.ignore_eos and last in self.sched.eos_token_ids)):
            return "stop"
        if n >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def next_slot(self) -> int:
        return next(self._slots)

    # ------------------------------------------------------------------ the intake's host

    def live_request(self, key: tuple[bytes, str]) -> Sequence | None:
        live = self.live.get(key)
        return None if live is None else live.seq

    def requests_of(self, identity: bytes) -> list[Sequence]:
        return [live.seq for key, live in self.live.items() if key[0] == identity]

    def make_live(self, identity: bytes, seq: Sequence, admitted_at: float,
                  resume: Resume | None = None) -> None:
        """An admitted request (queued by the intake) becomes live: its replies stream (a
        resumed one's detokenizer as the node that streamed it left it)."""
        key = (identity, seq.request_id)
        detok = (IncrementalDetokenizer(self.tokenizer, seq.prompt_ids) if resume is None
                 else IncrementalDetokenizer.resumed(self.tokenizer, seq.prompt_ids,
                                                     resume.output_ids, resume.text_prefix,
                                                     resume.text_read))
        self.live[key] = Live(identity, seq, detok, admitted_at)
        self.by_slot[seq.slot] = key

    async def end(self, seq: Sequence, terminal: Finished | Error) -> None:
        """End a live request with ``terminal`` (a side's call)."""
        await self._end(seq, terminal)

    async def to_messenger(self, frames: list[bytes]) -> None:
        assert self.mbox is not None
        await self.mbox.send_multipart(frames)

    async def _end(self, seq: Sequence, terminal: Finished | Error) -> None:
        """Make ``terminal`` the request's last message, free its pages, count it."""
        key = self.by_slot.pop(seq.slot, None)
        if key is None:
            return
        live = self.live.pop(key)
        self.intake.ended(live.identity, seq)
        await self.release(seq)
        if seq.trace is not None:
            seq.trace.end(outcome=terminal.reason if isinstance(terminal, Finished)
                          else terminal.code, completion_tokens=len(seq.output_ids))
        if isinstance(terminal, Error):
            self.counters.errored += 1
        elif terminal.reason == "abort":
            self.counters.aborted += 1
        else:
            self.counters.finished += 1
        await self.send(live.identity, terminal)

    async def release(self, seq: Sequence) -> None:
        """Take an ended sequence out of batching and free its pages."""
        if not await self.side.release(seq):
            self.sched.remove(seq)

    async def fail_all(self, code: ErrorCode, message: str) -> None:
        """End every live request with an Error (shutdown, executor failure)."""
        for live in list(self.live.values()):
            rid = live.seq.request_id
            try:
                await self._end(live.seq, Error(code, message, rid))
            except Exception:  # noqa: BLE001 - a broken state (the failure) still answers all
                log.exception("ending %s", rid)
                await self.send(live.identity, Error(code, message, rid))
        await self.intake.fail_tokenizing(code, message)

    def stop(self) -> None:
        self._stopping = True

    def drain(self, why: str) -> None:
        """Admit nothing new (new requests end ``unavailable`` naming ``why``; Stats say
        draining); live and queued requests go on."""
        self.intake.draining = why

    def busy(self) -> bool:
        """Whether a request is live (running, queued, waiting for KV) or being prepared."""
        return bool(self.live) or self.intake.has_tokenizing()
        for t in self._tasks:
            t.cancel()

    async def refuse_inbox(self, refuse: Callable[[ClientMessage], Error]) -> None:
        """Once stopped: answer every client frame still queued here with ``refuse``'s Error
        (a stopping node takes no more work, and leaves no frame it was sent unanswered)."""
        if self.inbox is None:
            return
        async for data in pending(self.inbox):
            msg = self._dec.decode(data)
            if not isinstance(msg, ClientGone):
                await self.intake.refuse_frame(msg, refuse)

    # ------------------------------------------------------------------ replies

    def stats(self) -> Stats:
        c, n = self.counters, self.side.transfers_in_flight()
        # typed Any: Stats has list fields, so mypy would check these ints against them
        counts: dict[str, Any] = self.sched.counters()
        tiers: dict[str, Any] = self.tiers.stats() if self.tiers is not None else {}
        messenger: dict[str, Any] = msgspec.structs.asdict(self.messenger_stats)
        if n is not None:
            messenger["transfers_in_flight"] = n
        return Stats(
            role=self.role, pages_total=self.pool.num_pages, pages_free=self.pool.num_free,
            pages_cached=self.pool.num_cached, **counts,
            page_size=self.page_size, running=len(self.sched.running),
            waiting=len(self.sched.waiting) + self.intake.waiting(),
            started=c.started, finished=c.finished,
            aborted=c.aborted, errored=c.errored, rejected=c.rejected, bad_frames=0,
            waiting_for_kv=self.side.waiting_for_kv(), pages_fenced=self.side.pages_fenced(),
            max_model_len=self.max_model_len, steps_overlapped=self.core.steps_ahead,
            draining=int(self.intake.draining is not None),
            dp_ranks=rank_stats(self.pool, self.sched.running, self.executors.all_to_all_s),
            start_phases_s=self.executors.phases.ordered(),
            **tiers, **messenger,
        )

    def usage(self, seq: Sequence) -> Usage:
        return Usage(len(seq.prompt_ids), len(seq.output_ids), self.side.cached_tokens(seq))

    async def send(self, identity: bytes, msg: NodeReply) -> None:
        """Reply to a client, counting the frames of it handled since the last reply."""
        kind: Literal["reply", "terminal", "stats"] = (
            "stats" if isinstance(msg, Stats) else "terminal" if isinstance(msg, Finished) or (
                isinstance(msg, Error) and msg.request_id is not None) else "reply")
        await self._to_frontend(ToClient(identity, self.intake.take_acks(identity), kind),
                                self._enc.encode(msg))

    async def _to_frontend(self, out: ToClient, reply: bytes | None = None) -> None:
        if self.inbox is None:  # a prefill node has no clients
            return
        header = self._enc.encode(out)
        await self.inbox.send_multipart([header] if reply is None else [header, reply])

