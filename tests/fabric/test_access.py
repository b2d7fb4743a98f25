"""What a stranger with plain libfabric can do to a registered region (tests/fabric_attacker.py's raw
endpoint, none of the engine's checks): nothing without a live key, and no reads ever."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest

from disagg.fabric.engine import FabricEngine, discover
from fabric_attacker import READ, WRITEDATA, Attacker

pytestmark = pytest.mark.fabric

N = 4096


@pytest.fixture(params=["tcp", "shm"])
async def pair(request: Any) -> AsyncIterator[tuple[FabricEngine, FabricEngine, Attacker]]:
    victim = FabricEngine(discover(request.param), weight_bits=16, default_timeout=10).start()
    sender = FabricEngine(discover(request.param), weight_bits=16, default_timeout=10).start()
    attacker = Attacker(request.param)
    yield victim, sender, attacker
    attacker.close()
    await sender.close()
    await victim.close()


async def scribble(attacker: Attacker, victim: FabricEngine, base: int, offsets: list[int],
                   keys: list[int], imm: int = 0x1_0001, op: int = WRITEDATA,
                   length: int = 8) -> list[int]:
    """The attacker's raw operations at ``base + offsets`` (``base``: a descriptor's, 0 or
    the virtual address), run off the loop (they block)."""
    peer = attacker.peer(victim.address)
    return await asyncio.to_thread(attacker.ops, op, peer, [base + o for o in offsets], keys,
                                   [imm] * len(keys), length, 1000)


async def test_keys_are_random_and_source_regions_refuse_remote_writes(pair) -> None:
    victim, _, attacker = pair
    buf = np.zeros(N, dtype=np.uint8)
    regions = [victim.register_address(buf.ctypes.data, N, buf, access="source")
               for _ in range(4)]
    keys = [r.descriptor.key for r in regions]
    assert len(set(keys)) == 4 and not set(keys) & set(range(0, 65))
    attacker.buffer()[:8] = b"SCRIBBLE"
    await scribble(attacker, victim, regions[0].descriptor.base, [0], [keys[0]])  # real key
    await asyncio.sleep(0.2)
    assert not buf.any() and victim.junk == 0 and victim.stats["arrived"] == 0


async def test_no_remote_reads_even_with_the_key(pair) -> None:
    victim, _, attacker = pair
    if victim.provider == "shm":  # libfabric 1.17 shm reads by CMA and checks no key at all
        pytest.skip("shm does not enforce read access (same-user processes only: docs/NOTES.md)")
    secret = np.full(N, 0x5A, dtype=np.uint8)
    region = victim.register_address(secret.ctypes.data, N, secret, access="both")
    attacker.buffer()[:64] = bytes(64)
    d = region.descriptor
    errs = await scribble(attacker, victim, d.base, [0], [d.key], op=READ, length=64)
    assert errs[0] != 0 and bytes(attacker.buffer()[:64]) == bytes(64)


async def test_a_closed_window_refuses_late_and_forged_writes(pair) -> None:
    victim, sender, attacker = pair
    buf = np.zeros(N, dtype=np.uint8)
    base = victim.register_address(buf.ctypes.data, N, buf, access="source")
    src = np.arange(N, dtype=np.uint8)
    src_region = sender.register_address(src.ctypes.data, N, src, access="source")
    win = victim.window([base])
    desc = win.descriptors[0]
    assert desc.key != base.descriptor.key and desc.length == N
    exp = victim.expect(0x77, 1)
    await sender.submit(src_region, desc, [0], [0], [N // 2], (0x77 << 16) | 1)
    await asyncio.wait_for(exp, 10)
    assert np.array_equal(buf[:N // 2], src[:N // 2])
    arrived = victim.stats["arrived"]
    win.close()
    win.close()  # idempotent
    buf[:] = 0
    exp = victim.expect(0x78, 1, timeout=1)
    late = sender.submit(src_region, desc, [0], [0], [N], (0x78 << 16) | 1)
    await asyncio.gather(late, return_exceptions=True)  # what the sender sees is its business
    attacker.buffer()[:8] = b"SCRIBBLE"
    await scribble(attacker, victim, desc.base, [0, 8], [desc.key, base.descriptor.key],
                   imm=(0x78 << 16) | 1)
    with pytest.raises(TimeoutError):
        await exp
    assert not buf.any() and victim.stats["arrived"] == arrived


async def test_a_write_into_a_closed_window_loses_no_other_write_silently(pair) -> None:
    """On tcp the receiver drops the connection a write with a revoked key came on, and the
    writes queued behind it with it: each of those fails at the sender (a failed last write
    of a batch once completed it as a success, and a prefiller answered done for KV that
    never landed). A write seen completed has landed; a later one goes through."""
    victim, sender, _ = pair
    if victim.provider == "shm":  # libfabric 1.17 shm: docs/NOTES.md
        pytest.skip("shm never completes the refused write and posts nothing after it")
    buf = np.zeros(N, dtype=np.uint8)
    base = victim.register_address(buf.ctypes.data, N, buf, access="source")
    src = np.arange(N, dtype=np.uint8)
    src_region = sender.register_address(src.ctypes.data, N, src, access="source")
    live, dead = victim.window([base]), victim.window([base])
    dead.close()
    n = 64
    exp = victim.expect(0x77, 2 * n, timeout=3)

    def one(desc: Any, imm: int) -> asyncio.Future[None]:  # one write: its batch's last
        return sender.submit(src_region, desc, [0], [0], [N], (imm << 16) | 1)

    before = [one(live.descriptors[0], 0x77) for _ in range(n)]
    refused = one(dead.descriptors[0], 0x78)
    after = [one(live.descriptors[0], 0x77) for _ in range(n)]
    results = await asyncio.gather(*before, refused, *after, return_exceptions=True)
    await asyncio.gather(exp, return_exceptions=True)
    completed = sum(r is None for i, r in enumerate(results) if i != n)
    assert completed <= victim.stats["arrived"] <= 2 * n
    exp = victim.expect(0x79, 1, timeout=5)
    await one(live.descriptors[0], 0x79)
    await asyncio.wait_for(exp, 10)


def test_ownership_nonces_leave_on_endpoints_of_their_own() -> None:
    from disagg.transfer import TransferEngine

    async def run() -> None:
        transfer = TransferEngine("fabric", "tcp").start()
        try:
            probes = transfer.probes()
            assert probes is not transfer and transfer.probes() is probes
            assert probes.engine.address != transfer.engine.address
        finally:
            await transfer.close()

    asyncio.run(run())


async def test_forged_immediates_on_a_live_window_are_junk(pair) -> None:
    victim, _, attacker = pair
    buf = np.zeros(N, dtype=np.uint8)
    base = victim.register_address(buf.ctypes.data, N, buf, access="source")
    win = victim.window([base])
    exp = victim.expect(0x99, 10, timeout=5)
    d = win.descriptors[0]
    # a stranger that somehow holds the live key but not the attempt's immediate key, then
    # one past the expected count: neither completes it nor raises anywhere
    await scribble(attacker, victim, d.base, [0] * 5, [d.key] * 5, imm=(0x98 << 16) | 10)
    await scribble(attacker, victim, d.base, [0], [d.key], imm=(0x99 << 16) | 11)
    await asyncio.sleep(0.3)
    assert not exp.future.done() and exp.landed() == 0 and victim.junk == 6
    win.close()
    assert exp.cancel()


def test_generations_are_random_and_fit_the_immediate() -> None:
    from disagg.remote.transfer_plan import (
        GEN_BITS,
        SLOT_BITS,
        UNIT_BITS,
        make_imm,
        make_key,
        new_generation,
    )

    assert SLOT_BITS + GEN_BITS + UNIT_BITS == 64 and GEN_BITS >= 40
    gens = {new_generation() for _ in range(1000)}
    assert len(gens) == 1000 and 0 not in gens and max(gens) < 1 << GEN_BITS
    assert not gens & set(range(1, 1 << 16))  # never the old counter's values (2^-24 each)
    imm = make_imm(make_key(255, (1 << GEN_BITS) - 1), (1 << UNIT_BITS) - 1)
    assert imm == (1 << 64) - 1


def test_per_attempt_windows_by_what_the_backend_says() -> None:
    from types import SimpleNamespace

    from disagg.fabric.engine import cheap_registration
    from disagg.transfer import per_attempt_windows

    assert cheap_registration("tcp;ofi_rxm") and cheap_registration("shm")
    assert not cheap_registration("verbs;ofi_rxm")

    def backend(revocable: bool, provider: str) -> Any:
        return SimpleNamespace(revocable_windows=revocable,
                               cheap_registration=cheap_registration(provider))

    assert per_attempt_windows(backend(True, "tcp;ofi_rxm"), "auto")
    assert per_attempt_windows(backend(True, "shm"), "auto")
    assert not per_attempt_windows(backend(True, "verbs;ofi_rxm"), "auto")
    assert per_attempt_windows(backend(True, "verbs;ofi_rxm"), "on")
    assert not per_attempt_windows(backend(True, "tcp;ofi_rxm"), "off")
    assert not per_attempt_windows(backend(False, "tcp"), "on")  # IPC mappings: not revocable
    with pytest.raises(ValueError):
        per_attempt_windows(backend(True, "tcp"), "yes")


def test_backends_declare_what_they_can_do() -> None:
    """The wrapper asks these, never a backend's name (cuda-ipc's class needs no GPU)."""
    from disagg.fabric.cuda_ipc import CudaIpcEngine
    from disagg.fabric.engine import FabricEngine
    from disagg.fabric.striped import StripedEngine

    for cls in (FabricEngine, StripedEngine):
        assert cls.backend == "fabric" and not cls.device_memory and cls.revocable_windows
    assert CudaIpcEngine.backend == "cuda-ipc"
    assert CudaIpcEngine.device_memory and not CudaIpcEngine.revocable_windows
