"""Host staging for GPU memory on the ``fabric`` backend (libfabric without FI_HMEM).

The lent GPU machines' libfabric cannot register CUDA memory, so a GPU KV cache travels
GPU -> pinned host mirror -> fabric -> pinned host mirror -> GPU. :class:`HostMirror` is a
pinned host copy of a CUDA tensor's bytes (same offsets, so a transfer plan made for the GPU
layout is valid on the mirror as it is) with async copies between the two on a dedicated
stream: ``await mirror.out(offsets, lengths)`` (GPU -> host, before posting fabric writes of
those bytes) and ``await mirror.into(offsets, lengths)`` (host -> GPU, once the writes of a
transfer all landed). Each call records an event and waits for it on one helper thread, so the
event loop never blocks; copies run in call order on the mirror's stream.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np


def coalesce(offsets: Any, lengths: Any) -> tuple[list[int], list[int]]:
    """Sort runs by offset and merge those that touch or overlap."""
    o = np.asarray(offsets, dtype=np.int64)
    n = np.asarray(lengths, dtype=np.int64)
    if o.size == 0:
        return [], []
    order = np.argsort(o, kind="stable")
    out_o: list[int] = []
    out_n: list[int] = []
    for a, b in zip(o[order].tolist(), n[order].tolist(), strict=True):
        if out_o and a <= out_o[-1] + out_n[-1]:
            out_n[-1] = max(out_o[-1] + out_n[-1], a + b) - out_o[-1]
        else:
            out_o.append(a)
            out_n.append(b)
    return out_o, out_n


class HostMirror:
    """A pinned host copy of a contiguous CUDA tensor's bytes."""

    def __init__(self, tensor: Any) -> None:
        import torch

        if not tensor.is_cuda or not tensor.is_contiguous():
            raise ValueError("a host mirror is made for a contiguous CUDA tensor")
        self.torch = torch
        self.gpu = tensor.view(torch.uint8).view(-1)
        self.device = tensor.device
        self.nbytes = self.gpu.numel()
        self.host = torch.empty(self.nbytes, dtype=torch.uint8, pin_memory=True)
        self.stream = torch.cuda.Stream(self.device)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="stage-wait")
        self.bytes_out = 0
        self.bytes_in = 0
        self._last: asyncio.Future[None] | None = None

    def _copy(self, offsets: Any, lengths: Any, to_host: bool) -> Any:
        torch = self.torch
        oo, nn = coalesce(offsets, lengths)
        if oo and (oo[0] < 0 or oo[-1] + nn[-1] > self.nbytes):
            raise ValueError("staged copy outside the mirrored tensor")
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            for o, n in zip(oo, nn, strict=True):
                if to_host:
                    self.host[o:o + n].copy_(self.gpu[o:o + n], non_blocking=True)
                else:
                    self.gpu[o:o + n].copy_(self.host[o:o + n], non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(self.stream)
        if to_host:
            self.bytes_out += sum(nn)
        else:
            self.bytes_in += sum(nn)
        return ev

    async def _wait(self, ev: Any) -> None:
        fut = asyncio.get_running_loop().run_in_executor(self._pool, ev.synchronize)
        self._last = fut
        await fut

    async def out(self, offsets: Any, lengths: Any) -> None:
        """GPU -> host for these byte runs; returns once they are in the mirror."""
        await self._wait(self._copy(offsets, lengths, True))

    async def into(self, offsets: Any, lengths: Any) -> None:
        """Host -> GPU for these byte runs; returns once they are on the GPU."""
        await self._wait(self._copy(offsets, lengths, False))

    async def idle(self) -> None:
        """Until every copy issued so far has finished (they finish in order)."""
        last = self._last
        if last is not None and not last.done():
            await asyncio.wait([last])

    def close(self) -> None:
        self._pool.shutdown(wait=True)
