"""A striped region's lanes as its descriptor advertises them (pure: no libfabric needed).

A region registered with several lanes (``disagg.fabric.striped``) is advertised by lane 0's
descriptor, with the other lanes' ``(address, base, key)`` in its ``handle`` (``b"S"`` +
msgpack), so a peer with a single lane still reads it as a plain descriptor. Both sides read
it with :func:`lanes_of`: the striped engine when it writes, the ownership check when it
proves who owns each lane's endpoint (``disagg.remote.ownership``).
"""

from __future__ import annotations

import functools
from typing import Annotated

import msgspec

from disagg.fabric.descriptor import MAX_ADDRESS_BYTES, U64, MemoryDescriptor, OutOfRange
from disagg.fabric.topology import MAX_LANES

LANES_TAG = b"S"


class Lane(msgspec.Struct, array_like=True, frozen=True):
    """Where one more lane of a striped region is written: its endpoint, base and key."""

    address: Annotated[bytes, msgspec.Meta(max_length=MAX_ADDRESS_BYTES)]
    base: U64
    key: U64


_lanes_dec = msgspec.msgpack.Decoder(Annotated[list[Lane], msgspec.Meta(max_length=MAX_LANES - 1)])
_lanes_enc = msgspec.msgpack.Encoder()


def lanes_handle(extra: list[Lane]) -> bytes:
    """The ``handle`` of a descriptor that advertises ``extra`` lanes after its own."""
    return LANES_TAG + _lanes_enc.encode(extra)


@functools.lru_cache(maxsize=1024)
def lanes_of(desc: MemoryDescriptor) -> list[MemoryDescriptor]:
    """The per-lane descriptors of a region a peer advertised (``[desc]`` for one lane, and
    for any backend other than ``fabric``). Raises ``OutOfRange`` on a malformed lane list.
    Cached: a sender posts to the same few descriptors every layer (do not modify the returned
    list)."""
    if desc.backend != "fabric" or not desc.handle.startswith(LANES_TAG):
        return [desc]
    try:
        extra = _lanes_dec.decode(desc.handle[len(LANES_TAG):])
        return [desc] + [msgspec.structs.replace(desc, address=ln.address, base=ln.base,
                                                 key=ln.key, handle=b"") for ln in extra]
    except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as e:
        raise OutOfRange(f"bad lane list in a descriptor: {e}") from e
