from __future__ import annotations

import pytest

from disagg.engine.cache import PagePool, pages_needed, slot_mapping


def test_allocate_prefers_contiguous_runs():
    pool = PagePool(10)
    a = pool.allocate(3)
    b = pool.allocate(2)
    assert a == [0, 1, 2] and b == [3, 4]
    pool.free([1])
    # a hole of one page cannot hold 3: the next contiguous run is used
    assert pool.allocate(3) == [5, 6, 7]
    assert pool.num_free == 3


def test_allocate_extends_in_place_after_last_page():
    pool = PagePool(8)
    first = pool.allocate(2)
    pool.allocate(1)  # page 2 taken
    pool.free([2])
    assert first == [0, 1]
    assert pool.allocate(1, after=1) == [2]


def test_allocate_falls_back_to_scattered_and_none_when_short():
    pool = PagePool(6)
    pool.allocate(6)
    pool.free([0, 2, 4])
    assert pool.allocate(4) is None
    assert pool.num_free == 3
    assert pool.allocate(3) == [0, 2, 4]


def test_refcount_and_double_free():
    pool = PagePool(4)
    pages = pool.allocate(2)
    assert pages is not None
    pool.incref(pages)
    pool.free(pages)
    assert pool.num_free == 2
    pool.free(pages)
    assert pool.num_free == 4
    with pytest.raises(ValueError):
        pool.free(pages)
    with pytest.raises(ValueError):
        PagePool(0)


def test_slot_mapping_and_pages_needed():
    assert pages_needed(0, 4) == 0
    assert pages_needed(4, 4) == 1
    assert pages_needed(5, 4) == 2
    assert slot_mapping([7, 2], 2, 4, 4) == [30, 31, 8, 9]
