"""One-row GEMVs with their prologues (``disagg.kernels.gemv``, ``disagg.kernels.fp8_gemv``):
under TRITON_INTERPRET=1 against the torch layer ops they replace (``gemv_cases``), the
layer ops' dispatch (``ops.norm_linear`` / ``ops.silu_linear``: one row on the fused path only),
the launchers' refusals, and (``gpu``) the compiled kernels at Qwen3-8B's shapes against the
unfused kernels and torch, split-K inside a CUDA graph."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from gemv_cases import EPS, all_cases, bound, operands, reference, rel, run_case  # noqa: E402

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(scope="module")
def results() -> dict[str, Any]:
    pytest.importorskip("triton")
    from interp import run_cases

    return run_cases(HERE / "gemv_cases.py", all_cases())


@pytest.mark.parametrize("cid", all_cases())
def test_gemv_kernel_matches_torch_ops(cid: str, results: dict[str, Any]) -> None:
    result = results[cid]
    assert "error" not in result, result.get("error")
    assert result["err"] <= bound(cid), f"{cid}: error {result['err']:.3g}"


class _Calls:
    """Fake kernels for the dispatch tests: each records its name and returns zeros."""

    def __init__(self) -> None:
        self.names: list[str] = []

    def norm(self, name: str):  # noqa: ANN201
        def fn(x: torch.Tensor, delta: Any, norm_w: Any, eps: float, w: Any, *rest: Any):
            self.names.append(name)
            return torch.zeros(1, w.shape[0]), x if delta is None else x + delta
        return fn

    def silu(self, name: str):  # noqa: ANN201
        def fn(gate_up: torch.Tensor, w: Any, *rest: Any) -> torch.Tensor:
            self.names.append(name)
            return torch.zeros(1, w.shape[0])
        return fn


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> _Calls:
    pytest.importorskip("triton")
    from disagg.kernels import fp8_gemv, gemv
    from disagg.model import ops

    c = _Calls()
    monkeypatch.setattr(ops, "fused_on", lambda x: True)
    monkeypatch.setattr(ops, "PROLOGUES", True)
    monkeypatch.setattr(ops, "FP8_PROLOGUES", True)
    monkeypatch.setattr(gemv, "norm_gemv", c.norm("norm_gemv"))
    monkeypatch.setattr(gemv, "silu_gemv", c.silu("silu_gemv"))
    monkeypatch.setattr(fp8_gemv, "fp8_norm_gemv", c.norm("fp8_norm_gemv"))
    monkeypatch.setattr(fp8_gemv, "fp8_silu_gemv", c.silu("fp8_silu_gemv"))
    return c


def test_one_row_on_the_fused_path_takes_the_fused_gemvs(calls: _Calls) -> None:
    from disagg.kernels.fp8_weight import Fp8Weight
    from disagg.model import ops

    o = operands(200, 300, torch.float32, "cpu", fp8=True)
    fp8 = Fp8Weight(o["wq"], o["ws"])
    w = o["w_ref"]
    y, r = ops.norm_linear(o["x"], o["delta"], o["norm_w"], EPS, w)
    assert y.shape == (1, 200) and torch.equal(r, o["x"] + o["delta"])
    ops.norm_linear(o["x"], None, o["norm_w"], EPS, fp8)
    ops.silu_linear(o["gate_up"], w)
    ops.silu_linear(o["gate_up"], fp8)
    assert calls.names == ["norm_gemv", "fp8_norm_gemv", "silu_gemv", "fp8_silu_gemv"]


def test_fp8_prologues_off_by_their_own_switch(calls: _Calls, monkeypatch: Any) -> None:
    """The FP8 GEMVs' prologues have their own switch (off by default: slower on an H100);
    a bf16 weight's stay fused."""
    from disagg.kernels.fp8_weight import Fp8Weight
    from disagg.model import ops

    monkeypatch.setattr(ops, "FP8_PROLOGUES", False)
    monkeypatch.setattr(ops, "add_norm", lambda x, a, w, eps: (x + a, x + a))
    monkeypatch.setattr(ops, "silu_mul", lambda gu: gu.chunk(2, -1)[0])
    monkeypatch.setattr(ops, "linear", lambda h, w, b=None: h)
    o = operands(200, 300, torch.float32, "cpu", fp8=True)
    fp8 = Fp8Weight(o["wq"], o["ws"])
    ops.norm_linear(o["x"], o["delta"], o["norm_w"], EPS, fp8)
    ops.silu_linear(o["gate_up"], fp8)
    ops.silu_linear(o["gate_up"], o["w_ref"])
    assert calls.names == ["silu_gemv"]


