"""Scheduler actor of a decode node.

Receives: client requests from the frontend; ``KVReady`` / ``RemoteFailed`` /
``RemoteReleased`` / ``PeersAlive`` / ``MessengerStats`` from the messenger.
Sends: tokens to clients; ``NeedPrefill`` / ``CancelRemote`` to the messenger.
Owns: the page pool. A prompt longer than ``--local-prefill-max-tokens`` gets un-evictable
pages and waits out of decode scheduling until its KV has landed (SEED.md 8); then its last
prompt token runs as an ordinary decode step (SEED.md 26). Short prompts, and every prompt
while no prefiller is alive, are prefilled here in mixed steps. Prompts waiting for pages (the
remote queue) are served whenever pages return to the pool, and end with ``timeout`` if they
wait past ``--queue-timeout``.
"""

from __future__ import annotations

import collections
import logging
import time

import msgspec

from disagg.actors.scheduler import SchedulerActor
from disagg.cache import pages_needed
from disagg.protocol import (
    CancelRemote,
    Error,
    KVReady,
    NeedPrefill,
    PeersAlive,
    PrefillTimings,
    RemoteFailed,
    RemoteReleased,
    StepPlan,
    StepResult,
    ToScheduler,
)
from disagg.scheduling import Batch, Sequence, SeqUpdate, Status

log = logging.getLogger(__name__)

MAX_REMOTE_RETRIES = 1  # --on-prefill-failure retry: new attempts after a fenced failure


