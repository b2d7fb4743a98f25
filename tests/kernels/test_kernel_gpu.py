"""The compiled Triton kernels and the host-mapped layer counter on a CUDA device."""

from __future__ import annotations

import itertools

import pytest
import torch

from disagg.kernels import reference

pytestmark = pytest.mark.gpu

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _setup(dtype: torch.dtype, page: int, group: int, lens: list[int], head_dim: int = 128):
    gen = torch.Generator().manual_seed(page * 31 + group)
    hkv = 4
    width = max((n + page - 1) // page for n in lens)
    pages = width * len(lens) + 5
    kv = torch.randn(3, pages, 2, hkv, page, head_dim, generator=gen).to("cuda", dtype)
    perm = torch.randperm(pages, generator=gen)[: width * len(lens)]
    bt = perm.view(len(lens), width).to("cuda", torch.int32)
    sl = torch.tensor(lens, dtype=torch.int32, device="cuda")
    return kv, bt, sl, hkv * group


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@needs_cuda
@pytest.mark.parametrize(
    "dtype,page,group",
    list(itertools.product([torch.bfloat16, torch.float16], [16, 64], [1, 4, 8])),
)
def test_decode_and_prefill(dtype: torch.dtype, page: int, group: int) -> None:
    from disagg.kernels.decode import paged_decode_attention
    from disagg.kernels.prefill import paged_prefill_attention

    lens = [1, page - 1, 3 * page + 5, 2000]
    kv, bt, sl, hq = _setup(dtype, page, group, lens)
    k, v = kv[2, :, 0], kv[2, :, 1]
    q = torch.randn(len(lens), hq, 128, device="cuda", dtype=dtype)
    ref = reference.paged_decode_attention(q, k, v, bt, sl, 0.088)
    for splits in (None, 1, 5):
        out = paged_decode_attention(q, k, v, bt, sl, 0.088, num_splits=splits)
        assert _rel(out, ref) < 1e-2
    cu = torch.tensor([0, 1, 1 + page - 1, 1 + page - 1 + 7, 1 + page - 1 + 7 + 300], device="cuda")
    cu = cu.to(torch.int32)
    q = torch.randn(int(cu[-1]), hq, 128, device="cuda", dtype=dtype)
    ref = reference.paged_attention(q, k, v, bt, sl, cu, 0.088)
    out = paged_prefill_attention(q, k, v, bt, sl, cu, 0.088)
    assert _rel(out, ref) < 1e-2


@needs_cuda
@pytest.mark.parametrize("dtype,head_dim", list(itertools.product(
    [torch.float32, torch.bfloat16], [64, 128, 256])))
def test_every_dtype_and_head_dim_fits_and_matches(dtype: torch.dtype, head_dim: int) -> None:
    """Prefill tiles chosen for the dtype: float32 at head_dim 128 over 64 query rows used to
    ask for more shared memory than the chip has; decode and prefill against the reference."""
    from disagg.kernels.decode import paged_decode_attention
    from disagg.kernels.prefill import paged_prefill_attention

    page, group = 16, 4
    lens = [7, 300, 1100]
    kv, bt, sl, hq = _setup(dtype, page, group, lens, head_dim)
    k, v = kv[1, :, 0], kv[1, :, 1]
    scale = head_dim**-0.5
    tol = 5e-3 if dtype == torch.float32 else 1e-2  # tl.dot takes float32 as tf32
    q = torch.randn(len(lens), hq, head_dim, device="cuda", dtype=dtype)
    ref = reference.paged_decode_attention(q, k, v, bt, sl, scale)
    assert _rel(paged_decode_attention(q, k, v, bt, sl, scale), ref) < tol
    cu = torch.tensor([0, 7, 7 + 300, 7 + 300 + 65], device="cuda", dtype=torch.int32)
    q = torch.randn(int(cu[-1]), hq, head_dim, device="cuda", dtype=dtype)
    ref = reference.paged_attention(q, k, v, bt, sl, cu, scale)
    assert _rel(paged_prefill_attention(q, k, v, bt, sl, cu, scale), ref) < tol


@needs_cuda
def test_append_exact() -> None:
    from disagg.kernels.append import append_kv

    kv, _, _, _ = _setup(torch.bfloat16, 16, 1, [64])
    slots = torch.randperm(kv.shape[1] * 16, device="cuda")[:40]
    slots[3] = -1
    rows = torch.randn(40, 3, 4, 128, device="cuda", dtype=torch.bfloat16)
    want = kv.clone()
    reference.append_kv(rows[:, 0], rows[:, 2], want[1, :, 0], want[1, :, 1], slots)
    append_kv(rows[:, 0], rows[:, 2], kv[1, :, 0], kv[1, :, 1], slots)
    assert torch.equal(kv, want)


@needs_cuda
def test_counter_bump_visible_without_sync() -> None:
    import time

    from disagg.kernels.counter import LayerCounter

    with LayerCounter.create("cuda") as counter:
        reader = LayerCounter.attach(counter.handle())
        counter.set_base(1000)
        torch.cuda._sleep(10_000_000)  # keep the stream busy; the bump lands after it
        counter.bump(7)
        deadline = time.monotonic() + 10
        while reader.read() != 1007 and time.monotonic() < deadline:
            pass
        assert reader.read() == 1007
        reader.close()


@needs_cuda
def test_prefill_steps_down_when_the_compiler_runs_out_of_shared_memory() -> None:
    """Told the chip has far more shared memory than it has, the launcher's first tiles do not
    compile; it steps down the ladder, still matches the reference, and starts lower later."""
    from disagg.kernels import prefill

    dtype, head_dim = torch.float32, 128
    key = (torch.cuda.current_device(), 4, head_dim)
    prefill._SMEM[key] = 10**6
    try:
        kv, bt, sl, hq = _setup(dtype, 16, 4, [300], head_dim)
        k, v = kv[1, :, 0], kv[1, :, 1]
        cu = torch.tensor([0, 300], device="cuda", dtype=torch.int32)
        q = torch.randn(300, hq, head_dim, device="cuda", dtype=dtype)
        ref = reference.paged_attention(q, k, v, bt, sl, cu, head_dim**-0.5)
        out = prefill.paged_prefill_attention(q, k, v, bt, sl, cu, head_dim**-0.5)
        assert _rel(out, ref) < 5e-3
        assert prefill._SMEM[key] < 10**6
    finally:
        prefill._SMEM.pop(key, None)
