"""The interface every transfer backend implements (``make_backend`` returns one).

Backends: ``FabricEngine`` (one libfabric endpoint, ``fabric/engine.py``), ``StripedEngine``
(several lanes, ``fabric/striped.py``), ``CudaIpcEngine`` (GPUs of one host,
``fabric/cuda_ipc.py``). Host staging for GPU memory over the fabric is a layer above them
(``disagg.actors.transfer.StagedRegion``), not a backend. A new backend implements this
Protocol, gets a name in ``make_backend`` and its tests in ``tests/fabric/``.
"""

from __future__ import annotations

import asyncio
from typing import Any, Protocol

from disagg.fabric.descriptor import MemoryDescriptor


class TransferBackend(Protocol):
    @property
    def provider(self) -> str:
        """What a peer's engine must match (with the backend name)."""
        ...

    @property
    def junk(self) -> int:
        """Immediates refused by the receiving counter (unknown, finished, overflowing)."""
        ...

    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> Any: ...

    async def close(self) -> None: ...

    def window(self, regions: list[Any]) -> Any:
        """One attempt's access to ``regions``: ``.descriptors``, ``.close()``."""
        ...

    def submit(self, src: Any, dst: MemoryDescriptor, src_offsets: Any, dst_offsets: Any,
               lengths: Any, imm: int, timeout: float | None = None) -> asyncio.Future[None]:
        """Write ``lengths[i]`` bytes from ``src + src_offsets[i]`` to ``dst +
        dst_offsets[i]``, each carrying ``imm``; the future resolves when all completed at
        the source (or fails; nothing is posted past ``timeout``)."""
        ...

    def expect(self, imm: int, count: int, timeout: float | None = None) -> Any:
        """An awaitable resolved once ``count`` units carrying key ``imm`` landed here."""
        ...


class FabricBackend(TransferBackend, Protocol):
    """The libfabric backends also register host memory by address, with an access mode."""

    def register_address(self, addr: int, length: int, owner: Any = None,
                         access: str = "both") -> Any: ...