class DecodeScheduler(SchedulerActor):
    def __init__(self, *args, local_prefill_max_tokens: int = 0, on_failure: str = "error",
                 **kwargs):  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        self.local_prefill_max_tokens = local_prefill_max_tokens
        self.on_failure = on_failure  # error | retry | local (retries happen in the messenger)
        self.peers_alive = 0
        self.remote_queue: collections.deque[Sequence] = collections.deque()  # no pages yet
        # (slot, fence) -> pages a write may still reach; fence 0 = cancelled by this side
        self.quarantine: dict[tuple[int, int], list[int]] = {}
        self.seqs: dict[int, Sequence] = {}  # slot -> sequence, while remote
        self.clock: dict[int, dict[str, float]] = {}  # slot -> TTFT milestones (monotonic s)
        self.retries: dict[int, int] = {}  # slot -> remote attempts retried with new pages
        self._menc = msgspec.msgpack.Encoder()

    def wants_remote(self, seq: Sequence) -> bool:
        return self.peers_alive > 0 and len(seq.prompt_ids) - 1 > self.local_prefill_max_tokens

    async def enqueue(self, seq: Sequence) -> None:
        if not self.wants_remote(seq):
            self.sched.add(seq)
            return
        self.seqs[seq.slot] = seq
        self.clock[seq.slot] = {"admit": time.monotonic()}
        self.remote_queue.append(seq)
        await self._pump()

    def in_flight(self) -> int:
        return super().in_flight() + len(self.sched.remote) + len(self.remote_queue)

    async def pages_changed(self) -> None:
        if self.remote_queue:
            await self._pump()

    def next_deadline(self) -> float | None:
        heads = [d for d in (super().next_deadline(), self._remote_deadline()) if d is not None]
        return min(heads) if heads else None

    def _remote_deadline(self) -> float | None:
        if not self.remote_queue:
            return None
        key = self.by_slot.get(self.remote_queue[0].slot)
        live = self.live.get(key) if key is not None else None
        return None if live is None else live.admitted_at + self.limits.queue_timeout_s

    async def _expire(self, now: float) -> None:
        await super()._expire(now)
        while self.remote_queue:  # in admission order (a retry goes first: its clock is older)
            deadline = self._remote_deadline()
            if deadline is None or deadline > now:
                break
            await self._timeout(self.remote_queue[0])

    async def _pump(self) -> None:
        """Reserve pages for queued remote prefills, oldest first, while the pool allows."""
        while self.remote_queue and self.sched.reserve_remote(self.remote_queue[0]):
            seq = self.remote_queue.popleft()
            self.clock.get(seq.slot, {})["sent"] = time.monotonic()
            n = len(seq.prompt_ids) - 1
            await self._to_messenger(NeedPrefill(seq.slot, seq.prompt_ids[:-1],
                                                 seq.block_table[: pages_needed(n, self.page_size)]))

    async def handle_messenger(self, msg: ToScheduler) -> None:
        match msg:
            case KVReady(slot=slot):
                seq = self.seqs.pop(slot, None)
                if seq is not None and seq.status is Status.REMOTE:
                    self.clock.get(slot, {})["kv"] = time.monotonic()
                    self.sched.kv_arrived(seq)
            case RemoteFailed(slot=slot, code=code, message=message, pages_free=free,
                              fence=fence):
                seq = self.seqs.pop(slot, None)
                if seq is None or seq.status is not Status.REMOTE:
                    return
                pages = self.sched.detach(seq)
                if free:  # no write can land any more
                    self.sched.free_pages(pages)
                else:  # fenced until the messenger's RemoteReleased
                    self.quarantine[(slot, fence)] = pages
                self.clock.pop(slot, None)
                if self.on_failure == "local" or code == "no_prefiller":
                    log.warning("prefilling %s locally: %s", seq.request_id, message)
                    seq.status = Status.WAITING
                    self.sched.add(seq)
                elif (self.on_failure == "retry" and self.peers_alive > 0
                      and self.retries.get(slot, 0) < MAX_REMOTE_RETRIES):
                    # the old pages may still be written: a new attempt gets new pages
                    log.warning("retrying the prefill of %s: %s", seq.request_id, message)
                    self.retries[slot] = self.retries.get(slot, 0) + 1
                    seq.status = Status.WAITING
                    self.seqs[slot] = seq
                    self.remote_queue.appendleft(seq)
                else:
                    await self._end(seq, Error("timeout" if code == "timeout" else
                                               "prefill_failed", f"{code}: {message}",
                                               seq.request_id))
                await self._pump()
            case PrefillTimings(slot=slot) as t:
                clock = self.clock.get(slot)
                if clock is not None:
                    clock.update(prefill_queue=t.queue_s, prefill_compute=t.compute_s)
            case RemoteReleased(slot=slot, fence=fence):
                self.sched.free_pages(self.quarantine.pop((slot, fence), []))
                await self._pump()
            case PeersAlive(count=n):
                self.peers_alive = n
                if n == 0:  # nobody to send queued prompts to: prefill them here
                    while self.remote_queue:
                        seq = self.remote_queue.popleft()
                        self.seqs.pop(seq.slot, None)
                        self.sched.add(seq)
            case _:
                await super().handle_messenger(msg)

    async def _emit(self, update: SeqUpdate) -> None:
        clock = self.clock.get(update.seq.slot)
        if clock is not None and "first" not in clock:
            clock["first"] = time.monotonic()
        await super()._emit(update)

    def timings_of(self, seq: Sequence) -> dict[str, float] | None:
        c = self.clock.get(seq.slot)
        if c is None or not {"admit", "sent", "kv", "first"} <= c.keys():
            return None
        out = {"decode_queue": c["sent"] - c["admit"], "kv_wait": c["kv"] - c["sent"],
               "first_step": c["first"] - c["kv"]}
        if "prefill_queue" in c:  # the prefiller's PrefillDone may still be on its way
            out.update(prefill_queue=c["prefill_queue"], prefill_compute=c["prefill_compute"],
                       exposed_transfer=max(0.0, out["kv_wait"] - c["prefill_queue"]
                                            - c["prefill_compute"]))
        return {k: round(1000 * v, 3) for k, v in out.items()}

    async def release(self, seq: Sequence) -> None:
        self.clock.pop(seq.slot, None)
        self.retries.pop(seq.slot, None)
        if seq in self.remote_queue:
            self.remote_queue.remove(seq)
            self.seqs.pop(seq.slot, None)
        if seq.status is Status.REMOTE:
            if seq.block_table:  # a write may still land: quarantine until released
                self.quarantine[(seq.slot, 0)] = self.sched.detach(seq)
                self.seqs.pop(seq.slot, None)
                await self._to_messenger(CancelRemote(seq.slot))
            else:
                self.sched.detach(seq)
            return
        await super().release(seq)

    async def after_step(self, plan: StepPlan, batch: Batch, result: StepResult,
                         hidden: bytes | None) -> None:
        if self.remote_queue:
            await self._pump()

    def pages_fenced(self) -> int:
        return sum(len(p) for p in self.quarantine.values())

    def waiting_for_kv(self) -> int:
        return len(self.sched.remote) + len(self.remote_queue)

    async def _to_messenger(self, msg: object) -> None:
        assert self.mbox is not None
        await self.mbox.send(self._menc.encode(msg))
