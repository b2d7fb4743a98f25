"""cuda-ipc backend: two processes, GPU0 -> last GPU, seeded pages verified (GPU machines)."""

from __future__ import annotations

import argparse

import pytest

pytestmark = [pytest.mark.gpu]


def test_cuda_ipc_pages_verified() -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from disagg.bench.fabric import add_arguments, run

    ap = argparse.ArgumentParser()
    add_arguments(ap)
    args = ap.parse_args(["--backend", "cuda-ipc", "--page-size", str(1 << 20), "--pages", "64",
                          "--rounds", "2", "--no-pin"])
    res = run(args)  # raises if any page differs
    assert res["verified"] and res["engine"]["gib_s"] > 0
