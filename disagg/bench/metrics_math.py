"""The metric math of ``disagg-bench serve``: pure functions over per-request records.

Definitions (times in seconds here; the report converts to milliseconds):

- TTFT: first token chunk received - request sent.
- E2E: terminal ``finished`` received - request sent.
- TPOT: ``(e2e - ttft) / (n - 1)`` for a request with ``n >= 2`` output tokens (undefined for
  ``n < 2``); the mean time per output token after the first, as one user sees it. A request
  of several choices (``--n``) streams each as its own sequence: its TPOT is the mean of its
  choices' own (each from its first chunk, over its own tokens), not the request's time over
  every choice's tokens.
- Tokens/s per user: ``1 / TPOT`` of each request.
- ITL: gaps between consecutive token *chunks* of one request, as received. A chunk carrying
  k tokens counts once (the gap is what the user waited); with one token per chunk this is the
  classic inter-token latency. With several choices, gaps within each choice.
- Output tokens (totals and throughputs): each completed request's usage as the node reported
  it (every choice's tokens with ``n > 1``), else the tokens its chunks counted.
- Goodput: completed requests meeting every SLO given (TTFT <= slo_ttft, TPOT <= slo_tpot; a
  request with no TPOT meets the TPOT SLO) per second of benchmark duration.

Percentiles interpolate linearly between closest ranks (numpy's default ``linear`` method), so
P50 of [1, 2, 3, 4] is 2.5.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import pairwise

PERCENTILES = (50.0, 90.0, 99.0)


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0 <= q <= 100) of ``values`` with linear interpolation."""
    if not values:
        raise ValueError("percentile of an empty sequence")
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile q must be in [0, 100], got {q}")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize(values: Sequence[float], percentiles: Sequence[float] = PERCENTILES,
              scale: float = 1.0) -> dict[str, float | int | None]:
    """``count``, ``mean``, ``std`` (population), ``min``, ``max`` and ``pXX`` of ``values``
    multiplied by ``scale``; every statistic is None when ``values`` is empty."""
    xs = [v * scale for v in values]
    out: dict[str, float | int | None] = {"count": len(xs)}
    if not xs:
        out.update({"mean": None, "std": None, "min": None, "max": None})
        out.update({_pkey(q): None for q in percentiles})
        return out
    mean = sum(xs) / len(xs)
    out["mean"] = mean
    out["std"] = math.sqrt(sum((x - mean) ** 2 for x in xs) / len(xs))
    out["min"] = min(xs)
    out["max"] = max(xs)
    for q in percentiles:
        out[_pkey(q)] = percentile(xs, q)
    return out


def _pkey(q: float) -> str:
    return f"p{q:g}".replace(".", "_")


def tpot(e2e: float, ttft: float, num_output_tokens: int) -> float | None:
    """Time per output token after the first; None for fewer than two output tokens."""
    if num_output_tokens < 2:
        return None
    return (e2e - ttft) / (num_output_tokens - 1)


def itls(chunk_times: Sequence[float], chunk_choices: Sequence[int] = ()) -> list[float]:
    """Gaps between consecutive chunk arrival times (non-decreasing timestamps) of each
    choice (``chunk_choices[i]``: chunk i's; empty: one choice), not across choices."""
    if not chunk_choices:
        return [b - a for a, b in pairwise(chunk_times)]
    out: list[float] = []
    for c in dict.fromkeys(chunk_choices):
        out += itls([t for t, k in zip(chunk_times, chunk_choices, strict=True) if k == c])
    return out


