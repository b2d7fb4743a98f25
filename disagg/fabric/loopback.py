"""Two-process loopback scenarios shared by the fabric tests and ``disagg-bench fabric``.

Each worker runs in its own (spawned) process, talks to the parent over a multiprocessing
pipe (msgpack-free: plain picklable tuples) and builds its pages from a shared seed, so both
sides know every expected byte without shipping it.
"""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class PeerConfig:
    provider: str = "tcp"
    page_size: int = 4096
    pages: int = 64
    seed: int = 0
    imm: int = 0x1234
    expected: int = 64  # writes the receiver waits for
    timeout: float = 30.0
    max_inflight: int = 1024
    cpu: int | None = None  # pin to this core
    verify: bool = True
    baseline: bool = False  # also run the plain C loop (bench)
    window: int = 64
    rounds: int = 1
    lanes: int = 1  # fabric endpoints (StripedEngine when > 1)


def make_engine(cfg: PeerConfig, max_inflight: int) -> Any:
    """The fabric engine a bench or loopback peer uses: one endpoint, or ``cfg.lanes``."""
    from disagg.fabric import make_backend

    return make_backend("fabric", cfg.provider, lanes=cfg.lanes, max_inflight=max_inflight)


def seeded_pages(seed: int, pages: int, page_size: int) -> np.ndarray:
    """``pages`` x ``page_size`` bytes; page i depends only on (seed, i)."""
    out = np.empty((pages, page_size), dtype=np.uint8)
    words = page_size // 8
    for i in range(pages):
        rng = np.random.Generator(np.random.PCG64([seed, i]))
        row = out[i]
        if words:
            row[: words * 8] = rng.integers(0, 1 << 63, size=words, dtype=np.int64).view(np.uint8)
        if page_size % 8:
            row[words * 8:] = rng.integers(0, 256, size=page_size % 8, dtype=np.uint8)
    return out


def bad_pages(buf: np.ndarray, expected: np.ndarray, dst_pages: list[int]) -> list[int]:
    """Destination pages whose bytes differ from the expected source pages, in order."""
    return [i for k, i in enumerate(dst_pages) if not np.array_equal(buf[i], expected[k])]


def _pin(cpu: int | None) -> None:
    if cpu is not None and hasattr(os, "sched_setaffinity"):
        ncpu = os.cpu_count() or 1
        os.sched_setaffinity(0, {cpu % ncpu})


def receiver_main(conn: Any, cfg: PeerConfig) -> None:
    """Register ``pages`` zeroed pages, advertise them, wait for ``expected`` writes, verify.

    Messages to the parent: ("desc", bytes), then per round ("ready",) and
    ("done", ok, bad_pages, stats, landed_ns) or ("error", text). Parent messages: ("go",) per round, ("stop",).
    """
    _pin(cfg.cpu)
    asyncio.run(_receiver(conn, cfg))


async def _receiver(conn: Any, cfg: PeerConfig) -> None:
    engine = make_engine(cfg, cfg.max_inflight).start()
    buf = np.zeros((cfg.pages, cfg.page_size), dtype=np.uint8)
    region = engine.register(buf)
    conn.send(("desc", region.descriptor.encode()))
    expected = seeded_pages(cfg.seed, cfg.pages, cfg.page_size) if cfg.verify else None
    loop = asyncio.get_running_loop()
    try:
        while True:
            msg = await loop.run_in_executor(None, conn.recv)
            if msg[0] == "stop":
                break
            imm = msg[1] if len(msg) > 1 else cfg.imm
            buf[:] = 0
            exp = engine.expect(imm, cfg.expected, timeout=cfg.timeout)
            conn.send(("ready",))
            try:
                await exp
            except Exception as e:  # reported to the parent, which decides
                conn.send(("error", f"{type(e).__name__}: {e}"))
                continue
            landed_ns = time.monotonic_ns()  # CLOCK_MONOTONIC: comparable across processes
            bad: list[int] = []
            if expected is not None:
                bad = bad_pages(buf, expected, list(range(cfg.pages)))
            conn.send(("done", not bad, bad, dict(engine.stats), landed_ns))
    finally:
        await engine.close()


def sender_main(conn: Any, cfg: PeerConfig) -> None:
    """Receive a descriptor, write every seeded page to it with ``cfg.imm``; report the result.

    Parent messages: ("desc", bytes), then ("go", imm) per round, ("stop",). Replies:
    ("sent", seconds) or ("error", text).
    """
    _pin(cfg.cpu)
    asyncio.run(_sender(conn, cfg))


async def _sender(conn: Any, cfg: PeerConfig) -> None:
    from disagg.fabric.descriptor import decode_descriptor
    engine = make_engine(cfg, cfg.max_inflight).start()
    src = seeded_pages(cfg.seed, cfg.pages, cfg.page_size)
    region = engine.register(src)
    loop = asyncio.get_running_loop()
    try:
        msg = await loop.run_in_executor(None, conn.recv)
        desc = decode_descriptor(msg[1])
        offs = np.arange(cfg.pages, dtype=np.int64) * cfg.page_size
        while True:
            msg = await loop.run_in_executor(None, conn.recv)
            if msg[0] == "stop":
                break
            t0 = time.perf_counter()
            try:
                await engine.submit(region, desc, offs, offs, cfg.page_size, msg[1],
                                    timeout=cfg.timeout)
            except Exception as e:
                conn.send(("error", f"{type(e).__name__}: {e}"))
                continue
            conn.send(("sent", time.perf_counter() - t0))
    finally:
        await engine.close()