def test_prologues_switched_off_keep_the_separate_ops(calls: _Calls, monkeypatch: Any) -> None:
    from disagg.model import ops

    monkeypatch.setattr(ops, "PROLOGUES", False)
    monkeypatch.setattr(ops, "add_norm", lambda x, a, w, eps: (x + a, x + a))
    monkeypatch.setattr(ops, "silu_mul", lambda gu: gu.chunk(2, -1)[0])
    monkeypatch.setattr(ops, "linear", lambda h, w, b=None: h @ w.T)
    o = operands(200, 300, torch.float32, "cpu", fp8=False)
    ops.norm_linear(o["x"], o["delta"], o["norm_w"], EPS, o["w"])
    ops.silu_linear(o["gate_up"], o["w"])
    assert calls.names == []


def test_more_rows_and_the_unfused_path_keep_the_separate_ops(calls: _Calls,
                                                              monkeypatch: Any) -> None:
    import torch.nn.functional as F

    from disagg.model import ops
    from disagg.model.rotary import rms_norm

    o = operands(200, 300, torch.float32, "cpu", fp8=False)
    x2, d2 = o["x"].repeat(2, 1), o["delta"].repeat(2, 1)
    monkeypatch.setattr(ops, "add_norm", lambda x, a, w, eps: (rms_norm(x + a, w, eps), x + a))
    monkeypatch.setattr(ops, "silu_mul", lambda gu: F.silu(gu.chunk(2, -1)[0]) * gu.chunk(2, -1)[1])
    y, r = ops.norm_linear(x2, d2, o["norm_w"], EPS, o["w"])
    ref, _ = reference("addnorm", o)
    assert y.shape == (2, 200) and rel(y[1:], ref) < 1e-6 and torch.equal(r, x2 + d2)
    assert rel(ops.silu_linear(o["gate_up"].repeat(3, 1), o["w"])[2:], reference("silu", o)[0]) < 1e-6
    monkeypatch.setattr(ops, "fused_on", lambda x: False)
    assert rel(ops.norm_linear(o["x"], o["delta"], o["norm_w"], EPS, o["w"])[0], ref) < 1e-6
    assert rel(ops.silu_linear(o["gate_up"], o["w"]), reference("silu", o)[0]) < 1e-6
    assert calls.names == []


def test_launchers_refuse_bad_rows_by_name() -> None:
    pytest.importorskip("triton")
    from disagg.kernels import fp8_gemv, gemv

    o = operands(200, 300, torch.float32, "cpu", fp8=True)
    wb = o["w_ref"]
    with pytest.raises(ValueError, match="x must be"):
        gemv.norm_gemv(o["x"].repeat(2, 1), None, o["norm_w"], EPS, wb)
    with pytest.raises(ValueError, match="delta"):
        gemv.norm_gemv(o["x"], o["delta"].double(), o["norm_w"], EPS, wb)
    with pytest.raises(ValueError, match="norm weight"):
        gemv.norm_gemv(o["x"], None, o["norm_w"][:-1], EPS, wb)
    with pytest.raises(ValueError, match="x must be"):
        gemv.silu_gemv(o["x"], wb)  # [1, K], not [1, 2K]
    with pytest.raises(ValueError, match="x must be"):
        fp8_gemv.fp8_silu_gemv(o["x"], o["wq"], o["ws"])
    with pytest.raises(ValueError, match="w_scale_inv"):
        fp8_gemv.fp8_gemv(o["x"], o["wq"], o["ws"][:, :1])
    with pytest.raises(ValueError, match="w_fp8"):
        fp8_gemv.fp8_gemv(o["x"], o["wq"].float(), o["ws"])
    with pytest.raises(ValueError, match="rows per program"):
        fp8_gemv.fp8_gemv(o["x"], o["wq"], o["ws"], fp8_gemv.GemvTile(24, 1, 1, 1))