def request_tpot(send_time: float, finish_time: float, chunk_times: Sequence[float],
                 chunk_tokens: Sequence[int], chunk_choices: Sequence[int] = ()
                 ) -> float | None:
    """A request's TPOT: with several choices (``n > 1``: ``chunk_choices[i]`` is chunk i's;
    empty: one choice) the mean of each choice's own, ``(finish - its first chunk) / (its
    tokens - 1)``: the time between one choice's tokens, not the request's time over every
    choice's tokens. None when no choice has two tokens."""
    choices = chunk_choices or [0] * len(chunk_times)
    first: dict[int, float] = {}
    tokens: dict[int, int] = {}
    for t, n, c in zip(chunk_times, chunk_tokens, choices, strict=True):
        first.setdefault(c, t)
        tokens[c] = tokens.get(c, 0) + n
    each = [x for c, t in first.items()
            if (x := tpot(finish_time - send_time, t - send_time, tokens[c])) is not None]
    return sum(each) / len(each) if each else None


def meets_slo(ttft: float, tpot_s: float | None, slo_ttft: float | None,
              slo_tpot: float | None) -> bool:
    """Whether one completed request meets every SLO given (None = no SLO on that metric)."""
    if slo_ttft is not None and ttft > slo_ttft:
        return False
    return not (slo_tpot is not None and tpot_s is not None and tpot_s > slo_tpot)


@dataclass
class RequestRecord:
    """One request as the load generator saw it. Times are seconds since the benchmark start
    (``time.perf_counter`` based); ``chunk_times[i]`` carried ``chunk_tokens[i]`` tokens."""

    index: int
    node: str  # address (or name) of the node that served it
    input_len: int  # prompt tokens sent
    output_len: int  # output tokens requested (max_tokens)
    scheduled_time: float  # when the arrival process released it
    send_time: float | None = None  # when it was sent (later than scheduled under a concurrency cap)
    chunk_times: list[float] = field(default_factory=list)
    chunk_tokens: list[int] = field(default_factory=list)
    # the choice (n > 1 over HTTP) each chunk belongs to (its index); empty: one choice
    chunk_choices: list[int] = field(default_factory=list)
    finish_time: float | None = None  # terminal ``finished`` received
    finish_reason: str | None = None
    prompt_tokens: int | None = None  # the node's usage report
    completion_tokens: int | None = None
    error: str | None = None  # None when the request completed
    # TTFT breakdown from node timestamps (ms per phase, e.g. decoder_queue, prefill_queue,
    # prefill_compute, transfer_tail, first_decode). Empty while the nodes report none.
    breakdown: dict[str, float] = field(default_factory=dict)
    cached_tokens: int | None = None  # prompt tokens served from the node's prefix cache
    conversation: int | None = None  # multiturn: which conversation, and its turn (from 0)
    turn: int | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.finish_time is not None and self.send_time is not None

    @property
    def num_output_tokens(self) -> int:
        """Tokens counted in the chunks received (the timing of TPOT and ITL)."""
        return sum(self.chunk_tokens)

    @property
    def output_tokens(self) -> int:
        """Output tokens generated: the node's usage where it reported one, else the chunks'
        count. Over HTTP they differ: an SSE event counts one token per choice with text,
        whatever it carried (several tokens; none for a token of empty text), and with
        ``n > 1`` usage counts every choice's tokens."""
        if self.completion_tokens is not None:
            return self.completion_tokens
        return self.num_output_tokens

    @property
    def ttft(self) -> float | None:
        if not self.ok or not self.chunk_times or self.send_time is None:
            return None
        return self.chunk_times[0] - self.send_time

    @property
    def e2e(self) -> float | None:
        if not self.ok or self.finish_time is None or self.send_time is None:
            return None
        return self.finish_time - self.send_time

    @property
    def tpot(self) -> float | None:
        """Per choice (``request_tpot``): one choice's time between tokens."""
        if self.ttft is None or self.finish_time is None or self.send_time is None:
            return None
        return request_tpot(self.send_time, self.finish_time, self.chunk_times,
                            self.chunk_tokens, self.chunk_choices)


