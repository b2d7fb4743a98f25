"""Descriptor validation and the pre-posting bounds check (pure, no libfabric)."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from disagg.fabric.counter import ImmCounter
from disagg.fabric.descriptor import (
    MemoryDescriptor,
    OutOfRange,
    check_writes,
    decode_descriptor,
)


def desc(**kw: object) -> MemoryDescriptor:
    base = dict(backend="fabric", provider="tcp;ofi_rxm", address=b"\x02" * 16, base=0,
                length=1 << 20, key=7, region=1)
    base.update(kw)
    return MemoryDescriptor(**base)  # type: ignore[arg-type]


def test_descriptor_round_trip() -> None:
    d = desc(base=(1 << 64) - (1 << 20))
    assert decode_descriptor(d.encode()) == d


@pytest.mark.parametrize(
    "field,value",
    [("length", 0), ("length", -5), ("key", -1), ("base", -1), ("length", 1 << 60),
     ("address", b"x" * 10_000), ("provider", "p" * 200)],
)
def test_descriptor_rejects_bad_fields(field: str, value: object) -> None:
    raw = msgspec.msgpack.encode(["mr", *[value if f == field else getattr(desc(), f)
                                          for f in MemoryDescriptor.__struct_fields__]])
    with pytest.raises(msgspec.ValidationError):
        decode_descriptor(raw)


def test_descriptor_rejects_overflow_and_garbage() -> None:
    fields = [getattr(desc(), f) for f in MemoryDescriptor.__struct_fields__]
    fields[3] = (1 << 64) - 10  # base + length wraps
    with pytest.raises(msgspec.ValidationError):
        decode_descriptor(msgspec.msgpack.encode(["mr", *fields]))
    with pytest.raises(msgspec.DecodeError):
        decode_descriptor(b"\xc1garbage")
    with pytest.raises(msgspec.ValidationError):
        decode_descriptor(msgspec.msgpack.encode(["other", 1, 2]))


def test_check_writes_accepts_in_range() -> None:
    so, do, ln = check_writes(4096, 8192, [0, 2048], [4096, 6144], 2048)
    assert so.tolist() == [0, 2048] and do.tolist() == [4096, 6144] and ln.tolist() == [2048] * 2


@pytest.mark.parametrize(
    "src,dst,lens",
    [([0], [8192], [1]),  # starts at the end of dst
     ([0], [8000], [200]),  # straddles the end of dst
     ([4000], [0], [200]),  # straddles the end of src
     ([0], [-1], [1]),  # negative offset
     ([0], [0], [0]),  # empty write
     ([0, 1], [0], [1, 1]),  # ragged batch
     ([0], [np.uint64(1 << 63)], [1]),  # huge offset
     ([0.5], [0], [1])],  # not integers
)
def test_check_writes_rejects(src: list, dst: list, lens: list) -> None:
    with pytest.raises(OutOfRange):
        check_writes(4096, 8192, src, dst, lens)


def test_counter_counts_in_any_order_and_refuses_the_unexpected() -> None:
    c = ImmCounter()
    assert not c.arrive(5)  # lands before anyone expects it: junk, never counted
    c.expect(5, 3)
    assert not c.arrive(6)
    assert not c.arrive(5)
    assert not c.arrive(5)
    assert c.arrive(5)
    assert c.expected == {} and c.junk == 2 and c.last_junk == 6
    assert not c.arrive(5)  # finished: junk too
    assert c.junk == 3


def test_counter_cancel_frees_the_slot() -> None:
    c = ImmCounter()
    c.expect(9, 4)
    c.arrive(9, 2)
    with pytest.raises(KeyError):
        c.expect(9, 4)  # one expectation per immediate at a time
    assert c.cancel(9)
    assert not c.cancel(9)
    c.expect(9, 2)  # starts from zero again
    assert c.arrive(9, 2)


def test_counter_holds_nothing_for_strangers() -> None:
    c = ImmCounter()
    for i in range(100_000):  # a flood of forged keys grows no table
        c.arrive(i)
    assert c.expected == {} and c.junk == 100_000
    c.expect(7, 1)  # and expect() is unaffected by what arrived before
    assert c.progress(7) == (0, 1)
    with pytest.raises(ValueError):
        c.expect(0, 0)
