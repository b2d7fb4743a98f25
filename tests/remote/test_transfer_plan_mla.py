"""Transfer plans of MLA layouts (``kv_parts`` 1: one latent row per token, one "head" that
every rank holds): simulated on per-rank byte buffers whose bytes encode their (layer, token,
head, part, dim, byte) coordinates, as in test_transfer_plan_tp."""

from __future__ import annotations

import random

import msgspec
import numpy as np
import pytest

from disagg.engine.cache import pages_needed
from disagg.protocol.peer import KVLayoutDesc, PrefillRequest
from disagg.remote.requests import request_problem
from disagg.remote.transfer_plan import (
    CONTEXT_UNITS,
    incompatibility,
    page_shares,
    pages_to_send,
    plan_chunk,
    plan_layer_writes,
    rank_heads,
    replica_senders,
    request_units,
    shard_kv_heads,
    units_per_page,
)

TP_PAIRS = [(1, 1), (1, 2), (2, 1), (2, 2)]


def mla(tp: int, num_pages: int = 12, page_size: int = 2, layers: int = 3, head_dim: int = 6,
        element_size: int = 2, total_heads: int = 1) -> KVLayoutDesc:
    heads, replicas = shard_kv_heads(total_heads, tp)
    return KVLayoutDesc(num_layers=layers, num_pages=num_pages, num_kv_heads=heads,
                        page_size=page_size, head_dim=head_dim, dtype=f"int{8 * element_size}",
                        element_size=element_size, hidden_size=4, tp_size=tp,
                        kv_replicas=replicas, kind="mla", kv_parts=1)


def coords(lay: KVLayoutDesc, rank: int, pages: list[int], total_tokens: int) -> np.ndarray:
    """One rank's buffer, one int64 per byte: the code of the byte the request's KV puts there
    (-1 outside the request's pages)."""
    L, P, K, h, ps, hd, es = (lay.num_layers, len(pages), lay.kv_parts, lay.num_kv_heads,
                              lay.page_size, lay.head_dim, lay.element_size)
    shape = (L, P, K, h, ps, hd, es)
    buf = np.full((L, lay.num_pages, K, h, ps, hd, es), -1, dtype=np.int64)
    layer = np.arange(L).reshape(L, 1, 1, 1, 1, 1, 1)
    token = (np.arange(P).reshape(1, P, 1, 1, 1, 1, 1) * ps
             + np.arange(ps).reshape(1, 1, 1, 1, ps, 1, 1))
    part = np.arange(K).reshape(1, 1, K, 1, 1, 1, 1)
    head = np.array(rank_heads(lay, rank)).reshape(1, 1, 1, h, 1, 1, 1)
    dim = np.arange(hd).reshape(1, 1, 1, 1, 1, hd, 1)
    byte = np.arange(es).reshape(1, 1, 1, 1, 1, 1, es)
    H, T = lay.total_kv_heads, P * ps
    code = (((((layer * T + token) * H + head) * K + part) * hd + dim) * es + byte)
    code = np.where(token < total_tokens, code, -2)
    buf[:, pages] = np.broadcast_to(code, shape)
    return buf.reshape(-1)


def simulate(src: KVLayoutDesc, dst: KVLayoutDesc, src_pages: list[int], dst_pages: list[int],
             total: int, seed: int, cuts: list[int]):
    """Run the prefiller's plan chunk by chunk and layer by layer; returns (writes, per-rank
    expected buffers, per-rank received buffers, per-rank hit counts)."""
    src_bufs = [coords(src, r, src_pages, total) for r in range(src.tp_size)]
    want = [coords(dst, r, dst_pages, total) for r in range(dst.tp_size)]
    got = [np.full_like(w, -1) for w in want]
    hits = [np.zeros(w.shape, dtype=np.int64) for w in want]
    writes = []
    bounds = sorted({c for c in cuts if 0 < c < total} | {0, total})
    for a, b in zip(bounds, bounds[1:], strict=False):
        idx = list(pages_to_send(a, b, total, src.page_size))
        for layer in range(src.num_layers):
            for w in plan_layer_writes(src, dst, [src_pages[i] for i in idx],
                                       [dst_pages[i] for i in idx], layer, seed=seed):
                assert 0 <= w.src_offset and w.src_offset + w.length <= src.total_bytes
                assert 0 <= w.dst_offset and w.dst_offset + w.length <= dst.total_bytes
                got[w.dst_rank][w.dst_offset:w.dst_offset + w.length] = (
                    src_bufs[w.src_rank][w.src_offset:w.src_offset + w.length])
                hits[w.dst_rank][w.dst_offset:w.dst_offset + w.length] += 1
                writes.append(w)
    return writes, want, got, hits


