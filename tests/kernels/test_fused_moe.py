"""The fused MoE kernels (``disagg.kernels.fused_moe``) against the torch loop.

CPU: the cases of ``moe_cases.py`` under TRITON_INTERPRET=1 in two subprocesses (the alignment
against its plain definition; ``MoEMLP`` fused vs the float32 loop on tiny shapes), and the tile
table. GPU: real layer shapes in bf16, CUDA-graph capture and replay, no compile after ``warm``.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from disagg.model.config import MoEArch
from disagg.model.moe import MoEMLP, warm

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from interp import run_cases  # noqa: E402
from moe_cases import SHAPES, TOL, all_cases  # noqa: E402

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(scope="module")
def moe_results() -> dict[str, Any]:
    pytest.importorskip("triton")
    return run_cases(HERE / "moe_cases.py", all_cases(), timeout=300)


@pytest.mark.parametrize("cid", all_cases())
def test_interpreted_matches_loop(cid: str, moe_results: dict[str, Any]) -> None:
    result = moe_results[cid]
    assert "error" not in result, result.get("error")
    tol = (TOL[SHAPES[cid][-1]] if cid in SHAPES
           else 1.0 if cid == "routing" else TOL["float32"])  # routing: error over tolerance
    assert result["err"] <= tol, f"{cid}: relative error {result['err']:.3g}"


def test_tile_table() -> None:
    pytest.importorskip("triton")
    from disagg.kernels import fused_moe as fm

    for top_k, experts in ((8, 128), (6, 64), (2, 8)):
        tokens = fm.config_tokens(top_k, experts, 1 << 16)
        tiles = [fm.tile_config(t, top_k, experts) for t in range(1, 1 << 14, 7)]
        assert len(tokens) == len(fm.TILE_TABLE) == len(set(tiles))  # every entry reachable
        assert {fm.tile_config(t, top_k, experts) for t in tokens} == set(tiles)
        block_ms = [t.block_m for t in tiles]
        assert block_ms == sorted(block_ms) and block_ms[0] == 16
        assert fm.config_tokens(top_k, experts, 1) == [1]
    for pairs, experts, bm in ((1, 128, 16), (8, 128, 16), (65536, 128, 128), (37, 8, 16)):
        cap = fm.align_capacity(pairs, experts, bm)
        assert cap % bm == 0 and cap >= pairs + min(pairs, experts) * (bm - 1)


def test_cpu_default_is_the_loop() -> None:
    arch = MoEArch(num_experts=4, top_k=2, intermediate_size=8, sparse_layers=(True,))
    mlp = MoEMLP(16, arch, torch.float32, torch.device("cpu"))
    assert not mlp.use_fused(torch.zeros(1, 16)) and warm(mlp, 64) == []


# --- GPU ------------------------------------------------------------------------------------

QWEN3 = MoEArch(num_experts=128, top_k=8, intermediate_size=768, sparse_layers=(True,),
                norm_topk_prob=True)
DSV2_LITE = MoEArch(num_experts=64, top_k=6, intermediate_size=1408, sparse_layers=(True,),
                    shared_intermediate_size=2816, router_fp32=True)
QWEN2_GATED = MoEArch(num_experts=60, top_k=4, intermediate_size=1408, sparse_layers=(True,),
                      shared_intermediate_size=5632, shared_gate=True)


def _mlp(arch: MoEArch, hidden: int = 2048, seed: int = 0) -> MoEMLP:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    mlp = MoEMLP(hidden, arch, torch.bfloat16, torch.device("cuda"))
    for p in mlp.parameters():
        p.copy_(torch.randn(p.shape, generator=gen, device="cuda") * p.shape[-1] ** -0.5)
    return mlp


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("name,arch", [("qwen3", QWEN3), ("dsv2lite", DSV2_LITE),
                                       ("qwen2-gated", QWEN2_GATED)])
@pytest.mark.parametrize("tokens", [1, 64, 256, 2048])
def test_real_shapes_bf16(name: str, arch: MoEArch, tokens: int) -> None:
    mlp = _mlp(arch)
    ref32 = copy.deepcopy(mlp).float()
    ref32.fused = False
    x = torch.randn(tokens, 2048, device="cuda", dtype=torch.bfloat16)
    weights, experts = mlp.route(x)
    out = mlp.mix(x, weights, experts)
    ref = ref32.mix(x.float(), weights.float(), experts)
    assert out.dtype == torch.bfloat16 and _rel(out, ref) < 1e-2
    assert torch.equal(mlp(x), out)  # forward = route + mix, deterministic


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("arch", [QWEN3, DSV2_LITE, QWEN2_GATED])
def test_cuda_graph_replay(arch: MoEArch) -> None:
    mlp = _mlp(arch, seed=1)
    static_x = torch.randn(64, 2048, device="cuda", dtype=torch.bfloat16)
    mlp(static_x)  # compile before capture
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        mlp(static_x)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = mlp(static_x)
    for seed in range(3):  # different routing each replay
        x = torch.randn(64, 2048, device="cuda", dtype=torch.bfloat16,
                        generator=torch.Generator(device="cuda").manual_seed(seed))
        static_x.copy_(x)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static_out, mlp(x))


@pytest.mark.gpu
@needs_cuda
def test_nothing_compiles_after_warm() -> None:
    from disagg.kernels import compile_watch

    mlp = _mlp(QWEN3, seed=2)
    ran = warm(mlp, 4096)
    assert ran[0] == 1 and len(ran) >= 3
    if not compile_watch.arm("test"):
        pytest.skip("no Triton post-compile hook")
    from triton import knobs

    before = compile_watch.compiled_after_ready
    try:
        for t in (1, 3, 17, 64, 100, 257, 999, 4096):
            mlp(torch.randn(t, 2048, device="cuda", dtype=torch.bfloat16))
        torch.cuda.synchronize()
    finally:
        knobs.runtime.jit_post_compile_hook = None
    assert compile_watch.compiled_after_ready == before