def test_norm_without_a_delta_returns_x_itself() -> None:
    """(launch-free: an empty weight) the residual stream is not copied when nothing is added"""
    pytest.importorskip("triton")
    from disagg.kernels import fp8_gemv

    x = torch.randn(1, 256)
    wq = torch.zeros(0, 256, dtype=torch.float8_e4m3fn)
    y, r = fp8_gemv.fp8_norm_gemv(x, None, torch.ones(256), EPS, wq, torch.zeros(0, 2))
    assert r is x and y.shape == (1, 0)


# Compiled kernels. The interpreter cases, then Qwen3-8B's shapes against the unfused kernels
# (fused.rms_norm / silu_mul then the plain GEMV): the residual is the same bytes, the outputs
# differ only by the float32 sum order of the row's squares (one bf16 rounding of a few h).
QWEN3_8B = {"qkv": (6144, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("cid", all_cases())
def test_gemv_kernel_matches_torch_ops_on_a_gpu(cid: str) -> None:
    assert run_case(cid, "cuda") <= bound(cid, "cuda")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("name", list(QWEN3_8B))
def test_fused_gemv_equals_the_unfused_kernels_on_a_gpu(name: str, fp8: bool) -> None:
    from disagg.kernels import fp8_gemv, gemv
    from disagg.model import fused

    n, k = QWEN3_8B[name]
    o = operands(n, k, torch.bfloat16, "cuda", fp8)

    def plain(row: torch.Tensor) -> torch.Tensor:
        return fp8_gemv.fp8_gemv(row, o["wq"], o["ws"]) if fp8 else gemv.gemv(row, o["w"])

    if name == "down":
        got = (fp8_gemv.fp8_silu_gemv(o["gate_up"], o["wq"], o["ws"]) if fp8
               else gemv.silu_gemv(o["gate_up"], o["w"]))
        want, ref = plain(fused.silu_mul(o["gate_up"])), reference("silu", o)[0]
    else:
        h, r_want = fused.rms_norm(o["delta"], o["norm_w"], EPS, residual=o["x"])
        args = (o["x"], o["delta"], o["norm_w"], EPS)
        got, r = (fp8_gemv.fp8_norm_gemv(*args, o["wq"], o["ws"]) if fp8
                  else gemv.norm_gemv(*args, o["w"]))
        assert torch.equal(r, r_want)
        want, ref = plain(h), reference("addnorm", o)[0]
    assert rel(got, want) < 2e-3
    assert rel(got, ref) < 8e-3


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("split", [2, 4, 7])
def test_split_k_gemv_in_a_cuda_graph(split: int) -> None:
    """Split-K's workspace is left zeroed by each launch, so graph replays repeat the result;
    as the engine captures: the step run eagerly on the capture stream first."""
    from disagg.kernels import fp8_gemv

    o = operands(4096, 4096, torch.bfloat16, "cuda", fp8=True)
    t = fp8_gemv.gemv_tile(4096, 4096)
    tile = fp8_gemv.GemvTile(t.bn, t.sub, t.warps, t.stages, split)
    want = fp8_gemv.fp8_norm_gemv(o["x"], o["delta"], o["norm_w"], EPS, o["wq"], o["ws"])[0]
    assert rel(want, reference("addnorm", o)[0]) < 8e-3
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        def step() -> torch.Tensor:
            return fp8_gemv.fp8_norm_gemv(o["x"], o["delta"], o["norm_w"], EPS, o["wq"],
                                          o["ws"], tile)[0]
        for _ in range(2):
            assert rel(step(), want) < 2e-3
        stream.synchronize()
        assert any(key[2] == stream.cuda_stream for key in fp8_gemv._workspaces)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=stream):
            out = step()
    for _ in range(3):
        g.replay()
        torch.cuda.synchronize()
        assert rel(out, want) < 2e-3
