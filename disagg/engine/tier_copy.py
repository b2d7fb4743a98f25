"""The bytes of the KV tiers: a host pool and the movers that copy pages in and out of it.

The host pool is slot-major, per rank: ``[num_slots, num_layers, page_bytes]`` bytes, so a
slot (a page of every layer) is one contiguous run and moves in one copy however scattered
the slots are (measured on an H200: per layer and run of adjacent pages and slots, 256
scattered pages moved at 4-5 GB/s; slot by slot through a device staging buffer at 42-44
GB/s). The fabric ships a slot's layer ``l`` from ``(slot * num_layers + l) * page_bytes``
(``host_layout``). It is pinned where CUDA is (``pin_memory``), plain memory on the CPU.

Movers (``disagg.engine.kv_tiers.Mover``): ``SyncMover`` copies when a copy is submitted (the
in-process engine on the CPU); ``ThreadMover`` copies on one worker thread, so the event loop
never waits for a copy: on the CPU a plain gather/scatter; on CUDA on a side stream of this
process, ``STAGE_PAGES`` pages at a time through a device staging buffer (out: one gather
of the pages on the device, one copy per run of adjacent slots to pinned memory; in: the
reverse, then one scatter into the pages), the thread waiting for the stream, never the loop.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

from disagg.config import env, memory_available
from disagg.engine.kv_disk import DiskError, DiskStore, identity
from disagg.engine.kv_tiers import Copy, KVTiers
from disagg.engine.tier_reload import LayeredReload, copy_layers, slot_runs

log = logging.getLogger(__name__)

WAIT_S = 30.0  # the longest an eviction waits for its page's copy out
SLOW_COPY_S = 0.05  # a copy slower than this is logged
STAGE_PAGES = 64  # CUDA: pages staged on the device at once (64 x 2.25 MiB for an 8B model)


def page_views(kv: Sequence[torch.Tensor], num_layers: int, num_pages: int,
               page_bytes: int) -> list[torch.Tensor]:
    """Each rank's KV memory as ``[num_layers, num_pages, page_bytes]`` bytes (the model's
    region; a speculative region after it is not a tier's)."""
    out = []
    for t in kv:
        raw = t.reshape(-1).view(torch.uint8) if t.dtype != torch.uint8 else t.reshape(-1)
        out.append(raw[:num_layers * num_pages * page_bytes].view(num_layers, num_pages,
                                                                  page_bytes))
    return out


def pin_host(t: torch.Tensor) -> None:
    """Page-lock ``t``'s memory for CUDA (``cudaHostRegister``), exactly its size: torch's
    ``pin_memory=True`` allocator rounds every allocation up to a power of two (a 40 GiB
    pool would pin 64 GiB). RuntimeError if CUDA refuses."""
    err = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0)
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister of {t.numel() * t.element_size()} bytes "
                           f"failed (cudaError {int(err)})")


def _unpin_host(ptrs: list[int]) -> None:
    for ptr in ptrs:
        torch.cuda.cudart().cudaHostUnregister(ptr)


class HostPool:
    """``num_slots`` host slots of one page (every layer) per rank; with ``pin``, page-locked
    for CUDA (``pin_host``) until the pool is collected."""

    def __init__(self, ranks: int, num_layers: int, num_slots: int, page_bytes: int,
                 pin: bool):
        self.num_slots = num_slots
        self.tensors = [torch.empty((num_slots, num_layers, page_bytes), dtype=torch.uint8)
                        for _ in range(ranks)]
        self.pinned = pin
        if pin:
            done: list[int] = []
            try:
                for t in self.tensors:
                    pin_host(t)
                    done.append(t.data_ptr())
            except RuntimeError:
                _unpin_host(done)
                raise
            # unregistered when the pool goes, before its tensors can be freed (it holds them)
            weakref.finalize(self, _unpin_host, done)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() for t in self.tensors)

    @staticmethod
    def slots_for(budget_mb: int, ranks: int, num_layers: int, page_bytes: int) -> int:
        return (budget_mb << 20) // max(1, ranks * num_layers * page_bytes)

    @classmethod
    def create(cls, budget_mb: int, ranks: int, num_layers: int, page_bytes: int,
               pin: bool, flag: str = "--kv-host-cache-mb") -> HostPool:
        """A pool of ``budget_mb`` MiB (whole slots); refuses a size this machine cannot give,
        naming both numbers."""
        avail = memory_available()
        if budget_mb << 20 > avail:
            raise ValueError(f"{flag} {budget_mb} MiB is more than this machine can "
                             f"{'pin' if pin else 'give'} ({avail >> 20} MiB available)")
        slots = cls.slots_for(budget_mb, ranks, num_layers, page_bytes)
        if slots < 1:
            raise ValueError(f"{flag} {budget_mb} MiB holds no page "
                             f"({ranks * num_layers * page_bytes} bytes each)")
        try:
            return cls(ranks, num_layers, slots, page_bytes, pin)
        except RuntimeError as e:  # cudaHostRegister refused it
            raise ValueError(f"{flag} {budget_mb} MiB could not be pinned: {e}") from e


