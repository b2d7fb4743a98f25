"""Token sampling: greedy, temperature, top-k, top-p, per-request seeds.

Each sampled row draws from its own generator seeded by ``(request seed, output index)``, so a
request gets the same tokens whether it runs alone or in a batch, and after a preemption.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from disagg.protocol.executor import SeqChunk

_MASK64 = (1 << 64) - 1


def draw_seed(seed: int, index: int) -> int:
    """SplitMix64 of (seed, index): independent seeds for consecutive output tokens."""
    z = (seed * 0x9E3779B97F4A7C15 + index + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask (to -inf) what top-k and top-p exclude from one row of float32 logits."""
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # drop a token when the mass before it already reaches top_p (the top token always stays)
        drop = (torch.cumsum(probs, dim=-1) - probs) >= top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return logits


def usable_or_greedy(probs: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """``probs`` when it is a distribution ``torch.multinomial`` accepts (finite, positive sum),
    else a one-hot on ``logits``' argmax: the greedy limit of a row whose temperature or top-p
    is too small for float32 (or whose logits are not finite). Stays on the device (no sync),
    so a bad row can neither raise on the host nor trip a device-side assert."""
    ok = torch.isfinite(probs).all() & (probs.sum() > 0)
    onehot = torch.zeros_like(probs).scatter_(0, logits.argmax().reshape(1), 1.0)
    return torch.where(ok, probs, onehot)


def sample(logits: torch.Tensor, chunks: Sequence[SeqChunk],
           argmax: torch.Tensor | None = None) -> list[int]:
    """``sample_device``'s tokens on the host (one device-to-host copy for the batch)."""
    return sample_device(logits, chunks, argmax).tolist()


def sample_device(logits: torch.Tensor, chunks: Sequence[SeqChunk],
                  argmax: torch.Tensor | None = None) -> torch.Tensor:
    """One token per row of ``logits [N, V]`` (float32); row i belongs to ``chunks[i]``.
    Returns them as an int64 tensor on the logits' device, without waiting for the device.

    Greedy rows take ``argmax`` (the rows' argmax already computed on the device, e.g. by a
    CUDA graph: returned as is when every row is greedy) or compute it here; only sampled rows
    work row by row.

    A row cannot fail the batch: one whose probabilities are not a distribution (non-finite,
    or nothing left after top-k/top-p) is sampled greedily instead (``usable_or_greedy``),
    which is what its parameters tend to; the other rows draw exactly what they would alone."""
    out = logits.argmax(dim=-1) if argmax is None else argmax
    drawn = [i for i, c in enumerate(chunks) if c.temperature > 0.0]
    if drawn:
        out = out.clone()
    for i in drawn:
        c = chunks[i]
        row = filter_logits(logits[i] / c.temperature, c.top_k, c.top_p)
        probs = usable_or_greedy(torch.softmax(row, dim=-1), logits[i])
        gen = torch.Generator(device=logits.device).manual_seed(draw_seed(c.seed, c.output_index))
        out[i:i + 1] = torch.multinomial(probs, 1, generator=gen)
    return out