def test_mla_layout_bytes():
    lay = mla(2, num_pages=5, page_size=4, head_dim=576)
    assert (lay.num_kv_heads, lay.kv_replicas, lay.total_kv_heads) == (1, 2, 1)
    assert lay.page_bytes == lay.head_bytes == 4 * 576 * 2  # one latent part, no K/V pair
    assert lay.total_bytes == 3 * 5 * 4 * 576 * 2
    assert lay.page_offset(1, 2) == (5 + 2) * lay.page_bytes
    assert [list(rank_heads(lay, r)) for r in range(2)] == [[0], [0]]  # replicated


@pytest.mark.parametrize("tp_s,tp_d", TP_PAIRS)
@pytest.mark.parametrize("sort", [False, True])
def test_mla_plan_lands_every_page_once(tp_s, tp_d, sort):
    rng = random.Random(tp_s * 10 + tp_d + sort)
    for _ in range(20):
        total = rng.randint(1, 20)
        n = pages_needed(total, 2)
        src, dst = mla(tp_s), mla(tp_d)
        assert incompatibility(src, dst) is None
        src_pages, dst_pages = rng.sample(range(12), n), rng.sample(range(12), n)
        if sort:
            src_pages.sort()
            dst_pages.sort()
        seed = rng.randrange(2**32)
        cuts = [rng.randint(1, 19) for _ in range(rng.randint(0, 3))]
        writes, want, got, hits = simulate(src, dst, src_pages, dst_pages, total, seed, cuts)
        for r in range(tp_d):
            inside = want[r] != -1
            assert (hits[r][inside] == 1).all()  # every page of every layer exactly once
            assert (hits[r][~inside] == 0).all()
            assert (got[r] == want[r]).all()  # the right (layer, token, dim, byte)
            senders = {w.src_rank for w in writes if w.dst_rank == r}
            assert senders <= set(range(tp_s))  # TP 2 -> 1: both replicas may send shares
            assert all(0 in rank_heads(src, s) for s in senders)  # it holds the latent
        units = sum(w.units for w in writes)
        assert units + CONTEXT_UNITS == request_units(src, dst, total)
        assert units == src.num_layers * n * tp_d  # one page run per destination rank
        assert all(w.length == w.units * src.page_bytes for w in writes)


