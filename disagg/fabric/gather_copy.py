"""Many byte runs copied by one kernel launch (Triton), for the ``cuda-ipc`` backend.

One ``cuMemcpyAsync`` per page run costs a driver call (microseconds) per run, about as long as
a 1 MiB run takes on NVLink, so the GPU ends up waiting on the CPU. Here a batch of runs becomes
a table of tiles (source address, destination address, 32-bit words; at most ``TILE`` bytes
each) and one persistent kernel copies them all: ``ctas`` programs, each walking the tiles
``pid, pid + ctas, ...`` with 16-byte vector loads and stores. Addresses are absolute (any
memory the launching device can reach: its own, a peer's mapped through cuMem or CUDA IPC,
mapped pinned host memory); the table lives in device memory.

Every address and length must be a multiple of ``ALIGN`` bytes (KV page runs always are);
:func:`aligned` says whether a batch qualifies, and callers fall back to the copy engine
otherwise. :func:`copy_runs_reference` is the plain loop the tests compare against.
"""

from __future__ import annotations

from typing import Any

import numpy as np

TILE = 1 << 16  # bytes per tile: small enough to spread 1 MiB runs over many SMs
ALIGN = 16
BLOCK = 4096  # 32-bit words per loop iteration of one program (16 KiB)

_kernel: Any = None


def aligned(src: np.ndarray, dst: np.ndarray, lengths: np.ndarray) -> bool:
    """True if every address and length of the batch is a multiple of ``ALIGN``."""
    m = np.uint64(ALIGN - 1)
    a = np.asarray(src, dtype=np.uint64)
    b = np.asarray(dst, dtype=np.uint64)
    c = np.asarray(lengths, dtype=np.uint64)
    return not bool(((a | b | c) & m).any())


def plan_tiles(src: np.ndarray, dst: np.ndarray, lengths: np.ndarray,
               tile: int = TILE) -> np.ndarray:
    """An ``(n_tiles, 3)`` int64 table: source address, destination address, 32-bit words.

    Run ``i`` becomes ``ceil(lengths[i] / tile)`` consecutive tiles; the last may be short.
    """
    s = np.asarray(src, dtype=np.int64)
    d = np.asarray(dst, dtype=np.int64)
    n = np.asarray(lengths, dtype=np.int64)
    k = (n + tile - 1) // tile
    total = int(k.sum())
    run = np.repeat(np.arange(s.shape[0]), k)
    first = np.repeat(np.cumsum(k) - k, k)
    off = (np.arange(total, dtype=np.int64) - first) * tile
    out = np.empty((total, 3), dtype=np.int64)
    out[:, 0] = s[run] + off
    out[:, 1] = d[run] + off
    out[:, 2] = np.minimum(tile, n[run] - off) // 4
    return out


def _build() -> Any:
    import triton
    import triton.language as tl

    # n_tiles and the table's offset in the ring change per batch: never specialized on
    @triton.jit(do_not_specialize=["tab_ptr", "n_tiles"])
    def copy_tiles(tab_ptr, n_tiles, BLOCK: tl.constexpr,  # noqa: N803 - Triton constexpr
                   HINTS: tl.constexpr):  # noqa: N803
        pid = tl.program_id(0)
        nprog = tl.num_programs(0)
        for t in range(pid, n_tiles, nprog):
            # the hints go on the pointers (after the int -> pointer cast) so the loads and
            # stores become 16-byte vectors (checked in the sm_90 PTX: ld/st.global.v4.b32)
            sp = tl.multiple_of(tl.load(tab_ptr + 3 * t).to(tl.pointer_type(tl.int32)), 16)
            dp = tl.multiple_of(tl.load(tab_ptr + 3 * t + 1).to(tl.pointer_type(tl.int32)), 16)
            nw = tl.multiple_of(tl.load(tab_ptr + 3 * t + 2), 4)
            for i in range(0, nw, BLOCK):
                o = i + tl.arange(0, BLOCK)
                m = o < nw
                if HINTS:
                    v = tl.load(sp + o, mask=m, cache_modifier=".cg")
                    tl.store(dp + o, v, mask=m, cache_modifier=".cs")
                else:
                    v = tl.load(sp + o, mask=m)
                    tl.store(dp + o, v, mask=m)

    return copy_tiles


def kernel() -> Any:
    global _kernel
    if _kernel is None:
        _kernel = _build()
    return _kernel


def launch(table: Any, n_tiles: int, ctas: int, num_warps: int = 8, block: int = BLOCK,
           hints: bool = True) -> None:
    """Copy every tile of ``table`` (an int64 tensor on the launching device, ``3 * n_tiles``
    entries) on the current stream with ``min(ctas, n_tiles)`` programs."""
    if n_tiles <= 0:
        return
    grid = (max(1, min(ctas, n_tiles)),)
    kernel()[grid](table, n_tiles, BLOCK=block, HINTS=hints, num_warps=num_warps)


def warm(device: Any) -> None:
    """Compile the default launch (hints on) now, before serving: copy one tile on ``device``."""
    import torch

    src = torch.arange(16, dtype=torch.int32, device=device)
    dst = torch.zeros_like(src)
    table = plan_tiles(np.array([src.data_ptr()]), np.array([dst.data_ptr()]), np.array([64]))
    launch(torch.from_numpy(table.reshape(-1)).to(device), table.shape[0], 1, num_warps=4)
    torch.cuda.synchronize(device)


def copy_runs_reference(src: np.ndarray, dst: np.ndarray, src_offsets: Any, dst_offsets: Any,
                        lengths: Any) -> None:
    """The plain loop: ``dst[d:d+n] = src[s:s+n]`` per run (byte arrays)."""
    for s, d, n in zip(np.asarray(src_offsets).tolist(), np.asarray(dst_offsets).tolist(),
                       np.asarray(lengths).tolist(), strict=True):
        dst[d:d + n] = src[s:s + n]
