"""The decode graphs' packed input layout (``disagg.engine.cuda_graphs.InputLayout``): one byte
buffer whose views do not overlap, are aligned, and whose prefix for a bucket holds every part
that bucket reads."""

from __future__ import annotations

import torch

from disagg.engine.cuda_graphs import InputLayout


def test_views_are_disjoint_aligned_and_round_trip():
    lay = InputLayout(rows=12, seqs=6, pages=5)
    buf = torch.zeros(lay.nbytes, dtype=torch.uint8)
    rows, lens, tables = lay.views(buf)
    assert rows.shape == (4, 12) and rows.dtype == torch.int64
    assert lens.shape == (6,) and lens.dtype == torch.int32
    assert tables.shape == (6, 5) and tables.dtype == torch.int32
    base = buf.data_ptr()
    for v in (rows, lens, tables):
        assert (v.data_ptr() - base) % InputLayout.ALIGN == 0
    rows.copy_(torch.arange(48).view(4, 12))
    lens.copy_(torch.arange(100, 106, dtype=torch.int32))
    tables.copy_(-torch.arange(30, dtype=torch.int32).view(6, 5))
    # each write landed in its own part only
    assert rows.flatten().tolist() == list(range(48))
    assert lens.tolist() == list(range(100, 106))
    assert tables.flatten().tolist() == [-i for i in range(30)]


def test_a_buckets_prefix_holds_its_rows_lengths_and_tables():
    lay = InputLayout(rows=8, seqs=8, pages=3)
    src = torch.zeros(lay.nbytes, dtype=torch.uint8)
    dst = torch.zeros(lay.nbytes, dtype=torch.uint8)
    s_rows, s_lens, s_tables = lay.views(src)
    s_rows.fill_(7)
    s_lens.fill_(9)
    s_tables.copy_(torch.arange(24, dtype=torch.int32).view(8, 3))
    size = lay.size_for(2)
    dst[:size].copy_(src[:size])
    rows, lens, tables = lay.views(dst)
    assert bool((rows == 7).all()) and bool((lens == 9).all())
    assert tables[:2].flatten().tolist() == list(range(6))
    assert bool((tables[2:] == 0).all())  # rows past the bucket are not copied
    assert lay.size_for(8) == lay.nbytes
