"""Sharded transfer plans: simulate every write on per-rank byte buffers whose bytes encode
their (layer, token, kv head, K/V, dim, byte) coordinates, and check the decoder's buffers."""

from __future__ import annotations

import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from disagg.engine.cache import pages_needed
from disagg.remote.transfer_plan import (
    CONTEXT_UNITS,
    MAX_RUN,
    KVLayoutDesc,
    incompatibility,
    make_imm,
    make_key,
    pages_to_send,
    plan_chunk,
    plan_layer_writes,
    rank_heads,
    replica_assignment,
    replica_ranks,
    request_units,
    shard_kv_heads,
)

TP = [1, 2, 4, 8]


def sharded(total_heads: int, tp: int, num_pages: int = 8, page_size: int = 2, layers: int = 2,
            head_dim: int = 2, element_size: int = 2) -> KVLayoutDesc:
    heads, replicas = shard_kv_heads(total_heads, tp)
    return KVLayoutDesc(num_layers=layers, num_pages=num_pages, num_kv_heads=heads,
                        page_size=page_size, head_dim=head_dim, dtype=f"int{8 * element_size}",
                        element_size=element_size, hidden_size=4, tp_size=tp,
                        kv_replicas=replicas)


def shardable(h: int, tp: int) -> bool:
    return h % tp == 0 or tp % h == 0


def coords(lay: KVLayoutDesc, rank: int, pages: list[int], total_tokens: int) -> np.ndarray:
    """One rank's buffer, one int64 per byte: the code of the byte the request's KV puts there
    (-1 outside the request's pages and past the prompt's last token)."""
    L, P, h, ps, hd, es = (lay.num_layers, len(pages), lay.num_kv_heads, lay.page_size,
                           lay.head_dim, lay.element_size)
    buf = np.full((L, lay.num_pages, 2, h, ps, hd, es), -1, dtype=np.int64)
    layer = np.arange(L).reshape(L, 1, 1, 1, 1, 1, 1)
    token = (np.arange(P).reshape(1, P, 1, 1, 1, 1, 1) * ps
             + np.arange(ps).reshape(1, 1, 1, 1, ps, 1, 1))
    kv = np.arange(2).reshape(1, 1, 2, 1, 1, 1, 1)
    head = np.array(rank_heads(lay, rank)).reshape(1, 1, 1, h, 1, 1, 1)
    dim = np.arange(hd).reshape(1, 1, 1, 1, 1, hd, 1)
    byte = np.arange(es).reshape(1, 1, 1, 1, 1, 1, es)
    H, T = lay.total_kv_heads, P * ps
    code = (((((layer * T + token) * H + head) * 2 + kv) * hd + dim) * es + byte)
    code = np.where(token < total_tokens, code, -2)  # slots past the prompt: still copied
    buf[:, pages] = np.broadcast_to(code, (L, P, 2, h, ps, hd, es))
    return buf.reshape(-1)


@st.composite
def layouts(draw):
    tp_s, tp_d = draw(st.sampled_from(TP)), draw(st.sampled_from(TP))
    heads = draw(st.sampled_from([h for h in range(1, 17)
                                  if shardable(h, tp_s) and shardable(h, tp_d)]))
    common = dict(page_size=draw(st.sampled_from([1, 2, 3, 4])),
                  layers=draw(st.integers(1, 3)),
                  head_dim=draw(st.sampled_from([1, 2, 4])),
                  element_size=draw(st.sampled_from([1, 2])))
    return heads, tp_s, tp_d, common


@settings(max_examples=300, deadline=None)
@given(lay=layouts(), total=st.integers(1, 24), cuts=st.lists(st.integers(1, 23), max_size=4),
       seed=st.integers(0, 2**32), rnd=st.integers(0, 2**16))
