"""The node's transfer engine: its one link to the fabric, over a transfer backend.

Not an actor: the messengers hold it and ``await`` it. Owns: the backend engine (built by
name from ``disagg.fabric.registry``: libfabric endpoint, CQ, AV and progress thread, or
cuda-ipc; on a prefiller a second one for ownership nonces, ``probes``), the registrations
of every executor's KV memory (mapped into this process) and of the context buffer. Turns
planned writes into batches with immediate data and counts what lands here. Callers only
``await``; the engine's progress thread enters asyncio in one place.

Backends and memory (``--transfer-backend``); the wrapper asks the backend what it can do
(``device_memory``, ``revocable_windows``), never its name:
- ``fabric`` + host KV (CPU): the KV memory is registered with libfabric as it is.
- ``fabric`` + CUDA KV: automatic host staging (a backend without ``device_memory``: libfabric
  without FI_HMEM cannot register GPU memory): ``register`` makes a pinned host mirror of the tensor (same byte offsets) and
  registers the mirror. ``write`` copies the runs it is about to send GPU -> mirror
  (``HostMirror.out``) before posting them; the decoder calls :meth:`stage_in_pages` once a
  transfer's units all landed, which copies its pages mirror -> GPU. The context buffers stay
  host memory.
- ``cuda-ipc`` (GPUs of one host): the KV is cuMem memory, registered with the fd the node
  keeps open (``ExecutorGroup.kv_fds``) so a peer can import and map it; context buffers are
  device tensors (:meth:`context_buffer`), shared by legacy CUDA IPC handles.

Access (fabric): registrations carry random keys (or the provider's), never remote read.
``register(access=...)``: ``source`` for what a prefiller sends from (no remote access),
``target``/``both`` for what peers write into. With per-attempt windows
(``--fabric-mr-per-attempt``, :meth:`window`), the decoder registers its KV and context memory
as ``source`` only and gives each attempt fresh registrations, revoked when it ends.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from disagg import trace
from disagg.fabric import decode_descriptor, make_backend
from disagg.fabric.backend import Access, RegionHandle, TransferBackend
from disagg.fabric.descriptor import MemoryDescriptor, OutOfRange, check_writes
from disagg.fabric.expectations import Expectation, NotPosted
from disagg.fabric.lanes import lanes_of
from disagg.fabric.regions import Window
from disagg.fabric.staging import HostMirror
from disagg.protocol.peer import KVLayoutDesc
from disagg.remote.transfer_plan import UNIT_BITS, Runs, make_imm, page_runs

log = logging.getLogger(__name__)

STRIPE_BYTES = 1 << 20  # with several fabric lanes, runs are cut to at most this
MR_PER_ATTEMPT = ("auto", "on", "off")


def per_attempt_windows(engine: TransferBackend, mode: str) -> bool:
    """Whether a decoder registers its memory anew for each attempt (``--fabric-mr-per-attempt``):
    ``auto`` where registration is cheap (pins nothing), never where windows cannot be revoked
    (cuda-ipc)."""
    if mode not in MR_PER_ATTEMPT:
        raise ValueError(f"--fabric-mr-per-attempt must be one of {MR_PER_ATTEMPT}, got {mode!r}")
    if not engine.revocable_windows:
        return False
    return mode == "on" or (mode == "auto" and engine.cheap_registration)


def nearest_nics(device: torch.device) -> tuple[str, ...]:
    """Names of the NICs nearest a CUDA device (sysfs), for lane placement; () if unknown."""
    if device.type != "cuda":
        return ()
    try:
        from disagg.fabric.topology import nearest_nic_names, read_topology

        p = torch.cuda.get_device_properties(device)
        ids = [getattr(p, f"pci_{k}_id") for k in ("domain", "bus", "device")]  # not in stubs
        bdf = "{:04x}:{:02x}:{:02x}.0".format(*ids)
        names = nearest_nic_names(read_topology("/"), bdf)
        log.info("NICs nearest %s (%s): %s", device, bdf, ", ".join(names) or "none found")
        return names
    except Exception as e:  # noqa: BLE001 - placement is a preference, never a failure
        log.warning("could not read the PCIe topology for %s: %s", device, e)
        return ()


@dataclass(eq=False)
class StagedRegion:
    """A CUDA tensor on a backend without ``device_memory``: ``region`` registers its pinned
    host ``mirror``."""

    region: RegionHandle  # the backend's registration of mirror.host
    mirror: HostMirror

    @property
    def descriptor(self) -> MemoryDescriptor:
        return self.region.descriptor

    @property
    def length(self) -> int:
        return self.region.length


def backend_region(region: RegionHandle) -> RegionHandle:
    """What the backend registered for ``region`` (the mirror's, for a staged one)."""
    return region.region if isinstance(region, StagedRegion) else region


class TransferEngine:
    def __init__(self, backend: str = "fabric", provider: str = "tcp", timeout_s: float = 30.0,
                 device: torch.device | None = None, lanes: int = 1,
                 stripe_bytes: int = STRIPE_BYTES, mr_per_attempt: str = "auto",
                 address: str = ""):
        self._options: dict[str, Any] = dict(  # for probes(): an engine like this one
            backend=backend, provider=provider, timeout_s=timeout_s, device=device, lanes=lanes,
            stripe_bytes=stripe_bytes, mr_per_attempt=mr_per_attempt, address=address)
        self._probes: TransferEngine | None = None
        self.device = device if device is not None else torch.device("cpu")
        self.lanes = lanes
        self.stripe_bytes = stripe_bytes
        self.engine: TransferBackend = make_backend(
            backend, provider=provider, lanes=lanes, nearest=lambda: nearest_nics(self.device),
            address=address, device=self.device.index or 0, weight_bits=UNIT_BITS,
            default_timeout=timeout_s, trace=trace.mark)
        self.backend = backend
        # "backend/provider": what a peer's engine must match (carried in Pong)
        self.transport = f"{backend}/{self.engine.provider}"
        self.windows = per_attempt_windows(self.engine, mr_per_attempt)
        self.timeout_s = timeout_s
        self.writes_sent = 0
        self.bytes_sent = 0
        self._mirrors: list[HostMirror] = []

    def start(self) -> TransferEngine:
        self.engine.start(asyncio.get_running_loop())
        return self

    async def close(self) -> None:
        if self._probes is not None:
            await self._probes.close()
        await self.engine.close()
        for m in self._mirrors:
            m.close()

    def probes(self) -> TransferEngine:
        """A transfer engine of its own (same backend and options, its own endpoints) for
        writes whose target a peer names and may have revoked: ownership nonces. A receiver
        refusing a write (a revoked or unknown key) drops the whole connection it came on
        (libfabric 1.17 tcp: ``tcpx_op_write`` fails, the endpoint is disabled), and with it
        every write behind it on that connection, KV of other requests included; on these
        endpoints none is. Itself where windows cannot be revoked (cuda-ipc)."""
        if not self.engine.revocable_windows:
            return self
        if self._probes is None:
            self._probes = TransferEngine(**self._options).start()
        return self._probes

    def register(self, tensor: torch.Tensor, fd: int | None = None,
                 access: Access = "both") -> RegionHandle:
        """Register a tensor's memory once; returns the local region (``.descriptor`` for peers).

        ``fd``: for CUDA memory from cuMem (the node's KV), the allocation's POSIX fd, which
        cuda-ipc peers import; ignored elsewhere. ``access`` (fabric): ``source``, ``target``
        or ``both`` (see the module docstring)."""
        if tensor.is_cuda and not self.engine.device_memory:
            mirror = HostMirror(tensor)
            self._mirrors.append(mirror)
            region = self.engine.register(mirror.host, access=access)
            log.info("%s over host staging: %d MiB pinned mirror of %s memory",
                     self.backend, mirror.nbytes >> 20, tensor.device)
            return StagedRegion(region, mirror)
        return self.engine.register(tensor, fd=fd if tensor.is_cuda else None, access=access)

    def window(self, regions: Sequence[RegionHandle]) -> Window:
        """One attempt's access to ``regions`` (registered here): ``.descriptors`` (in order)
        for the PrefillRequest, ``.close()`` when the attempt ends, after which the provider
        refuses its writes. Without per-attempt windows: the regions' own descriptors, and
        ``close`` revokes nothing."""
        if not self.windows:
            return Window([r.descriptor for r in regions])
        return self.engine.window([backend_region(r) for r in regions])

    def prepare(self, descriptors: list[MemoryDescriptor]) -> None:
        """Peer regions this engine will write into soon (their owner proved it owns them):
        cuda-ipc maps them now, on its progress thread, not at their first write; the fabric
        engines need nothing (the peer's address went in with the ownership check's write)."""
        self.engine.prepare(descriptors)

    @property
    def junk(self) -> int:
        """Immediates refused by the receiving counter (unknown, finished, overflowing)."""
        return self.engine.junk

    @property
    def delivery_complete(self) -> bool:
        """Whether a write's completion here means its data was placed at the target (else
        only that it was sent: the receiver counts its own immediates either way)."""
        return self.engine.delivery_complete

    def context_buffer(self, rows: int, row_bytes: int) -> torch.Tensor:
        """A zeroed ``[rows, row_bytes]`` uint8 buffer for context rows, in memory this backend
        can share: device memory where the backend registers it (cuda-ipc), else host memory
        (the fabric)."""
        if self.engine.device_memory and self.device.type == "cuda":
            return torch.zeros(rows, row_bytes, dtype=torch.uint8, device=self.device)
        return torch.zeros(rows, row_bytes, dtype=torch.uint8)

    @staticmethod
    def decode_descriptor(data: bytes) -> MemoryDescriptor:
        """Decode and validate a peer's descriptor, a fabric one's lane list included
        (``OutOfRange``)."""
        desc = decode_descriptor(data)
        lanes_of(desc)
        return desc

    def write(self, src: RegionHandle, dst: MemoryDescriptor, runs: Runs, key: int,
              timeout: float | None = None, counted: bool = True) -> list[asyncio.Future[None]]:
        """Post ``runs`` (one batch per distinct unit count: the immediate carries it).
        Raises ``OutOfRange`` before posting anything that falls outside ``dst``. ``timeout``
        counts from now, host staging included: nothing is posted after it (the engines drop
        batches still queued at their deadline). ``counted``: KV writes, counted in
        ``writes_sent`` / ``bytes_sent`` (an ownership nonce is not)."""
        if self.lanes > 1:  # long runs in pieces, so that every lane gets a share
            runs = runs.split(self.stripe_bytes)
        groups = [(u, runs.units == u) for u in np.unique(runs.units).tolist()]
        futures: list[asyncio.Future[None]] = []
        if isinstance(src, StagedRegion):
            if dst.backend != self.backend:
                raise OutOfRange(f"descriptor is for {dst.backend}, engine is {self.backend}")
            check_writes(src.length, dst.length, runs.src_offset, runs.dst_offset, runs.length)
            t = self.timeout_s if timeout is None else timeout
            futures.append(asyncio.ensure_future(
                self._staged_write(src, dst, runs, groups, key, time.monotonic() + t)))
        else:
            for units, m in groups:
                futures.append(self.engine.submit(
                    src, dst, runs.src_offset[m], runs.dst_offset[m], runs.length[m],
                    make_imm(key, units), timeout=timeout))
        if counted:
            self.writes_sent += len(runs)
            self.bytes_sent += int(runs.length.sum())
        return futures

    async def _staged_write(self, src: StagedRegion, dst: MemoryDescriptor, runs: Runs,
                            groups: list[tuple[int, np.ndarray]], key: int,
                            deadline: float) -> None:
        await src.mirror.out(runs.src_offset.tolist(), runs.length.tolist())
        left = deadline - time.monotonic()  # the copy took some of it
        if left <= 0:
            raise NotPosted("write passed its deadline while staged (not posted)")
        await asyncio.gather(*[self.engine.submit(
            src.region, dst, runs.src_offset[m], runs.dst_offset[m], runs.length[m],
            make_imm(key, units), timeout=left) for units, m in groups])

    def expect(self, key: int, units: int, timeout: float,
               standing: bool = False) -> Expectation:
        """An awaitable that resolves when ``units`` units carrying ``key`` have landed
        (``standing``: armed ahead of need, e.g. a challenge key, no write due soon)."""
        return self.engine.expect(key, units, timeout=timeout, standing=standing)

    async def stage_in(self, region: RegionHandle, offsets: list[int],
                       lengths: list[int]) -> None:
        """Copy these byte runs of a staged region mirror -> GPU (no-op for other regions)."""
        if isinstance(region, StagedRegion) and offsets:
            await region.mirror.into(offsets, lengths)

    async def stage_in_pages(self, region: RegionHandle, layout: KVLayoutDesc, pages: list[int],
                             lead: bool = False) -> None:
        """``stage_in`` of every layer of these KV pages (runs of adjacent pages coalesced);
        ``lead``: the lead rank's region, which also holds the speculative one after it."""
        if not isinstance(region, StagedRegion) or not pages:
            return
        offsets, lengths = [], []
        parts = [(layout, 0)]
        if lead and layout.spec is not None:
            parts.append((layout.spec, layout.total_bytes))
        for lay, base in parts:
            for layer in range(lay.num_layers):
                for p, _, n in page_runs(pages, pages):
                    offsets.append(base + lay.page_offset(layer, p))
                    lengths.append(n * lay.page_bytes)
        await region.mirror.into(offsets, lengths)

    async def staging_idle(self) -> None:
        """Until every mirror -> GPU copy issued so far finished (call before pages a staged
        copy may still write are given back)."""
        for m in self._mirrors:
            await m.idle()