@pytest.mark.parametrize("tp_s,tp_d", TP_PAIRS)
def test_mla_writes_one_run_per_page_per_layer_per_rank(tp_s, tp_d):
    """Pages adjacent on neither side: nothing coalesces, so the decoder's unit count is the
    number of writes: one per destination rank, page and layer, each one whole latent page."""
    src, dst = mla(tp_s, num_pages=16), mla(tp_d, num_pages=16)
    src_pages, dst_pages = [0, 2, 4, 6, 8], [9, 1, 13, 5, 11]
    total = 2 * len(src_pages)
    writes, want, got, hits = simulate(src, dst, src_pages, dst_pages, total, 7, [])
    assert len(writes) == src.num_layers * len(src_pages) * tp_d
    assert all(w.units == 1 and w.length == src.page_bytes for w in writes)
    per = {}
    for w in writes:
        layer, page = divmod(w.dst_offset // dst.page_bytes, dst.num_pages)
        per[(w.dst_rank, layer, page)] = per.get((w.dst_rank, layer, page), 0) + 1
    assert per == {(r, layer, p): 1 for r in range(tp_d) for layer in range(src.num_layers)
                   for p in dst_pages}
    assert len(writes) + CONTEXT_UNITS == request_units(src, dst, total)
    assert units_per_page(src, dst) == tp_d
    assert all((got[r] == want[r]).all() for r in range(tp_d))


def test_mla_replica_choice_varies_with_the_key():
    one, two = mla(1), mla(2)
    pages = [3]

    def senders(src, dst, seed):
        return tuple(sorted({(w.dst_rank, w.src_rank)
                             for w in plan_layer_writes(src, dst, pages, pages, 0, seed)}))

    # TP2 -> TP1: one of the two source replicas sends, which one depends on the key
    assert {senders(two, one, s) for s in range(40)} == {((0, 0),), ((0, 1),)}
    # TP2 -> TP2: both source replicas send, one destination rank each, pairing varies
    assert {senders(two, two, s) for s in range(40)} == {((0, 0), (1, 1)), ((0, 1), (1, 0))}
    # TP1 -> TP2: the one source rank feeds both destination replicas
    assert {senders(one, two, s) for s in range(10)} == {((0, 0), (1, 0))}
    # the decoder's count never depends on the key
    assert {request_units(two, two, 5) for _ in range(3)} == {3 * 3 * 2 + CONTEXT_UNITS}


def test_mla_replicas_share_each_transfer_drawn_per_chunk():
    """TP 2 -> TP 1 (SEED.md 29): each chunk's pages are cut between the two latent replicas,
    the first share's sender drawn per chunk from the key; every page of every layer lands
    once, from one replica, and the decoder's count is unchanged."""
    src, dst = mla(2, num_pages=40), mla(1, num_pages=40)
    assert replica_senders(src, dst, 5) in ([[0, 1]], [[1, 0]])  # both replicas send
    firsts, per_rank = set(), {0: 0, 1: 0}
    rng = random.Random(3)
    for seed in range(30):
        total = rng.randint(9, 40)
        n = pages_needed(total, 2)
        src_pages, dst_pages = rng.sample(range(40), n), rng.sample(range(40), n)
        cuts = sorted(rng.sample(range(1, total), 2))
        writes, want, got, hits = simulate(src, dst, src_pages, dst_pages, total, seed, cuts)
        inside = want[0] != -1
        assert (hits[0][inside] == 1).all() and (hits[0][~inside] == 0).all()
        assert (got[0] == want[0]).all()
        assert sum(w.units for w in writes) + CONTEXT_UNITS == request_units(src, dst, total)
        for w in writes:
            per_rank[w.src_rank] += w.units
        bounds = [0, *cuts, total]
        for a, b in zip(bounds, bounds[1:], strict=False):  # chunk by chunk
            idx = list(pages_to_send(a, b, total, 2))
            if not idx:
                continue
            shares = page_shares(len(idx), replica_senders(src, dst, seed)[0], seed,
                                 dst_pages[idx[0]])
            assert [p for _, r in shares for p in r] == list(range(len(idx)))  # each page once
            assert len(shares) == min(2, len(idx))  # two pages or more: both replicas send
            assert abs(len(shares[0][1]) - len(shares[-1][1])) <= 1  # near-equal shares
            firsts.add(shares[0][0])
            layer0 = plan_layer_writes(src, dst, [src_pages[i] for i in idx],
                                       [dst_pages[i] for i in idx], 0, seed)
            assert {w.src_rank for w in layer0} == {r for r, _ in shares}
            assert plan_layer_writes(src, dst, [src_pages[i] for i in idx],
                                     [dst_pages[i] for i in idx], 0, seed) == layer0  # seeded
    assert firsts == {0, 1}  # the first share's sender varies from transfer to transfer
    assert min(per_rank.values()) > 0.4 * sum(per_rank.values())  # the replicas share the load


def test_partial_pieces_with_one_part_are_one_run_per_head_range():
    """A latent layout sharded over heads (the planner's partial-piece path): with kv_parts 1
    each head range of a page is ONE run (GQA would need two: K and V)."""
    src, dst = mla(1, total_heads=2), mla(2, total_heads=2)  # 2 heads -> 1 per rank
    writes, want, got, hits = simulate(src, dst, [4, 1], [2, 7], 4, 0, [])
    assert len(writes) == src.num_layers * 2 * 2  # layers x pages x destination ranks
    assert all(w.units == 1 and w.length == src.head_bytes for w in writes)
    assert sum(w.units for w in writes) + CONTEXT_UNITS == request_units(src, dst, 4)
    for r in range(2):
        inside = want[r] != -1
        assert (hits[r][inside] == 1).all() and (got[r] == want[r]).all()
    back = simulate(dst, src, [2, 7], [4, 1], 4, 0, [])  # and the prefiller wider
    assert len(back[0]) == src.num_layers * 2 * 2
    assert (back[2][0] == back[1][0]).all()


def test_chunk_plan_matches_layer_plans_for_mla():
    src, dst = mla(2), mla(2)
    plan = plan_chunk(src, dst, [5, 6, 9], [1, 2, 3], seed=11)
    for layer in range(src.num_layers):
        want = {}
        for w in plan_layer_writes(src, dst, [5, 6, 9], [1, 2, 3], layer, 11):
            want.setdefault((w.src_rank, w.dst_rank), []).append(
                (w.src_offset, w.dst_offset, w.length, w.units))
        for pair, ws in want.items():
            r = plan.layer(pair, layer)
            assert list(zip(r.src_offset.tolist(), r.dst_offset.tolist(), r.length.tolist(),
                            r.units.tolist(), strict=True)) == ws


def test_gqa_and_mla_layouts_refused_naming_both_kinds():
    gqa = KVLayoutDesc(num_layers=3, num_pages=12, num_kv_heads=1, page_size=2, head_dim=6,
                       dtype="int16", element_size=2, hidden_size=4)
    assert (gqa.kind, gqa.kv_parts) == ("gqa", 2)
    lat = mla(1)
    msg = incompatibility(lat, gqa)
    assert msg == ("KV layout mismatch: the prefiller's pages hold mla (latent) and the "
                   "decoder's gqa (K/V heads)")
    msg = incompatibility(gqa, lat)
    assert msg is not None and "prefiller's pages hold gqa (K/V heads)" in msg
    assert "decoder's mla (latent)" in msg
    # the prefiller refuses such a request before planning any write
    req = PrefillRequest("0.1", 1, [1, 2, 3], [0, 1], gqa, b"", b"", 0, 5.0)
    assert request_problem(lat, 100, req) == incompatibility(lat, gqa)


def test_kv_parts_must_match_the_kind():
    bad = msgspec.structs.replace(mla(1), kv_parts=2)
    msg = incompatibility(mla(1), bad)
    assert msg is not None and msg.startswith("decoder") and "kv_parts=2" in msg
    odd = msgspec.structs.replace(mla(1), kind="mha")
    msg = incompatibility(odd, mla(1))
    assert msg is not None and msg.startswith("prefiller") and "'mha'" in msg


def test_old_peer_layout_decodes_as_gqa():
    old = dict(num_layers=2, num_pages=8, num_kv_heads=2, page_size=2, head_dim=2,
               dtype="int16", element_size=2, hidden_size=4, tp_size=1, kv_replicas=1)
    lay = msgspec.msgpack.decode(msgspec.msgpack.encode(old), type=KVLayoutDesc)
    assert (lay.kind, lay.kv_parts, lay.page_bytes) == ("gqa", 2, 2 * 2 * 2 * 2 * 2)
    new = msgspec.msgpack.decode(msgspec.msgpack.encode(mla(2)), type=KVLayoutDesc)
    assert new == mla(2)