def test_sharded_plan_moves_every_element_to_its_place_once(lay, total, cuts, seed, rnd):
    heads, tp_s, tp_d, common = lay
    rng = random.Random(rnd)
    n = pages_needed(total, common["page_size"])
    src = sharded(heads, tp_s, num_pages=n + rng.randint(0, 4), **common)
    dst = sharded(heads, tp_d, num_pages=n + rng.randint(0, 4), **common)
    assert incompatibility(src, dst) is None
    src_pages = rng.sample(range(src.num_pages), n)
    dst_pages = rng.sample(range(dst.num_pages), n)
    for pages in (src_pages, dst_pages):
        if rng.random() < 0.5:
            pages.sort()  # contiguous-ish lists, so whole-page runs coalesce
    src_bufs = [coords(src, r, src_pages, total) for r in range(tp_s)]
    want = [coords(dst, r, dst_pages, total) for r in range(tp_d)]
    got = [np.full_like(w, -1) for w in want]
    hits = [np.zeros(w.shape, dtype=np.int64) for w in want]
    units, senders = 0, set()
    bounds = sorted({c for c in cuts if c < total} | {0, total})
    for a, b in zip(bounds, bounds[1:], strict=False):  # the prefiller: chunk by chunk,
        idx = list(pages_to_send(a, b, total, src.page_size))
        for layer in range(src.num_layers):  # layer by layer
            writes = plan_layer_writes(src, dst, [src_pages[i] for i in idx],
                                       [dst_pages[i] for i in idx], layer, seed=seed)
            for w in writes:
                assert 0 <= w.src_offset and w.src_offset + w.length <= src.total_bytes
                assert 0 <= w.dst_offset and w.dst_offset + w.length <= dst.total_bytes
                assert 0 < w.units <= MAX_RUN
                make_imm(make_key(7, 1), w.units)
                got[w.dst_rank][w.dst_offset:w.dst_offset + w.length] = (
                    src_bufs[w.src_rank][w.src_offset:w.src_offset + w.length])
                hits[w.dst_rank][w.dst_offset:w.dst_offset + w.length] += 1
                units += w.units
                senders.add(w.src_rank)
    for r in range(tp_d):
        inside = want[r] != -1
        assert (hits[r][inside] == 1).all()  # every destination byte exactly once
        assert (hits[r][~inside] == 0).all()  # nothing outside the destination pages
        assert (got[r] == want[r]).all()  # the same (layer, token, head, K/V, dim, byte)
    # both sides agree: the decoder's count from the two layouts is what the prefiller sent
    assert units + CONTEXT_UNITS == request_units(src, dst, total)
    if dst.kv_replicas >= src.kv_replicas:
        assert senders == set(range(tp_s))  # every source device sends