def disk_copy(copy: Copy, host: list[torch.Tensor], store: DiskStore | None) -> bool:
    """The disk side of ``copy``: a spill's files written (the dropped ones removed first);
    an in-copy's fills read into their host slots. False: a write failed (the disk is full:
    ``DiskStore.write`` said so) or a file failed its check (``DiskError``: removed)."""
    if store is None:
        return copy.kind != "spill" and not any(copy.hashes)
    if copy.kind == "spill":
        for h in copy.drop:
            store.remove(h)
        ok = True
        for slot, h in zip(copy.slots, copy.hashes, strict=True):
            ok = ok and store.write(h, b"".join(t[slot].numpy().tobytes() for t in host))
        return ok
    for slot, h in zip(copy.slots, copy.hashes, strict=False):
        if not h:
            continue
        try:
            data = store.read(h)
        except DiskError:
            return False
        per = len(data) // len(host)
        for r, t in enumerate(host):
            t[slot].copy_(torch.frombuffer(bytearray(data[r * per:(r + 1) * per]),
                                           dtype=torch.uint8).view(t.shape[1], t.shape[2]))
    return True


def run_copy(copy: Copy, kv: list[torch.Tensor], host: list[torch.Tensor],
             store: DiskStore | None, stream: torch.cuda.Stream | None) -> bool:
    """Carry out ``copy``, its disk side first; whether it did."""
    if not disk_copy(copy, host, store):
        return False
    if copy.kind != "spill":
        copy_pages(copy, kv, host, stream)
    return True


def copy_pages(copy: Copy, kv: list[torch.Tensor], host: list[torch.Tensor],
               stream: torch.cuda.Stream | None = None) -> None:
    """Carry out ``copy`` on every rank (synchronously: returns when the bytes are there):
    the device side ``[layers, pages, page bytes]``, the host side slot-major."""
    for dev, pool in zip(kv, host, strict=True):
        if not dev.is_cuda:
            pages = torch.tensor(copy.pages, dtype=torch.long)
            slots = torch.tensor(copy.slots, dtype=torch.long)
            if copy.kind == "out":
                pool.index_copy_(0, slots, dev.index_select(1, pages).transpose(0, 1))
            else:
                dev.index_copy_(1, pages, pool.index_select(0, slots).transpose(0, 1))
            continue
        assert stream is not None
        with torch.cuda.stream(stream):
            for lo in range(0, len(copy.pages), STAGE_PAGES):
                _stage(copy, dev, pool, lo, min(len(copy.pages), lo + STAGE_PAGES))
    if stream is not None:
        stream.synchronize()


def _stage(copy: Copy, dev: torch.Tensor, pool: torch.Tensor, lo: int, hi: int) -> None:
    """Pages ``[lo, hi)`` of ``copy`` on CUDA, on the current stream, through a staging
    buffer ``[pages, layers, page bytes]`` on the device."""
    pages = torch.tensor(copy.pages[lo:hi], dtype=torch.long).to(dev.device, non_blocking=True)
    if copy.kind == "out":
        staged = dev.index_select(1, pages).transpose(0, 1).contiguous()
        for i, s, n in slot_runs(copy.slots[lo:hi]):
            pool[s:s + n].copy_(staged[i:i + n], non_blocking=True)
    else:
        staged = torch.empty((hi - lo, dev.shape[0], dev.shape[2]), dtype=torch.uint8,
                             device=dev.device)
        for i, s, n in slot_runs(copy.slots[lo:hi]):
            staged[i:i + n].copy_(pool[s:s + n], non_blocking=True)
        dev.index_copy_(1, pages, staged.transpose(0, 1))
    staged.record_stream(torch.cuda.current_stream(dev.device))


def host_layout_pages(slots: Sequence[int], num_layers: int) -> list[int]:
    """The page ids that give a slot-major host pool's offsets through a layout of one page
    (``KVLayoutDesc`` with ``num_pages`` 1: ``page_offset(l, p) = (l + p) * page_bytes``), so
    the transfer planner ships host slots as it ships pages: slot ``s`` -> ``s * layers``."""
    return [s * num_layers for s in slots]


def layered(kv: list[torch.Tensor], host: HostPool, events: Sequence[Sequence[Any]] | None
            ) -> LayeredReload | None:
    """Reloads issued layer by layer on CUDA when the ranks' layer events are given and
    ``DISAGG_LAYERED_RELOAD=1`` (off by default until a GPU run has checked it: a reload then
    lands before its sequence is scheduled, as disk fills do)."""
    if not (kv[0].is_cuda and events and env("LAYERED_RELOAD", "0") == "1"):
        return None
    return LayeredReload(kv, host.tensors, events)


