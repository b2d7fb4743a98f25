"""The fabric engine's progress thread (``ProgressThread``, owned by ``FabricEngine``): it
owns every libfabric call after ``start()``, posts queued writes, drains the completion queue,
counts immediate data and checks deadlines. Native events enter asyncio in exactly one place,
``_emit`` (``call_soon_threadsafe``). When idle it blocks on the CQ's wait fd (after
``fi_trywait``) or, where the provider has none (shm), naps with a growing back-off on its wake
eventfd; it never spins while nothing is in flight."""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import select
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from disagg.fabric import lib as fl
from disagg.fabric.expectations import ExpectationTable, NotPosted, TransferTimeout
from disagg.fabric.regions import EngineClosed, settle_futures
from disagg.fabric.slots import Batch, CQReader, WriteSlots

log = logging.getLogger("disagg.fabric")

T = TypeVar("T")


class ProgressThread:
    """One engine's progress thread and what only it touches: its wake eventfd, the inbox
    (write batches and calls to run on the thread), the write slots and the batches in flight.
    The engine hands it the libfabric objects it drives, the expectation table arrivals count
    in and the counters it adds to; the engine talks to it through ``start``, ``stop``,
    ``post``, ``call``, ``wake`` and ``in_flight``."""

    def __init__(self, fabric: fl.Fabric, cq: fl.CompletionQueue, av: fl.AddressVector,
                 ep: fl.Endpoint, expectations: ExpectationTable, capacity: int,
                 idle_sleep_max: float, stats: collections.Counter[str], label: str) -> None:
        """``capacity``: writes posted at once; ``label``: the provider, for logs."""
        self.fabric = fabric
        self.cq = cq
        self.av = av
        self.ep = ep
        self.idle_sleep_max = idle_sleep_max
        self.stats = stats
        self._label = label
        self._expectations = expectations
        self._slots = WriteSlots(capacity)
        self._cqr = CQReader()
        self._inbox: collections.deque[Batch | Callable[[], None]] = collections.deque()
        self._sending: collections.deque[Batch] = collections.deque()
        self._active: set[Batch] = set()
        self._wake_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._running = False

    # ---- what the engine calls -------------------------------------------------------------

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        """The event loop futures resolve on, once started."""
        return self._loop

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._thread is None:
            self._loop = loop
            self._running = True
            self._thread = threading.Thread(target=self._run, name="fabric-progress",
                                            daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """End the loop (failing whatever is pending) and join the thread."""
        if self._thread is not None:
            self._running = False
            self.wake()
            self._thread.join()

    def close(self) -> None:
        """Release the wake fd (after ``stop``)."""
        os.close(self._wake_fd)

    def post(self, batch: Batch) -> None:
        """Queue a write batch (any thread)."""
        self._inbox.append(batch)
        self.wake()

    def call(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the progress thread (libfabric objects are used from one thread) and
        return its result; inline before ``start`` or on the thread itself."""
        if self._thread is None or threading.current_thread() is self._thread:
            return fn()
        done = threading.Event()
        box: list[tuple[bool, Any]] = []

        def job() -> None:
            try:
                box.append((True, fn()))
            except BaseException as e:  # noqa: BLE001 - handed back to the caller
                box.append((False, e))
            done.set()

        self._inbox.append(job)
        self.wake()
        done.wait()
        ok, val = box[0]
        if not ok:
            raise val
        return val  # type: ignore[no-any-return]

    def in_flight(self) -> int:
        """Write batches it holds (posting, queued or awaiting completion)."""
        return len(self._active)

    def wake(self) -> None:
        try:
            os.eventfd_write(self._wake_fd, 1)
        except (BlockingIOError, OSError):
            pass

    def _emit(self, events: list[tuple[asyncio.Future[None], BaseException | None]]) -> None:
        """The one door from the progress thread into asyncio."""
        if events and self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(settle_futures, events)

    def _run(self) -> None:
        """Loop: run inbox jobs, post writes, drain the CQ, expire deadlines, emit, then wait."""
        events: list[tuple[asyncio.Future[None], BaseException | None]] = []
        idle_sleep = 0.0
        poller = select.poll()
        poller.register(self._wake_fd, select.POLLIN)
        if self.cq.fd >= 0:
            poller.register(self.cq.fd, select.POLLIN)
        next_deadline_check = 0.0
        try:
            while self._running:
                work = self._take_inbox()
                work |= self._post(events)
                work |= self._drain(events)
                now = time.monotonic()
                if now >= next_deadline_check:
                    self._expire(now, events)
                    next_deadline_check = now + 0.05
                if events:
                    self._emit(events)
                    events = []
                if work:
                    idle_sleep = 0.0
                    continue
                self._idle(poller, idle_sleep)
                idle_sleep = min(max(idle_sleep * 2, 2e-5), self.idle_sleep_max)
        except BaseException as e:  # pragma: no cover - a bug; fail everything loudly
            log.exception("fabric progress thread died")
            events.extend(self._fail_all(fl.FabricError("progress thread died", -1, repr(e))))
        finally:
            events.extend(self._fail_all(EngineClosed("fabric engine closed")))
            self._emit(events)

    def _idle(self, poller: select.poll, sleep: float) -> None:
        # Where writes are queued behind EAGAIN the provider needs progress calls, not sleep.
        if self._sending and self._slots.free:
            os.sched_yield()
            return
        if self.cq.fd >= 0:
            if fl.lib.dg_trywait_cq(self.fabric.ptr, self.cq.ptr) != 0:
                return  # events pending: read the CQ again
            # Some providers signal the fd only for new completions, not for send progress
            # they still owe: with writes in flight, wake up every millisecond regardless.
            ready = poller.poll(1 if self._active else 200)
        else:
            if self._active or self._expectations.urgent():
                sleep = min(sleep, 5e-5)  # work is expected soon: keep latency low
            # no CQ fd (shm): nap, then poll the CQ; a wake (a caller in _call, a new batch)
            # ends the nap (a plain sleep held a per-attempt window 1.6 ms instead of 0.2)
            r, _, _ = select.select([self._wake_fd], [], [], sleep)
            ready = [(fd, select.POLLIN) for fd in r]
        for fd, _ in ready:
            if fd == self._wake_fd:
                try:
                    os.eventfd_read(self._wake_fd)
                except BlockingIOError:
                    pass

    def _take_inbox(self) -> bool:
        work = False
        while self._inbox:
            item = self._inbox.popleft()
            work = True
            if isinstance(item, Batch):
                self._sending.append(item)
                self._active.add(item)
            else:
                item()
        return work

    def _post(self, events: list[Any]) -> bool:
        work = False
        lib = fl.lib
        ffi = fl.ffi
        free = self._slots.free
        while self._sending and free:
            b = self._sending[0]
            if not b.finished and b.deadline <= time.monotonic():  # never post past it
                self._finish(b, (NotPosted if b.posted == 0 else TransferTimeout)(
                    f"write batch (imm {b.imm:#x}): {b.src.shape[0] - b.posted} writes still "
                    f"queued at the deadline, not posted"), events)
            if b.finished:
                self._sending.popleft()
                continue
            try:
                peer = self.av.insert(b.peer)
            except fl.FabricError as e:
                self._finish(b, e, events)
                self._sending.popleft()
                continue
            k = min(len(free), b.src.shape[0] - b.posted)
            slots = self._slots.take(k)
            p = b.posted
            rc = lib.dg_post_writes(
                self.ep.ptr, k,
                ffi.cast("uint64_t *", b.src.ctypes.data + 8 * p),
                ffi.cast("uint64_t *", b.lens.ctypes.data + 8 * p),
                b.desc, peer,
                ffi.cast("uint64_t *", b.dst.ctypes.data + 8 * p),
                b.key, b.imm, self._slots.ctx,
                ffi.cast("uint32_t *", slots.ctypes.data),
            )
            if rc < 0:
                self._finish(b, fl.FabricError("fi_writedata", rc), events)
                self._sending.popleft()
                continue
            if rc:
                work = True
                self._slots.posted(slots, rc, b)
                b.posted += rc
                self.stats["posted"] += rc
            if b.posted == b.src.shape[0]:
                self._sending.popleft()
            elif rc < k:
                self.stats["eagain"] += 1
                break  # provider queue full: progress the CQ first
        return work

    def _drain(self, events: list[Any]) -> bool:
        work = False
        for _ in range(64):
            n = self._cqr.read(self.cq, self._slots)
            if n == -fl.lib.FI_EAVAIL:
                self._read_error(events)
                work = True
                continue
            if n < 0:
                raise fl.FabricError("fi_cq_read", n)
            if n == 0:
                break
            work = True
            local = self._cqr.local(n)
            if local:
                self._complete_slots(local, events)
            if len(local) != n:
                self._arrive(self._cqr.immediates(n), events)
            if n < self._cqr.n:
                break
        return work

    def _complete_slots(self, slots: list[int], events: list[Any]) -> None:
        for s in slots:
            b = self._slots.release(s)
            if b is None:
                continue
            b.remaining -= 1
            if b.remaining == 0 and not b.finished:
                self._finish(b, None, events)
        self.stats["completed"] += len(slots)

    def _arrive(self, imms: list[int], events: list[Any]) -> None:
        self.stats["arrived"] += len(imms)
        if imms:
            self._expectations.arrive(imms, events)
            report = self._expectations.junk_report(time.monotonic())
            if report:
                log.warning("fabric (%s): %s", self._label, report)

    def _read_error(self, events: list[Any]) -> None:
        ctx, err, flags, text = self.cq.readerr()
        self.stats["cq_errors"] += 1
        s = self._slots.slot_of(ctx)
        if s is not None and not flags & int(fl.lib.FI_REMOTE_CQ_DATA):
            b = self._slots.batch[s]
            if b is not None and not b.finished:  # first: its last write failing fails it
                self._finish(b, fl.FabricError("write completion", -err, text), events)
            self._complete_slots([s], events)
        else:
            log.warning("fabric: target-side completion error %d: %s", err, text)

    def _finish(self, b: Batch, exc: BaseException | None, events: list[Any]) -> None:
        b.finished = True
        self._active.discard(b)
        events.append((b.future, exc))

    def _expire(self, now: float, events: list[Any]) -> None:
        for b in [b for b in self._active if b.deadline <= now]:
            self.stats["timeouts"] += 1
            self._finish(b, TransferTimeout(
                f"write batch (imm {b.imm:#x}): {b.remaining} of {b.src.shape[0]} writes "
                f"unfinished at the deadline (peer gone?)"), events)
        self._expectations.expire(now, events)

    def _fail_all(self, exc: BaseException) -> list[Any]:
        out: list[Any] = [(b.future, exc) for b in self._active]
        out += [(b.future, exc) for b in self._inbox if isinstance(b, Batch)]
        self._active.clear()
        return out + self._expectations.fail_all(exc)
