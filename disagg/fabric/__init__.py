"""disagg.fabric: libfabric bindings (cffi, API mode) and the KV transfer engine.

Self-contained: imports nothing else from ``disagg``. The native module is built by
``python -m disagg.fabric.build`` (run by ``make install``); importing this package does not
load it, so the pure parts (descriptors, counters, topology) work without libfabric.

    from disagg.fabric import make_backend
    engine = make_backend("fabric", provider="tcp").start()
    region = engine.register(buffer)          # region.descriptor -> peer (msgspec Struct)
    await engine.submit(region, peer_desc, src_offsets, dst_offsets, lengths, imm)
    await engine.expect(imm, count)           # receiver side
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from disagg.fabric.counter import ImmCounter
from disagg.fabric.descriptor import (
    MemoryDescriptor,
    OutOfRange,
    check_writes,
    decode_descriptor,
)

__all__ = [
    "ImmCounter", "MemoryDescriptor", "OutOfRange", "check_writes", "decode_descriptor",
    "make_backend", "BACKENDS",
]

if TYPE_CHECKING:
    from disagg.fabric.backend import TransferBackend

BACKENDS = ("fabric", "cuda-ipc")


def make_backend(name: str = "fabric", provider: str | None = "tcp", lanes: int = 1,
                 nearest: tuple[str, ...] = (), address: str = "", **kw: Any) -> TransferBackend:
    """Build a transfer engine by ``--transfer-backend`` name (not started). ``fabric`` binds
    its endpoint(s) on ``address`` (``--fabric-address``; empty: loopback, the provider's
    choice); with ``lanes`` > 1 it stripes writes
    over that many endpoints, on the interfaces named in ``nearest`` first (see
    ``disagg.fabric.striped``)."""
    if name == "fabric" and lanes > 1:
        from disagg.fabric.striped import StripedEngine, discover_lanes

        return StripedEngine(discover_lanes(provider, lanes, nearest, node=address or "127.0.0.1",
                                            source=bool(address)), **kw)
    if name == "fabric":
        from disagg.fabric.engine import FabricEngine, discover

        return FabricEngine(discover(provider, node=address or "127.0.0.1",
                                     source=bool(address)), **kw)
    if name == "cuda-ipc":
        from disagg.fabric.cuda_ipc import CudaIpcEngine

        return CudaIpcEngine(**kw)
    raise ValueError(f"unknown transfer backend {name!r}; choose one of {', '.join(BACKENDS)}")
