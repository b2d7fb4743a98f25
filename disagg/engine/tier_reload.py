"""A host-tier reload issued layer by layer, so the step that uses its pages starts at once.

A reload (``Copy`` kind ``in``, host slots only) goes out in layer groups (``layer_groups``)
on a reload stream per rank; after each group every layer's event of it is recorded. The
step that consumes the pages waits, before each layer, on that layer's event
(``ModelRunner.execute`` with ``StepPlan.reload_wait``: ``torch.cuda.Event.wait``, a wait on
the device, no host sync; a decode step replayed from a CUDA graph waits on the last layer's
event before the replay, i.e. for the whole reload). The events are the executor's
(``ExecutorReady.reload_events``: interprocess events, opened here by their handles), and the
scheduler issues a reload before it sends the step that waits on it, so every record a wait
needs is already enqueued when the executor calls that wait (a wait sees the latest record
enqueued before it; the reloads of one rank share one stream, so a layer's latest record is
also after every earlier reload's). On the CPU a reload is copied layer by layer at once
(synchronously): the waits are no-ops there.

The host pool is slot-major (``[slots, layers, page bytes]``): one group of one run of
adjacent slots is one 2D copy (rows: slots, ``layers * page bytes`` apart), through a device
staging buffer and one scatter per group into the pages. Groups times slot runs is bounded
(``MAX_COPIES``): few, long copies move at link speed, many small ones do not (NOTES).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from disagg.engine.kv_tiers import Copy

MAX_COPIES = 1024  # 2D copies per rank and reload at most (groups x slot runs)
STAGE_PAGES = 64  # pages staged on the device at once per group


def slot_runs(slots: Sequence[int]) -> list[tuple[int, int, int]]:
    """(first index into ``slots``, first slot, length) of the runs of adjacent slots."""
    out: list[tuple[int, int, int]] = []
    for i, s in enumerate(slots):
        if out and (last := out[-1])[1] + last[2] == s:
            out[-1] = (last[0], last[1], last[2] + 1)
        else:
            out.append((i, s, 1))
    return out


def layer_groups(num_layers: int, runs: int, max_copies: int = MAX_COPIES
                 ) -> list[tuple[int, int]]:
    """``[lo, hi)`` layer ranges covering ``num_layers`` in order: one per layer when
    ``runs`` slot runs allow it, else as many equal groups as ``max_copies`` copies allow
    (at least one)."""
    groups = max(1, min(num_layers, max_copies // max(1, runs)))
    bounds = [num_layers * g // groups for g in range(groups + 1)]
    return [(bounds[g], bounds[g + 1]) for g in range(groups)]


def copy_layers(copy: Copy, kv: Sequence[torch.Tensor], host: Sequence[torch.Tensor],
                on_layer: Callable[[int], None] | None = None) -> None:
    """Reload ``copy`` on the CPU, layer by layer (``on_layer(l)`` once layer ``l`` of every
    rank is in: tests observe the order)."""
    pages = torch.tensor(copy.pages, dtype=torch.long)
    slots = torch.tensor(copy.slots, dtype=torch.long)
    for layer in range(kv[0].shape[0]):
        for dev, pool in zip(kv, host, strict=True):
            dev[layer].index_copy_(0, pages, pool[:, layer].index_select(0, slots))
        if on_layer is not None:
            on_layer(layer)


_CDEF = """
typedef int CUresult;
typedef unsigned long long CUdeviceptr;
typedef struct {
    size_t srcXInBytes; size_t srcY; int srcMemoryType; const void *srcHost;
    CUdeviceptr srcDevice; void *srcArray; size_t srcPitch;
    size_t dstXInBytes; size_t dstY; int dstMemoryType; void *dstHost;
    CUdeviceptr dstDevice; void *dstArray; size_t dstPitch;
    size_t WidthInBytes; size_t Height;
} CUDA_MEMCPY2D;
CUresult cuMemcpy2DAsync_v2(const CUDA_MEMCPY2D *pCopy, void *hStream);
"""
_drv: Any = None


def _driver() -> tuple[Any, Any]:
    global _drv
    if _drv is None:
        import cffi

        ffi = cffi.FFI()
        ffi.cdef(_CDEF)
        _drv = (ffi, ffi.dlopen("libcuda.so.1"))
    return _drv


def memcpy_2d(dst: int, dpitch: int, src: int, spitch: int, width: int, height: int,
              stream: torch.cuda.Stream) -> None:
    """``height`` rows of ``width`` bytes from page-locked host ``src`` to device ``dst``
    on ``stream`` (cuMemcpy2DAsync)."""
    ffi, drv = _driver()
    p = ffi.new("CUDA_MEMCPY2D *")
    p.srcMemoryType, p.srcHost, p.srcPitch = 1, ffi.cast("void *", src), spitch  # HOST
    p.dstMemoryType, p.dstDevice, p.dstPitch = 2, dst, dpitch  # DEVICE
    p.WidthInBytes, p.Height = width, height
    rc = drv.cuMemcpy2DAsync_v2(p, ffi.cast("void *", stream.cuda_stream))
    if rc != 0:
        raise RuntimeError(f"cuMemcpy2DAsync failed: CUDA error {rc}")


class LayeredReload:
    """Reloads issued layer by layer on CUDA: per rank a stream and the executor's layer
    events (``events[rank][layer]``)."""

    def __init__(self, kv: Sequence[torch.Tensor], host: Sequence[torch.Tensor],
                 events: Sequence[Sequence[Any]]):
        self.kv, self.host, self.events = list(kv), list(host), [list(e) for e in events]
        self.streams = [torch.cuda.Stream(t.device) for t in kv]
        self._pending: list[tuple[int, list[Any]]] = []  # (op, each rank's end event)

    def issue(self, copy: Copy) -> None:
        """Enqueue ``copy``'s layers on the reload streams (returns before they land)."""
        runs = slot_runs(copy.slots)
        ends = []
        for dev, pool, events, stream in zip(self.kv, self.host, self.events, self.streams,
                                             strict=True):
            layers, pb = dev.shape[0], dev.shape[2]
            with torch.cuda.device(dev.device), torch.cuda.stream(stream):
                for lo, hi in layer_groups(layers, len(runs)):
                    for first in range(0, len(copy.pages), STAGE_PAGES):
                        last = min(len(copy.pages), first + STAGE_PAGES)
                        self._group(copy, dev, pool, stream, (lo, hi), (first, last), pb)
                    for layer in range(lo, hi):
                        events[layer].record(stream)
                end = torch.cuda.Event()
                end.record(stream)
            ends.append(end)
        self._pending.append((copy.op, ends))

    @staticmethod
    def _group(copy: Copy, dev: torch.Tensor, pool: torch.Tensor, stream: torch.cuda.Stream,
               layers: tuple[int, int], span: tuple[int, int], pb: int) -> None:
        (lo, hi), (first, last) = layers, span
        staged = torch.empty((last - first, hi - lo, pb), dtype=torch.uint8, device=dev.device)
        row = pool.shape[1] * pb  # one slot of the host pool
        for i, s, n in slot_runs(copy.slots[first:last]):
            memcpy_2d(staged[i].data_ptr(), (hi - lo) * pb, pool[s, lo].data_ptr(), row,
                      (hi - lo) * pb, n, stream)
        pages = torch.tensor(copy.pages[first:last], dtype=torch.long).to(dev.device,
                                                                        non_blocking=True)
        dev[lo:hi].index_copy_(1, pages, staged.transpose(0, 1))
        staged.record_stream(stream)

    def landed(self) -> list[int]:
        """The reloads every rank finished since the last call (no wait)."""
        out = [op for op, ends in self._pending if all(e.query() for e in ends)]
        self._pending = [p for p in self._pending if p[0] not in out]
        return out

    def busy(self) -> bool:
        return bool(self._pending)