class SyncMover:
    """Copies at ``submit`` (the caller's thread); ``overlap``: on the CPU at once, layer by
    layer (``on_layer``: tests observe it); on CUDA issued layer by layer over ``events``."""

    def __init__(self, kv: list[torch.Tensor], host: HostPool, disk: DiskStore | None = None,
                 events: Sequence[Sequence[Any]] | None = None):
        self.kv, self.host, self.disk = kv, host, disk
        self.page_bytes = len(kv) * kv[0].shape[0] * kv[0].shape[2]
        self._done: list[tuple[int, bool]] = []
        self._stream = torch.cuda.Stream(kv[0].device) if kv[0].is_cuda else None
        self._layered = layered(kv, host, events)
        self.on_layer: Callable[[int], None] | None = None

    def overlap(self, copy: Copy) -> bool:
        if self._layered is not None:
            self._layered.issue(copy)
        elif self._stream is None:
            copy_layers(copy, self.kv, self.host.tensors, self.on_layer)
            self._done.append((copy.op, True))
        return self._layered is not None or self._stream is None

    def submit(self, copy: Copy) -> None:
        self._done.append((copy.op, run_copy(copy, self.kv, self.host.tensors, self.disk,
                                             self._stream)))

    def done(self) -> list[tuple[int, bool]]:
        out, self._done = self._done, []
        return out + [(op, True) for op in (self._layered.landed() if self._layered else ())]

    def busy(self) -> bool:
        return bool(self._done) or (self._layered is not None and self._layered.busy())

    def wait(self, op: int) -> bool:
        """Every copy is done at ``submit``."""
        return True

    def expedite(self, op: int, page: int) -> bool:
        return False  # done at submit


class ThreadMover:
    """Copies on one worker thread; ``done`` reports what finished (a copy that raised is
    reported not ok, and logged). Reloads that read only host slots go first (a request
    waits for them); the rest (copies out, spills, reloads reading disk files, which must
    follow the spills of the slots they fill) in submission order. ``expedite`` copies a page
    of a copy out not started yet at once, in the caller's thread."""

    def __init__(self, kv: list[torch.Tensor], host: HostPool, disk: DiskStore | None = None,
                 events: Sequence[Sequence[Any]] | None = None):
        self.kv, self.host, self.disk = kv, host, disk
        self.page_bytes = len(kv) * kv[0].shape[0] * kv[0].shape[2]
        self._layered = layered(kv, host, events)
        self._urgent: collections.deque[Copy] = collections.deque()
        self._later: collections.deque[Copy] = collections.deque()
        self._cond = threading.Condition()  # guards the queues, _completed, _running
        self._completed: list[tuple[int, bool]] = []  # done, not reported yet
        self._done_ops: set[int] = set()
        self._running: Copy | None = None
        self._closing = False
        self._in_flight = 0
        self._stream = torch.cuda.Stream(kv[0].device) if kv[0].is_cuda else None
        self._caller_stream = torch.cuda.Stream(kv[0].device) if kv[0].is_cuda else None
        self._thread = threading.Thread(target=self._work, name="kv-tiers", daemon=True)
        self._thread.start()

    def _work(self) -> None:
        if self._stream is not None:
            torch.cuda.set_device(self.kv[0].device)
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._urgent or self._later or self._closing)
                if self._closing:
                    return
                copy = (self._urgent or self._later).popleft()
                self._running = copy
            t0 = time.perf_counter()
            try:
                ok = run_copy(copy, self.kv, self.host.tensors, self.disk, self._stream)
            except Exception:  # noqa: BLE001 - a failed copy is a miss, never fatal
                log.exception("KV tier copy %s of %d pages failed", copy.kind, len(copy.pages))
                ok = False
            took = time.perf_counter() - t0
            if took > SLOW_COPY_S:
                log.info("slow KV tier copy %s: %d pages in %d slot runs, %.1f ms (%d queued)",
                         copy.kind, len(copy.slots), len(slot_runs(copy.slots)), 1e3 * took,
                         len(self._urgent) + len(self._later))
            with self._cond:
                self._running = None
                self._completed.append((copy.op, ok))
                self._done_ops.add(copy.op)
                self._cond.notify_all()

    def submit(self, copy: Copy) -> None:
        self._in_flight += 1
        urgent = copy.kind == "in" and not any(copy.hashes)
        with self._cond:
            (self._urgent if urgent else self._later).append(copy)
            self._cond.notify_all()

    def overlap(self, copy: Copy) -> bool:
        """A reload issued layer by layer on CUDA (``LayeredReload``), or on the CPU copied
        at once in the caller's thread (its slots are pinned, its pages just allocated:
        nothing else touches them)."""
        if self._layered is not None:
            self._layered.issue(copy)
        elif self._stream is None:
            copy_layers(copy, self.kv, self.host.tensors)
            with self._cond:
                self._completed.append((copy.op, True))
                self._done_ops.add(copy.op)
        else:
            return False
        self._in_flight += 1
        return True

    def done(self) -> list[tuple[int, bool]]:
        with self._cond:
            out, self._completed = self._completed, []
            self._done_ops.difference_update(op for op, _ in out)
        out += [(op, True) for op in (self._layered.landed() if self._layered else ())]
        self._in_flight -= len(out)
        return out

    def busy(self) -> bool:
        return self._in_flight > 0

    def expedite(self, op: int, page: int) -> bool:
        """Copy ``page`` of copy out ``op`` now, in the caller's thread, if that copy has not
        started (it goes on without the page): True once the bytes are in its slot; False
        when the copy runs or ran, or when a spill ahead of it still has to read the slot
        (the slot's old entry on its way to disk: writing the slot now would put this page's
        bytes on disk under the old page's hash); ``wait`` for it then."""
        with self._cond:
            spilling: set[int] = set()
            if self._running is not None and self._running.kind == "spill":
                spilling.update(self._running.slots)
            for i, c in enumerate(self._later):
                if c.kind == "spill":
                    spilling.update(c.slots)
                if c.op == op and c.kind == "out" and page in c.pages:
                    j = c.pages.index(page)
                    slot = c.slots[j]
                    if slot in spilling:
                        return False
                    self._later[i] = Copy(op, "out", c.pages[:j] + c.pages[j + 1:],
                                          c.slots[:j] + c.slots[j + 1:])
                    break
            else:
                return False
        copy_pages(Copy(op, "out", (page,), (slot,)), self.kv, self.host.tensors,
                   self._caller_stream)
        return True

    def wait(self, op: int) -> bool:
        """Block until copy ``op`` is done: an eviction of a page whose copy runs, at most
        that copy's time; False (logged) when ``WAIT_S`` passed first."""
        with self._cond:
            if self._cond.wait_for(lambda: op in self._done_ops, timeout=WAIT_S):
                return True
        log.error("a KV tier copy did not finish within %g s; its pages are not kept", WAIT_S)
        return False

    def close(self) -> None:
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join(timeout=10)


