"""``disagg-bench fabric``: page-write bandwidth of the transfer engine vs. a plain C loop.

Two real processes on one host: this one sends, a spawned child receives. Each round the
child zeroes its pages, the sender writes every seeded page with one immediate value, the
child waits for all immediates, then checks every byte. Time runs from the first post to the
moment the last immediate landed at the child (CLOCK_MONOTONIC, shared by both processes).
Rounds alternate between the engine (Python API, progress thread) and the baseline: a tight C
loop of ``fi_writedata`` / ``fi_cq_read`` with the same provider, page size and window,
compiled into the same cffi module.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict
from typing import Any

import numpy as np

from disagg.fabric.loopback import (
    PeerConfig,
    _pin,
    bad_pages,
    make_engine,
    receiver_main,
    seeded_pages,
)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--backend", default="fabric", choices=["fabric", "cuda-ipc", "staged"],
                    help="fabric (host memory), cuda-ipc (GPU0 -> last GPU of this host), or "
                         "staged (GPU0 -> pinned -> fabric --provider -> pinned -> last GPU)")
    ap.add_argument("--page-sizes", default="",
                    help="cuda-ipc/staged: comma-separated run sizes, one sweep (bytes)")
    ap.add_argument("--total-bytes", type=int, default=0,
                    help="cuda-ipc/staged: bytes per round (default pages x page size)")
    ap.add_argument("--copy", default="auto",
                    help="cuda-ipc: comma-separated copy modes: auto, kernel[:CTAS], ce, loop")
    ap.add_argument("--memory", default="cumem", choices=["cumem", "malloc"],
                    help="cuda-ipc receiver memory: cuMem with an fd (as the node's KV) or "
                         "cudaMalloc (legacy IPC handle)")
    ap.add_argument("--provider", default="tcp", help="libfabric provider: tcp, shm, net, ...")
    ap.add_argument("--page-size", type=int, default=256 * 1024, help="bytes per write")
    ap.add_argument("--pages", type=int, default=1024, help="writes per round")
    ap.add_argument("--window", type=int, default=64, help="writes in flight at most")
    ap.add_argument("--lanes", type=int, default=1,
                    help="fabric: endpoints the writes are striped over (both sides)")
    ap.add_argument("--rounds", type=int, default=5, help="rounds of each (median reported)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds per round")
    ap.add_argument("--no-pin", action="store_true", help="do not pin the two processes")
    ap.add_argument("--no-baseline", action="store_true", help="skip the plain C loop")
    ap.add_argument("--json", action="store_true", help="print one JSON object")


def _baseline_receiver(conn: Any, cfg: PeerConfig) -> None:
    """Child: a raw endpoint polled by dg_bench_recv, same protocol as receiver_main."""
    from disagg.fabric import lib as fl
    from disagg.fabric.engine import discover

    _pin(cfg.cpu)
    info = discover(cfg.provider)
    fab = fl.Fabric(info)
    dom = fl.Domain(fab)
    cq = fl.CompletionQueue(dom, size=4096, wait_fd=False)
    av = fl.AddressVector(dom)
    ep = fl.Endpoint(dom, cq, av)
    buf = np.zeros((cfg.pages, cfg.page_size), dtype=np.uint8)
    mr = fl.MemoryRegion(dom, buf.ctypes.data, buf.nbytes, ep)
    conn.send(("desc", (ep.name(), mr.remote_base, mr.key)))
    expected = seeded_pages(cfg.seed, cfg.pages, cfg.page_size)
    while True:
        msg = conn.recv()
        if msg[0] == "stop":
            break
        buf[:] = 0
        conn.send(("ready",))
        rc = fl.lib.dg_bench_recv(cq.ptr, cfg.expected, msg[1], int(cfg.timeout * 1e9))
        landed_ns = time.monotonic_ns()
        if rc < 0:
            conn.send(("error", str(fl.FabricError("dg_bench_recv", rc))))
            continue
        bad = bad_pages(buf, expected, list(range(cfg.pages)))
        conn.send(("done", not bad, bad, {}, landed_ns))
    for obj in (mr, ep, cq, av, dom, fab):
        obj.close()


def _spawn(target: Any, cfg: PeerConfig) -> tuple[Any, Any]:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=target, args=(child, cfg), daemon=True)
    proc.start()
    child.close()
    return parent, proc


def _recv(conn: Any, timeout: float) -> Any:
    if not conn.poll(timeout):
        raise TimeoutError("bench peer did not answer")
    msg = conn.recv()
    if msg[0] == "error":
        raise RuntimeError(f"bench peer: {msg[1]}")
    return msg


async def _engine_rounds(cfg: PeerConfig, rounds: int) -> list[float]:
    from disagg.fabric.descriptor import decode_descriptor

    conn, proc = _spawn(receiver_main, cfg)
    engine = make_engine(cfg, cfg.window).start()
    loop = asyncio.get_running_loop()
    try:
        desc = decode_descriptor((await loop.run_in_executor(None, _recv, conn, 60))[1])
        src = engine.register(seeded_pages(cfg.seed, cfg.pages, cfg.page_size))
        offs = np.arange(cfg.pages, dtype=np.int64) * cfg.page_size
        times = []
        for r in range(rounds + 1):  # round 0 warms up connections and page faults
            conn.send(("go", cfg.imm + r))
            await loop.run_in_executor(None, _recv, conn, 60)
            t0 = time.monotonic_ns()
            await engine.submit(src, desc, offs, offs, cfg.page_size, cfg.imm + r,
                                timeout=cfg.timeout)
            _, ok, bad, _, landed = await loop.run_in_executor(None, _recv, conn, cfg.timeout)
            if not ok:
                raise RuntimeError(f"engine round {r}: pages differ: {bad[:10]}")
            if r:
                times.append((landed - t0) / 1e9)
        return times
    finally:
        conn.send(("stop",))
        proc.join(10)
        await engine.close()


def _baseline_rounds(cfg: PeerConfig, rounds: int) -> list[float]:
    from disagg.fabric import lib as fl
    from disagg.fabric.engine import discover

    conn, proc = _spawn(_baseline_receiver, cfg)
    info = discover(cfg.provider)
    fab = fl.Fabric(info)
    dom = fl.Domain(fab)
    cq = fl.CompletionQueue(dom, size=4096, wait_fd=False)
    av = fl.AddressVector(dom)
    ep = fl.Endpoint(dom, cq, av)
    src = seeded_pages(cfg.seed, cfg.pages, cfg.page_size)
    mr = fl.MemoryRegion(dom, src.ctypes.data, src.nbytes, ep)
    try:
        name, base, key = _recv(conn, 60)[1]
        peer = av.insert(name)
        times = []
        for r in range(rounds + 1):
            conn.send(("go", cfg.imm + r))
            _recv(conn, 60)
            t0 = time.monotonic_ns()
            rc = fl.lib.dg_bench_send(
                ep.ptr, cq.ptr, src.ctypes.data, mr.desc, peer, base, key, cfg.page_size,
                cfg.pages, cfg.window, cfg.imm + r, int(cfg.timeout * 1e9))
            if rc < 0:
                raise fl.FabricError("dg_bench_send", rc)
            _, ok, bad, _, landed = _recv(conn, cfg.timeout)
            if not ok:
                raise RuntimeError(f"baseline round {r}: pages differ: {bad[:10]}")
            if r:
                times.append((landed - t0) / 1e9)
        return times
    finally:
        conn.send(("stop",))
        proc.join(10)
        for obj in (mr, ep, cq, av, dom, fab):
            obj.close()


def _summary(times: list[float], cfg: PeerConfig) -> dict[str, float]:
    t = statistics.median(times)
    nbytes = cfg.pages * cfg.page_size
    return {"seconds": t, "gib_s": nbytes / t / 2**30, "writes_s": cfg.pages / t,
            "best_gib_s": nbytes / min(times) / 2**30}


def _pattern(torch: Any, nbytes: int, seed: int, device: str) -> Any:
    """Deterministic bytes, made on the device in both processes: word i = seed + i * K."""
    w = torch.arange(nbytes // 8, dtype=torch.int64, device=device)
    w = w * -7046029254386353131 + seed  # 0x9E3779B97F4A7C15, wrapping
    return w.view(torch.uint8)


def _cuda_receiver(conn: Any, cfg: PeerConfig, total: int, memory: str, backend: str) -> None:
    """Child for cuda-ipc / staged: one buffer on the last GPU, many rounds of any run size.

    Per round ("go", imm, page_size, pages): zero, expect ``pages`` writes, (staged: copy the
    mirror to the GPU), check on the GPU that dst page j holds src page ``pages - 1 - j``."""
    asyncio.run(_cuda_receiver_async(conn, cfg, total, memory, backend))


async def _cuda_receiver_async(conn: Any, cfg: PeerConfig, total: int, memory: str,
                               backend: str) -> None:
    import torch

    dev = torch.cuda.device_count() - 1
    torch.cuda.set_device(dev)
    keep: Any = None
    mirror: Any = None
    if backend == "staged":
        from disagg.fabric.engine import FabricEngine, discover
        from disagg.fabric.staging import HostMirror

        engine: Any = FabricEngine(discover(cfg.provider), max_inflight=cfg.window).start()
        buf = torch.zeros(total, dtype=torch.uint8, device=f"cuda:{dev}")
        mirror = HostMirror(buf)
        region = engine.register_address(int(mirror.host.data_ptr()), total, owner=mirror)
    else:
        from disagg.fabric.cuda_ipc import CudaIpcEngine
        from disagg.fabric.cuda_mem import CuMemAllocation

        engine = CudaIpcEngine(device=dev).start()
        if memory == "cumem":
            keep = CuMemAllocation.create(total, torch.device(f"cuda:{dev}"))
            buf = keep.as_tensor(torch.uint8, (total,))
            region = engine.register(buf, fd=keep.export_fd())
        else:
            buf = torch.zeros(total, dtype=torch.uint8, device=f"cuda:{dev}")
            region = engine.register(buf)
    conn.send(("desc", region.descriptor.encode()))
    src = _pattern(torch, total, cfg.seed, f"cuda:{dev}")
    loop = asyncio.get_running_loop()
    try:
        while True:
            msg = await loop.run_in_executor(None, conn.recv)
            if msg[0] == "stop":
                break
            _, imm, page_size, pages = msg
            buf.zero_()
            if mirror is not None:
                mirror.host.zero_()
            torch.cuda.synchronize(dev)
            exp = engine.expect(imm, pages, timeout=cfg.timeout)
            conn.send(("ready",))
            try:
                await exp
                if mirror is not None:
                    await mirror.into([0], [pages * page_size])
            except Exception as e:  # reported to the parent
                conn.send(("error", f"{type(e).__name__}: {e}"))
                continue
            landed_ns = time.monotonic_ns()
            n = pages * page_size
            got = buf[:n].view(pages, page_size)
            want = src[:n].view(pages, page_size).flip(0)
            bad = (got != want).any(dim=1).nonzero().flatten().tolist()[:10]
            conn.send(("done", not bad, bad, dict(engine.stats), landed_ns))
    finally:
        await engine.close()
        if keep is not None:
            keep.close()


def _spawn_args(target: Any, *args: Any) -> tuple[Any, Any]:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=target, args=(child, *args), daemon=True)
    proc.start()
    child.close()
    return parent, proc


async def _cuda_sweep(cfg: PeerConfig, rounds: int, page_sizes: list[int], copies: list[str],
                      total: int, memory: str, backend: str) -> list[dict[str, Any]]:
    """GPU0 -> last GPU, ``total`` bytes per round in runs of each page size, dst pages in
    reverse order; per (copy mode, page size): engine rounds, each next to a peer copy of the
    same bytes (one ``tensor.copy_``) in the same run."""
    import torch

    from disagg.fabric.descriptor import decode_descriptor

    torch.cuda.set_device(0)
    last = torch.cuda.device_count() - 1
    conn, proc = _spawn_args(_cuda_receiver, cfg, total, memory, backend)
    mirror: Any = None
    if backend == "staged":
        from disagg.fabric.engine import FabricEngine, discover
        from disagg.fabric.staging import HostMirror

        engine: Any = FabricEngine(discover(cfg.provider), max_inflight=cfg.window).start()
    else:
        from disagg.fabric.cuda_ipc import CudaIpcEngine

        engine = CudaIpcEngine(device=0).start()
    loop = asyncio.get_running_loop()
    out: list[dict[str, Any]] = []
    imm = cfg.imm
    try:
        desc = decode_descriptor((await loop.run_in_executor(None, _recv, conn, 120))[1])
        src_t = _pattern(torch, total, cfg.seed, "cuda:0")
        if backend == "staged":
            mirror = HostMirror(src_t)
            region = engine.register_address(int(mirror.host.data_ptr()), total, owner=mirror)
        else:
            region = engine.register(src_t)
        dst_ref = torch.empty_like(src_t, device=f"cuda:{last}")
        for copy in copies:
            if backend != "staged":
                engine.copy = copy
            for ps in page_sizes:
                pages = total // ps
                n = pages * ps
                offs = np.arange(pages, dtype=np.int64) * ps
                times, peer = [], []
                for r in range(rounds + 1):  # round 0 warms up (mapping, JIT, connections)
                    imm += 1
                    conn.send(("go", imm, ps, pages))
                    await loop.run_in_executor(None, _recv, conn, 60)
                    t0 = time.monotonic_ns()
                    if mirror is not None:
                        await mirror.out([0], [n])
                    await engine.submit(region, desc, offs, offs[::-1].copy(), ps, imm,
                                        timeout=cfg.timeout)
                    _, ok, bad, stats, landed = await loop.run_in_executor(
                        None, _recv, conn, cfg.timeout)
                    if not ok:
                        raise RuntimeError(f"{backend} {copy} page {ps} round {r}: "
                                           f"pages differ: {bad}")
                    torch.cuda.synchronize(0)
                    t1 = time.perf_counter()
                    dst_ref[:n].copy_(src_t[:n])
                    torch.cuda.synchronize(last)
                    t2 = time.perf_counter()
                    if r:
                        times.append((landed - t0) / 1e9)
                        peer.append(t2 - t1)
                e = _summary(times, PeerConfig(page_size=ps, pages=pages))
                c = _summary(peer, PeerConfig(page_size=ps, pages=pages))
                row = {"copy": copy if backend != "staged" else f"staged/{cfg.provider}",
                       "page_size": ps, "pages": pages, "engine": e, "peer_copy": c,
                       "ratio": e["gib_s"] / c["gib_s"]}
                out.append(row)
                sys.stderr.write(f"{row['copy']:>12} run {ps >> 10:6d} KiB x {pages:5d}: "
                                 f"{e['gib_s']:7.1f} GiB/s (best {e['best_gib_s']:.1f}), peer copy "
                                 f"{c['gib_s']:7.1f} GiB/s, ratio {row['ratio']:.2f}\n")
        if backend != "staged":
            sys.stderr.write(f"sender stats: {dict(engine.stats)}\n")
        return out
    finally:
        conn.send(("stop",))
        proc.join(20)
        await engine.close()
        if mirror is not None:
            mirror.close()


def run(args: argparse.Namespace) -> dict[str, Any]:
    ncpu = os.cpu_count() or 1
    pin = not args.no_pin and ncpu > 1
    cfg = PeerConfig(
        provider=args.provider, page_size=args.page_size, pages=args.pages, seed=args.seed,
        imm=0x100, expected=args.pages, timeout=args.timeout, max_inflight=args.window,
        cpu=1 if pin else None, window=args.window, lanes=args.lanes,
    )
    if pin:
        _pin(0)
    result: dict[str, Any] = {
        "bench": "fabric", "backend": args.backend, "provider": args.provider,
        "page_size": args.page_size, "pages": args.pages, "window": args.window,
        "lanes": args.lanes,
        "rounds": args.rounds, "pinned": pin, "verified": True,
        "host": f"{platform.machine()} {ncpu} cpus, {platform.system()} {platform.release()}",
        "date": time.strftime("%Y-%m-%d"),
    }
    if args.backend in ("cuda-ipc", "staged"):
        sizes = [int(x) for x in args.page_sizes.split(",")] if args.page_sizes else [
            args.page_size]
        total = args.total_bytes or args.pages * args.page_size
        copies = args.copy.split(",") if args.backend == "cuda-ipc" else ["staged"]
        result.update(total_bytes=total, memory=args.memory, copy=args.copy)
        sweep = asyncio.run(_cuda_sweep(cfg, args.rounds, sizes, copies, total, args.memory,
                                        args.backend))
        result["sweep"] = sweep
        for k in ("engine", "peer_copy", "ratio"):
            result[k] = sweep[0][k]
        return result
    result["engine"] = _summary(asyncio.run(_engine_rounds(cfg, args.rounds)), cfg)
    if not args.no_baseline:
        result["baseline_c"] = _summary(_baseline_rounds(cfg, args.rounds), cfg)
        result["ratio"] = result["engine"]["gib_s"] / result["baseline_c"]["gib_s"]
    return result


def main(args: argparse.Namespace) -> int:
    res = run(args)
    if args.json:
        sys.stdout.write(json.dumps(res) + "\n")
        return 0
    lines = [f"fabric bench: provider={res['provider']} page={res['page_size']} "
             f"pages={res['pages']} window={res['window']} (every byte verified)"]
    for k in ("engine", "baseline_c", "peer_copy"):
        if k in res:
            s = res[k]
            lines.append(f"  {k:<10} {s['gib_s']:7.2f} GiB/s  {s['writes_s']:9.0f} writes/s  "
                         f"(median of {res['rounds']})")
    if "ratio" in res:
        lines.append(f"  engine / reference: {res['ratio']:.2f}x")
    sys.stdout.write("\n".join(lines) + "\n")
    return 0


__all__ = ["add_arguments", "main", "run", "asdict"]
