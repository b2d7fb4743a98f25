"""disagg.fabric: libfabric bindings (cffi, API mode) and the KV transfer engine.

Self-contained: imports nothing else from ``disagg``. The native module is built by
``python -m disagg.fabric.build`` (run by ``make install``); importing this package does not
load it, so the pure parts (descriptors, counters, topology) work without libfabric.

    from disagg.fabric import make_backend
    engine = make_backend("fabric", provider="tcp").start()  # by name (fabric/registry.py)
    region = engine.register(buffer)          # region.descriptor -> peer (msgspec Struct)
    await engine.submit(region, peer_desc, src_offsets, dst_offsets, lengths, imm)
    await engine.expect(imm, count)           # receiver side
"""

from __future__ import annotations

from disagg.fabric.counter import ImmCounter
from disagg.fabric.descriptor import (
    MemoryDescriptor,
    OutOfRange,
    check_writes,
    decode_descriptor,
)
from disagg.fabric.registry import BACKENDS, make_backend

__all__ = [
    "ImmCounter", "MemoryDescriptor", "OutOfRange", "check_writes", "decode_descriptor",
    "make_backend", "BACKENDS",
]