def node_tiers(kv: list[torch.Tensor], shape: list[int], dtype: str, host_mb: int,
               disk_dir: str = "", disk_mb: int = 0, model_salt: bytes = b"",
               events: Sequence[Sequence[Any]] | None = None) -> tuple[KVTiers, HostPool]:
    """A node's host tier over its executors' KV memory mapped into this process (one
    tensor per rank; ``shape``, ``dtype``: ``KVMemoryInfo``'s), copied by a ``ThreadMover``
    (``events``: each rank's layer events, for reloads issued layer by layer); with
    ``disk_dir`` a disk tier of ``disk_mb`` MiB under it (``open_disk``)."""
    layers, pages, parts, heads, page, dim = shape
    page_bytes = parts * heads * page * dim * torch.empty((), dtype=getattr(torch, dtype)
                                                          ).element_size()
    views = page_views(kv, layers, pages, page_bytes)
    host = HostPool.create(host_mb, len(kv), layers, page_bytes, pin=views[0].is_cuda)
    log.info("host KV tier: %d pages (%.1f MiB%s)", host.num_slots, host.nbytes / 2**20,
             ", pinned" if host.pinned else "")
    ident = identity(model_salt, page_bytes, (len(kv), *shape[:1], *shape[2:]))
    store, slots, on_disk = (
        open_disk(disk_dir, disk_mb << 20, ident, len(kv) * layers * page_bytes) if disk_dir
        else (None, 0, []))
    mover = ThreadMover(views, host, store, events)
    return KVTiers(host.num_slots, mover, slots, on_disk), host


def open_disk(root: str, bound: int, ident: bytes, page_bytes: int
              ) -> tuple[DiskStore | None, int, list[bytes]]:
    """The disk tier's store, its bound in pages (``bound``: bytes) and the pages a
    previous run left (the newest that fit; older ones removed). A directory that cannot be
    written is logged and the node serves without the disk tier (None)."""
    store = DiskStore(root, ident, page_bytes)
    try:
        store.open()
        left = store.existing()
    except OSError as e:
        log.error("disk KV tier off: --kv-disk-cache-dir %s is not writable (%s); serving from "
                  "the host and device tiers", root, e)
        return None, 0, []
    slots = bound // store.file_bytes
    for h in left[:max(0, len(left) - slots)]:
        store.remove(h)
    kept = left[max(0, len(left) - slots):]
    log.info("disk KV tier %s: %d pages (%.0f MiB), %d reused from a previous run", store.dir,
             slots, bound / 2**20, len(kept))
    return store, slots, kept
