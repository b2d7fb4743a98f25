"""Kernel-vs-reference cases, run by ``conftest.interp_results`` in a TRITON_INTERPRET=1 subprocess.

Run directly it reads a JSON list of case ids on stdin and prints one JSON object mapping each
id to ``{"err": float}`` or ``{"error": str}``. Caches are always layer views of a
``[L, P, 2, Hkv, S, D]`` allocation (strided), block tables are random permutations, and
lengths end mid-page.
"""

from __future__ import annotations

import itertools
import zlib
from typing import Any

HEAD_DIMS = (64, 128)
PAGE_SIZES = (4, 16)
GROUPS = (1, 4, 8)
DTYPES = ("float32", "float16", "bfloat16")
NUM_KV_HEADS = 2
# relative L2 error bound per dtype (outputs are rounded to the dtype)
TOL = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 1.5e-2}


def case_id(kind: str, head_dim: int, page: int, group: int, dtype: str) -> str:
    return f"{kind}-d{head_dim}-s{page}-g{group}-{dtype}"


def all_cases() -> list[str]:
    ids = []
    for kind in ("append", "decode", "prefill", "backend"):
        for d, s, g, dt in itertools.product(HEAD_DIMS, PAGE_SIZES, GROUPS, DTYPES):
            if kind in ("append", "backend") and g not in (1, 4):
                continue  # append ignores q heads; the backend case is a smoke test of dispatch
            ids.append(case_id(kind, d, s, g, dt))
    return [*ids, "bump-kernel"]


def _rel(out: Any, ref: Any) -> float:
    import torch

    if not torch.isfinite(out).all():
        return float("inf")
    diff = (out.double() - ref.double()).norm()
    return float(diff / ref.double().norm().clamp_min(1e-30))


