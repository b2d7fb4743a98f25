"""The interface every transfer backend implements, and the named types it speaks in.

Backends (each one module, named once in ``disagg.fabric.registry``): ``FabricEngine`` (one
libfabric endpoint, ``fabric/engine.py``), ``StripedEngine`` (several lanes,
``fabric/striped.py``; the ``fabric`` name builds one or the other), ``CudaIpcEngine`` (GPUs
of one host, ``fabric/cuda_ipc.py``). A backend says what it can do in class attributes
(``device_memory``, ``revocable_windows``) so that its wrapper never asks for its name. Host
staging for GPU memory over a backend without ``device_memory`` is a layer above them
(``disagg.transfer.StagedRegion``), not a backend.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Protocol, TypeAlias

import numpy as np
import numpy.typing as npt

from disagg.fabric.descriptor import MemoryDescriptor
from disagg.fabric.expectations import Expectation
from disagg.fabric.regions import Window

if TYPE_CHECKING:
    import torch
    from typing_extensions import Buffer

# Byte offsets or lengths of the runs of one batch, one per write (int64 arrays, or lists).
Offsets: TypeAlias = "npt.NDArray[np.int64] | npt.NDArray[np.uint64] | Sequence[int]"
# Memory a backend registers: a tensor (host or device), or a host buffer (bytes-like).
Memory: TypeAlias = "torch.Tensor | Buffer"
# Who may write a registration: ``source`` (only written from here), ``target`` (peers write
# into it) or ``both`` (fabric; cuda-ipc grants same-host peers what the mapping allows).
Access = Literal["source", "target", "both"]


class TraceHook(Protocol):
    """Records that a key passed an event (``disagg.trace.mark``); the fabric imports nothing
    else of disagg, so its user hands this in."""

    def __call__(self, event: str, *key: object) -> None: ...


def no_trace(event: str, *key: object) -> None:
    """The trace hook of a backend nobody traces."""


class RegionHandle(Protocol):
    """A registered local region, as its backend hands it out: ``descriptor`` is what a peer
    needs to write into it; ``length`` its size in bytes. Only the backend that made it takes
    it back (``submit``, ``window``), and refuses one it did not make (``OutOfRange``)."""

    @property
    def descriptor(self) -> MemoryDescriptor: ...

    @property
    def length(self) -> int: ...


@dataclass(frozen=True)
class BackendOptions:
    """What building any backend may use (``--transfer-backend``, ``--fabric-*`` flags); each
    backend's ``create`` takes the fields it needs and ignores the rest."""

    provider: str | None = "tcp"  # libfabric provider (None: the first offered)
    lanes: int = 1  # fabric endpoints to stripe over
    # names of the NICs nearest this process's GPU, asked only when lanes > 1
    nearest: Callable[[], Sequence[str]] = tuple
    address: str = ""  # where the fabric binds (--fabric-address; empty: loopback)
    device: int = 0  # the CUDA device (cuda-ipc)
    weight_bits: int = 0  # low immediate bits that carry a write's units (ImmCounter)
    default_timeout: float = 60.0  # seconds, for writes and expectations given none
    max_inflight: int = 1024  # fabric: writes posted at once per endpoint
    trace: TraceHook = no_trace


class TransferBackend(Protocol):
    """Register memory, write into peers' registrations with immediates, count what lands."""

    @property
    def backend(self) -> str:
        """Its name in the registry; also every descriptor's ``backend`` it accepts."""
        ...

    @property
    def device_memory(self) -> bool:
        """Whether it registers device (CUDA) memory itself; else its wrapper stages it."""
        ...

    @property
    def revocable_windows(self) -> bool:
        """Whether ``window`` makes fresh registrations that ``close`` revokes."""
        ...

    @property
    def provider(self) -> str:
        """What a peer's engine must match (with the backend name)."""
        ...

    @property
    def cheap_registration(self) -> bool:
        """Whether registering pins nothing (then per-attempt windows are the default)."""
        ...

    @property
    def delivery_complete(self) -> bool:
        """Whether a write's completion means its data was placed at the target."""
        ...

    @property
    def junk(self) -> int:
        """Immediates refused by the receiving counter (unknown, finished, overflowing)."""
        ...

    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> TransferBackend: ...

    async def close(self) -> None: ...

    def register(self, memory: Memory, fd: int | None = None,
                 access: Access = "both") -> RegionHandle:
        """Register memory once. ``fd``: the POSIX fd of the cuMem allocation it lies in, for
        backends that share it (ignored by others)."""
        ...

    def window(self, regions: Sequence[RegionHandle]) -> Window:
        """One attempt's access to ``regions``: ``.descriptors``, ``.close()``."""
        ...

    def prepare(self, descriptors: Sequence[MemoryDescriptor]) -> None:
        """Peer regions it will write into soon (map them now, if it maps anything)."""
        ...

    def submit(self, src: RegionHandle, dst: MemoryDescriptor, src_offsets: Offsets,
               dst_offsets: Offsets, lengths: Offsets, imm: int,
               timeout: float | None = None) -> asyncio.Future[None]:
        """Write ``lengths[i]`` bytes from ``src + src_offsets[i]`` to ``dst +
        dst_offsets[i]``, each carrying ``imm``; the future resolves when all completed at
        the source (or fails; nothing is posted past ``timeout``)."""
        ...

    def expect(self, imm: int, count: int, timeout: float | None = None,
               standing: bool = False) -> Expectation:
        """Resolved once ``count`` units carrying key ``imm`` landed here (``standing``: armed
        ahead of need, no write due soon)."""
        ...
