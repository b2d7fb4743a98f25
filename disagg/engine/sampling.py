"""Token sampling: greedy, temperature, top-k, top-p, per-request seeds.

Each sampled token is ``draw``: a draw from its own generator seeded by ``(request seed, output
index)``, so a request gets the same tokens whether it runs alone or in a batch, after a
preemption, and with speculative decoding (which verifies a sampled draft by comparing it with
this same draw, ``disagg.engine.speculative``).
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
    """``probs`` (a row ``[V]`` or rows ``[N, V]``) where a row is a distribution one can draw
    from (finite, positive sum), else a one-hot on that row of ``logits``' argmax: the greedy
    limit of a row whose temperature or top-p is too small for float32 (or whose logits are
    not finite). Stays on the device (no sync), so a bad row can neither raise on the host nor
    trip a device-side assert."""
    ok = torch.isfinite(probs).all(dim=-1, keepdim=True) & (probs.sum(dim=-1, keepdim=True) > 0)
    onehot = torch.zeros_like(probs).scatter_(-1, logits.argmax(dim=-1, keepdim=True), 1.0)
    return torch.where(ok, probs, onehot)


Draw = tuple[float, int, float, int, int]  # temperature (> 0), top_k, top_p, seed, output index


def draw(logits: torch.Tensor, rows: Sequence[Draw]) -> torch.Tensor:
    """Row i of float32 ``logits [N, V]`` sampled as output token ``index`` of a request with
    ``(temperature, top_k, top_p, seed, index) = rows[i]``: ``[N]`` int64 on the logits'
    device, not waited for. The one way a sampled token is drawn, with or without drafts, and
    row by row independent of the other rows (so of the batch).

    The draw is the exponential race ``torch.multinomial`` runs for one sample (argmax of p_v /
    E_v, E_v ~ Exp(1)), its noise from a generator seeded by ``draw_seed(seed, index)``;
    done here so that the whole batch shares one softmax, one division and one argmax (only
    top-k/top-p filters and the noise go row by row), and nothing waits for the device."""
    dev, vocab = logits.device, logits.shape[-1]
    temps = torch.tensor([r[0] for r in rows], dtype=torch.float32).to(dev, non_blocking=True)
    scaled = logits / temps[:, None]
    for i, (_, top_k, top_p, _, _) in enumerate(rows):
        if 0 < top_k < vocab or top_p < 1.0:
            scaled[i] = filter_logits(scaled[i], top_k, top_p)
    probs = usable_or_greedy(torch.softmax(scaled, dim=-1), logits)
    noise = torch.empty_like(probs)
    for i, (_, _, _, seed, index) in enumerate(rows):
        noise[i].exponential_(generator=torch.Generator(device=dev).manual_seed(
            draw_seed(seed, index)))
    return (probs / noise.clamp_min_(torch.finfo(noise.dtype).tiny)).argmax(dim=-1)


def draw_into(out: torch.Tensor, logits: torch.Tensor, at: list[int], rows: Sequence[Draw]
              ) -> torch.Tensor:
    """``out`` (``[N]`` int64, e.g. the rows' argmax) with rows ``at`` replaced by ``draw``
    of those rows of ``logits [N, V]`` with ``rows``; in place, on the device."""
    if len(at) == out.shape[0]:
        return out.copy_(draw(logits, rows))
    idx = torch.tensor(at, dtype=torch.int64).to(logits.device, non_blocking=True)
    return out.index_copy_(0, idx, draw(logits.index_select(0, idx), rows))


def sample(logits: torch.Tensor, chunks: Sequence[SeqChunk],
           argmax: torch.Tensor | None = None) -> list[int]:
    """``sample_device``'s tokens on the host (one device-to-host copy for the batch)."""
    return sample_device(logits, chunks, argmax).tolist()


def sample_device(logits: torch.Tensor, chunks: Sequence[SeqChunk],
                  argmax: torch.Tensor | None = None) -> torch.Tensor:
    """One token per row of ``logits [N, V]`` (float32); row i belongs to ``chunks[i]``.
    Returns them as an int64 tensor on the logits' device, without waiting for the device.

    Greedy rows take ``argmax`` (the rows' argmax already computed on the device, e.g. by a
    CUDA graph: returned as is when every row is greedy) or compute it here; sampled rows are
    ``draw``n together (only their top-k/top-p filters and their generators go row by row).

    A row cannot fail the batch: one whose probabilities are not a distribution (non-finite,
    or nothing left after top-k/top-p) is sampled greedily instead (``usable_or_greedy``),
    which is what its parameters tend to; the other rows draw exactly what they would alone."""
    out = logits.argmax(dim=-1) if argmax is None else argmax
    drawn = [i for i, c in enumerate(chunks) if c.temperature > 0.0]
    if not drawn:
        return out
    rows = [(c.temperature, c.top_k, c.top_p, c.seed, c.output_index)
            for c in (chunks[i] for i in drawn)]
    return draw_into(out.clone(), logits, drawn, rows)
