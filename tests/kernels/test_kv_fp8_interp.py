"""The Triton kernels over FP8 KV pages under TRITON_INTERPRET=1 (CPU): appends store the
torch reference's bytes, attention equals the reference over the same pages and scales."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from fp8kv_cases import TOL, all_cases  # noqa: E402

GPU_TOL = {"float32": 5e-3}  # relative error of tf32 dots (measured on an H200: <= 4.6e-4)


@pytest.fixture(scope="module")
def results() -> dict[str, Any]:
    pytest.importorskip("triton")
    from interp import run_cases

    return run_cases(HERE / "fp8kv_cases.py", all_cases())


@pytest.mark.parametrize("cid", all_cases())
def test_fp8_kernel_matches_reference(cid: str, results: dict[str, Any]) -> None:
    result = results[cid]
    assert "error" not in result, result.get("error")
    kind, dtype = cid.split("-")
    bound = 0.0 if kind.endswith("append") else TOL[dtype]
    assert result["err"] <= bound, f"{cid}: error {result['err']:.3g}"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("cid", all_cases())
def test_fp8_kernel_matches_reference_on_a_gpu(cid: str) -> None:
    """Compiled kernels: every appended byte equals torch's (no interpreter exemption).
    Attention over float32 queries is held to tf32's bound: a compiled ``tl.dot`` takes float32
    operands as tf32 (as in test_kernel_gpu.py); the interpreter computes them in float32."""
    from fp8kv_cases import run_case

    kind, dtype = cid.split("-")
    bound = 0.0 if kind.endswith("append") else GPU_TOL.get(dtype, TOL[dtype])
    assert run_case(cid, "cuda") <= bound
