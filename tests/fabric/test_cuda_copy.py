"""The cuda-ipc copy issuer's choices that need no GPU: the copy mode for a batch and where its
tile table goes in the ring (waiting for the oldest batches when the ring is full)."""

from __future__ import annotations

import collections

import numpy as np
import pytest

from disagg.fabric.cuda_copy import CE_MAX_RUNS, RING_ENTRIES, CopyIssuer, _RingFull


def issuer(copy: str = "auto", ce: bool = True) -> CopyIssuer:
    c = CopyIssuer(None, 0, copy, 4, collections.Counter())
    c._ce_fn = object() if ce else None
    return c


def runs(n: int, length: int, offset: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    src = np.arange(n, dtype=np.uint64) * np.uint64(1 << 24) + np.uint64(offset)
    return src, src + np.uint64(1 << 40), np.full(n, length, dtype=np.uint64)


def test_auto_copies_short_aligned_runs_with_the_kernel_and_the_rest_on_copy_engines():
    c = issuer()
    assert c._mode(*runs(64, 4096)) == "kernel"
    assert c._mode(*runs(64, 8 << 20)) == "ce"  # mean run over 4 MiB
    assert c._mode(*runs(64, 4096, offset=4)) == "ce"  # not 16-byte aligned
    c._kernel_broken = True
    assert c._mode(*runs(64, 4096)) == "ce"
    assert issuer(ce=False)._mode(*runs(8, 8 << 20)) == "loop"  # no compiled copy loop
    assert issuer("kernel:64")._mode(*runs(8, 8 << 20)) == "kernel"  # as asked


def test_auto_puts_a_batch_of_few_runs_on_the_copy_engines():
    # a context marker (one run) or a layer in a few long runs: no tile plan, upload, launch
    c = issuer()
    assert c._mode(*runs(1, 8192)) == "ce"
    assert c._mode(*runs(CE_MAX_RUNS, 4096)) == "ce"
    assert c._mode(*runs(CE_MAX_RUNS + 1, 4096)) == "kernel"
    assert issuer(ce=False)._mode(*runs(1, 8192)) == "loop"
    assert issuer("kernel")._mode(*runs(1, 8192)) == "kernel"  # as asked


def test_a_bad_copy_mode_is_refused():
    with pytest.raises(ValueError, match="copy mode"):
        CopyIssuer(None, 0, "dma", None, collections.Counter())


def test_tile_tables_take_the_ring_in_order_and_wait_for_the_oldest_when_it_is_full():
    c = issuer()
    in_flight: collections.deque[tuple[int, int]] = collections.deque()
    waited = []

    def wait_oldest() -> None:
        waited.append(in_flight.popleft())

    def alloc(need: int) -> int:
        start = c._ring_alloc(need, lambda: list(in_flight), wait_oldest)
        in_flight.append((start, start + need))
        return start

    half = RING_ENTRIES // 2
    assert alloc(half - 10) == 0 and alloc(half) == half - 10  # back to back
    assert not waited
    assert alloc(100) == 0 and waited == [(0, half - 10)]  # wrapped, after the oldest finished
    assert alloc(half - 200) == 100  # fits between the wrapped head and the tail
    assert c.stats["ring_waits"] == 1
    with pytest.raises(_RingFull):  # larger than the ring: the copy engines take it
        c._ring_alloc(RING_ENTRIES + 1, lambda: [], wait_oldest)
