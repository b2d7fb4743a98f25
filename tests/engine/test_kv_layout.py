"""KVLayout (disagg.engine.kv_memory): the third dim is K and V (2) or the MLA latent (1)."""

from __future__ import annotations

import os

import torch

from disagg.engine.kv_memory import KVAllocation, KVLayout, map_kv


def test_positional_layout_is_still_k_and_v():
    lay = KVLayout(2, 8, 4, 16, 64, torch.bfloat16)
    assert lay.kv_parts == 2
    assert lay.shape == (2, 8, 2, 4, 16, 64)
    assert lay.page_bytes == 2 * 4 * 16 * 64 * 2


def test_latent_layout_shape_and_bytes():
    lay = KVLayout(3, 10, 1, 16, 576, torch.bfloat16, kv_parts=1)
    assert lay.shape == (3, 10, 1, 1, 16, 576)
    assert lay.page_bytes == 16 * 576 * 2  # one latent row per token, no K/V pair
    assert lay.nbytes == 3 * 10 * lay.page_bytes
    assert lay.nbytes == torch.empty(lay.shape, dtype=lay.dtype).nbytes
    positional = KVLayout(3, 10, 1, 16, 576, torch.bfloat16, 1)
    assert positional == lay


def test_pages_for_budget_follows_kv_parts():
    per_gqa = 4 * 2 * 1 * 16 * 576 * 2  # layers x parts x heads x page x dim x bytes
    budget = 10 * per_gqa + 5
    assert KVLayout.pages_for_budget(budget, 4, 1, 16, 576, torch.bfloat16) == 10
    assert KVLayout.pages_for_budget(budget, 4, 1, 16, 576, torch.bfloat16, kv_parts=1) == 20
    assert KVLayout.pages_for_budget(budget, 4, 1, 16, 576, torch.bfloat16, kv_parts=2) == 10


def test_cpu_allocation_of_a_latent_layout_maps_in_another_view():
    lay = KVLayout(2, 3, 1, 4, 8, torch.float32, kv_parts=1)
    alloc = KVAllocation.create(lay, torch.device("cpu"))
    try:
        assert tuple(alloc.tensor.shape) == lay.shape
        assert alloc.info.shape == [2, 3, 1, 1, 4, 8] and alloc.info.nbytes == lay.nbytes
        assert alloc.fd is not None
        raw, keep = map_kv(alloc.info, alloc.fd)
        assert raw.dtype == torch.uint8 and raw.numel() == lay.nbytes
        view = raw.view(torch.float32).view(lay.shape)
        alloc.tensor[1, 2, 0, 0, 3] = torch.arange(8, dtype=torch.float32)
        assert torch.equal(view[1, 2, 0, 0, 3], torch.arange(8, dtype=torch.float32))
        assert view.view(-1).numel() * 4 == lay.nbytes
        del view, raw, keep
    finally:
        if alloc.fd is not None:
            os.close(alloc.fd)


def test_a_spec_region_follows_the_model_region_in_one_allocation():
    lay = KVLayout(2, 3, 2, 4, 8, torch.float32)
    spec = KVLayout(1, 3, 1, 4, 16, torch.float32)  # a draft model's cache, same pages
    alloc = KVAllocation.create(lay, torch.device("cpu"), spec)
    try:
        assert alloc.spec_tensor is not None and tuple(alloc.spec_tensor.shape) == spec.shape
        assert alloc.info.nbytes == lay.nbytes + spec.nbytes
        assert alloc.info.spec_shape == list(spec.shape)
        assert alloc.fd is not None
        raw, keep = map_kv(alloc.info, alloc.fd)  # what the main process registers: both
        alloc.spec_tensor[0, 2, 1, 0, 3] = 7.0
        floats = raw.view(torch.float32)
        at = (lay.nbytes + (((2 * 2 + 1) * 1 + 0) * 4 + 3) * 16 * 4) // 4
        assert torch.equal(floats[at:at + 16], torch.full((16,), 7.0))
        assert float(alloc.tensor.abs().sum()) == 0.0  # the model's region untouched
        del floats, raw, keep
    finally:
        if alloc.fd is not None:
            os.close(alloc.fd)
