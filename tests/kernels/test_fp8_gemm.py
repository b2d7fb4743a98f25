"""Block-FP8 linear layers (``disagg.kernels.fp8_gemm``): the torch reference against plain
float32 math, the Triton kernels under TRITON_INTERPRET=1 against the reference
(``fp8gemm_cases``), the launchers' refusals, and (``gpu``) the compiled kernels at model
shapes."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from disagg.kernels import reference
from disagg.model.fp8 import dequantize

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from fp8gemm_cases import all_cases, bound, operands, rel  # noqa: E402

# fp8_linear's reference against float32 x @ W.T over the same (dequantized) weights: what
# quantizing the activations to e4m3 costs, ~2.6% relative L2 (3 mantissa bits) on these data
ACT_QUANT_ERR = (0.01, 0.04)


def _expand(scale: torch.Tensor, rows: int, cols: int, block_rows: int) -> torch.Tensor:
    s = scale.repeat_interleave(block_rows, 0)[:rows]
    return s.repeat_interleave(128, 1)[:, :cols]


@pytest.mark.parametrize("m, n, k", [(1, 128, 128), (3, 200, 300), (17, 384, 256)])
def test_reference_matmul_is_float32_math_of_the_dequantized_operands(m: int, n: int,
                                                                       k: int) -> None:
    x, wq, ws = operands(m, n, k, torch.float32, "cpu")
    q, s = reference.quantize_groups(x)
    a = q.float() * _expand(s, m, k, 1)
    w = dequantize("w", wq, ws, (128, 128))  # the loader's convention: w = w_fp8 * scale_inv
    want = a.double() @ w.double().T
    got = reference.fp8_block_matmul(q, s, wq, ws, torch.float32)
    assert got.shape == (m, n) and got.dtype == torch.float32
    assert rel(got, want) < 1e-6
    assert reference.fp8_block_matmul(q, s, wq, ws).dtype == torch.bfloat16


def test_reference_quantize_groups_scales_each_row_group_by_its_amax() -> None:
    x, _, _ = operands(4, 128, 300, torch.float32, "cpu")
    x[1, 128:256] = 0.0  # an all-zero group
    q, s = reference.quantize_groups(x)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (4, 300)
    assert s.dtype == torch.float32 and s.shape == (4, 3)
    groups = torch.nn.functional.pad(x, (0, 84)).view(4, 3, 128).abs().amax(-1)
    live = groups > 0
    assert torch.equal(s[live], groups[live] / 448.0)
    assert s[1, 1] == torch.tensor(reference.FP8_AMAX_FLOOR) / 448.0 > 0
    assert not q[1, 128:256].float().any()
    back = q.float() * _expand(s, 4, 300, 1)
    assert (back - x).abs().max() <= (x.abs() * 2**-4 + s.max() * 2**-9).max()
    # each group's largest magnitude lands on the format's largest value
    qa = torch.nn.functional.pad(q.float(), (0, 84)).view(4, 3, 128).abs().amax(-1)
    assert torch.equal(qa[live], torch.full_like(qa[live], 448.0))


def test_reference_linear_costs_what_e4m3_activations_cost() -> None:
    x, wq, ws = operands(32, 256, 1024, torch.bfloat16, "cpu", seed=3)
    w = dequantize("w", wq, ws, (128, 128))
    out = reference.fp8_linear(x, wq, ws)
    assert out.dtype == torch.bfloat16 and out.shape == (32, 256)
    err = rel(reference.fp8_linear(x, wq, ws, torch.float32), x.float() @ w.T)
    assert ACT_QUANT_ERR[0] < err < ACT_QUANT_ERR[1]


@pytest.fixture(scope="module")
def results() -> dict[str, Any]:
    pytest.importorskip("triton")
    from interp import run_cases

    return run_cases(HERE / "fp8gemm_cases.py", all_cases())


@pytest.mark.parametrize("cid", all_cases())
def test_fp8_kernel_matches_reference(cid: str, results: dict[str, Any]) -> None:
    result = results[cid]
    assert "error" not in result, result.get("error")
    assert result["err"] <= bound(cid), f"{cid}: error {result['err']:.3g}"


def _bad(**over: Any) -> dict[str, torch.Tensor]:
    x, wq, ws = operands(3, 256, 384, torch.float32, "cpu")
    q, s = reference.quantize_groups(x)
    args = dict(x_fp8=q, x_scale=s, w_fp8=wq, w_scale_inv=ws)
    args.update(over)
    return args


@pytest.mark.parametrize("args, name", [
    (_bad(x_fp8=torch.zeros(3, 384)), "x_fp8"),
    (_bad(w_fp8=torch.zeros(256, 384, dtype=torch.float8_e5m2)), "w_fp8"),
    (_bad(w_fp8=torch.zeros(256, 256, dtype=torch.float8_e4m3fn)), "w_fp8"),
    (_bad(x_scale=torch.ones(3, 4)), "x_scale"),
    (_bad(x_scale=torch.ones(3, 3, dtype=torch.float16)), "x_scale"),
    (_bad(w_scale_inv=torch.ones(2, 2)), "w_scale_inv"),
    (_bad(w_scale_inv=torch.ones(3, 2).t()), "w_scale_inv"),
    (_bad(w_fp8=torch.zeros(384, 256, dtype=torch.float8_e4m3fn).t()), "w_fp8"),
])  # fmt: skip
def test_gemm_refuses_bad_operands_by_name(args: dict[str, torch.Tensor], name: str) -> None:
    fp8_gemm = pytest.importorskip("disagg.kernels.fp8_gemm")
    with pytest.raises(ValueError, match=name):
        fp8_gemm.fp8_block_matmul(**args)


def test_launchers_refuse_bad_inputs_by_name() -> None:
    fp8_gemm = pytest.importorskip("disagg.kernels.fp8_gemm")
    with pytest.raises(ValueError, match="out_dtype"):
        fp8_gemm.fp8_block_matmul(**_bad(), out_dtype=torch.int8)
    for x in (torch.zeros(3, 4, dtype=torch.int32), torch.zeros(2, 3, 4),
              torch.zeros(4, 3).t(), torch.zeros(3, 4, dtype=torch.float8_e4m3fn)):
        with pytest.raises(ValueError, match="x must"):
            fp8_gemm.quantize_groups(x)
    _, wq, ws = operands(1, 256, 384, torch.float32, "cpu")
    with pytest.raises(ValueError, match="w_fp8 must be"):
        fp8_gemm.fp8_linear(torch.zeros(2, 256), wq, ws)


def test_empty_rows_launch_nothing() -> None:
    fp8_gemm = pytest.importorskip("disagg.kernels.fp8_gemm")
    _, wq, ws = operands(1, 256, 384, torch.float32, "cpu")
    out = fp8_gemm.fp8_linear(torch.zeros(0, 384, dtype=torch.bfloat16), wq, ws)
    assert out.shape == (0, 256) and out.dtype == torch.bfloat16


def test_tile_table_covers_every_m_with_fp8_dot_shapes() -> None:
    fp8_gemm = pytest.importorskip("disagg.kernels.fp8_gemm")
    bounds = [b for b, _ in fp8_gemm.TILE_TABLE]
    assert bounds == sorted(bounds) and bounds[0] == 16
    assert fp8_gemm.tile_for(1) == fp8_gemm.tile_for(16) == fp8_gemm.TILE_TABLE[0][1]
    assert fp8_gemm.tile_for(17) == fp8_gemm.TILE_TABLE[1][1]
    assert fp8_gemm.tile_for(1 << 20) == fp8_gemm.TILE_TABLE[-1][1]
    for _, t in fp8_gemm.TILE_TABLE:
        for v in (t.block_m, t.block_n, t.num_warps):
            assert v & (v - 1) == 0
        assert t.block_m >= 16 and t.block_n >= 16 and t.num_stages >= 2


# Compiled kernels on a GPU: the quantizer's bytes equal torch's exactly (no interpreter
# exemption: IEEE division and the round-to-nearest-even cast on both sides); float32 GEMM
# outputs sum the same exact FP8 products as the reference in another order, each 128-term
# block on the tensor cores (whose FP8 accumulation keeps fewer bits than float32, DeepSeek-V3
# 3.3.2: about 14), so 1e-3; bf16 outputs add one rounding of each (~2e-3 RMS): 8e-3.
GPU_SHAPES = [(4096, 4096), (12288, 4096), (4096, 12288)]  # Qwen3-8B: o, gate_up half, down
GPU_F32_TOL = 1e-3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("cid", all_cases())
def test_fp8_kernel_matches_reference_on_a_gpu(cid: str) -> None:
    from fp8gemm_cases import run_case

    limit = 0.0 if cid.startswith("quant") else max(bound(cid), GPU_F32_TOL)
    assert run_case(cid, "cuda") <= limit


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("m", [1, 16, 64, 512, 2048, 1030])
@pytest.mark.parametrize("n, k", GPU_SHAPES)
def test_fp8_linear_at_model_shapes_on_a_gpu(m: int, n: int, k: int) -> None:
    from disagg.kernels import fp8_gemm

    x, wq, ws = operands(m, n, k, torch.bfloat16, "cuda", seed=m)
    q, s = fp8_gemm.quantize_groups(x)
    rq, rs = reference.quantize_groups(x)
    assert torch.equal(s, rs)
    assert int((q.view(torch.uint8) != rq.view(torch.uint8)).sum()) == 0
    ref = reference.fp8_block_matmul(rq, rs, wq, ws, torch.float32)
    assert rel(fp8_gemm.fp8_block_matmul(q, s, wq, ws, torch.float32), ref) < GPU_F32_TOL
    out = fp8_gemm.fp8_linear(x, wq, ws)  # 2048 rows: cuBLASLt's block-scaled GEMM
    assert out.dtype == torch.bfloat16 and out.shape == (m, n)
    assert rel(out, ref) < 8e-3
    qc, sc = fp8_gemm.quantize_groups(x, column_major_scales=True)
    assert torch.equal(qc.view(torch.uint8), q.view(torch.uint8)) and torch.equal(sc, s)
    assert sc.stride() == (1, m)
    w = dequantize("w", wq, ws, (128, 128))
    assert ACT_QUANT_ERR[0] < rel(out, x.float() @ w.T) < ACT_QUANT_ERR[1]
