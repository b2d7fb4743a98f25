"""Transfer engine actor: the node's one link to the fabric.

Owns: the backend engine (libfabric endpoint, CQ, AV and progress thread, or cuda-ipc), the
registrations of every executor's KV memory (mapped into this process) and of the context
buffer. Turns planned writes into batches with immediate data and counts what lands here.
Callers only ``await``; the engine's progress thread enters asyncio in one place.

Backends and memory (``--transfer-backend``):
- ``fabric`` + host KV (CPU): the KV memory is registered with libfabric as it is.
- ``fabric`` + CUDA KV: automatic host staging (libfabric without FI_HMEM cannot register GPU
  memory): ``register`` makes a pinned host mirror of the tensor (same byte offsets) and
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
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import torch

from disagg.fabric import decode_descriptor, make_backend
from disagg.fabric.backend import FabricBackend, TransferBackend
from disagg.fabric.descriptor import MemoryDescriptor, OutOfRange, check_writes
from disagg.fabric.expectations import NotPosted
from disagg.protocol.peer import KVLayoutDesc
from disagg.remote.transfer_plan import UNIT_BITS, Runs, make_imm, page_runs

log = logging.getLogger(__name__)

STRIPE_BYTES = 1 << 20  # with several fabric lanes, runs are cut to at most this
MR_PER_ATTEMPT = ("auto", "on", "off")
# providers whose registrations pin nothing (measured on tcp: ~5 us a registration + close,
# whatever the size): per-attempt windows by default
CHEAP_REGISTRATION = ("tcp", "shm", "net", "udp", "sockets")


def per_attempt_windows(backend: str, provider: str, mode: str) -> bool:
    """Whether a decoder registers its memory anew for each attempt (``--fabric-mr-per-attempt``):
    ``auto`` where registration is cheap (pins nothing), never for cuda-ipc (not revocable)."""
    if mode not in MR_PER_ATTEMPT:
        raise ValueError(f"--fabric-mr-per-attempt must be one of {MR_PER_ATTEMPT}, got {mode!r}")
    if backend != "fabric":
        return False
    return mode == "on" or (mode == "auto" and provider.split(";")[0] in CHEAP_REGISTRATION)


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
    """A CUDA tensor on the fabric backend: ``region`` registers its pinned host ``mirror``."""

    region: Any  # the fabric LocalRegion of mirror.host
    mirror: Any  # disagg.fabric.staging.HostMirror

    @property
    def descriptor(self) -> MemoryDescriptor:
        return self.region.descriptor  # type: ignore[no-any-return]

    @property
    def length(self) -> int:
        return int(self.region.length)


class TransferEngine:
    def __init__(self, backend: str = "fabric", provider: str = "tcp", timeout_s: float = 30.0,
                 device: torch.device | None = None, lanes: int = 1,
                 stripe_bytes: int = STRIPE_BYTES, mr_per_attempt: str = "auto",
                 address: str = ""):
        kw: dict[str, Any] = {"weight_bits": UNIT_BITS, "default_timeout": timeout_s}
        self.device = device if device is not None else torch.device("cpu")
        self.lanes = lanes
        self.stripe_bytes = stripe_bytes
        if backend == "cuda-ipc":
            kw["device"] = (device.index or 0) if device is not None else 0
            self.engine: TransferBackend = make_backend(backend, **kw)
        else:
            nearest = nearest_nics(self.device) if lanes > 1 else ()
            self.engine = make_backend(backend, provider=provider, lanes=lanes, nearest=nearest,
                                       address=address, **kw)
        self.backend = backend
        # "backend/provider": what a peer's engine must match (carried in Pong)
        self.transport = f"{backend}/{self.engine.provider}"
        self.windows = per_attempt_windows(backend, self.engine.provider, mr_per_attempt)
        self.timeout_s = timeout_s
        self.writes_sent = 0
        self.bytes_sent = 0
        self._mirrors: list[Any] = []

    def start(self) -> TransferEngine:
        self.engine.start(asyncio.get_running_loop())
        return self

    async def close(self) -> None:
        await self.engine.close()
        for m in self._mirrors:
            m.close()

    def register(self, tensor: torch.Tensor, fd: int | None = None, access: str = "both") -> Any:
        """Register a tensor's memory once; returns the local region (``.descriptor`` for peers).

        ``fd``: for CUDA memory from cuMem (the node's KV), the allocation's POSIX fd, which
        cuda-ipc peers import; ignored elsewhere. ``access`` (fabric): ``source``, ``target``
        or ``both`` (see the module docstring)."""
        if self.backend == "cuda-ipc":
            from disagg.fabric.cuda_ipc import CudaIpcEngine

            return cast(CudaIpcEngine, self.engine).register(tensor,
                                                             fd=fd if tensor.is_cuda else None)
        fabric = cast(FabricBackend, self.engine)
        if tensor.is_cuda:
            from disagg.fabric.staging import HostMirror

            mirror = HostMirror(tensor)
            self._mirrors.append(mirror)
            region = fabric.register_address(int(mirror.host.data_ptr()), mirror.nbytes,
                                                  owner=mirror, access=access)
            log.info("fabric over host staging: %d MiB pinned mirror of %s memory",
                     mirror.nbytes >> 20, tensor.device)
            return StagedRegion(region, mirror)
        return fabric.register_address(int(tensor.data_ptr()),
                                            tensor.numel() * tensor.element_size(), owner=tensor,
                                            access=access)

    def window(self, regions: list[Any]) -> Any:
        """One attempt's access to ``regions`` (registered here): ``.descriptors`` (in order)
        for the PrefillRequest, ``.close()`` when the attempt ends, after which the provider
        refuses its writes. Without per-attempt windows: the regions' own descriptors, and
        ``close`` revokes nothing."""
        if not self.windows:
            from disagg.fabric.regions import Window

            return Window([r.descriptor for r in regions])
        return self.engine.window([r.region if isinstance(r, StagedRegion) else r
                                   for r in regions])

    def prepare(self, descriptors: list[MemoryDescriptor]) -> None:
        """Peer regions this engine will write into soon (their owner proved it owns them):
        cuda-ipc maps them now, on its progress thread, not at their first write; the fabric
        engines need nothing (the peer's address went in with the ownership check's write)."""
        prepare = getattr(self.engine, "prepare", None)
        if prepare is not None:
            prepare(descriptors)

    @property
    def junk(self) -> int:
        """Immediates refused by the receiving counter (unknown, finished, overflowing)."""
        return int(self.engine.junk)

    @property
    def delivery_complete(self) -> bool:
        """Whether a write's completion here means its data was placed at the target (else
        only that it was sent: the receiver counts its own immediates either way)."""
        return bool(getattr(self.engine, "delivery_complete", False))

    def context_buffer(self, rows: int, row_bytes: int) -> torch.Tensor:
        """A zeroed ``[rows, row_bytes]`` uint8 buffer for context rows, in memory this backend
        can share: device memory for cuda-ipc, host memory for the fabric."""
        if self.backend == "cuda-ipc" and self.device.type == "cuda":
            return torch.zeros(rows, row_bytes, dtype=torch.uint8, device=self.device)
        return torch.zeros(rows, row_bytes, dtype=torch.uint8)

    @staticmethod
    def decode_descriptor(data: bytes) -> MemoryDescriptor:
        """Decode and validate a peer's descriptor, lane list included (``OutOfRange``)."""
        desc = decode_descriptor(data)
        if desc.backend == "fabric":
            from disagg.fabric.striped import lanes_of

            lanes_of(desc)
        return desc

    def write(self, src: Any, dst: MemoryDescriptor, runs: Runs, key: int,
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
            if dst.backend != "fabric":
                raise OutOfRange(f"descriptor is for {dst.backend}, engine is fabric")
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

    def expect(self, key: int, units: int, timeout: float) -> Any:
        """An awaitable that resolves when ``units`` units carrying ``key`` have landed."""
        return self.engine.expect(key, units, timeout=timeout)

    async def stage_in(self, region: Any, offsets: list[int], lengths: list[int]) -> None:
        """Copy these byte runs of a staged region mirror -> GPU (no-op for other regions)."""
        if isinstance(region, StagedRegion) and offsets:
            await region.mirror.into(offsets, lengths)

    async def stage_in_pages(self, region: Any, layout: KVLayoutDesc, pages: list[int],
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