def aggregate(records: Sequence[RequestRecord], duration: float,
              slo_ttft: float | None = None, slo_tpot: float | None = None) -> dict[str, object]:
    """The benchmark summary: counts, throughputs, latency distributions (ms), goodput.

    ``duration`` is the benchmark's wall time in seconds (first arrival to last completion)."""
    if duration <= 0:
        raise ValueError(f"duration must be > 0, got {duration}")
    done = [r for r in records if r.ok]
    ttfts = [t for r in done if (t := r.ttft) is not None]
    tpots = [t for r in done if (t := r.tpot) is not None]
    e2es = [t for r in done if (t := r.e2e) is not None]
    itl_all = [g for r in done for g in itls(r.chunk_times, r.chunk_choices)]
    out_tokens = sum(r.output_tokens for r in done)
    in_tokens = sum(r.input_len for r in done)
    errors: dict[str, int] = {}
    for r in records:
        if r.error is not None:
            key = r.error.split(":", 1)[0]
            errors[key] = errors.get(key, 0) + 1
    summary: dict[str, object] = {
        "num_requests": len(records),
        "completed": len(done),
        "failed": len(records) - len(done),
        "errors": errors,
        "duration_s": duration,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(done) / duration,
        "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        "ttft_ms": summarize(ttfts, scale=1e3),
        "tpot_ms": summarize(tpots, scale=1e3),
        "itl_ms": summarize(itl_all, scale=1e3),
        "e2e_ms": summarize(e2es, scale=1e3),
        # the slow users are the low percentiles of speed
        "tokens_per_s_per_user": summarize([1.0 / t for t in tpots if t > 0],
                                           percentiles=(1.0, 10.0, 50.0, 90.0, 99.0)),
    }
    if slo_ttft is not None or slo_tpot is not None:
        good = sum(1 for r in done if r.ttft is not None
                   and meets_slo(r.ttft, r.tpot, slo_ttft, slo_tpot))
        summary["goodput"] = {
            "slo_ttft_ms": None if slo_ttft is None else slo_ttft * 1e3,
            "slo_tpot_ms": None if slo_tpot is None else slo_tpot * 1e3,
            "good_requests": good,
            "request_goodput": good / duration,
            "fraction": good / len(records) if records else 0.0,
        }
    else:
        summary["goodput"] = None
    phases = sorted({k for r in done for k in r.breakdown})
    summary["ttft_breakdown_ms"] = {
        k: summarize([r.breakdown[k] for r in done if k in r.breakdown]) for k in phases}
    return summary


def multiturn_summary(records: Sequence[RequestRecord]) -> dict[str, object]:
    """Per turn of a multiturn run: requests, TTFT (ms) and the share of prompt tokens the
    nodes served from their prefix caches; over all turns the same share, each later turn's
    median TTFT over the first turn's, and the TTFT of every turn after the first together
    (``later_turns_ttft_ms``: what a prefix cache and its tiers serve)."""
    done = [r for r in records if r.ok and r.turn is not None]
    turns: dict[int, dict[str, object]] = {}
    for t in sorted({r.turn for r in done if r.turn is not None}):
        rs = [r for r in done if r.turn == t]
        prompt = sum(r.prompt_tokens or r.input_len for r in rs)
        cached = sum(r.cached_tokens or 0 for r in rs)
        turns[t] = {"requests": len(rs),
                    "ttft_ms": summarize([x for r in rs if (x := r.ttft) is not None], scale=1e3),
                    "prompt_tokens": prompt, "cached_tokens": cached,
                    "cached_share": cached / prompt if prompt else 0.0}
    first = turns.get(0, {}).get("ttft_ms")
    p50_first = first.get("p50") if isinstance(first, dict) else None
    ratios = {}
    for t, d in turns.items():
        p50 = d["ttft_ms"].get("p50") if isinstance(d["ttft_ms"], dict) else None
        if t > 0 and p50 is not None and p50_first:
            ratios[t] = p50 / p50_first
    prompt = sum(r.prompt_tokens or r.input_len for r in done)
    cached = sum(r.cached_tokens or 0 for r in done)
    later = [x for r in done if r.turn and (x := r.ttft) is not None]
    return {"turns": turns, "ttft_p50_vs_first_turn": ratios,
            "prefix_hit_rate": cached / prompt if prompt else 0.0,
            "later_turns_ttft_ms": summarize(later, scale=1e3)}
