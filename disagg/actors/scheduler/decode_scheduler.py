"""The decode node's side of the scheduler: remote prefill (``disagg.actors.scheduler.sides``).

Receives (through the scheduler): ``AttemptEvent`` / ``PeersAlive`` from the messenger.
Sends: ``SendPrefill`` / ``StopPrefill`` / ``ForgetPrefill`` to the messenger.
Owns: the remote-prefill machine (``disagg.remote.decode.DecodeRemote``), which holds every
page reserved for a remote request until its KV landed or no write can reach it any more; the
sequences prefilled remotely; their TTFT milestones. A prompt longer than
``--local-prefill-max-tokens`` waits out of decode scheduling until its KV has landed; then its
last prompt token runs as an ordinary decode step. Short prompts, and every prompt while no
prefiller is alive, are prefilled here in mixed steps. Prompts waiting for pages (the remote
queue) are served whenever pages return to the pool, and end with ``timeout`` if they wait
past ``--queue-timeout``. With prefix caching, a remote prompt's pages are hashed while its
prefill runs elsewhere (``_hash_ahead``), so caching them when its KV lands does not delay its
first token. With KV tiers, a remote prompt's lower-tier pages are brought back into the
device cache before its turn (``PrefixTiers.promote``), so they go as ``skip_pages``.
"""

from __future__ import annotations

import asyncio
import logging
import time

import msgspec

from disagg import trace
from disagg.actors.scheduler.sides import SchedulerPort, SchedulerSide
from disagg.engine.cache import pages_needed
from disagg.engine.prefix_tiers import TieredScheduler
from disagg.engine.scheduling import Batch, Sequence, Status
from disagg.protocol import Error, Finished, Usage
from disagg.protocol.executor import StepPlan, StepResult
from disagg.protocol.inproc import (
    AttemptEvent,
    ForgetPrefill,
    PeersAlive,
    SendPrefill,
    StopPrefill,
    ToScheduler,
    drop_last_id,
)
from disagg.remote.decode import (
    Abort,
    Command,
    DecodeRemote,
    Fail,
    Forget,
    Free,
    Local,
    OnFailure,
    Policy,
    Ready,
    Send,
)
from disagg.remote.transfer_plan import new_generation
from disagg.serving.routing import encoded_prefix_keys

log = logging.getLogger(__name__)

HOLD_FINISH_S = 2.0  # at most this long a finished request's Finished waits for PrefillDone
HASH_SLICE_PAGES = 64  # pages hashed ahead between two turns of the event loop
HASH_AFTER_S = 0.002  # hashing ahead starts this long after the request went to the messenger


