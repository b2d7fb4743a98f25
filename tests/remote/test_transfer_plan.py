"""The transfer planner: every destination byte written exactly once, counts agree."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from disagg.engine.cache import pages_needed
from disagg.fabric.counter import ImmCounter
from disagg.remote.transfer_plan import (
    UNIT_BITS,
    KVLayoutDesc,
    Runs,
    Write,
    incompatibility,
    make_imm,
    make_key,
    page_runs,
    pages_to_send,
    plan_layer_writes,
    request_units,
)


def layout(num_pages=32, page_size=4, layers=3, **kw):
    base = dict(num_layers=layers, num_pages=num_pages, num_kv_heads=2, page_size=page_size,
                head_dim=8, dtype="float32", element_size=4, hidden_size=16)
    base.update(kw)
    return KVLayoutDesc(**base)


def test_runs_coalesce_only_when_adjacent_on_both_sides():
    assert page_runs([4, 5, 6, 9], [10, 11, 13, 14]) == [(4, 10, 2), (6, 13, 1), (9, 14, 1)]
    assert page_runs([], []) == []


def test_pages_to_send_partial_page_waits_for_completing_chunk():
    # 10 tokens, page 4: pages 0,1 full, page 2 partial (2 tokens)
    assert list(pages_to_send(0, 5, 10, 4)) == [0]  # page 1 only partly filled
    assert list(pages_to_send(5, 9, 10, 4)) == [1]  # completes page 1; page 2 still partial
    assert list(pages_to_send(9, 10, 10, 4)) == [2]  # last chunk sends the partial page
    assert list(pages_to_send(0, 10, 10, 4)) == [0, 1, 2]
    assert list(pages_to_send(0, 2, 10, 4)) == []


def test_incompatible_layouts_named():
    assert incompatibility(layout(), layout(num_pages=7)) is None  # pool sizes may differ
    msg = incompatibility(layout(), layout(page_size=8))
    assert msg is not None and "page_size" in msg
    assert "dtype" in (incompatibility(layout(), layout(dtype="bfloat16")) or "")


def test_keys_differ_per_generation_and_imm_roundtrips():
    assert make_key(5, 1) != make_key(5, 2)
    c = ImmCounter(weight_bits=UNIT_BITS)
    assert c.split(make_imm(make_key(5, 1), 7)) == (make_key(5, 1), 7)
    with pytest.raises(ValueError):
        make_imm(1, 0)


@settings(max_examples=200, deadline=None)
@given(
    total=st.integers(1, 80),
    page_size=st.sampled_from([1, 2, 4, 16]),
    cuts=st.lists(st.integers(1, 79), max_size=6),
    seed=st.integers(0, 2**16),
)
def test_chunked_layerwise_plan_writes_each_destination_byte_once(total, page_size, cuts, seed):
    """Simulate the prefiller: any chunking, every layer; check bytes and the decoder's count."""
    rng = random.Random(seed)
    n = pages_needed(total, page_size)
    src_l, dst_l = layout(num_pages=n * 3 + 2, page_size=page_size), layout(num_pages=n * 2 + 5,
                                                                            page_size=page_size)
    src_pages = sorted(rng.sample(range(src_l.num_pages), n))
    dst_pages = rng.sample(range(dst_l.num_pages), n)
    if rng.random() < 0.5:
        dst_pages.sort()
    bounds = sorted({c for c in cuts if c < total} | {0, total})
    written: dict[int, int] = {}
    units = 0
    for a, b in zip(bounds, bounds[1:], strict=False):
        idx = list(pages_to_send(a, b, total, page_size))
        for layer in range(src_l.num_layers):
            writes = plan_layer_writes(src_l, dst_l, [src_pages[i] for i in idx],
                                       [dst_pages[i] for i in idx], layer)
            for w in writes:
                assert w.length == w.units * src_l.page_bytes
                # source and destination ranges hold the same pages, in order
                s0 = w.src_offset // src_l.page_bytes - layer * src_l.num_pages
                d0 = w.dst_offset // dst_l.page_bytes - layer * dst_l.num_pages
                k = src_pages.index(s0)
                assert dst_pages[k : k + w.units] == list(range(d0, d0 + w.units))
                for off in range(w.dst_offset, w.dst_offset + w.length, dst_l.page_bytes):
                    written[off] = written.get(off, 0) + 1
                units += w.units
    expected = {dst_l.page_offset(layer, p) for layer in range(dst_l.num_layers) for p in dst_pages}
    assert set(written) == expected  # nothing outside the destination pages
    assert all(v == 1 for v in written.values())  # each exactly once
    assert units + 1 == request_units(src_l, dst_l, total)  # + the context write


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 40), st.sampled_from([16, 48, 4096])), min_size=1,
                max_size=8),
       st.integers(1, 1 << 16))
def test_split_runs_keeps_bytes_and_units(runs, max_bytes):
    writes, off = [], 0
    for units, unit in runs:
        writes.append(Write(off, off + (1 << 30), units * unit, units))
        off += units * unit
    r = Runs.of(writes)
    out = r.split(max_bytes)
    assert int(out.units.sum()) == int(r.units.sum())  # what the receiver counts
    covered = sorted(zip(out.src_offset.tolist(), out.dst_offset.tolist(), out.length.tolist(),
                         out.units.tolist(), strict=True))
    assert covered[0][0] == 0 and all(a[0] + a[2] == b[0]
                                      for a, b in zip(covered, covered[1:], strict=False))
    assert sum(c[2] for c in covered) == off and all(d == s + (1 << 30) for s, d, _, _ in covered)
    for s_, _, n, u in covered:
        assert n % u == 0 and (n <= max_bytes or u == 1)
        src_run = next(w for w in writes if w.src_offset <= s_ < w.src_offset + w.length)
        assert n // u == src_run.length // src_run.units  # pieces keep their run's unit size
