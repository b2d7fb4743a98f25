"""MLA kernel-vs-reference cases, run by ``test_mla_kernels`` in a TRITON_INTERPRET=1 subprocess.

Run directly it reads a JSON list of case ids on stdin and prints one JSON object mapping each
id to ``{"err": float}`` or ``{"error": str}``. Caches are layer views ``buf[:, 1]`` of a
``[P, 2, 1, S, W]`` allocation (the page stride is twice a page's rows), block tables are
random permutations and lengths end mid-page. Dims ``(latent, rope)``: 32 + 16 (48 wide, two
power-of-two parts, as 512 + 64) and 24 + 8 (parts padded and masked, rope narrower than a
dot tile).
"""

from __future__ import annotations

import itertools
import zlib
from typing import Any

DIMS = ((32, 16), (24, 8))
HEADS = (1, 3, 16)
PAGES = (4, 16)
TOL = {"float32": 1e-5, "bfloat16": 1.5e-2}


def all_cases() -> list[str]:
    ids = []
    for (lat, rope), h, s in itertools.product(DIMS, HEADS, PAGES):
        dt = "bfloat16" if (h == 3 and s == 4) else "float32"
        ids.append(f"decode-l{lat}-r{rope}-h{h}-s{s}-{dt}")
        ids.append(f"prefill-l{lat}-r{rope}-h{h}-s{s}-{dt}")
    return [*ids, "append-l32-r16-h1-s4-bfloat16", "append-l24-r8-h1-s16-float32",
            "layer-l32-r8-h4-s4-float32", "warm-l32-r16-h3-s4-bfloat16"]


def _rel(out: Any, ref: Any) -> float:
    import torch

    if not torch.isfinite(out).all():
        return float("inf")
    diff = (out.double() - ref.double()).norm()
    return float(diff / ref.double().norm().clamp_min(1e-30))


