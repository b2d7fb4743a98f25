"""Fused-MoE cases, run by ``test_fused_moe`` in a TRITON_INTERPRET=1 subprocess.

Run directly it reads a JSON list of case ids on stdin and prints one JSON object mapping each
id to ``{"err": float}`` (the worst relative error over its row counts) or ``{"error": str}``.
Shapes are tiny and not multiples of the (interpreter's 16-wide) tiles.
"""

from __future__ import annotations

import zlib
from typing import Any

NUM_EXPERTS = 8
TOKENS = (1, 5, 37)
# (top_k, hidden, intermediate, shared intermediate, shared gate, dtype)
SHAPES = {
    "k2-plain": (2, 40, 24, 0, False, "float32"),
    "k3-shared": (3, 64, 48, 20, False, "float32"),
    "k2-gated-bf16": (2, 32, 16, 24, True, "bfloat16"),
    "k3-even": (3, 32, 32, 0, False, "bfloat16"),
}
TOL = {"float32": 1e-5, "bfloat16": 2e-2}


# (experts, top_k, norm_topk_prob, routed_scaling_factor, router_fp32, logits dtype)
ROUTINGS = [(8, 2, False, 1.0, False, "float32"), (64, 6, False, 1.0, True, "float32"),
            (128, 8, True, 1.0, False, "bfloat16"), (8, 3, True, 2.5, False, "bfloat16"),
            (5, 5, True, 1.0, True, "float32")]


def all_cases() -> list[str]:
    return ["align", "tiles32", "routing", "fp8", "fp8-tiles32", *SHAPES]


def _rel(out: Any, ref: Any) -> float:
    import torch

    if not torch.isfinite(out).all():
        return float("inf")
    return float((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30))


