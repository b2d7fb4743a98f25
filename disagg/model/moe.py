"""Mixture-of-experts MLP (Qwen2/3-MoE, DeepSeek V2/V3): routing and the torch path.

``route`` turns router logits into each token's ``top_k`` experts and weights exactly as the
Hugging Face models do (see ``MoEArch``). ``MoEMLP`` holds every expert's SiLU-gated MLP as
stacked tensors (``gate_up [E, 2I, H]``, ``down [E, H, I]``) plus the shared expert, and runs
each expert hit on the rows routed to it. Under tensor parallelism every rank holds a slice
of every expert's intermediate dimension (as for dense MLPs), so its output is a partial sum
the caller all-reduces.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from disagg.model.config import MoEArch


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


class MoEMLP(nn.Module):
    def __init__(self, hidden: int, moe: MoEArch, dtype: torch.dtype, device: torch.device):
        """``moe`` holds this rank's (local) intermediate sizes."""
        super().__init__()
        self.arch = moe

        def p(*shape: int, dt: torch.dtype = dtype) -> nn.Parameter:
            return nn.Parameter(torch.empty(*shape, dtype=dt, device=device), requires_grad=False)

        e, i, s = moe.num_experts, moe.intermediate_size, moe.shared_intermediate_size
        self.router = p(e, hidden)
        self.correction_bias = p(e, dt=torch.float32) if moe.correction_bias else None
        self.gate_up = p(e, 2 * i, hidden)
        self.down = p(e, hidden, i)
        self.shared_gate_up = p(2 * s, hidden) if s else None
        self.shared_down = p(hidden, s) if s else None
        self.shared_gate = p(1, hidden) if moe.shared_gate else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [T, H]`` -> this rank's partial MLP output ``[T, H]``."""
        if self.arch.router_fp32:
            logits = F.linear(x.float(), self.router.float())
        else:
            logits = F.linear(x, self.router)
        weights, experts = route(logits, self.arch, self.correction_bias)
        out = torch.zeros_like(x)
        for e in torch.unique(experts).tolist():
            rows, pos = torch.where(experts == e)
            gate, up = F.linear(x[rows], self.gate_up[e]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.down[e]) * weights[rows, pos, None]
            out.index_add_(0, rows, y.to(out.dtype))
        if self.shared_gate_up is not None and self.shared_down is not None:
            gate, up = F.linear(x, self.shared_gate_up).chunk(2, dim=-1)
            shared = F.linear(F.silu(gate) * up, self.shared_down)
            if self.shared_gate is not None:
                shared = torch.sigmoid(F.linear(x, self.shared_gate)) * shared
            out = out + shared
        return out