class _Setup:
    def __init__(self, lat: int, rope: int, page: int, dtype: str, lens: list[int], seed: int):
        import torch

        self.gen = torch.Generator().manual_seed(seed)
        self.dtype = getattr(torch, dtype)
        self.lat, self.width, self.page = lat, lat + rope, page
        width_pages = max((n + page - 1) // page for n in lens)
        num_pages = width_pages * len(lens) + 3
        self.buf = torch.randn(num_pages, 2, 1, page, lat + rope, generator=self.gen).to(
            self.dtype)
        self.cache = self.buf[:, 1]
        perm = torch.randperm(num_pages, generator=self.gen).to(torch.int32)
        self.block_tables = perm[: width_pages * len(lens)].view(len(lens), width_pages)
        self.block_tables = self.block_tables.contiguous()
        self.seq_lens = torch.tensor(lens, dtype=torch.int32)
        self.scale = (lat + rope) ** -0.5

    def q(self, rows: int, heads: int) -> Any:
        import torch

        return torch.randn(rows, heads, self.width, generator=self.gen).to(self.dtype)


def _cu(shapes: list[tuple[int, int]]) -> Any:
    import torch

    return torch.tensor([0, *itertools.accumulate(n for _, n in shapes)], dtype=torch.int32)


def run_case(cid: str) -> float:
    import torch

    from disagg.kernels import mla

    kind, lat_s, rope_s, h_s, s_s, dtype = cid.split("-")
    lat, rope, heads, page = int(lat_s[1:]), int(rope_s[1:]), int(h_s[1:]), int(s_s[1:])
    seed = zlib.crc32(cid.encode())
    if kind == "decode":
        lens = [1, page - 1, page + 1, 3 * page + 2, 7 * page + 3]
        st = _Setup(lat, rope, page, dtype, lens, seed)
        q = st.q(len(lens), heads)
        cu = torch.arange(len(lens) + 1, dtype=torch.int32)
        ref = mla.reference_attention(q, st.cache, st.block_tables, st.seq_lens, cu, st.scale,
                                      lat)
        errs = []
        for splits in (None, 1, 3):
            out = mla.mla_decode(q, st.cache, st.block_tables, st.seq_lens, st.scale, lat,
                                 num_splits=splits)
            errs.append(_rel(out, ref))
        return max(errs)
    if kind == "prefill":
        # (context before the chunk, chunk length): a fresh prompt, a later chunk, a decode
        # row, a long chunk, a speculative step (K+1 = 4) over a context ending mid-page
        shapes = [(0, 5), (page + 3, 7), (2 * page, 1), (3, 2 * page + 9), (5 * page + 1, 4)]
        lens = [c + n for c, n in shapes]
        st = _Setup(lat, rope, page, dtype, lens, seed)
        cu = _cu(shapes)
        q = st.q(int(cu[-1]), heads)
        ref = mla.reference_attention(q, st.cache, st.block_tables, st.seq_lens, cu, st.scale,
                                      lat)
        out = mla.mla_prefill(q, st.cache, st.block_tables, st.seq_lens, cu, st.scale, lat)
        err = _rel(out, ref)
        if heads != 3:
            return err
        # the same chunks after two decode rows (seq_base), rows before them untouched
        sentinel = torch.full((2, heads, lat), 7.0).to(st.dtype)
        out2 = torch.cat((sentinel, torch.zeros_like(out)))
        q2 = torch.cat((st.q(2, heads), q))
        lens2 = torch.cat((torch.tensor([1, 1], dtype=torch.int32), st.seq_lens))
        bt2 = torch.cat((st.block_tables[:2], st.block_tables))
        cu2 = torch.cat((torch.tensor([0, 1], dtype=torch.int32), cu + 2))
        mla.mla_prefill(q2, st.cache, bt2, lens2, cu2, st.scale, lat,
                        max_q_len=max(n for _, n in shapes), out=out2, seq_base=2)
        if not torch.equal(out2[:2], sentinel):
            return float("inf")
        return max(err, _rel(out2[2:], ref))
    if kind == "append":
        st = _Setup(lat, rope, page, dtype, [3 * page], seed)
        tokens = 2 * page + 3
        slots = torch.randperm(st.cache.shape[0] * page, generator=st.gen)[:tokens]
        slots = slots.to(torch.int64)
        slots[1] = -1
        fused = torch.randn(tokens, 3, lat + rope, generator=st.gen).to(st.dtype)
        rows = fused[:, 1]  # strided rows
        want = st.buf.clone()
        keep = slots >= 0
        want[slots[keep] // page, 1, 0, slots[keep] % page] = rows[keep]
        mla.append_latent(rows, st.cache, slots)
        return 0.0 if torch.equal(st.buf, want) else float("inf")
    if kind == "layer":
        return _layer_case(lat, rope, heads, page, seed)
    if kind == "warm":
        st = _Setup(lat, rope, page, dtype, [page], seed)
        before = st.buf.clone()
        mla.warm(st.cache, heads, lat)
        return 0.0 if torch.equal(st.buf, before) else float("inf")
    raise ValueError(f"unknown case {cid}")


def _layer_case(lat: int, rope: int, heads: int, page: int, seed: int) -> float:
    """``MLAAttention`` through the triton backend (append, decode rows, chunks) against the
    torch backend: same output, same cache."""
    import torch

    from disagg.engine.attention import get_backend
    from disagg.kernels.interface import AttentionMetadata
    from disagg.model.config import MLAArch
    from disagg.model.mla import MLAAttention

    torch.manual_seed(seed)
    arch = MLAArch(q_lora_rank=0, kv_lora_rank=lat, qk_nope_head_dim=16, qk_rope_head_dim=rope,
                   v_head_dim=16, rope_interleave=True, softmax_scale=(16 + rope) ** -0.5)
    hidden = 64
    layer = MLAAttention(hidden, heads, arch, 1e-6, torch.float32, torch.device("cpu"))
    for p in layer.parameters():
        p.data.normal_(0, 0.2)
    shapes = [(page + 2, 1), (0, 1), (2, 9), (page, page + 1), (3, 4)]  # 2 decodes, 3 chunks
    lens = [c + n for c, n in shapes]
    st = _Setup(lat, rope, page, "float32", lens, seed)
    cu = _cu(shapes)
    slots = [int(st.block_tables[b, pos // page]) * page + pos % page
             for b, (c, n) in enumerate(shapes) for pos in range(c, c + n)]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64), block_tables=st.block_tables,
        seq_lens=st.seq_lens, cu_seqlens_q=cu, num_decodes=2,
        max_q_len=max(n for _, n in shapes), max_seq_len=max(lens))
    tokens = int(cu[-1])
    h = torch.randn(tokens, hidden)
    ang = torch.rand(tokens, 1, rope // 2) * 6
    cos, sin = torch.cat((ang.cos(), ang.cos()), -1), torch.cat((ang.sin(), ang.sin()), -1)
    buf_ref = st.buf.clone()
    ref = layer(h, cos, sin, buf_ref[:, 1], meta, get_backend("torch", h.device))
    out = layer(h, cos, sin, st.cache, meta, get_backend("triton", h.device))
    if not torch.allclose(st.buf, buf_ref):
        return float("inf")
    return _rel(out, ref)


if __name__ == "__main__":
    from interp import serve

    serve(run_case)