class DecodeSide(SchedulerSide):
    def __init__(self, port: SchedulerPort, *, local_prefill_max_tokens: int = 0,
                 on_failure: OnFailure = "error", prefill_timeout_s: float = 60.0,
                 peer_timeout_s: float = 5.0):
        super().__init__(port)
        self.local_prefill_max_tokens = local_prefill_max_tokens
        self.remote = DecodeRemote(
            Policy(on_failure, prefill_timeout_s, peer_timeout_s, port.limits.queue_timeout_s),
            new_generation)
        self.seqs: dict[int, Sequence] = {}  # slot -> sequence, while remote
        self.clock: dict[int, dict[str, float]] = {}  # slot -> TTFT milestones (monotonic s)
        self.sent: dict[int, str] = {}  # slot -> its latest attempt's request id
        # slot -> (sequence, finish reason, deadline): finished before its prefiller's
        # PrefillDone came in; its Finished waits (bounded) for the prefiller's timings and hit
        self.held: dict[int, tuple[Sequence, str, float]] = {}
        self.context: dict[int, bytes] = {}  # slot -> the landed attempt's context row (mtp)
        self._menc = msgspec.msgpack.Encoder()
        self._failed: tuple[int, int] | None = None  # (head slot, pages free) of a failed _pump
        # KV tiers: sequences whose prefix is coming back into the device cache before their
        # remote prefill (disagg.engine.prefix_tiers.PrefixTiers.promote), and those promoted
        self.promoting: dict[int, Sequence] = {}
        self._promoted: set[int] = set()

    async def enqueue(self, seq: Sequence) -> bool:
        """Take ``seq`` for remote prefill when a prefiller is alive and more than
        ``--local-prefill-max-tokens`` of its prompt (all but the last token) is not in this
        node's prefix cache (never when it asks prompt logprobs: prefilled here). It holds no page while it waits in the remote queue: its cached
        leading pages and new ones for the rest are taken together when its turn comes
        (``_reserve``)."""
        if self.remote.peers_alive == 0 or seq.params.prompt_logprobs is not None:
            return False  # prompt logprobs: computed here, where the prompt runs (README)
        sched, ps = self.port.sched, self.port.page_size
        n = seq.num_tokens - 1  # the prefiller computes all but the last token (of a resumed
        # request: its prompt and the tokens streamed before)
        hashes = sched.prefix_hashes(seq) if sched.prefix_caching else []
        held = sched.held_run(hashes)  # in any KV tier: a host-tier prefix is reloaded here
        if n - held * ps <= self.local_prefill_max_tokens:
            return False  # the scheduler takes the same cached pages and computes the rest
        if (isinstance(sched, TieredScheduler) and seq.slot not in self._promoted
                and sched.tiers.promote(sched, seq, hashes)):
            self._promoted.add(seq.slot)  # once: its lower-tier pages come to the device
            self.promoting[seq.slot] = seq  # cache first; then it is enqueued again
            return True
        seq.status = Status.REMOTE
        self.seqs[seq.slot] = seq
        if seq.trace is not None:  # waits for pages, then a prefiller's KV
            seq.trace.enter("remote_prefill", tokens=n)
        self.clock[seq.slot] = {"admit": time.monotonic()}
        self.remote.admit(seq.slot, n, pages_needed(seq.num_tokens, ps), time.monotonic())
        await self._pump()
        if sched.prefix_caching:
            self.port.spawn(self._hash_ahead(seq))
        return True

    async def _hash_ahead(self, seq: Sequence) -> None:
        """Hash the pages of ``seq``'s prompt while it is prefilled elsewhere, a slice at a
        time between the loop's other work: the scheduler caches them when its KV has landed,
        on its first token's path (32k tokens: 2048 pages, ~3 ms of hashing). It starts once
        the request is on its way: its slices would otherwise sit between every callback of the
        messenger's wake-up (0.75 ms more to send a 32k prompt out, on the 2-core box)."""
        await asyncio.sleep(HASH_AFTER_S)
        pages = seq.num_tokens // self.port.page_size
        while seq.status is Status.REMOTE and len(seq.known_hashes) < pages:
            self.port.sched.page_hashes(seq, min(pages, len(seq.known_hashes) + HASH_SLICE_PAGES))
            await asyncio.sleep(0)

    def in_flight(self) -> int:
        return self.remote.waiting_for_kv() + len(self.promoting)

    async def pages_changed(self) -> None:
        if isinstance(self.port.sched, TieredScheduler):  # prefixes back in the device cache
            for seq in self.port.sched.tiers.take_promoted():
                if self.promoting.pop(seq.slot, None) is not None and not await self.enqueue(
                        seq):
                    self.port.sched.add(seq)
        await self._pump()

    def next_deadline(self) -> float | None:
        held = min((d for _, _, d in self.held.values()), default=None)
        own = self.remote.next_deadline()
        return held if own is None else own if held is None else min(own, held)

    async def expire(self, now: float) -> None:
        await self._carry_out(self.remote.expire(now))
        for slot in [s for s, (_, _, d) in self.held.items() if d <= now]:
            await self._finish_held(slot)

    async def hold_finish(self, seq: Sequence, reason: str) -> bool:
        """Hold the Finished of a remotely prefilled request whose prefiller's PrefillDone
        has not arrived yet (it can trail the KV): its timings and prefix-cache hit come with
        it. Sent when it arrives, when the attempt ends otherwise, or after HOLD_FINISH_S."""
        clock = self.clock.get(seq.slot)
        if clock is None or "sent" not in clock or "prefill_queue" in clock:
            return False
        self.held[seq.slot] = (seq, reason, time.monotonic() + HOLD_FINISH_S)
        return True

    async def _finish_held(self, slot: int) -> None:
        held = self.held.pop(slot, None)
        if held is None:
            return
        seq, reason, _ = held
        usage = Usage(len(seq.prompt_ids), len(seq.output_ids), self.cached_tokens(seq))
        await self.port.end(seq, Finished(seq.request_id, reason, usage,
                                          timings=self.timings_of(seq)))

    async def _pump(self) -> None:
        """Reserve pages for queued remote prefills, oldest first, while the pool allows. A
        head that could not get its pages is tried again only once pages have returned (this
        runs after every step: a long prompt's lookup need not run on each)."""
        while (head := self.remote.head()) is not None:
            slot, _ = head
            if self._failed == (slot, self.port.pool.num_free):
                return
            pages = self._reserve(self.seqs[slot])
            if pages is None:
                self._failed = (slot, self.port.pool.num_free)
                return
            self._failed = None
            await self._carry_out(self.remote.reserved(slot, pages, time.monotonic()))

    def _reserve(self, seq: Sequence) -> list[int] | None:
        """All or nothing: the cached leading pages of ``seq``'s prompt (never written by
        the prefiller: ``skip_pages``) and new pages for the rest, or None, holding nothing.
        A queued request that held its cached pages while it waited could, with others like
        it, hold the whole pool: nothing would run and nothing could be freed."""
        sched, pool = self.port.sched, self.port.pool
        if sched.prefix_caching and not seq.block_table:  # a fenced retry still holds its own
            hashes = sched.prefix_hashes(seq)
            seq.block_table = pool.match(hashes)
            seq.hashes = hashes[:len(seq.block_table)]
        pages = pool.allocate(pages_needed(seq.num_tokens, self.port.page_size)  # after its
                              - len(seq.block_table),  # cached ones (--dp: on their rank)
                              seq.block_table[-1] if seq.block_table else None)
        if pages is None:
            sched.free_pages(seq.block_table)  # still cached: a later turn matches them again
            seq.block_table, seq.hashes = [], []
            return None
        if isinstance(sched, TieredScheduler) and not seq.matched:
            sched.tiers.count_held(seq, len(seq.block_table), self.port.page_size)
        sched.count_lookup(seq, len(seq.block_table) * self.port.page_size)
        return pages

    async def _carry_out(self, commands: list[Command]) -> None:
        """Do what the remote-prefill machine decided, in its order."""
        for c in commands:
            match c:
                case Send():
                    seq = self.seqs[c.slot]
                    self.clock.get(c.slot, {}).update(sent=time.monotonic(),
                                                      sent_unix=time.time())
                    if seq.trace is not None:  # this attempt's marks become its events
                        trace.unbind(self.sent.get(c.slot))
                        trace.bind(c.request_id, seq.trace.phase)
                    trace.mark("d.send", c.request_id, value=len(seq.prompt_ids))
                    self.sent[c.slot] = c.request_id
                    await self._to_messenger(self._send_prefill(seq, c))
                    trace.mark("d.sent_out", c.request_id)
                case Abort():
                    await self._to_messenger(StopPrefill(c.request_id, c.blame))
                case Forget():
                    await self._to_messenger(ForgetPrefill(c.request_id))
                case Free():
                    self.port.sched.free_pages(list(c.pages))
                case Ready():
                    seq = self.seqs.pop(c.slot)
                    self.clock.get(c.slot, {})["kv"] = time.monotonic()
                    trace.mark("d.ready", self.sent.get(c.slot))
                    if seq.trace is not None:
                        trace.event(seq.trace.phase, "kv_landed")
                        trace.unbind(self.sent.get(c.slot))
                        seq.trace.enter("first_decode_step")
                    self.port.sched.kv_arrived(seq, seq.block_table + list(c.pages),
                                               self.context.pop(c.slot, b""))
                case Local():
                    seq = self.seqs.pop(c.slot)
                    self.clock.pop(c.slot, None)
                    log.warning("prefilling %s locally: %s", seq.request_id, c.why)
                    if seq.trace is not None:
                        trace.unbind(self.sent.get(c.slot))
                        seq.trace.enter("prefill", why=c.why)
                    seq.num_computed = len(seq.block_table) * self.port.page_size  # cached
                    self.port.sched.add(seq)
                case Fail():
                    seq = self.seqs.pop(c.slot)
                    self.clock.pop(c.slot, None)
                    await self.port.end(seq, Error(c.code, c.message, seq.request_id))

    async def handle_messenger(self, msg: ToScheduler) -> None:
        now = time.monotonic()
        match msg:
            case AttemptEvent(request_id=rid, kind=kind) as ev:
                trace.mark(f"d.event_{kind}", rid)
                slot = int(rid.split(".")[0])
                if ev.timings is not None:
                    self._prefiller_timings(rid, ev.timings, ev.cached_tokens)
                if ev.context and self.sent.get(slot) == rid:
                    self.context[slot] = ev.context  # for its Ready
                if kind == "failed" or kind == "peer_dead":
                    log.warning("remote prefill %s: %s %s", rid, ev.code or kind, ev.message)
                await self._carry_out(self.remote.event(rid, kind, now, ev.code, ev.message))
                if kind != "landed" and kind != "progress" and self.sent.get(slot) == rid:
                    await self._finish_held(slot)  # nothing more of its attempt will come
            case PeersAlive(count=n):
                await self._carry_out(self.remote.set_peers_alive(n))

    def _prefiller_timings(self, rid: str, timings: tuple[float, float, float, float],
                           cached_tokens: int) -> None:
        """The prefiller's queue and compute time and its prefix-cache hit, from the
        PrefillDone of the attempt that delivered the KV (before or after the KV itself)."""
        slot = int(rid.split(".")[0])
        clock = self.clock.get(slot)
        if clock is not None and self.sent.get(slot) == rid:
            clock.update(prefill_queue=timings[0], prefill_compute=timings[1],
                         prefill_tail=timings[2], accepted_unix=timings[3],
                         prefill_cached=cached_tokens)

    def cached_tokens(self, seq: Sequence) -> int:
        """Prompt tokens not computed for ``seq``: held in this node's cache or taken from
        the prefiller's, whichever covers more."""
        clock = self.clock.get(seq.slot, {})
        return max(seq.cached_tokens, min(int(clock.get("prefill_cached", 0)),
                                          len(seq.prompt_ids)))

    def emitting(self, seq: Sequence) -> None:
        clock = self.clock.get(seq.slot)
        if clock is not None and "first" not in clock:
            clock["first"] = time.monotonic()
            trace.mark("d.first", self.sent.get(seq.slot))

    def timings_of(self, seq: Sequence) -> dict[str, float] | None:
        """Where the time to first token went (``Finished.timings``, ms). ``exposed_transfer``
        is everything but compute: the node's TTFT less the prefiller's compute (to the last
        layer of the prompt done on its device) and the decoder's first step (launched ->
        token out), never clipped; its parts: ``decode_queue``, ``request_trip`` (sent ->
        accepted by the prefiller; with one clock for both), ``prefill_queue``,
        ``transfer_tail`` (last layer -> last write completed at the prefiller),
        ``completion_signal`` (-> the KV seen landed here; with ``request_trip``'s clock,
        else the two together as ``trip_and_signal``) and ``wake_up`` (-> the step that
        computes its first token launched)."""
        c = self.clock.get(seq.slot)
        if c is None or not {"admit", "sent", "kv", "first"} <= c.keys():
            return None
        launch = c.get("launch", c["kv"])
        out = {"decode_queue": c["sent"] - c["admit"], "kv_wait": c["kv"] - c["sent"],
               "wake_up": launch - c["kv"], "first_step": c["first"] - launch}
        if "prefill_queue" in c:  # the prefiller's PrefillDone may still be on its way
            compute = c["prefill_compute"]
            out.update(prefill_queue=c["prefill_queue"], prefill_compute=compute,
                       transfer_tail=c["prefill_tail"],
                       exposed_transfer=c["first"] - c["admit"] - compute - out["first_step"])
            both = out["kv_wait"] - c["prefill_queue"] - compute - c["prefill_tail"]
            if c.get("accepted_unix"):
                trip = c["accepted_unix"] - c["sent_unix"]
                out.update(request_trip=trip, completion_signal=both - trip)
            else:
                out["trip_and_signal"] = both
        return {k: round(1000 * v, 3) for k, v in out.items()}

    async def release(self, seq: Sequence) -> bool:
        self.held.pop(seq.slot, None)
        self.promoting.pop(seq.slot, None)  # its copy lands in the cache alone (remove)
        self._promoted.discard(seq.slot)
        self.context.pop(seq.slot, None)
        self.clock.pop(seq.slot, None)
        trace.unbind(self.sent.pop(seq.slot, None))
        if self.seqs.pop(seq.slot, None) is None:
            return False
        seq.status = Status.FINISHED  # still remote: the machine holds its pages
        self.port.sched.free_pages(seq.block_table)  # its cached pages: never written
        seq.block_table = []
        await self._carry_out(self.remote.cancel(seq.slot, time.monotonic()))
        return True

    def _send_prefill(self, seq: Sequence, c: Send) -> SendPrefill:
        """The request for the KV of ``seq``'s prompt but its last token. Its ids go as the
        client's frame carried them, less the last id (no id converted); a prompt tokenized
        here is encoded, its last token off the list meanwhile (slicing would copy, and later
        free, a 32k-element list). The routing keys come from those bytes and its cache salt,
        which the prefiller's page hashes take too."""
        ids, held = seq.prompt_ids, len(seq.block_table)
        if seq.output_ids:  # resumed (protocol.Resume): the prompt and what was streamed
            ids = seq.tokens(0, seq.num_tokens)
        n = len(ids) - 1
        prompt = None if seq.prompt_msgpack is None or seq.output_ids else drop_last_id(
            seq.prompt_msgpack, len(ids), ids[-1])
        if prompt is None:
            last = ids.pop()
            try:
                prompt = self._menc.encode(ids)
            finally:
                ids.append(last)
        return SendPrefill(c.request_id, c.key, memoryview(prompt), n,
                           encoded_prefix_keys(prompt, seq.cache_salt),
                           list(c.pages[: pages_needed(n, self.port.page_size) - held]),
                           c.cap_s, held, seq.cache_salt,
                           None if seq.trace is None else trace.traceparent(seq.trace.phase))

    async def before_step(self, plan: StepPlan, batch: Batch) -> None:
        now = time.monotonic()
        for c in batch.chunks:  # the step that computes a landed prompt's first token
            clock = self.clock.get(c.seq.slot)
            if clock is not None and "kv" in clock and "launch" not in clock:
                clock["launch"] = now
                trace.mark("link", self.sent.get(c.seq.slot), "=d", plan.step_id)

    async def after_step(self, plan: StepPlan, batch: Batch, result: StepResult,
                         hidden: bytes | None) -> None:
        trace.mark("d.step_back", "d", plan.step_id)
        await self._pump()

    def pages_fenced(self) -> int:
        return self.remote.pages_fenced()

    def waiting_for_kv(self) -> int:
        return self.remote.waiting_for_kv()

    def transfers_in_flight(self) -> int:
        return self.remote.in_flight()

    async def _to_messenger(self, msg: object) -> None:
        await self.port.to_messenger([self._menc.encode(msg)])
