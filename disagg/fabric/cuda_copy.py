"""How the cuda-ipc progress thread puts one batch of runs on the device (``CopyIssuer``).

Modes (``CudaIpcEngine(copy=...)`` or ``DISAGG_CUDA_IPC_COPY``):
- ``kernel``: one Triton launch copies every run (``gather_copy``; runs cut into 64 KiB tiles,
  16-byte vectors), so the CPU cost per batch is a table upload and a launch. The tile tables
  live in a ring (pinned, uploaded into a device twin); a batch waits for the oldest in flight
  when the ring is full, and one larger than the ring goes to the copy engines;
- ``ce``: one ``cuMemcpyAsync`` per run (copy engine), issued by a C loop in the cffi module;
  ``ce:S`` spreads the runs round-robin over S streams, joined into the engine's stream;
- ``loop``: the same from Python (the old path; kept as the last fallback).
``auto`` picks ``kernel`` (4 CTAs of 4 warps per SM) when the batch's mean run is under 4 MiB and
every address and length is 16-byte aligned, else ``ce``; a batch of at most ``CE_MAX_RUNS`` runs
(a job's context marker, a layer whose pages lie in a few long runs) always goes to ``ce``: its
few copies cost the copy engines microseconds, the kernel's tile plan, table upload and launch
from Python ~0.3 ms more, which the last layer's batch pays on the TTFT tail. Options for experiments:
``kernel:CTAS:WARPS:BLOCK:HINTS``, ``ce:STREAMS``.
"""

from __future__ import annotations

import collections
import logging
import os
from collections.abc import Callable
from typing import Any

import numpy as np

from disagg.fabric.cuda_mem import check_rc, driver

log = logging.getLogger("disagg.fabric")

COPY_MODES = ("auto", "kernel", "ce", "loop")
KERNEL_MAX_MEAN_RUN = 4 << 20  # auto: kernel for batches whose mean run is shorter
CE_MAX_RUNS = 16  # auto: batches of this many runs or fewer go to the copy engines
RING_ENTRIES = 1 << 19  # int64 entries of the tile-table ring (4 MiB pinned + 4 MiB device)

Span = tuple[int, int]  # ring entries [start, end) a batch's tile table uses


