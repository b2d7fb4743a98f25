"""MoE routing in one Triton kernel: softmax over the router logits, top-k, optional
renormalisation and scaling, per token (``disagg.model.moe.route``'s plain case).

Torch spends about ten small kernels on it (softmax, top-k's sort, gather, sum, divide, casts:
27-33 us a layer on an H200 at 1 to 64 tokens, a quarter of a Qwen3-30B-A3B-shaped batch-1
step). One program per token loads its ``E`` logits, takes the float32 softmax and picks the
``k`` best by repeated arg-max (descending, ties to the lower expert id, as ``torch.topk``
sorts them), then writes the weights as ``route`` rounds them (in the logits' dtype unless the
router runs in float32, then times ``routed_scaling_factor``) and the experts (int64).

Grouped routing (``n_group`` > 1), DeepSeek V3's correction bias and sigmoid scores are not
handled here (``supported``): ``route`` keeps them.
"""

from __future__ import annotations

from typing import Protocol

import torch
import triton
import triton.language as tl

from disagg.kernels import checks


class Routing(Protocol):
    """The routing settings read here: ``disagg.model.config.MoEArch`` has them (kernels sit
    below the model and do not import it)."""

    @property
    def top_k(self) -> int: ...
    @property
    def scoring(self) -> str: ...  # softmax | sigmoid
    @property
    def n_group(self) -> int: ...
    @property
    def correction_bias(self) -> bool: ...
    @property
    def norm_topk_prob(self) -> bool: ...
    @property
    def routed_scaling_factor(self) -> float: ...
    @property
    def router_fp32(self) -> bool: ...


@triton.jit
def _route_kernel(logits_ptr, w_ptr, e_ptr, stride_l, num_experts, scale, eps,
                  TOP_K: tl.constexpr, K_PAD: tl.constexpr, E_PAD: tl.constexpr,
                  NORM: tl.constexpr, SCALE: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    idx = tl.arange(0, E_PAD)
    ok = idx < num_experts
    x = tl.load(logits_ptr + t * stride_l + idx, mask=ok, other=float("-inf")).to(tl.float32)
    p = tl.exp(x - tl.max(x, 0))
    s = tl.where(ok, p / tl.sum(p, 0), -1.0)  # scores in [0, 1]; padding never chosen
    k = tl.arange(0, K_PAD)
    weights = tl.zeros([K_PAD], tl.float32)
    experts = tl.zeros([K_PAD], tl.int64)
    total = 0.0
    for j in tl.static_range(TOP_K):
        best = tl.max(s, 0)
        arg = tl.min(tl.where(s == best, idx, E_PAD), 0)  # the lowest id among equals
        weights = tl.where(k == j, best, weights)
        experts = tl.where(k == j, arg.to(tl.int64), experts)
        total += best
        s = tl.where(idx == arg, -2.0, s)
    if NORM:
        weights = weights / (total + eps)
    out = weights.to(w_ptr.dtype.element_ty)
    if SCALE:
        out = (out.to(tl.float32) * scale).to(w_ptr.dtype.element_ty)
    kmask = k < TOP_K
    tl.store(w_ptr + t * TOP_K + k, out, mask=kmask)
    tl.store(e_ptr + t * TOP_K + k, experts, mask=kmask)


def supported(moe: Routing, correction_bias: torch.Tensor | None) -> bool:
    """Whether ``route_fused`` computes this routing (softmax, no groups, no bias)."""
    return (moe.scoring == "softmax" and moe.n_group <= 1 and not moe.correction_bias
            and correction_bias is None)


def route_fused(logits: torch.Tensor, moe: Routing) -> tuple[torch.Tensor, torch.Tensor]:
    """``route(logits, moe)`` for a ``supported`` set-up: ``logits [T, E]`` (unit stride along
    E) -> ``(weights [T, k], experts [T, k] int64)``; weights in float32 when the router runs
    in float32 (``router_fp32``), else in the logits' dtype."""
    t, e = logits.shape
    if logits.stride(1) != 1:
        raise ValueError("route_fused needs unit stride along the experts")
    if not 0 < moe.top_k <= e:
        raise ValueError(f"top_k {moe.top_k} outside 1..{e} experts")
    dtype = torch.float32 if moe.router_fp32 else logits.dtype
    weights = torch.empty((t, moe.top_k), dtype=dtype, device=logits.device)
    experts = torch.empty((t, moe.top_k), dtype=torch.int64, device=logits.device)
    if t == 0:
        return weights, experts
    launch = {} if checks.interpreting() else dict(num_warps=4 if e <= 256 else 8)
    _route_kernel[(t,)](logits, weights, experts, logits.stride(0), e,
                        moe.routed_scaling_factor, 1e-20 if moe.router_fp32 else 0.0,
                        TOP_K=moe.top_k, K_PAD=triton.next_power_of_2(moe.top_k),
                        E_PAD=triton.next_power_of_2(e), NORM=moe.norm_topk_prob,
                        SCALE=moe.routed_scaling_factor != 1.0, **launch)
    return weights, experts
