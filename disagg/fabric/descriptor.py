"""What crosses the wire about memory, and the bounds checks made before any write is posted.

A :class:`MemoryDescriptor` is what a receiver advertises about a region it registered; the
sender may write only inside ``[0, length)`` of it. Descriptors from outside the process are
decoded with :func:`decode_descriptor`, which validates every field. :func:`check_writes` is the
pure bounds check both the engine and tests use; it raises :class:`OutOfRange` before posting.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
import numpy as np

U64_MAX = (1 << 64) - 1
MAX_ADDRESS_BYTES = 512  # fi_getname results are tens of bytes (tcp: 16-28, shm: ~60)
# Offsets and lengths are checked as int64; no real region comes near this.
MAX_REGION_BYTES = 1 << 56

U64 = Annotated[int, msgspec.Meta(ge=0)]  # <= U64_MAX checked in __post_init__


class OutOfRange(ValueError):
    """A write would fall outside the source region or the destination descriptor."""


class MemoryDescriptor(msgspec.Struct, frozen=True, array_like=True, tag="mr", tag_field="t"):
    """A remotely writable region, as its owner advertises it.

    Owner: the receiver that registered the region; it must keep the memory registered until
    every sender holding this descriptor is done (the sender never frees anything here).
    """

    backend: Annotated[str, msgspec.Meta(max_length=32)]  # "fabric" or "cuda-ipc"
    provider: Annotated[str, msgspec.Meta(max_length=64)]  # libfabric provider, e.g. "tcp;ofi_rxm"
    address: Annotated[bytes, msgspec.Meta(max_length=MAX_ADDRESS_BYTES)]  # owner endpoint name
    base: U64  # remote address of byte 0: the VA under FI_MR_VIRT_ADDR, else 0 (offsets)
    length: Annotated[int, msgspec.Meta(gt=0, le=MAX_REGION_BYTES)]  # bytes, advertised size
    key: U64  # fi_mr_key as read back from the provider (never assumed)
    region: U64 = 0  # owner-local region id, for logs
    handle: Annotated[bytes, msgspec.Meta(max_length=4096)] = b""  # backend extra (cuda-ipc)

    def __post_init__(self) -> None:
        if self.base > U64_MAX or self.key > U64_MAX or self.region > U64_MAX:
            raise ValueError("descriptor field exceeds 64 bits")
        if self.base + self.length - 1 > U64_MAX:
            raise ValueError("descriptor base + length overflows 64 bits")

    def encode(self) -> bytes:
        return _encoder.encode(self)


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(MemoryDescriptor)


def decode_descriptor(data: bytes) -> MemoryDescriptor:
    """Decode and validate a descriptor received from a peer (raises msgspec.ValidationError)."""
    return _decoder.decode(data)


def as_u64_array(x: Any, n: int | None = None, name: str = "value") -> np.ndarray:
    """A 1-D int64 array of non-negative values (scalars broadcast to ``n``)."""
    a = np.asarray(x)
    if a.ndim == 0 and n is not None:
        a = np.full(n, int(a), dtype=np.int64)
    if a.ndim != 1:
        raise OutOfRange(f"{name} must be one-dimensional")
    if a.dtype.kind not in "iu":
        raise OutOfRange(f"{name} must be integers, got {a.dtype}")
    if a.dtype == np.uint64 and a.size and int(a.max()) > MAX_REGION_BYTES:
        raise OutOfRange(f"{name} too large")
    return a.astype(np.int64, copy=False)


def check_writes(
    src_length: int, dst_length: int, src_offsets: Any, dst_offsets: Any, lengths: Any,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Validate a batch of writes; return (src_offsets, dst_offsets, lengths) as int64 arrays.

    Every write must have a positive length and lie inside both regions. Nothing is posted
    unless the whole batch passes.
    """
    so = as_u64_array(src_offsets, name="src_offsets")
    n = so.shape[0]
    do = as_u64_array(dst_offsets, n, name="dst_offsets")
    ln = as_u64_array(lengths, n, name="lengths")
    if not (do.shape[0] == n and ln.shape[0] == n):
        raise OutOfRange(f"batch arrays differ in length: {n}, {do.shape[0]}, {ln.shape[0]}")
    if n == 0:
        return so, do, ln
    if int(ln.min()) <= 0:
        raise OutOfRange("every write needs a positive length")
    if int(so.min()) < 0 or int(do.min()) < 0:
        raise OutOfRange("negative offset")
    if int(so.max()) > MAX_REGION_BYTES or int(do.max()) > MAX_REGION_BYTES:
        raise OutOfRange("offset too large")
    if int(ln.max()) > MAX_REGION_BYTES:
        raise OutOfRange("length too large")
    src_end = int((so + ln).max())
    if src_end > src_length:
        raise OutOfRange(f"write reads past the source region ({src_end} > {src_length} bytes)")
    dst_end = int((do + ln).max())
    if dst_end > dst_length:
        raise OutOfRange(
            f"write lands past the advertised destination region ({dst_end} > {dst_length} bytes)"
        )
    return so, do, ln
