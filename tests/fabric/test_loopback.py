"""Acceptance: two real processes on loopback, for the tcp and shm providers.

The test process is one side (an in-process FabricEngine); a spawned child is the other
(:mod:`disagg.fabric.loopback`). Both regenerate the page bytes from a shared seed.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import signal
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest

from disagg.fabric.descriptor import OutOfRange, decode_descriptor
from disagg.fabric.engine import FabricEngine, TransferTimeout, discover
from disagg.fabric.lib import FabricError
from disagg.fabric.loopback import PeerConfig, receiver_main, seeded_pages, sender_main
from disagg.fabric.regions import EngineClosed

pytestmark = [pytest.mark.fabric, pytest.mark.procs]  # libfabric peers in child processes

PROVIDERS = ["tcp", "shm"]
DEADLINE = 60.0  # a guard against hangs only; the engine's own deadlines are shorter


async def recv(conn: Any, timeout: float = DEADLINE) -> Any:
    loop = asyncio.get_running_loop()
    ready = await loop.run_in_executor(None, conn.poll, timeout)
    assert ready, "peer process did not answer"
    return conn.recv()


class Child:
    def __init__(self, target: Any, cfg: PeerConfig) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child_conn = ctx.Pipe()
        self.proc = ctx.Process(target=target, args=(child_conn, cfg), daemon=True)
        self.proc.start()
        child_conn.close()

    def stop(self) -> None:
        if self.proc.is_alive():
            try:
                self.conn.send(("stop",))
            except OSError:
                pass
            self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)


@pytest.fixture
async def engine(request: Any) -> AsyncIterator[FabricEngine]:
    eng = FabricEngine(discover(request.param), max_inflight=4096, default_timeout=30).start()
    yield eng
    await eng.close()


def engine_for(providers: list[str]) -> Any:
    return pytest.mark.parametrize("engine", providers, indirect=True)


@engine_for(PROVIDERS)
async def test_seeded_pages_thousands_in_flight(engine: FabricEngine) -> None:
    """4096 writes submitted at once in shuffled order over 4 batches; verified page by page."""
    pages, page_size = 4096, 2048
    cfg = PeerConfig(provider=engine.info.provider.split(";")[0], pages=pages,
                     page_size=page_size, seed=11, expected=pages, timeout=30)
    child = Child(receiver_main, cfg)
    try:
        kind, raw = await recv(child.conn)
        assert kind == "desc"
        desc = decode_descriptor(raw)
        src = engine.register(seeded_pages(cfg.seed, pages, page_size))
        order = np.random.default_rng(3).permutation(pages)
        child.conn.send(("go", 0xABC))
        assert (await recv(child.conn))[0] == "ready"
        offs = order * page_size
        futs = [engine.submit(src, desc, part, part, page_size, 0xABC)
                for part in np.array_split(offs, 4)]
        await asyncio.wait_for(asyncio.gather(*futs), DEADLINE)
        kind, ok, bad, stats, _ = await recv(child.conn)
        assert kind == "done" and ok and bad == [], f"pages differ: {bad[:10]}"
        assert stats["arrived"] == pages
        assert engine.stats["posted"] == pages
    finally:
        child.stop()


@engine_for(["tcp"])
async def test_out_of_range_rejected_before_posting(engine: FabricEngine) -> None:
    pages, page_size = 8, 4096
    cfg = PeerConfig(provider="tcp", pages=pages, page_size=page_size, seed=5, expected=pages)
    child = Child(receiver_main, cfg)
    try:
        desc = decode_descriptor((await recv(child.conn))[1])
        assert desc.length == pages * page_size
        src = engine.register(seeded_pages(cfg.seed, pages, page_size))
        offs = np.arange(pages) * page_size
        for bad_dst in ([desc.length], [desc.length - 1], [-page_size]):
            with pytest.raises(OutOfRange):
                engine.submit(src, desc, [0], bad_dst, page_size, 1)
        with pytest.raises(OutOfRange):  # batch with one bad write among good ones
            engine.submit(src, desc, offs, np.r_[offs[:-1], desc.length], page_size, 1)
        with pytest.raises(OutOfRange):  # reads past the source
            engine.submit(src, desc, [src.length - 10], [0], page_size, 1)
        with pytest.raises(OutOfRange):  # immediate does not fit
            engine.submit(src, desc, [0], [0], page_size, 1 << 64)
        assert engine.stats["posted"] == 0
        # The peer saw nothing: a legitimate round afterwards lands exactly its pages.
        child.conn.send(("go", 2))
        assert (await recv(child.conn))[0] == "ready"
        await asyncio.wait_for(engine.submit(src, desc, offs, offs, page_size, 2), DEADLINE)
        kind, ok, bad, stats, _ = await recv(child.conn)
        assert kind == "done" and ok, bad
        assert stats["arrived"] == pages
    finally:
        child.stop()


@engine_for(PROVIDERS)
async def test_receiver_dies_mid_transfer(engine: FabricEngine) -> None:
    """The receiver is frozen while a batch to it is in the engine (posting or queued behind
    it), then killed: the batch fails in time."""
    pages, page_size = 512, 256 * 1024
    cfg = PeerConfig(provider=engine.info.provider.split(";")[0], pages=pages,
                     page_size=page_size, expected=pages, verify=False)
    child = Child(receiver_main, cfg)
    try:
        desc = decode_descriptor((await recv(child.conn))[1])
        src = engine.register(np.ones(pages * page_size, dtype=np.uint8))
        offs = np.arange(pages) * page_size
        os.kill(child.proc.pid, signal.SIGSTOP)
        fut = engine.submit(src, desc, offs, offs, page_size, 3, timeout=3)
        for _ in range(300):  # until the progress thread holds the batch for the frozen peer
            if engine.batches_in_flight():
                break
            await asyncio.sleep(0.01)
        assert engine.batches_in_flight() == 1 and not fut.done()
        os.kill(child.proc.pid, signal.SIGKILL)
        child.proc.join(10)
        with pytest.raises((FabricError, TransferTimeout)):
            await asyncio.wait_for(fut, DEADLINE)
        # The engine stays usable: a later batch to the dead peer fails too, within its deadline.
        with pytest.raises((FabricError, TransferTimeout)):
            await asyncio.wait_for(
                engine.submit(src, desc, offs[:4], offs[:4], page_size, 4, timeout=1), DEADLINE)
    finally:
        child.stop()


@engine_for(PROVIDERS)
async def test_sender_dies_expectation_times_out(engine: FabricEngine) -> None:
    pages, page_size = 64, 4096
    cfg = PeerConfig(provider=engine.info.provider.split(";")[0], pages=pages,
                     page_size=page_size, seed=2)
    buf = np.zeros((pages, page_size), dtype=np.uint8)
    region = engine.register(buf)
    child = Child(sender_main, cfg)
    try:
        child.conn.send(("desc", region.descriptor.encode()))
        exp = engine.expect(7, 2 * pages, timeout=3)  # more writes than the sender will make
        child.conn.send(("go", 7))
        assert (await recv(child.conn))[0] == "sent"
        child.proc.kill()
        child.proc.join(10)
        with pytest.raises(TransferTimeout, match=f"{pages} of {2 * pages}"):
            await asyncio.wait_for(exp, DEADLINE)
        assert engine.pending_expectations() == 0
        assert np.array_equal(buf, seeded_pages(cfg.seed, pages, page_size))
    finally:
        child.stop()


@engine_for(PROVIDERS)
async def test_cancelled_expectation_frees_its_slot(engine: FabricEngine) -> None:
    pages, page_size = 32, 4096
    cfg = PeerConfig(provider=engine.info.provider.split(";")[0], pages=pages,
                     page_size=page_size, seed=9)
    buf = np.zeros((pages, page_size), dtype=np.uint8)
    region = engine.register(buf)
    child = Child(sender_main, cfg)
    try:
        child.conn.send(("desc", region.descriptor.encode()))
        exp = engine.expect(0x55, pages)
        assert engine.pending_expectations() == 1
        assert exp.cancel()
        assert not exp.cancel()
        assert engine.pending_expectations() == 0
        with pytest.raises(asyncio.CancelledError):
            await exp
        again = engine.expect(0x55, pages, timeout=30)  # the same immediate, reusable at once
        child.conn.send(("go", 0x55))
        assert (await recv(child.conn))[0] == "sent"
        await asyncio.wait_for(again, DEADLINE)
        assert np.array_equal(buf, seeded_pages(cfg.seed, pages, page_size))
    finally:
        child.stop()


@engine_for(["tcp"])
async def test_close_fails_pending(engine: FabricEngine) -> None:
    exp = engine.expect(1, 1)
    await engine.close()
    with pytest.raises(EngineClosed):
        await asyncio.wait_for(exp, DEADLINE)
