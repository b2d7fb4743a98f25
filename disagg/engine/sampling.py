"""Token sampling: greedy, temperature, top-k, top-p, per-request seeds; logits processors
(penalties, logit_bias) and logprobs.

Each sampled token is ``draw``: a draw whose noise is a function of ``(request seed, output
index)`` and the token alone (``disagg.kernels.sample_race``), so a request gets the same
tokens whether it runs alone or in a batch, after a preemption, and with speculative decoding
(which verifies a sampled draft by comparing it with this same draw,
``disagg.engine.speculative``).

Logits processors (``process_logits``) run on the device over the batch's float32 logits
before anything picks a token, in this order: ``repetition_penalty`` on every token id seen in
the prompt or the output (positive logits divided by it, negative ones multiplied: the CTRL
rule transformers and vLLM apply), then ``frequency_penalty * count + presence_penalty *
(count > 0)`` subtracted over the output tokens, then ``logit_bias`` added. The counts travel
with the step (``SeqChunk.penalty_ids`` / ``seen_ids``; a follow chunk's in-flight token is
added on the device), so a decode step in a CUDA graph stays one: the graph computes the raw
logits and its argmax, the processors run after it and the argmax is taken again for those
rows only when some row was processed.

Logprobs (``token_logprobs``) are the log-softmax of the logits the token was picked from:
after the processors and the grammar mask (a constrained row's distribution is over what its
grammar admits) and divided by the temperature (greedy rows: by 1), before top-k/top-p (which
only cut the support). Prompt logprobs (``prompt_logprobs``) are the model's raw log-softmax
(no processor, no temperature), as vLLM's default. No logprob leaves as -inf or NaN
(``LogprobRows.host``): alternatives without probability (a token the grammar masked) are not
listed, so a row may have fewer than it asked, and a token's own logprob that is not finite (a
row with nothing left to draw from, sampled greedily) is ``LOGPROB_FLOOR``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from disagg.engine.constraints import apply_masks, to_device
from disagg.protocol import TokenLogprobs
from disagg.protocol.executor import SeqChunk

_MASK64 = (1 << 64) - 1
LOGPROB_FLOOR = -9999.0  # a token's logprob that is not finite (vLLM's floor for its API)


def draw_seed(seed: int, index: int) -> int:
    """SplitMix64 of (seed, index): independent seeds for consecutive output tokens."""
    z = (seed * 0x9E3779B97F4A7C15 + index + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


Draw = tuple[float, int, float, int, int]  # temperature (> 0), top_k, top_p, seed, output index


def draw(logits: torch.Tensor, rows: Sequence[Draw], greedy: torch.Tensor | None = None
         ) -> torch.Tensor:
    """Row i of float32 ``logits [N, V]`` sampled as output token ``index`` of a request with
    ``(temperature, top_k, top_p, seed, index) = rows[i]``: ``[N]`` int64 on the logits'
    device, not waited for. The one way a sampled token is drawn, with or without drafts, and
    row by row independent of the other rows (so of the batch). ``greedy``: the rows' argmax
    if known (a row that is not a distribution takes it).

    The draw is the exponential race ``torch.multinomial`` runs for one sample (argmax of p_v /
    E_v, E_v ~ Exp(1)), its noise a counter-based function of ``draw_seed(seed, index)`` and
    the token (``disagg.kernels.sample_race``): the batch shares one ``torch.topk`` (the rows
    with top-k: its k-th value over the temperature is the row's floor) and one race launch,
    which divides by the temperature and applies top-p itself on CUDA (no sort;
    ``filter_batch``'s on the CPU)."""
    from disagg.kernels.sample_race import race

    dev, vocab = logits.device, logits.shape[-1]
    n = len(rows)
    temps = torch.tensor([r[0] for r in rows], dtype=torch.float32).to(dev, non_blocking=True)
    ks = [k if 0 < k < vocab else 0 for _, k, _, _, _ in rows]
    floor = top_p = None
    if any(ks):  # the division is monotone: the k-th scaled logit is the k-th logit scaled
        at = torch.tensor([max(k, 1) - 1 for k in ks], dtype=torch.int64)
        at = at.to(dev, non_blocking=True)
        kth = torch.topk(logits, max(ks), dim=-1).values.gather(1, at[:, None])[:, 0] / temps
        on = torch.tensor([k > 0 for k in ks]).to(dev, non_blocking=True)
        floor = torch.where(on, kth, torch.full((n,), float("-inf"), device=dev))
    if any(r[2] < 1.0 for r in rows):
        top_p = torch.tensor([r[2] for r in rows], dtype=torch.float32).to(dev,
                                                                           non_blocking=True)
    keys = torch.tensor([draw_seed(seed, index) for _, _, _, seed, index in rows],
                        dtype=torch.int64).to(dev, non_blocking=True)
    tok = race(logits, keys, floor, top_p, temps)
    return torch.where(tok >= 0, tok, logits.argmax(dim=-1) if greedy is None else greedy)


def draw_into(out: torch.Tensor, logits: torch.Tensor, at: list[int], rows: Sequence[Draw]
              ) -> torch.Tensor:
    """``out`` (``[N]`` int64: the rows' argmax) with rows ``at`` replaced by ``draw`` of those
    rows of ``logits [N, V]`` with ``rows`` (a row that is not a distribution keeps its
    argmax); in place, on the device."""
    if len(at) == out.shape[0]:
        return out.copy_(draw(logits, rows, out))
    idx = torch.tensor(at, dtype=torch.int64).to(logits.device, non_blocking=True)
    return out.index_copy_(0, idx, draw(logits.index_select(0, idx), rows,
                                        out.index_select(0, idx)))


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
    ``draw``n together (one sort for the rows with top-k/top-p, one race launch).

    A row cannot fail the batch: one whose probabilities are not a distribution (non-finite,
    or nothing left after top-k/top-p) is sampled greedily instead (``race`` gives it -1),
    which is what its parameters tend to; the other rows draw exactly what they would alone.

    Rows carrying a grammar mask (``SeqChunk.allowed``) have what it does not admit masked
    first, in place (``disagg.engine.constraints``); then the argmax is taken here again."""
    if apply_masks(logits, chunks):
        argmax = None  # a graph's argmax saw the logits before the masks
    out = logits.argmax(dim=-1) if argmax is None else argmax
    drawn = [i for i, c in enumerate(chunks) if c.temperature > 0.0]
    if not drawn:
        return out
    rows = [(c.temperature, c.top_k, c.top_p, c.seed, c.output_index)
            for c in (chunks[i] for i in drawn)]
    return draw_into(out.clone(), logits, drawn, rows)


# ------------------------------------------------------------------ logits processors


def has_processors(c: SeqChunk) -> bool:
    """``c``'s logits change before sampling (a penalty or a logit bias)."""
    return bool(c.presence_penalty or c.frequency_penalty or c.logit_bias
                or c.repetition_penalty != 1.0)


def _dev(values: list[int] | list[float], dtype: torch.dtype, dev: torch.device
         ) -> torch.Tensor:
    return to_device(torch.tensor(values, dtype=dtype), dev)


def process_logits(logits: torch.Tensor, chunks: Sequence[SeqChunk],
                   follow: torch.Tensor | None = None) -> torch.Tensor:
    """``logits [N, V]`` (float32; row i is ``chunks[i]``'s) with every row's processors
    applied (the module docstring's order): a new tensor, or ``logits`` itself when no row has
    one. ``follow`` (``[N]`` int64 on the device, -1 where none): a token each row's output
    holds beyond its ``penalty_ids`` (the in-flight token of a follow chunk). Batched over the
    processed rows, on the device, without waiting for it."""
    rows = [i for i, c in enumerate(chunks) if has_processors(c)]
    if not rows:
        return logits
    dev, m = logits.device, len(rows)
    picked = [chunks[i] for i in rows]
    idx = _dev(rows, torch.int64, dev)
    sub = logits.index_select(0, idx)
    counts = torch.zeros_like(sub)
    r_ids = [j for j, c in enumerate(picked) for _ in c.penalty_ids]
    if r_ids:
        ids = [t for c in picked for t in c.penalty_ids]
        counts.index_put_((_dev(r_ids, torch.int64, dev), _dev(ids, torch.int64, dev)),
                          torch.ones(len(ids), dtype=counts.dtype, device=dev), accumulate=True)
    if follow is not None:
        f = follow.index_select(0, idx)
        counts.index_put_((torch.arange(m, device=dev), f.clamp_min(0)),
                          (f >= 0).to(counts.dtype), accumulate=True)
    rep_rows = [j for j, c in enumerate(picked) if c.repetition_penalty != 1.0]
    if rep_rows:
        seen = counts > 0
        r_seen = [j for j in rep_rows for _ in picked[j].seen_ids]
        if r_seen:
            ids = [t for j in rep_rows for t in picked[j].seen_ids]
            seen[_dev(r_seen, torch.int64, dev), _dev(ids, torch.int64, dev)] = True
        rep = _dev([c.repetition_penalty for c in picked], torch.float32, dev)[:, None]
        sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
    if any(c.presence_penalty or c.frequency_penalty for c in picked):
        freq = _dev([c.frequency_penalty for c in picked], torch.float32, dev)[:, None]
        pres = _dev([c.presence_penalty for c in picked], torch.float32, dev)[:, None]
        sub = sub - freq * counts - pres * (counts > 0).to(sub.dtype)
    r_bias = [j for j, c in enumerate(picked) for _ in c.logit_bias]
    if r_bias:
        ids = [t for c in picked for t, _ in c.logit_bias]
        bias = [b for c in picked for _, b in c.logit_bias]
        sub = sub.index_put((_dev(r_bias, torch.int64, dev), _dev(ids, torch.int64, dev)),
                            _dev(bias, torch.float32, dev), accumulate=True)
    return logits.index_copy(0, idx, sub)


# ------------------------------------------------------------------ logprobs


def top_logprobs(logprobs: torch.Tensor, chosen: torch.Tensor, k: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For rows of ``logprobs [R, V]`` (log-softmax) and the token ``chosen [R]`` of each:
    (its logprob ``[R]``, the ``k`` largest logprobs ``[R, k]`` and their ids ``[R, k]``)."""
    lp = logprobs.gather(1, chosen[:, None])[:, 0]
    top = torch.topk(logprobs, k, dim=-1) if k > 0 else None
    empty = logprobs.new_empty((logprobs.shape[0], 0))
    return (lp, top.values if top is not None else empty,
            top.indices if top is not None else empty.long())


def finite_logprobs(token: int, logprob: float, top_ids: list[int], top_lps: list[float]
                    ) -> TokenLogprobs:
    """One row's logprobs with no -inf or NaN (which JSON cannot carry: msgspec writes null):
    the alternatives that are not finite (without probability, e.g. masked by a grammar) left
    out, the token's own logprob ``LOGPROB_FLOOR`` if it is not finite."""
    isfinite = math.isfinite
    if not isfinite(logprob):
        logprob = LOGPROB_FLOOR
    if all(map(isfinite, top_lps)):
        return TokenLogprobs(token, logprob, top_ids, top_lps)
    kept = [j for j, v in enumerate(top_lps) if isfinite(v)]
    return TokenLogprobs(token, logprob, [top_ids[j] for j in kept], [top_lps[j] for j in kept])


class LogprobRows:
    """Logprobs computed on the device for some rows, read on the host once it is done."""

    def __init__(self, keys: list[int], ks: list[int], chosen: torch.Tensor,
                 lp: torch.Tensor, top_lp: torch.Tensor, top_ids: torch.Tensor):
        self.keys, self.ks = keys, ks
        self.tensors = (chosen, lp, top_lp, top_ids)

    def stage(self) -> None:
        """Queue the rows' copy into pinned host memory now (CUDA), so that reading them
        after the step's event (``host``) never waits for work queued later: the step after
        an overlapped one is on the device by then."""
        if self.tensors[0].device.type != "cuda":
            return
        staged = []
        for t in self.tensors:
            dst = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            dst.copy_(t, non_blocking=True)
            staged.append(dst)
        self.tensors = (staged[0], staged[1], staged[2], staged[3])

    def host(self) -> list[tuple[int, TokenLogprobs]]:
        """(key, logprobs) per row, in order (one copy per tensor; none once ``stage``d and
        the step's event passed), every value finite (``finite_logprobs``)."""
        chosen, lp, top_lp, top_ids = (t.tolist() for t in self.tensors)
        return [(key, finite_logprobs(chosen[i], lp[i], top_ids[i][:k], top_lp[i][:k]))
                for i, (key, k) in enumerate(zip(self.keys, self.ks, strict=True))]

    def grouped(self) -> dict[int, list[TokenLogprobs]]:
        """The rows' logprobs by key, each key's in order."""
        out: dict[int, list[TokenLogprobs]] = {}
        for key, lp in self.host():
            out.setdefault(key, []).append(lp)
        return out


def token_logprobs(logits: torch.Tensor, chunks: Sequence[SeqChunk], tokens: torch.Tensor
                   ) -> LogprobRows | None:
    """The sampled ``tokens [N]``' logprobs for the rows of processed ``logits [N, V]`` whose
    chunk asked (``SeqChunk.logprobs >= 0``), keyed by slot: log-softmax of the logits divided
    by the row's temperature (1 for greedy rows). ``logits`` are the ones the tokens were picked
    from, grammar masks included (what a row's grammar does not admit is -inf: never listed,
    ``LogprobRows.host``). None when no row asked."""
    rows = [i for i, c in enumerate(chunks) if c.logprobs >= 0]
    if not rows:
        return None
    dev = logits.device
    idx = _dev(rows, torch.int64, dev)
    temps = _dev([chunks[i].temperature if chunks[i].temperature > 0 else 1.0 for i in rows],
                 torch.float32, dev)
    lps = torch.log_softmax(logits.index_select(0, idx) / temps[:, None], dim=-1)
    chosen = tokens.index_select(0, idx)
    ks = [chunks[i].logprobs for i in rows]
    return LogprobRows([chunks[i].slot for i in rows], ks, chosen,
                       *top_logprobs(lps, chosen, max(ks)))


PROMPT_LOGPROB_ROWS = 512  # prompt rows whose logits are materialised at once ([rows, V] fp32)


def prompt_logprobs(logits_of: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor,
                    targets: torch.Tensor, k: int) -> tuple[torch.Tensor, ...]:
    """Raw logprobs of ``targets [R]`` after hidden rows ``hidden [R, H]`` (``logits_of``:
    the model's head) and their ``k`` alternatives, ``PROMPT_LOGPROB_ROWS`` rows at a time:
    (targets, their logprobs ``[R]``, top logprobs ``[R, k]``, top ids ``[R, k]``)."""
    parts = [top_logprobs(torch.log_softmax(logits_of(hidden[a:a + PROMPT_LOGPROB_ROWS]), -1),
                          targets[a:a + PROMPT_LOGPROB_ROWS], k)
             for a in range(0, hidden.shape[0], PROMPT_LOGPROB_ROWS)]
    return (targets, *(torch.cat([p[j] for p in parts]) for j in range(3)))