def align_reference(
    experts: list[int], num_experts: int, block_m: int
) -> tuple[list[int], list[int]]:
    """Pairs grouped by expert in order, each group padded to ``block_m`` with the sentinel."""
    sentinel = len(experts)
    ids: list[int] = []
    blocks: list[int] = []
    for e in range(num_experts):
        mine = [p for p, x in enumerate(experts) if x == e]
        mine += [sentinel] * (-len(mine) % block_m)
        ids += mine
        blocks += [e] * (len(mine) // block_m)
    return ids, blocks


def _check_align() -> float:
    import torch

    from disagg.kernels.fused_moe import align

    gen = torch.Generator().manual_seed(7)
    for t, k, block_m, block in ((1, 2, 16, 64), (5, 3, 16, 64), (37, 3, 16, 64), (70, 2, 32, 16)):
        experts = torch.randint(0, NUM_EXPERTS, (t, k), generator=gen)
        experts[0] = torch.arange(k)  # ties in the order are kept stably
        sorted_ids, expert_ids, num_post = align(experts, NUM_EXPERTS, block_m, block)
        ids, blocks = align_reference(experts.view(-1).tolist(), NUM_EXPERTS, block_m)
        n = int(num_post[0])
        if n != len(ids) or n > sorted_ids.numel():
            return float("inf")
        if sorted_ids[:n].tolist() != ids or expert_ids[: n // block_m].tolist() != blocks:
            return float("inf")
    return 0.0


def _check_tiles32() -> float:
    """``fused_experts`` with explicit 32-row blocks, uneven N/K tiles and no grouping."""
    import torch

    from disagg.kernels.fused_moe import GemmTile, MoETiles, fused_experts
    from disagg.model.moe import experts_loop

    gen = torch.Generator().manual_seed(3)
    t, k, h, i = 45, 2, 48, 40
    x = torch.randn(t, h, generator=gen)
    gate_up = torch.randn(NUM_EXPERTS, 2 * i, h, generator=gen) * h**-0.5
    down = torch.randn(NUM_EXPERTS, h, i, generator=gen) * i**-0.5
    weights = torch.rand(t, k, generator=gen)
    experts = torch.randint(0, NUM_EXPERTS, (t, k), generator=gen)
    tiles = MoETiles(32, GemmTile(32, 16, 1, 1, 1), GemmTile(16, 32, 3, 1, 1), 16)
    out = fused_experts(x, weights, experts, gate_up, down, tiles)
    return _rel(out, experts_loop(x, weights, experts, gate_up, down))


def _check_fp8(tiles32: bool) -> float:
    """Block-FP8 experts (128x128 blocks; H and I off the blocks, so edge blocks are partial)
    against the loop over the same weights dequantized."""
    import torch

    from disagg.kernels.fp8_weight import Fp8Weight
    from disagg.kernels.fused_moe import GemmTile, MoETiles, fused_experts
    from disagg.model.fp8 import quantize_blocks
    from disagg.model.moe import experts_loop

    gen = torch.Generator().manual_seed(11)
    t, k, h, i = 21, 2, 160, 136
    x = torch.randn(t, h, generator=gen)
    gate_up = Fp8Weight(*quantize_blocks(torch.randn(NUM_EXPERTS, 2 * i, h, generator=gen)
                                         * h**-0.5, (128, 128)))
    down = Fp8Weight(*quantize_blocks(torch.randn(NUM_EXPERTS, h, i, generator=gen) * i**-0.5,
                                      (128, 128)))
    weights = torch.rand(t, k, generator=gen)
    experts = torch.randint(0, NUM_EXPERTS, (t, k), generator=gen)
    tiles = MoETiles(32, GemmTile(32, 32, 1, 1, 1), GemmTile(16, 64, 3, 1, 1), 16) \
        if tiles32 else None
    out = fused_experts(x, weights, experts, gate_up, down, tiles)
    return _rel(out, experts_loop(x, weights, experts, gate_up.dequantize(), down.dequantize()))


def _check_routing() -> float:
    """``route_fused`` against ``route``: experts of the same scores in the same order (equal
    scores may be broken either way: bf16 logits tie often) and the weights rounded alike.
    Returns the worst relative weight error over its dtype's tolerance (pass: <= 1; inf when
    a chosen score differs)."""
    import torch

    from disagg.kernels.moe_routing import route_fused, supported
    from disagg.model.config import MoEArch
    from disagg.model.moe import route

    gen = torch.Generator().manual_seed(7)
    worst = 0.0
    for e, k, norm, scale, fp32, dtype in ROUTINGS:
        moe = MoEArch(num_experts=e, top_k=k, intermediate_size=8, sparse_layers=(True,),
                      norm_topk_prob=norm, routed_scaling_factor=scale, router_fp32=fp32)
        assert supported(moe, None)
        for t in (1, 9):
            logits = (torch.randn(t, e, generator=gen) * 3).to(getattr(torch, dtype))
            w, ex = route_fused(logits, moe)
            rw, rex = route(logits, moe)
            scores = logits.float().softmax(dim=-1)
            if not torch.equal(scores.gather(1, ex), scores.gather(1, rex)) or w.dtype != rw.dtype:
                return float("inf")
            worst = max(worst, _rel(w, rw) / TOL[dtype])
    return worst


def run_case(cid: str) -> float:
    import torch

    from disagg.model.config import MoEArch
    from disagg.model.moe import MoEMLP

    if cid == "align":
        return _check_align()
    if cid == "routing":
        return _check_routing()
    if cid == "tiles32":
        return _check_tiles32()
    if cid.startswith("fp8"):
        return _check_fp8(cid == "fp8-tiles32")
    top_k, h, i, s, gated, dtype = SHAPES[cid]
    gen = torch.Generator().manual_seed(zlib.crc32(cid.encode()))
    arch = MoEArch(num_experts=NUM_EXPERTS, top_k=top_k, intermediate_size=i,
                   sparse_layers=(True,), shared_intermediate_size=s, shared_gate=gated)
    mlp = MoEMLP(h, arch, getattr(torch, dtype), torch.device("cpu"))
    for p in mlp.parameters():
        p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)
    ref32 = MoEMLP(h, arch, torch.float32, torch.device("cpu"))
    ref32.load_state_dict({k: v.float() for k, v in mlp.state_dict().items()})
    ref32.fused = False
    mlp.fused = True
    worst = 0.0
    for t in TOKENS:
        x = torch.randn(t, h, generator=gen).to(mlp.router.dtype)
        weights, experts = mlp.route(x)
        out = mlp.mix(x, weights, experts)
        ref = ref32.mix(x.float(), weights.float(), experts)
        if out.dtype != x.dtype or out.shape != x.shape:
            return float("inf")
        worst = max(worst, _rel(out, ref))
    return worst


if __name__ == "__main__":
    from interp import serve

    serve(run_case)
