"""The speculative region of a KV layout (a draft model's or the MTP layers' pages, shipped
beside the model's, SEED.md 15/25): validation, refusal by name, and plans that write every
byte of it once, after the main region, counted as the decoder counts."""

from __future__ import annotations

import random

import numpy as np
import pytest

from disagg.engine.cache import pages_needed
from disagg.protocol.peer import KVLayoutDesc, PrefillRequest
from disagg.remote.requests import descriptor_problem
from disagg.remote.transfer_plan import (
    incompatibility,
    job_pages_plan,
    layout_problem,
    pages_to_send,
    request_units,
    spec_pages_plan,
)

PAGE = 4


def region(layers: int = 2, heads: int = 1, dim: int = 4, pages: int = 24, kind: str = "gqa",
           dtype: str = "float32") -> KVLayoutDesc:
    return KVLayoutDesc(layers, pages, heads, PAGE, dim, dtype, 4, 0, kind=kind,
                        kv_parts=2 if kind == "gqa" else 1)


def layout(spec: KVLayoutDesc | None = None, method: str = "draft", tp: int = 1,
           pages: int = 24) -> KVLayoutDesc:
    return KVLayoutDesc(3, pages, 2, PAGE, 8, "float32", 4, 16, tp_size=tp,
                        spec_method=method if spec is not None else "", spec=spec)


def request(dst: KVLayoutDesc, n: int, skip: int, seed: int) -> PrefillRequest:
    rng = random.Random(seed)
    pages = rng.sample(range(dst.num_pages), pages_needed(n, PAGE) - skip)
    return PrefillRequest("r", 1, [5] * n, pages, dst, b"", b"", 0, 10.0, skip_pages=skip)


def test_a_spec_region_must_be_well_formed():
    assert layout_problem(layout(region())) is None
    assert layout_problem(layout(region(), method="mtp")) is None
    assert "unknown spec_method" in (layout_problem(layout(region(), method="eagle")) or "")
    assert "without a spec region" in (layout_problem(
        KVLayoutDesc(3, 24, 2, PAGE, 8, "float32", 4, 16, spec_method="draft")) or "")
    assert "same pages" in (layout_problem(layout(region(pages=23))) or "")
    nested = KVLayoutDesc(2, 24, 1, PAGE, 4, "float32", 4, 0, spec_method="draft",
                          spec=region())
    assert "holds a spec region" in (layout_problem(layout(nested)) or "")


def test_a_decoder_refuses_a_prefiller_whose_speculative_setup_differs_by_name():
    plain, draft = layout(), layout(region())
    assert incompatibility(draft, draft) is None
    assert incompatibility(plain, draft) == (
        "speculative set-up mismatch: the decoder (draft) needs a draft model's KV and the "
        "prefiller (none) makes no speculative KV")
    assert "the decoder (none) needs no speculative KV and the prefiller (draft)" in (
        incompatibility(draft, plain) or "")
    assert "(mtp) makes the MTP layers' KV" in (
        incompatibility(layout(region(), method="mtp"), draft) or "")
    why = incompatibility(layout(region(layers=3)), draft)
    assert why == ("speculative set-up mismatch: the prefiller's draft KV has num_layers=3, "
                   "the decoder's num_layers=2")
    assert "head_dim=8" in (incompatibility(layout(region(dim=8)), draft) or "")


@pytest.mark.parametrize("seed", range(6))
def test_spec_writes_cover_the_region_once_after_the_main_one(seed):
    rng = random.Random(seed)
    spec = region(layers=rng.choice([1, 2, 3]), heads=rng.choice([1, 2]),
                  kind=rng.choice(["gqa", "mla"]))
    src, dst = layout(spec, pages=24), layout(spec, pages=30)
    n = rng.randrange(1, 40)
    skip = rng.randrange(0, n // PAGE + 1)
    req = request(dst, n, skip, seed)
    src_pages = rng.sample(range(src.num_pages), pages_needed(n, PAGE))
    cuts = sorted({0, n, *rng.sample(range(1, n), min(3, n - 1))}) if n > 1 else [0, n]
    written = np.zeros(dst.total_bytes + dst.spec_bytes, dtype=np.int64)
    units = 1  # the context write
    for a, b in zip(cuts, cuts[1:], strict=False):
        idx = pages_to_send(a, b, n, PAGE)
        for plan, layers in ((job_pages_plan(src, req, src_pages, idx), src.num_layers),
                             (spec_pages_plan(src, req, src_pages, idx), spec.num_layers)):
            if plan is None:
                continue
            for layer in range(layers):
                runs = plan.layer((0, 0), layer)
                units += int(runs.units.sum())
                for d, length in zip(runs.dst_offset, runs.length, strict=True):
                    written[d:d + length] += 1
    assert units == request_units(src, dst, n, skip)
    main, extra = written[:dst.total_bytes], written[dst.total_bytes:]
    assert main.max(initial=0) <= 1 and extra.max(initial=0) <= 1
    page_bytes = spec.page_bytes
    expect = np.zeros_like(extra)
    for p in req.dst_pages:
        for layer in range(spec.num_layers):
            at = (layer * spec.num_pages + p) * page_bytes
            expect[at:at + page_bytes] = 1
    assert np.array_equal(extra, expect)  # every page of every layer, nothing else
    assert int(main.sum()) == len(req.dst_pages) * src.num_layers * src.page_bytes


def test_no_spec_plan_without_a_region_and_the_lead_descriptor_must_hold_it():
    plain = layout()
    assert spec_pages_plan(plain, request(plain, 9, 0, 1), [0, 1, 2], range(3)) is None
    dst = layout(region())
    req = request(dst, 9, 0, 2)

    class Desc:
        def __init__(self, length: int):
            self.length = length

    ctx = Desc(1 << 20)
    assert descriptor_problem(dst, req, [Desc(dst.total_bytes + dst.spec_bytes)], ctx) is None
    assert "spec region" in (descriptor_problem(dst, req, [Desc(dst.total_bytes)], ctx) or "")
