"""Triton kernels vs the torch references under TRITON_INTERPRET=1 (CPU, tiny sizes)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernel_cases import TOL, all_cases  # noqa: E402


@pytest.mark.parametrize("cid", all_cases())
def test_kernel_matches_reference(cid: str, interp_results: dict[str, Any]) -> None:
    result = interp_results[cid]
    assert "error" not in result, result.get("error")
    dtype = cid.rsplit("-", 1)[1]
    assert result["err"] <= TOL.get(dtype, 0.0), f"{cid}: relative error {result['err']:.3g}"