class CopyIssuer:
    """Issues batches of (src, dst, length) runs on a stream; ``issue`` is called on the
    progress thread only. ``stats``: the engine's counters (``*_batches``, ``ring_waits``)."""

    def __init__(self, torch: Any, device: int, copy: str | None, ctas: int | None,
                 stats: collections.Counter[str]) -> None:
        self.torch = torch
        self.device = device
        self.copy = copy or os.environ.get("DISAGG_CUDA_IPC_COPY", "auto")
        if self.copy.split(":")[0] not in COPY_MODES:
            raise ValueError(f"cuda-ipc copy mode must be one of {COPY_MODES}, got {self.copy!r}")
        env_ctas = os.environ.get("DISAGG_CUDA_IPC_CTAS")
        self.ctas = ctas or (int(env_ctas) if env_ctas else 0)  # 0: 4 per SM, set on setup
        self.stats = stats
        self._ring: Any = None  # pinned int64 tile tables, uploaded into _dring
        self._dring: Any = None
        self._ce_fn: Any = None  # cuMemcpyAsync as a void * for the C loop, or None
        self._ce_lib: Any = None
        self._kernel_broken = False
        self._opts = ""  # the copy mode's options: kernel:CTAS:WARPS:BLOCK:HINTS, ce:STREAMS
        self._side: list[Any] = []  # extra streams of ce:S

    def warm(self) -> None:
        """Compile the copy kernel now, not during the first transfer (kernel modes)."""
        if self.copy.split(":")[0] in ("auto", "kernel"):
            from disagg.fabric import gather_copy

            try:
                gather_copy.warm(self.torch.device("cuda", self.device))
            except Exception as e:  # noqa: BLE001 - the copy engines still serve
                log.warning("cuda-ipc: gather-copy kernel unavailable (%s)", e)
                self._kernel_broken = True

    def setup(self) -> Any:
        """On the progress thread: its device, stream, and the compiled copy loop."""
        torch = self.torch
        torch.cuda.set_device(self.device)
        stream = torch.cuda.Stream(self.device)
        if not self.ctas:
            self.ctas = 4 * torch.cuda.get_device_properties(self.device).multi_processor_count
        try:
            from disagg.fabric import lib as fl

            ffi, drv = driver()
            self._ce_fn = fl.ffi.cast("void *", int(ffi.cast("uintptr_t", drv.cuMemcpyAsync)))
            self._ce_lib = fl
        except Exception as e:  # noqa: BLE001 - no cffi module: Python loop instead
            log.info("cuda-ipc: no compiled copy loop (%s)", e)
            self._ce_fn = None
        return stream

    def issue(self, src: np.ndarray, dst: np.ndarray, lens: np.ndarray, stream: Any,
              spans: Callable[[], list[Span]], wait_oldest: Callable[[], None]) -> Span | None:
        """Queue the runs on ``stream``; the ring span their tile table holds until the
        stream passes this point (None: no table). ``spans``: those of the batches in flight,
        oldest first; ``wait_oldest``: block until the oldest completed and retire it."""
        mode = self._mode(src, dst, lens)
        if mode == "kernel":
            try:
                span = self._issue_kernel(src, dst, lens, stream, spans, wait_oldest)
                self.stats["kernel_batches"] += 1
                return span
            except _RingFull:
                pass
            except Exception as e:
                if self.copy != "auto":
                    raise
                log.warning("cuda-ipc: copy kernel failed (%s); using the copy engine", e)
                self._kernel_broken = True
            mode = "ce" if self._ce_fn is not None else "loop"
        if mode == "ce":
            self._issue_ce(src, dst, lens, stream)
            self.stats["ce_batches"] += 1
            return None
        ffi, drv = driver()
        s = ffi.cast("void *", stream.cuda_stream)
        for a, b, n in zip(src.tolist(), dst.tolist(), lens.tolist(), strict=True):
            check_rc("cuMemcpyAsync", drv.cuMemcpyAsync(b, a, n, s))
        self.stats["loop_batches"] += 1
        return None

    def _mode(self, src: np.ndarray, dst: np.ndarray, lens: np.ndarray) -> str:
        mode, _, self._opts = self.copy.partition(":")
        if mode == "auto":
            from disagg.fabric.gather_copy import aligned

            # measured on 2x H200 (BENCHMARKS.md, Fabric): the kernel wins below ~4 MiB runs,
            # the copy engine above
            n = lens.shape[0]
            small = int(lens.sum()) < KERNEL_MAX_MEAN_RUN * n
            mode = ("kernel" if small and n > CE_MAX_RUNS and not self._kernel_broken
                    and aligned(src, dst, lens) else "ce")
        if mode == "ce" and self._ce_fn is None:
            mode = "loop"
        return mode

    def _issue_ce(self, src: np.ndarray, dst: np.ndarray, lens: np.ndarray, stream: Any) -> None:
        """Copy-engine copies from the C loop; ``ce:S`` spreads the runs round-robin over S
        streams (several copy engines overlap their per-copy latency), joined into ``stream``."""
        fl = self._ce_lib
        nstreams = int(self._opts.split(":")[0]) if self._opts and self.copy.startswith("ce") else 1
        nstreams = max(1, min(nstreams, src.shape[0]))
        while len(self._side) < nstreams - 1:
            self._side.append(self.torch.cuda.Stream(self.device))
        targets = [stream] + self._side[:nstreams - 1]
        if nstreams > 1:
            ev = self.torch.cuda.Event()
            ev.record(stream)
            for s in targets[1:]:
                s.wait_event(ev)
        for k, s in enumerate(targets):
            d = np.ascontiguousarray(dst[k::nstreams])
            a = np.ascontiguousarray(src[k::nstreams])
            ln = np.ascontiguousarray(lens[k::nstreams])
            rc = fl.lib.dg_cuda_copy_runs(
                self._ce_fn, d.shape[0], fl.ffi.cast("uint64_t *", d.ctypes.data),
                fl.ffi.cast("uint64_t *", a.ctypes.data), fl.ffi.cast("uint64_t *", ln.ctypes.data),
                fl.ffi.cast("void *", s.cuda_stream))
            check_rc("cuMemcpyAsync", rc)
        for s in targets[1:]:
            ev = self.torch.cuda.Event()
            ev.record(s)
            stream.wait_event(ev)

    def _issue_kernel(self, src: np.ndarray, dst: np.ndarray, lens: np.ndarray, stream: Any,
                      spans: Callable[[], list[Span]], wait_oldest: Callable[[], None]) -> Span:
        from disagg.fabric import gather_copy

        torch = self.torch
        table = gather_copy.plan_tiles(src, dst, lens)
        need = table.size
        start = self._ring_alloc(need, spans, wait_oldest)
        if self._ring is None:
            self._ring = torch.empty(RING_ENTRIES, dtype=torch.int64, pin_memory=True)
            self._dring = torch.empty(RING_ENTRIES, dtype=torch.int64, device=self.device)
        self._ring[start:start + need].numpy()[:] = table.reshape(-1)
        with torch.cuda.stream(stream):
            tab = self._dring[start:start + need]
            tab.copy_(self._ring[start:start + need], non_blocking=True)
            o = [int(x) if x else -1 for x in self._opts.split(":")] if (
                self.copy.startswith("kernel")) else []
            o += [-1] * (4 - len(o))
            gather_copy.launch(tab, table.shape[0], o[0] if o[0] > 0 else self.ctas,
                               num_warps=o[1] if o[1] > 0 else 4,
                               block=o[2] if o[2] > 0 else gather_copy.BLOCK,
                               hints=bool(o[3]) if o[3] >= 0 else True)
        return (start, start + need)

    def _ring_alloc(self, need: int, spans: Callable[[], list[Span]],
                    wait_oldest: Callable[[], None]) -> int:
        """Start of ``need`` free ring entries (waits for the oldest batches if none)."""
        if need > RING_ENTRIES:
            raise _RingFull
        while True:
            used = spans()
            if not used:
                return 0
            tail, head = used[0][0], used[-1][1]
            if head > tail:  # used: [tail, head)
                if RING_ENTRIES - head >= need:
                    return head
                if tail >= need:
                    return 0
            elif tail - head >= need:  # wrapped, used: [tail, end) and [0, head)
                return head
            self.stats["ring_waits"] += 1
            wait_oldest()  # in order: the oldest span frees first


class _RingFull(Exception):
    """The batch's tile table is larger than the ring: use the copy engine."""