@settings(max_examples=100, deadline=None)
@given(lay=layouts(), pages=st.integers(1, 40))
def test_write_counts_follow_sharding(lay, pages):
    """Equal sharding: rank i -> rank i, one write per run of pages; otherwise K and V of every
    page piece are separate writes of one unit each."""
    heads, tp_s, tp_d, common = lay
    src, dst = (sharded(heads, t, num_pages=pages, **common) for t in (tp_s, tp_d))
    ids = list(range(pages))
    writes = plan_layer_writes(src, dst, ids, ids, 0)
    if (src.num_kv_heads, src.kv_replicas, tp_s) == (dst.num_kv_heads, dst.kv_replicas, tp_d) \
            and src.kv_replicas == 1:
        assert [(w.src_rank, w.dst_rank, w.units) for w in writes] == [
            (r, r, pages) for r in range(tp_s)]
    if src.num_kv_heads != dst.num_kv_heads:
        assert all(w.units == 1 and w.length == min(src.num_kv_heads, dst.num_kv_heads)
                   * src.head_bytes for w in writes)
        per_dst = {}
        for w in writes:
            per_dst[w.dst_rank] = per_dst.get(w.dst_rank, 0) + 1
        pieces = max(1, dst.num_kv_heads // src.num_kv_heads)
        assert per_dst == {d: 2 * pages * pieces for d in range(tp_d)}


def test_tp1_plan_unchanged():
    a = sharded(2, 1, num_pages=10)
    writes = plan_layer_writes(a, a, [1, 2, 3, 7], [4, 5, 6, 0], 1)
    pb = a.page_bytes
    assert [(w.src_offset, w.dst_offset, w.length, w.units, w.src_rank, w.dst_rank)
            for w in writes] == [((10 + 1) * pb, (10 + 4) * pb, 3 * pb, 3, 0, 0),
                                 ((10 + 7) * pb, 10 * pb, pb, 1, 0, 0)]
    assert request_units(a, a, 7) == 2 * 4 + 1  # layers x pages of 7 tokens by 2, + context


def test_prefiller_wider_assembles_a_page_from_head_ranges():
    src, dst = sharded(4, 2), sharded(4, 1)  # 2 heads per source rank, 4 on the decoder
    writes = plan_layer_writes(src, dst, [3], [5], 0)
    hb = src.head_bytes
    assert [(w.src_rank, w.src_offset, w.dst_offset, w.length) for w in writes] == [
        (0, 3 * src.page_bytes, 5 * dst.page_bytes, 2 * hb),  # K of heads 0-1
        (0, 3 * src.page_bytes + 2 * hb, 5 * dst.page_bytes + 4 * hb, 2 * hb),  # V of 0-1
        (1, 3 * src.page_bytes, 5 * dst.page_bytes + 2 * hb, 2 * hb),  # K of heads 2-3
        (1, 3 * src.page_bytes + 2 * hb, 5 * dst.page_bytes + 6 * hb, 2 * hb),  # V of 2-3
    ]
    assert request_units(src, dst, 2) == 2 * 1 * 4 + 1


def test_replica_sets_and_assignment():
    lay = sharded(2, 8)  # 2 kv heads over 8 ranks: 4 replicas, ranks 0-3 hold head 0
    assert (lay.num_kv_heads, lay.kv_replicas, lay.total_kv_heads) == (1, 4, 2)
    assert [rank_heads(lay, r).start for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert replica_ranks(lay, 1) == [1, 5]
    one = sharded(2, 2)
    assert replica_assignment(one, lay, 5) == [0, 0, 0, 0]
    spread = replica_assignment(lay, lay, 123)
    assert sorted(spread) == [0, 1, 2, 3]  # every source set sends
    assert replica_assignment(lay, lay, 123) == spread  # deterministic in the seed
    assert len({tuple(replica_assignment(lay, one, s)) for s in range(50)}) == 4  # varies


def test_incompatible_layouts_named():
    base = sharded(8, 2)
    assert incompatibility(base, sharded(8, 4, num_pages=3)) is None  # sharding may differ
    for kw, field in ((dict(head_dim=4), "head_dim"), (dict(page_size=4), "page_size"),
                      (dict(layers=3), "num_layers"), (dict(element_size=1), "dtype")):
        msg = incompatibility(base, sharded(8, 2, **kw))
        assert msg is not None and field in msg, (kw, msg)
    msg = incompatibility(base, sharded(4, 2))
    assert msg is not None and "total_kv_heads" in msg
    bad = KVLayoutDesc(num_layers=2, num_pages=8, num_kv_heads=1, page_size=2, head_dim=2,
                       dtype="int16", element_size=2, hidden_size=4, tp_size=4, kv_replicas=3)
    msg = incompatibility(base, bad)
    assert msg is not None and "kv_replicas" in msg and msg.startswith("decoder")
    with pytest.raises(ValueError, match="--tp 4"):
        shard_kv_heads(6, 4)


def test_layout_without_replica_field_decodes_as_unreplicated():
    import msgspec

    old = dict(num_layers=2, num_pages=8, num_kv_heads=2, page_size=2, head_dim=2,
               dtype="int16", element_size=2, hidden_size=4, tp_size=1)
    lay = msgspec.msgpack.decode(msgspec.msgpack.encode(old), type=KVLayoutDesc)
    assert (lay.kv_replicas, lay.total_kv_heads, list(rank_heads(lay, 0))) == (1, 2, [0, 1])


@settings(max_examples=200, deadline=None)
@given(lay=layouts(), n=st.integers(1, 12), seed=st.integers(0, 2**32), rnd=st.integers(0, 2**16))
def test_chunk_plan_equals_planning_every_layer(lay, n, seed, rnd):
    """What the prefiller posts (one plan per chunk, shifted per layer) is exactly
    ``plan_layer_writes`` of each layer, per (source rank, destination rank)."""
    heads, tp_s, tp_d, common = lay
    rng = random.Random(rnd)
    src = sharded(heads, tp_s, num_pages=n + rng.randint(0, 4), **common)
    dst = sharded(heads, tp_d, num_pages=n + rng.randint(0, 4), **common)
    src_pages = rng.sample(range(src.num_pages), n)
    dst_pages = rng.sample(range(dst.num_pages), n)
    if rng.random() < 0.5:
        src_pages.sort()
        dst_pages.sort()
    plan = plan_chunk(src, dst, src_pages, dst_pages, seed)
    for layer in range(src.num_layers):
        want: dict[tuple[int, int], list] = {}
        for w in plan_layer_writes(src, dst, src_pages, dst_pages, layer, seed):
            want.setdefault((w.src_rank, w.dst_rank), []).append(
                (w.src_offset, w.dst_offset, w.length, w.units))
        assert set(want) == set(plan.by_pair)
        for pair, ws in want.items():
            r = plan.layer(pair, layer)
            got = list(zip(r.src_offset.tolist(), r.dst_offset.tolist(), r.length.tolist(),
                           r.units.tolist(), strict=True))
            assert got == ws
