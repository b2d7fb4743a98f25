"""MLA latent-attention kernels (``disagg.kernels.mla``) against the torch reference: tiny shapes
under the Triton interpreter (a subprocess: an out-of-bounds load segfaults it), DeepSeek sizes
in bf16 on a CUDA device (``gpu``), a decode CUDA graph replayed over new lengths, and no
compile after ``warm``."""

from __future__ import annotations

import itertools
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from interp import run_cases  # noqa: E402
from mla_cases import TOL, all_cases  # noqa: E402

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(scope="module")
def mla_results() -> dict[str, Any]:
    pytest.importorskip("triton")
    return run_cases(HERE / "mla_cases.py", all_cases(), timeout=600)


@pytest.mark.parametrize("cid", all_cases())
def test_interpreted_kernel_matches_reference(cid: str, mla_results: dict[str, Any]) -> None:
    result = mla_results[cid]
    assert "error" not in result, result.get("error")
    tol = TOL[cid.rsplit("-", 1)[1]]
    assert result["err"] <= tol, f"{cid}: relative error {result['err']:.3g}"


# ---------------------------------------------------------------- CUDA, DeepSeek sizes

LAT, ROPE = 512, 64
SCALE = 192**-0.5


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def _cache(page: int, lens: list[int], seed: int, dtype: torch.dtype = torch.bfloat16):
    """A layer view ``buf[1]`` of a ``[2, P, 1, S, 576]`` buffer, scattered block tables."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    width = max((n + page - 1) // page for n in lens)
    pages = width * len(lens) + 7
    buf = torch.randn(2, pages, 1, page, LAT + ROPE, generator=gen, device="cuda").to(dtype)
    perm = torch.randperm(pages, generator=gen, device="cuda")[: width * len(lens)]
    bt = perm.view(len(lens), width).to("cuda", torch.int32)
    return buf, buf[1], bt, torch.tensor(lens, dtype=torch.int32, device="cuda")


def _ref(q, cache, bt, sl, cu):  # type: ignore[no-untyped-def]
    from disagg.kernels import mla

    return mla.reference_attention(q.float(), cache.float(), bt, sl, cu, SCALE, LAT)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("heads,page,batch", [(16, 16, 64), (16, 64, 5), (128, 16, 9),
                                              (128, 64, 1)])
def test_gpu_decode(heads: int, page: int, batch: int) -> None:
    from disagg.kernels import mla

    gen = torch.Generator().manual_seed(heads + page + batch)
    lens = [1, page - 1, page + 1, 4096, 2047][:batch]
    lens += torch.randint(1, 4097, (batch - len(lens),), generator=gen).tolist()
    _, cache, bt, sl = _cache(page, lens, heads * page)
    q = torch.randn(batch, heads, LAT + ROPE, device="cuda", dtype=torch.bfloat16)
    cu = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
    ref = _ref(q, cache, bt, sl, cu)
    for splits in (None, 1, 7):
        out = mla.mla_decode(q, cache, bt, sl, SCALE, LAT, num_splits=splits)
        assert _rel(out, ref) < 1e-2, splits


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("heads,page", list(itertools.product([16, 128], [16, 64])))
def test_gpu_prefill(heads: int, page: int) -> None:
    from disagg.kernels import mla

    # (cached context, chunk): a fresh prompt, a chunk continuing a cached prefix, a decode
    # row, speculative steps (K+1 = 4) over long contexts, a long continuation
    shapes = [(0, 300), (1000, 257), (37, 1), (4000, 4), (page + 1, 4), (2048, 1024)]
    lens = [c + n for c, n in shapes]
    _, cache, bt, sl = _cache(page, lens, heads + page)
    cu = torch.tensor([0, *itertools.accumulate(n for _, n in shapes)], dtype=torch.int32,
                      device="cuda")
    q = torch.randn(int(cu[-1]), heads, LAT + ROPE, device="cuda", dtype=torch.bfloat16)
    out = mla.mla_prefill(q, cache, bt, sl, cu, SCALE, LAT)
    assert _rel(out, _ref(q, cache, bt, sl, cu)) < 1e-2


@pytest.mark.gpu
@needs_cuda
def test_gpu_float32_and_append() -> None:
    from disagg.kernels import mla

    buf, cache, bt, sl = _cache(16, [700, 33], 3, torch.float32)
    rows = torch.randn(40, 2, LAT + ROPE, device="cuda")[:, 1]
    slots = torch.randperm(cache.shape[0] * 16, device="cuda")[:40]
    slots[5] = -1
    want = buf.clone()
    keep = slots >= 0
    want[1, slots[keep] // 16, 0, slots[keep] % 16] = rows[keep]
    mla.append_latent(rows, cache, slots)
    assert torch.equal(buf, want)
    q = torch.randn(2, 16, LAT + ROPE, device="cuda")
    cu = torch.arange(3, dtype=torch.int32, device="cuda")
    ref = _ref(q, cache, bt, sl, cu)
    assert _rel(mla.mla_decode(q, cache, bt, sl, SCALE, LAT), ref) < 5e-3  # tf32 dots
    assert _rel(mla.mla_prefill(q, cache, bt, sl, cu, SCALE, LAT), ref) < 5e-3


@pytest.mark.gpu
@needs_cuda
def test_gpu_decode_graph_replays_new_lengths() -> None:
    """A decode launch captured once (splits fixed by a 4k bound) replays correctly with new
    lengths and block tables copied into the captured tensors."""
    from disagg.kernels import mla

    batch, heads, page = 8, 16, 16
    _, cache, bt, sl = _cache(page, [4096] * batch, 11)
    q = torch.randn(batch, heads, LAT + ROPE, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(batch, heads, LAT, device="cuda", dtype=torch.bfloat16)
    lens_a = sl.clone()
    mla.mla_decode(q, cache, bt, sl, SCALE, LAT, max_seq_len=4096, out=out)  # compile
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        mla.mla_decode(q, cache, bt, sl, SCALE, LAT, max_seq_len=4096, out=out)
    cu = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
    gen = torch.Generator().manual_seed(5)
    for lens in (lens_a, torch.tensor([1, 17, 4096, 300, 15, 16, 2000, 999]),
                 torch.randint(1, 4097, (batch,), generator=gen)):
        sl.copy_(lens.to(torch.int32))
        bt.copy_(bt[torch.randperm(batch, generator=gen).to("cuda")])
        q.copy_(torch.randn_like(q))
        graph.replay()
        torch.cuda.synchronize()
        assert _rel(out, _ref(q, cache, bt, sl, cu)) < 1e-2


@pytest.mark.gpu
@needs_cuda
def test_gpu_layer_and_no_compile_after_warm() -> None:
    """``MLAAttention`` on the triton backend matches the torch backend at DeepSeek-V2-Lite
    sizes; after ``warm`` no step shape (batch, lengths, split count, chunk mix) compiles."""
    from triton import knobs

    from disagg.engine.attention import get_backend
    from disagg.kernels import mla
    from disagg.kernels.interface import AttentionMetadata
    from disagg.model.config import MLAArch
    from disagg.model.mla import MLAAttention

    torch.manual_seed(0)
    page, heads, hidden = 16, 16, 1024
    arch = MLAArch(q_lora_rank=0, kv_lora_rank=LAT, qk_nope_head_dim=128, qk_rope_head_dim=ROPE,
                   v_head_dim=128, rope_interleave=True, softmax_scale=SCALE)
    layer = MLAAttention(hidden, heads, arch, 1e-6, torch.bfloat16, torch.device("cuda"))
    for p in layer.parameters():
        p.data.normal_(0, 0.02)
    kv = torch.zeros(3, 256, 1, page, LAT + ROPE, device="cuda", dtype=torch.bfloat16)
    mla.warm(kv[0], heads, LAT)
    # the layer's own non-attention kernels (its latent norm) compile in one step on the torch
    # backend, as a node's warm-up steps compile them
    dev = torch.device("cuda")
    one = torch.zeros(1, 1, ROPE, device=dev, dtype=torch.bfloat16)
    layer(torch.randn(1, hidden, device=dev, dtype=torch.bfloat16), one, one, kv[0],
          AttentionMetadata(torch.zeros(1, dtype=torch.int64, device=dev),
                            torch.zeros(1, 1, dtype=torch.int32, device=dev),
                            torch.ones(1, dtype=torch.int32, device=dev),
                            torch.tensor([0, 1], dtype=torch.int32, device=dev), 0, 1, 1),
          get_backend("torch", dev))
    compiled: list[Any] = []
    old = knobs.runtime.jit_post_compile_hook
    knobs.runtime.jit_post_compile_hook = lambda *a, **k: compiled.append(k.get("repr"))
    try:
        for step, shapes in enumerate([[(0, 40)], [(40, 1), (0, 300)], [(41, 1), (300, 1)],
                                       [(42, 1), (301, 1), (0, 7), (5, 3)], [(9, 4), (50, 4)]]):
            lens = [c + n for c, n in shapes]
            bt = torch.arange(len(shapes) * 20, dtype=torch.int32).view(len(shapes), 20)
            slots = [int(bt[b, pos // page]) * page + pos % page
                     for b, (c, n) in enumerate(shapes) for pos in range(c, c + n)]
            nd = sum(1 for c, n in shapes if n == 1 and c > 0)
            meta = AttentionMetadata(
                slot_mapping=torch.tensor(slots, device="cuda"), block_tables=bt.cuda(),
                seq_lens=torch.tensor(lens, dtype=torch.int32, device="cuda"),
                cu_seqlens_q=torch.tensor([0, *itertools.accumulate(n for _, n in shapes)],
                                          dtype=torch.int32, device="cuda"),
                num_decodes=nd, max_q_len=max(n for _, n in shapes), max_seq_len=max(lens))
            h = torch.randn(sum(n for _, n in shapes), hidden, device="cuda",
                            dtype=torch.bfloat16)
            ang = torch.rand(h.shape[0], 1, ROPE // 2, device="cuda") * 6
            cos = torch.cat((ang.cos(), ang.cos()), -1).bfloat16()
            sin = torch.cat((ang.sin(), ang.sin()), -1).bfloat16()
            kv[2].copy_(kv[1])
            ref = layer(h, cos, sin, kv[2], meta, get_backend("torch", h.device))
            out = layer(h, cos, sin, kv[1], meta, get_backend("triton", h.device))
            assert torch.equal(kv[1], kv[2]), step
            assert _rel(out.float(), ref.float()) < 2e-2, step
    finally:
        knobs.runtime.jit_post_compile_hook = old
    assert compiled == []


@pytest.mark.gpu
@needs_cuda
def test_gpu_tiles_step_down_when_shared_memory_runs_out() -> None:
    """Asked for key tiles no chip holds, both launchers step down, match the reference, and
    remember the tiles that compiled."""
    from disagg.kernels import mla

    _, cache, bt, sl = _cache(16, [900, 5], 21)
    q = torch.randn(2, 16, LAT + ROPE, device="cuda", dtype=torch.bfloat16)
    cu = torch.arange(3, dtype=torch.int32, device="cuda")
    ref = _ref(q, cache, bt, sl, cu)
    before = dict(mla._FITTED)
    try:
        assert _rel(mla.mla_decode(q, cache, bt, sl, SCALE, LAT, tiles=(16, 256, 2, 4)),
                    ref) < 1e-2
        assert _rel(mla.mla_prefill(q, cache, bt, sl, cu, SCALE, LAT, tiles=(32, 256, 2, 4)),
                    ref) < 1e-2
        assert len(mla._FITTED) == len(before) + 2
    finally:
        mla._FITTED.clear()
        mla._FITTED.update(before)