class _Setup:
    """A strided layer view of a random cache and a scattered block table."""

    def __init__(
        self, head_dim: int, page: int, group: int, dtype: str, lens: list[int], seed: int
    ):
        import torch

        gen = torch.Generator().manual_seed(seed)
        self.dtype = getattr(torch, dtype)
        self.page = page
        self.group = group
        max_pages = max((n + page - 1) // page for n in lens)
        num_pages = max_pages * len(lens) + 3
        kv = torch.randn(2, num_pages, 2, NUM_KV_HEADS, page, head_dim, generator=gen)
        self.kv = kv.to(self.dtype)
        self.k_cache, self.v_cache = self.kv[1, :, 0], self.kv[1, :, 1]
        perm = torch.randperm(num_pages, generator=gen).to(torch.int32)
        self.block_tables = perm[: max_pages * len(lens)].view(len(lens), max_pages).contiguous()
        self.seq_lens = torch.tensor(lens, dtype=torch.int32)
        self.gen = gen
        self.head_dim = head_dim
        self.scale = head_dim**-0.5

    def q(self, rows: int) -> Any:
        import torch

        shape = (rows, NUM_KV_HEADS * self.group, self.head_dim)
        return torch.randn(shape, generator=self.gen).to(self.dtype)


def run_case(cid: str) -> float:
    import torch

    from disagg.kernels import reference

    if cid == "bump-kernel":  # the CUDA counter's kernel, on a plain CPU cell
        from disagg.kernels.counter import _get_bump_kernel

        base, cell = torch.tensor([40], dtype=torch.int64), torch.zeros(1, dtype=torch.int64)
        _get_bump_kernel()[(1,)](base, cell, 2)
        return 0.0 if int(cell[0]) == 42 else float("inf")
    kind, d, s, g, dtype = cid.split("-")
    head_dim, page, group = int(d[1:]), int(s[1:]), int(g[1:])
    seed = zlib.crc32(cid.encode())
    if kind == "append":
        st = _Setup(head_dim, page, group, dtype, [3 * page], seed)
        from disagg.kernels.append import append_kv

        num_slots = st.k_cache.shape[0] * page
        tokens = 2 * page + 3
        slots = torch.randperm(num_slots, generator=st.gen)[:tokens].to(torch.int64)
        slots[1] = -1
        # k/v as strided views of a fused qkv-like buffer
        fused = torch.randn(tokens, 3, NUM_KV_HEADS, head_dim, generator=st.gen).to(st.dtype)
        k, v = fused[:, 1], fused[:, 2]
        want = st.kv.clone()
        reference.append_kv(k, v, want[1, :, 0], want[1, :, 1], slots)
        append_kv(k, v, st.k_cache, st.v_cache, slots)
        return 0.0 if torch.equal(st.kv, want) else float("inf")
    if kind == "decode":
        from disagg.kernels.decode import paged_decode_attention

        lens = [1, page - 1, page + 1, 3 * page + 2, 5 * page]
        st = _Setup(head_dim, page, group, dtype, lens, seed)
        q = st.q(len(lens))
        ref = reference.paged_decode_attention(
            q, st.k_cache, st.v_cache, st.block_tables, st.seq_lens, st.scale
        )
        errs = []
        for splits in (None, 1, 3):
            out = paged_decode_attention(
                q, st.k_cache, st.v_cache, st.block_tables, st.seq_lens, st.scale,
                num_splits=splits, block_n=16,
            )  # fmt: skip
            errs.append(_rel(out, ref))
        return max(errs)
    if kind == "prefill":
        from disagg.kernels.prefill import paged_prefill_attention

        # (context before the chunk, chunk length): fresh prompt, a later chunk, a decode row,
        # a chunk longer than a block
        shapes = [(0, 5), (page + 3, 7), (2 * page, 1), (3, 2 * page + 17)]
        lens = [c + n for c, n in shapes]
        st = _Setup(head_dim, page, group, dtype, lens, seed)
        cu = torch.tensor([0, *itertools.accumulate(n for _, n in shapes)], dtype=torch.int32)
        q = st.q(int(cu[-1]))
        ref = reference.paged_attention(
            q, st.k_cache, st.v_cache, st.block_tables, st.seq_lens, cu, st.scale
        )
        out = paged_prefill_attention(
            q, st.k_cache, st.v_cache, st.block_tables, st.seq_lens, cu, st.scale
        )
        return _rel(out, ref)
    if kind == "backend":
        from disagg.engine.attention import get_backend
        from disagg.kernels.interface import AttentionMetadata

        shapes = [(page + 2, 1), (0, 1), (2, 9), (page, page + 1)]  # two decodes, two chunks
        lens = [c + n for c, n in shapes]
        st = _Setup(head_dim, page, group, dtype, lens, seed)
        cu = torch.tensor([0, *itertools.accumulate(n for _, n in shapes)], dtype=torch.int32)
        tokens = int(cu[-1])
        slots = []
        for b, (c, n) in enumerate(shapes):
            for pos in range(c, c + n):
                slots.append(int(st.block_tables[b, pos // page]) * page + pos % page)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            block_tables=st.block_tables,
            seq_lens=st.seq_lens,
            cu_seqlens_q=cu,
            num_decodes=2,
            max_q_len=max(n for _, n in shapes),
            max_seq_len=max(lens),
        )
        q = st.q(tokens)
        k = torch.randn(tokens, NUM_KV_HEADS, head_dim, generator=st.gen).to(st.dtype)
        v = torch.randn(tokens, NUM_KV_HEADS, head_dim, generator=st.gen).to(st.dtype)
        kv_ref = st.kv.clone()
        torch_be, triton_be = get_backend("torch", q.device), get_backend("triton", q.device)
        torch_be.append_kv(k, v, kv_ref[1, :, 0], kv_ref[1, :, 1], meta)
        ref = torch_be.attend(q, kv_ref[1, :, 0], kv_ref[1, :, 1], meta, st.scale)
        triton_be.append_kv(k, v, st.k_cache, st.v_cache, meta)
        if not torch.equal(st.kv, kv_ref):
            return float("inf")
        out = triton_be.attend(q, st.k_cache, st.v_cache, meta, st.scale)
        return _rel(out, ref)
    raise ValueError(f"unknown case {cid}")


if __name__ == "__main__":
    from interp import serve

    serve(run_case)
