"""Mixture-of-experts MLP (Qwen2/3-MoE, DeepSeek V2/V3): routing and the torch path.

``route`` turns router logits into each token's ``top_k`` experts and weights exactly as the
Hugging Face models do (see ``MoEArch``). ``MoEMLP`` holds every expert's SiLU-gated MLP as
stacked tensors (``gate_up [E, 2I, H]``, ``down [E, H, I]``) plus the shared expert. On CUDA in
fp16/bf16 the routed experts run in the fused Triton kernels (``disagg.kernels.fused_moe``) and
plain softmax routing in one kernel (``disagg.kernels.moe_routing``): no host sync, so a
forward can be captured in a CUDA graph. Elsewhere ``experts_loop`` runs each
expert hit on the rows routed to it (it asks the host which experts were hit). Under tensor
parallelism every rank holds a slice of every expert's intermediate dimension (as for dense
MLPs), so its output is a partial sum the caller all-reduces. Under expert parallelism
(``disagg.model.ep``) a rank holds ``E / ranks`` whole experts and the routed rows travel to
them and back by all-to-all; with one EP rank that is today's path, unchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from disagg.kernels.fp8_weight import Fp8Weight
from disagg.model.config import MoEArch
from disagg.model.ep import token_share
from disagg.model.ops import project, silu_mul
from disagg.model.tp import TensorParallel


def route(logits: torch.Tensor, moe: MoEArch,
          correction_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``logits [T, E]`` -> ``(weights [T, k], experts [T, k])``."""
    t, e = logits.shape
    if moe.scoring == "sigmoid":
        scores = logits.sigmoid()
    else:
        scores = logits.softmax(dim=-1, dtype=torch.float32)
    choice = scores if correction_bias is None else scores + correction_bias
    if moe.n_group > 1:
        grouped = choice.view(t, moe.n_group, e // moe.n_group)
        group_scores = (grouped.max(dim=-1).values if moe.group_score == "max"
                        else grouped.topk(2, dim=-1)[0].sum(dim=-1))
        best = torch.topk(group_scores, k=moe.topk_group, dim=-1, sorted=False)[1]
        keep = torch.zeros_like(group_scores).scatter_(1, best, 1).bool()
        keep = keep.unsqueeze(-1).expand(-1, -1, e // moe.n_group).reshape(t, e)
        # V3 chooses on the corrected scores among the kept groups; V2 zeroes the others
        choice = choice.masked_fill(~keep, float("-inf") if moe.correction_bias else 0.0)
    if moe.correction_bias or moe.n_group > 1:
        experts = torch.topk(choice, k=moe.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, experts)
    else:
        weights, experts = torch.topk(scores, k=moe.top_k, dim=-1)
    if moe.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + (1e-20 if moe.router_fp32
                                                                  else 0.0))
    if not moe.router_fp32:
        weights = weights.to(logits.dtype)  # Qwen-MoE rounds the weights to the model dtype
    return weights * moe.routed_scaling_factor if moe.routed_scaling_factor != 1.0 \
        else weights, experts


def experts_loop(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
                 gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """The routed experts' weighted sum, one expert at a time (the fused kernels' reference)."""
    out = torch.zeros_like(x)
    for e in torch.unique(experts).tolist():
        rows, pos = torch.where(experts == e)
        gate, up = F.linear(x[rows], gate_up[e]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, down[e]) * weights[rows, pos, None]
        out.index_add_(0, rows, y.to(out.dtype))
    return out


class MoEMLP(nn.Module):
    def __init__(self, hidden: int, moe: MoEArch, dtype: torch.dtype, device: torch.device,
                 tp: TensorParallel | None = None):
        """``moe`` holds this rank's (local) intermediate sizes; under ``tp.ep`` (expert
        parallelism over more than one rank) only this rank's experts are held."""
        super().__init__()
        self.arch = moe
        self.tp = tp or TensorParallel()
        ep = self.tp.ep
        self.ep = ep if ep is not None and ep.size > 1 else None

        def p(*shape: int, dt: torch.dtype = dtype) -> nn.Parameter:
            return nn.Parameter(torch.empty(*shape, dtype=dt, device=device), requires_grad=False)

        e, i, s = moe.num_experts, moe.intermediate_size, moe.shared_intermediate_size
        local = len(self.ep.experts(e)) if self.ep is not None else e
        self.router = p(e, hidden)
        self.correction_bias = p(e, dt=torch.float32) if moe.correction_bias else None
        self.gate_up = p(local, 2 * i, hidden)
        self.down = p(local, hidden, i)
        self.shared_gate_up = p(2 * s, hidden) if s else None
        self.shared_down = p(hidden, s) if s else None
        self.shared_gate = p(1, hidden) if moe.shared_gate else None

    # None: the fused kernels on CUDA for fp16/bf16, the loop otherwise; False: always the loop;
    # True: always the fused kernels (also on CPU under TRITON_INTERPRET=1, for tests)
    fused: bool | None = None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x [T, H]`` -> ``(weights [T, k], experts [T, k])``."""
        if self.arch.router_fp32:
            logits = F.linear(x.float(), self.router.float())
        else:
            logits = F.linear(x, self.router)
        if self.use_fused(x):
            from disagg.kernels.moe_routing import route_fused, supported

            if supported(self.arch, self.correction_bias):
                return route_fused(logits, self.arch)
        return route(logits, self.arch, self.correction_bias)

    def use_fused(self, x: torch.Tensor) -> bool:
        if self.fused is not None:
            return self.fused
        return x.is_cuda and x.dtype in (torch.float16, torch.bfloat16)

    def mix(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """The routed experts for the given routing plus the shared expert: ``[T, H]``."""
        return self._shared(x, self._experts(x, weights, experts))

    def _experts(self, x: torch.Tensor, weights: torch.Tensor,
                 experts: torch.Tensor) -> torch.Tensor:
        """The weighted sum of this rank's experts ``experts [T, k]`` (ids into the experts
        it holds) over ``x [T, H]``."""
        if self.use_fused(x):
            from disagg.kernels.fused_moe import fused_experts

            if x.shape[0] == 0:
                return torch.zeros_like(x)
            return fused_experts(x, weights, experts, self.gate_up, self.down)
        gate_up, down = self.gate_up, self.down
        if isinstance(gate_up, Fp8Weight):  # the CPU path: dequantized per call
            gate_up = gate_up.dequantize(x.dtype)
        if isinstance(down, Fp8Weight):
            down = down.dequantize(x.dtype)
        return experts_loop(x, weights, experts, gate_up, down)

    def _shared(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``out`` plus the shared expert over ``x`` (when the model has one)."""
        if self.shared_gate_up is not None and self.shared_down is not None and x.shape[0]:
            shared = project(silu_mul(project(x, self.shared_gate_up)), self.shared_down)
            if self.shared_gate is not None:
                shared = torch.sigmoid(F.linear(x, self.shared_gate)) * shared
            out = out + shared
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [T, H]`` -> this rank's partial MLP output ``[T, H]``."""
        if self.ep is not None:
            return self._forward_ep(x)
        weights, experts = self.route(x)
        return self.mix(x, weights, experts)

    def _forward_ep(self, x: torch.Tensor) -> torch.Tensor:
        """Expert parallelism: route this TP rank's share of the rows, send them to their
        experts' ranks and back (``ExpertParallel.exchange``); the other rows stay zero (the
        TP all-reduce after the MLP fills them in from their ranks)."""
        assert self.ep is not None
        lo, hi = token_share(x.shape[0], self.tp.rank, self.tp.size)
        own = x[lo:hi]
        if hi > lo:
            weights, experts = self.route(own)
        else:  # no rows here (a dummy batch, or fewer rows than TP ranks): join with none
            k = self.arch.top_k
            weights = own.new_empty((0, k), dtype=torch.float32 if self.arch.router_fp32
                                    else own.dtype)
            experts = torch.empty((0, k), dtype=torch.long, device=own.device)

        def local(rows: torch.Tensor, w: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
            return self._experts(rows, w[:, None], e[:, None])

        routed = self.ep.exchange(own, weights, experts, self.arch.num_experts, local)
        if self.tp.size > 1:
            out = torch.zeros_like(x)
            out[lo:hi] = routed
            routed = out
        return self._shared(x, routed)


def warm(mlp: MoEMLP, max_tokens: int) -> list[int]:
    """Compile every fused-kernel variant a forward of up to ``max_tokens`` rows can launch
    (one forward per distinct tile config); returns the row counts run. Call before ready."""
    from disagg.kernels.fused_moe import config_tokens

    x = mlp.router
    if not mlp.use_fused(x):
        return []
    tokens = config_tokens(mlp.arch.top_k, mlp.arch.num_experts, max_tokens)
    for t in tokens:
        mlp(torch.randn(t, x.shape[1], dtype=x.dtype, device=x.device))
    return tokens
