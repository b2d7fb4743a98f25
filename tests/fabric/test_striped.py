"""Writes striped over several endpoints (lanes) on loopback tcp: every byte lands once, the
receiver counts one expectation across its lanes, and lane counts may differ on the two sides."""

from __future__ import annotations

import asyncio

import msgspec
import numpy as np
import pytest

from disagg.fabric.descriptor import OutOfRange, decode_descriptor
from disagg.fabric.engine import FabricEngine, discover
from disagg.fabric.lanes import LANES_TAG, lanes_of
from disagg.fabric.loopback import seeded_pages
from disagg.fabric.striped import StripedEngine, discover_lanes

pytestmark = [pytest.mark.fabric, pytest.mark.procs]  # libfabric peers in child processes

DEADLINE = 30.0


def striped(lanes: int) -> StripedEngine:
    return StripedEngine(discover_lanes("tcp", lanes), default_timeout=DEADLINE).start()


async def roundtrip(sender, receiver, pages: int = 96, page_size: int = 4096, imm: int = 7):
    """Send seeded pages in shuffled order, with uneven run lengths; return (dst bytes, src)."""
    data = seeded_pages(5, pages, page_size)
    dst = np.zeros(pages * page_size, dtype=np.uint8)
    src_r = sender.register(data)
    dst_r = receiver.register(dst)
    desc = decode_descriptor(dst_r.descriptor.encode())  # as a peer gets it
    rng = np.random.default_rng(1)
    cuts = np.sort(rng.choice(np.arange(1, pages), 20, replace=False))
    starts = np.r_[0, cuts]
    lens = np.diff(np.r_[starts, pages])
    order = rng.permutation(len(starts))
    exp = receiver.expect(imm, len(starts), timeout=DEADLINE)
    fut = sender.submit(src_r, desc, starts[order] * page_size, starts[order] * page_size,
                        lens[order] * page_size, imm)
    await asyncio.wait_for(asyncio.gather(fut, exp), DEADLINE)
    return dst, data


async def test_two_lanes_to_three_lanes_every_byte_once() -> None:
    sender, receiver = striped(2), striped(3)
    try:
        assert len(lanes_of(receiver.register(np.zeros(16, np.uint8)).descriptor)) == 3
        dst, data = await roundtrip(sender, receiver)
        assert (dst == np.frombuffer(data, np.uint8)).all()
        posted = [lane.stats["posted"] for lane in sender.lanes]
        assert all(p > 0 for p in posted) and sum(posted) == 21  # both lanes carried writes
        arrived = [lane.stats["arrived"] for lane in receiver.lanes]
        assert arrived[2] == 0 and sum(arrived) == 21  # the sender's two lanes reach two of ours
        assert receiver.pending_expectations() == 0
    finally:
        await sender.close()
        await receiver.close()


async def test_striped_and_single_endpoint_peers_interoperate() -> None:
    plain = FabricEngine(discover("tcp"), default_timeout=DEADLINE).start()
    multi = striped(2)
    try:
        for sender, receiver in ((multi, plain), (plain, multi)):
            dst, data = await roundtrip(sender, receiver, pages=32)
            assert (dst == np.frombuffer(data, np.uint8)).all()
    finally:
        await plain.close()
        await multi.close()


async def test_bad_lane_lists_and_bounds_refused_before_posting() -> None:
    sender, receiver = striped(2), striped(2)
    try:
        src = sender.register(np.zeros(8192, np.uint8))
        desc = receiver.register(np.zeros(4096, np.uint8)).descriptor
        with pytest.raises(OutOfRange):
            sender.submit(src, desc, [0, 4096], [0, 4096], 4096, 1)  # past the destination
        for handle in (LANES_TAG + b"\xff\x00", LANES_TAG + msgspec.msgpack.encode(
                [[b"x", 0, 0]] * 16)):  # garbage; more lanes than allowed
            bad = msgspec.structs.replace(desc, handle=handle)
            with pytest.raises(OutOfRange):
                sender.submit(src, bad, [0, 2048], [0, 2048], 2048, 1)
        assert sum(lane.stats["posted"] for lane in sender.lanes) == 0
    finally:
        await sender.close()
        await receiver.close()


@pytest.mark.parametrize("lanes", [1, 2])
def test_bench_fabric_runs_verified(lanes: int) -> None:
    """``disagg-bench fabric`` on CPU, two processes, every byte checked (accounting only)."""
    import json
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "disagg.bench", "fabric", "--pages", "64",
                        "--page-size", "8192", "--rounds", "2", "--lanes", str(lanes), "--json"],
                       capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res["verified"] and res["lanes"] == lanes and res["engine"]["gib_s"] > 0
    assert res["baseline_c"]["writes_s"] > 0 and res["ratio"] > 0


def test_node_refuses_a_descriptor_with_a_bad_lane_list() -> None:
    """What a prefiller does with a PrefillRequest's descriptors: validate the lanes too."""
    from disagg.fabric.descriptor import MemoryDescriptor
    from disagg.transfer import TransferEngine

    good = MemoryDescriptor("fabric", "tcp;ofi_rxm", b"\x02" * 16, 0, 4096, 1,
                            handle=LANES_TAG + msgspec.msgpack.encode([[b"\x02" * 16, 0, 2]]))
    assert len(lanes_of(TransferEngine.decode_descriptor(good.encode()))) == 2
    for handle in (LANES_TAG + b"\xc1", LANES_TAG + msgspec.msgpack.encode([[b"a", -1, 0]]),
                   LANES_TAG + msgspec.msgpack.encode([[b"a", (1 << 64) - 1, 0]])):
        with pytest.raises(OutOfRange):
            TransferEngine.decode_descriptor(
                msgspec.structs.replace(good, handle=handle).encode())
