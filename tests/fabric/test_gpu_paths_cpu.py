"""The CPU-testable parts of the GPU transfer paths: the gather-copy tile plan and kernel (Triton
interpreter), the compiled copy-engine loop (a Python callback stands in for cuMemcpyAsync),
the cuMem fd hand-over between processes' engines (SCM_RIGHTS), staging run coalescing."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from disagg.fabric.gather_copy import aligned, copy_runs_reference, plan_tiles
from disagg.fabric.staging import coalesce


def test_plan_tiles_covers_every_byte_once():
    src = np.array([0, 1 << 20, 5 * 16], dtype=np.int64)
    dst = np.array([1 << 30, 0, 7 * 16], dtype=np.int64)
    ln = np.array([16, (3 << 16) + 32, 1 << 16], dtype=np.int64)
    t = plan_tiles(src, dst, ln, tile=1 << 16)
    assert t.shape == (1 + 4 + 1, 3)
    assert (t[:, 2] * 4).sum() == ln.sum()
    assert t[1].tolist() == [1 << 20, 0, (1 << 16) // 4]
    assert t[4].tolist() == [(1 << 20) + (3 << 16), 3 << 16, 8]
    assert aligned(src, dst, ln) and not aligned(src + 8, dst, ln)


def test_gather_copy_kernel_under_the_interpreter():
    code = """
import numpy as np, torch
from disagg.fabric import gather_copy as gc
rng = np.random.default_rng(1)
src = torch.from_numpy(rng.integers(0, 256, size=1 << 20, dtype=np.uint8))
dst = torch.zeros(1 << 20, dtype=torch.uint8)
so = np.array([0, 3 << 16, 4096, 31248 * 16]); do = np.array([43744 * 16, 0, 300016, 6240 * 16])
ln = np.array([16, (2 << 16) + 48, 4096, 4368 * 16])
tab = gc.plan_tiles(so + src.data_ptr(), do + dst.data_ptr(), ln)
gc.launch(torch.from_numpy(tab.reshape(-1).copy()), tab.shape[0], ctas=3, num_warps=1)
ref = np.zeros(1 << 20, dtype=np.uint8)
gc.copy_runs_reference(src.numpy(), ref, so, do, ln)
assert (dst.numpy() == ref).all() and ref.any()
print("ok")
"""
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-2000:]


@pytest.mark.fabric
def test_compiled_copy_loop_calls_the_driver_per_run():
    from disagg.fabric import lib as fl

    src = np.arange(4096, dtype=np.uint8)
    dst = np.zeros(4096, dtype=np.uint8)
    calls = []

    @fl.ffi.callback("int(uint64_t, uint64_t, size_t, void *)")
    def fake_memcpy(d, s, n, stream):
        calls.append(int(fl.ffi.cast("uintptr_t", stream)))
        fl.ffi.memmove(fl.ffi.cast("void *", d), fl.ffi.cast("void *", s), n)
        return 0

    so = np.array([0, 1000, 3000], dtype=np.uint64) + np.uint64(src.ctypes.data)
    do = np.array([2000, 0, 100], dtype=np.uint64) + np.uint64(dst.ctypes.data)
    ln = np.array([500, 700, 96], dtype=np.uint64)
    rc = fl.lib.dg_cuda_copy_runs(fl.ffi.cast("void *", fake_memcpy), 3,
                                  fl.ffi.cast("uint64_t *", do.ctypes.data),
                                  fl.ffi.cast("uint64_t *", so.ctypes.data),
                                  fl.ffi.cast("uint64_t *", ln.ctypes.data),
                                  fl.ffi.cast("void *", 77))
    ref = np.zeros(4096, dtype=np.uint8)
    copy_runs_reference(src, ref, [0, 1000, 3000], [2000, 0, 100], [500, 700, 96])
    assert rc == 0 and calls == [77, 77, 77] and (dst == ref).all()


@pytest.mark.fabric
def test_cumem_fd_handed_over_to_a_peer_of_the_same_user():
    from disagg.fabric.cuda_ipc import CudaIpcEngine
    from disagg.fabric.cuda_mem import fetch_fd, serve_fds

    engine = CudaIpcEngine()
    fd = os.memfd_create("kv-standin")
    os.write(fd, b"hello")
    engine._exports[7] = os.dup(fd)
    got: list[object] = []

    def client() -> None:
        try:
            got.append(fetch_fd(engine._name, 7, timeout=5))
        except Exception as e:  # noqa: BLE001 - checked below
            got.append(e)
        try:
            fetch_fd(engine._name, 8, timeout=5)
        except ConnectionError as e:
            got.append(e)

    t = threading.Thread(target=client)
    t.start()
    deadline = time.monotonic() + 10
    while t.is_alive() and time.monotonic() < deadline:
        serve_fds(engine._fd_srv, engine._exports, engine.stats)
        time.sleep(0.01)
    t.join(1)
    assert isinstance(got[0], int), got
    assert os.pread(got[0], 5, 0) == b"hello"  # the same file, another descriptor
    os.close(got[0])
    assert isinstance(got[1], ConnectionError)
    assert engine.stats["fd_served"] == 1 and engine.stats["fd_refused"] == 1
    os.close(fd)
    engine._release()


def test_staging_coalesces_touching_runs():
    assert coalesce([4096, 0, 8192, 20000], [4096, 4096, 100, 10]) == ([0, 20000], [8292, 10])
    assert coalesce([], []) == ([], [])


@pytest.mark.fabric
def test_cuda_ipc_receiver_counts_notes_and_expires_without_a_gpu():
    """The receiving half of cuda-ipc is plain sockets and the shared expectation table: notes
    ``(imm, runs)`` from a sender count weighted units; junk is counted, late ones time out."""
    import asyncio
    import socket

    from disagg.fabric.cuda_ipc import _IMM, CudaIpcEngine
    from disagg.fabric.expectations import TransferTimeout

    engine = CudaIpcEngine(weight_bits=4)
    loop = asyncio.new_event_loop()
    engine._loop = loop  # no progress thread: the test drives its steps
    met = engine.expect(5, 5, timeout=60)
    late = engine.expect(6, 1, timeout=0)
    out = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    out.sendto(_IMM.pack((5 << 4) | 2, 2), engine._name)  # two runs of two pages
    out.sendto(b"junk", engine._name)
    events: list = []
    assert engine._read_notes(events) and events == []
    out.sendto(_IMM.pack((5 << 4) | 1, 1), engine._name)
    assert engine._read_notes(events)
    assert events == [(met.future, None)] and engine.stats["bad_notes"] == 1
    events.clear()
    engine._expire(events)
    assert len(events) == 1 and events[0][0] is late.future
    assert isinstance(events[0][1], TransferTimeout)
    assert engine.pending_expectations() == 0
    out.close()
    engine._release()
    loop.close()
