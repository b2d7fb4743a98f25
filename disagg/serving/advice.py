"""Prefill : decode ratio advice: is the deployment prefill-bound or decode-bound, and which
ratio of prefill to decode nodes would meet the latency SLOs at today's load (pure: no
sockets, no clock of its own; the router feeds it, ``docs/ADVICE.md`` derives the formulas).

Inputs: one ``NodeLoad`` per live node (its last ``Stats``: the router polls its decode peers;
prefill nodes count through their ``prefill_peers_alive``) and the ``Sample``s of recently
finished requests (TTFT, TPOT, the decoder's ``Finished.timings``), kept by ``LatencyWindow``.

Each pool gets a *pressure*: the capacity it needs to meet its SLO at the current load over
the capacity it has (1 = exactly at the SLO; 2 = twice the nodes needed; 0.5 = half would do).

- Prefill (TTFT): each prefiller is taken as an M/M/1 queue. Its utilisation is
  ``rho = q / (q + c)`` (mean prefill queue time q and compute time c from the timings; from
  Stats when fewer than ``MIN_SAMPLES`` requests carry timings: ``n / (1 + n)`` with ``n`` the
  requests waiting for KV per prefiller). The TTFT SLO leaves ``Q = SLO - (TTFT_p90 - q_p90)``
  for queueing, which M/M/1 reaches at ``rho* = Q / (Q + c)``. Pressure ``rho / rho*``.
- Decode (TPOT): step time taken as proportional to the batch, so pressure is the largest of
  ``TPOT_p90 / SLO``, ``1 + W / (R + K)`` when requests queue at the decoders (W waiting,
  R running, K waiting for KV: the queue's decode share) and KV page use over ``KV_TARGET``.

Needed nodes = nodes x pressure; the suggested ratio is their quotient. The verdict names the
pool whose pressure exceeds the other's by more than ``TOLERANCE``; under light load (both
below ``LIGHT``) or within the tolerance it is ``balanced`` and the ratio is kept.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from disagg.protocol import Finished, Stats

VERDICTS = ("prefill-bound", "decode-bound", "balanced", "unknown")
MIN_SAMPLES = 5  # finished requests needed before a percentile is trusted
PERCENTILE = 0.9  # the SLOs are read as bounds on the p90
TOLERANCE = 0.25  # one pool is "the bound" when its pressure exceeds the other's by this much
LIGHT = 0.5  # below this pressure in both pools the load is too light to judge a ratio
RHO_STATS = 0.8  # target prefill utilisation when no timings say what the SLO allows
RHO_MIN, RHO_MAX = 0.05, 0.9  # bounds on a prefill utilisation target
KV_TARGET = 0.9  # decode KV page use regarded as full
MAX_PRESSURE = 8.0  # pressures are capped: beyond this the advice is "much more" anyway
FLOOR = 0.05  # a pool never needs less than this fraction of its nodes (no division by 0)


@dataclass(frozen=True)
class Slo:
    """Latency objectives, on the p90 of recent requests (``--slo-ttft-ms``, ``--slo-tpot-ms``)."""

    ttft_s: float = 1.0
    tpot_s: float = 0.05

    def __post_init__(self) -> None:
        if not (self.ttft_s > 0 and self.tpot_s > 0):
            raise ValueError(f"SLOs must be > 0, got TTFT {self.ttft_s}s, TPOT {self.tpot_s}s")


@dataclass(frozen=True)
class NodeLoad:
    """What the advice reads of one node's ``Stats``."""

    role: str  # decode, mixed or prefill
    running: int = 0
    waiting: int = 0
    waiting_for_kv: int = 0
    prefill_peers_alive: int = 0
    pages_total: int = 0
    pages_free: int = 0
    layer_lag: int = 0

    @classmethod
    def from_stats(cls, s: Stats) -> NodeLoad:
        return cls(s.role, s.running, s.waiting, s.waiting_for_kv, s.prefill_peers_alive,
                   s.pages_total, s.pages_free, s.layer_lag)


@dataclass(frozen=True)
class Sample:
    """One finished request as the router saw it."""

    ttft_s: float
    tpot_s: float | None = None  # None for a single-token answer
    timings: Mapping[str, float] | None = None  # Finished.timings (ms), remote prefills only


@dataclass(frozen=True)
class Advice:
    verdict: str  # one of VERDICTS
    ratio: float | None  # suggested prefill / decode nodes (None: unknown)
    prefill_nodes: int
    decode_nodes: int
    suggested_prefill: int  # the same number of nodes, split in the suggested ratio
    suggested_decode: int
    needed_prefill: int  # nodes needed to meet the SLOs at the current load
    needed_decode: int
    prefill_pressure: float | None
    decode_pressure: float | None
    ttft_p90_s: float | None
    tpot_p90_s: float | None
    samples: int
    slo: Slo
    reasons: tuple[str, ...] = field(default=())

    @property
    def reasoning(self) -> str:
        return " ".join(self.reasons)

    def to_json(self) -> dict[str, Any]:
        """The body of ``GET /v1/disagg/advice``."""
        ms = _ms
        cur = self.prefill_nodes / self.decode_nodes if self.decode_nodes else None
        return {
            "verdict": self.verdict,
            "suggested_ratio": _round(self.ratio),
            "suggested": {"prefill": self.suggested_prefill, "decode": self.suggested_decode},
            "current": {"prefill": self.prefill_nodes, "decode": self.decode_nodes,
                        "ratio": _round(cur)},
            "needed": {"prefill": self.needed_prefill, "decode": self.needed_decode},
            "pressure": {"prefill": _round(self.prefill_pressure),
                         "decode": _round(self.decode_pressure)},
            "observed": {"ttft_p90_ms": ms(self.ttft_p90_s), "tpot_p90_ms": ms(self.tpot_p90_s),
                         "samples": self.samples},
            "slo": {"ttft_ms": ms(self.slo.ttft_s), "tpot_ms": ms(self.slo.tpot_s)},
            "reasoning": self.reasoning,
        }


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 3)


def _ms(x: float | None) -> float | None:
    return None if x is None else round(1000 * x, 2)


def percentile(values: Sequence[float], q: float = PERCENTILE) -> float:
    """Nearest-rank percentile (``values`` not empty)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


# ------------------------------------------------------------------ the model


def advise(nodes: Sequence[NodeLoad], samples: Sequence[Sample], slo: Slo = Slo()) -> Advice:
    """The verdict and ratio for the live ``nodes`` and recent ``samples`` (see the module)."""
    decoders = [n for n in nodes if n.role in ("decode", "mixed")]
    prefillers = [n for n in nodes if n.role == "prefill"]
    d = len(decoders)
    p = len(prefillers) or max((n.prefill_peers_alive for n in decoders), default=0)
    ttfts = [s.ttft_s for s in samples]
    tpots = [s.tpot_s for s in samples if s.tpot_s is not None]
    ttft90 = percentile(ttfts) if len(ttfts) >= MIN_SAMPLES else None
    tpot90 = percentile(tpots) if len(tpots) >= MIN_SAMPLES else None

    def unknown(why: str) -> Advice:
        return Advice("unknown", None, p, d, p, d, p, d, None, None, ttft90, tpot90,
                      len(samples), slo, (why,))

    if d == 0:
        return unknown("No decode node is live: nothing to advise on.")
    if p == 0:
        return unknown("No prefill node is live (decoders report prefill_peers_alive 0, or "
                       "the peers are mixed nodes): prompts are prefilled on the decoders, "
                       "there is no prefill : decode ratio to balance.")
    running = sum(n.running for n in decoders)
    waiting = sum(n.waiting for n in decoders)
    kv_wait = sum(n.waiting_for_kv for n in decoders)
    reasons: list[str] = []
    pi_d = _decode_pressure(decoders, running, waiting, kv_wait, tpot90, slo, reasons)
    pi_p = _prefill_pressure(prefillers, p, running, waiting, kv_wait, samples, slo, reasons)
    lag = sum(n.layer_lag for n in prefillers)
    if lag:
        reasons.append(f"Prefillers report {lag} layers computed but not yet shipped: the KV "
                       "transfer lags the compute, so more prefillers alone may not cut TTFT.")

    if max(pi_p, pi_d) < LIGHT:
        verdict = "balanced"
        reasons.append(f"Both pools are lightly loaded (pressures below {LIGHT}): keep "
                       f"{p}:{d}; the ratio is only meaningful under load.")
    elif pi_p > pi_d * (1 + TOLERANCE):
        verdict = "prefill-bound"
    elif pi_d > pi_p * (1 + TOLERANCE):
        verdict = "decode-bound"
    else:
        verdict = "balanced"
    need_p, need_d = p * max(pi_p, FLOOR), d * max(pi_d, FLOOR)
    ratio = need_p / need_d if verdict != "balanced" else p / d
    total = p + d
    sug_p = min(total - 1, max(1, round(total * ratio / (1 + ratio))))
    if verdict != "balanced":
        more, less = ("prefill", "decode") if verdict == "prefill-bound" else ("decode", "prefill")
        reasons.append(f"Verdict {verdict}: the {more} pool is under more pressure than the "
                       f"{less} pool (prefill {pi_p:.2f}, decode {pi_d:.2f}); suggested "
                       f"prefill : decode = {ratio:.2f} ({sug_p}:{total - sug_p} of today's "
                       f"{total} nodes).")
    elif max(pi_p, pi_d) >= LIGHT:
        reasons.append(f"Verdict balanced: prefill {pi_p:.2f} and decode {pi_d:.2f} are within "
                       f"{TOLERANCE:.0%} of each other: keep {p}:{d}.")
    if max(pi_p, pi_d) > 1:
        reasons.append(f"To meet both SLOs at this load: about {math.ceil(need_p)} prefill and "
                       f"{math.ceil(need_d)} decode nodes.")
    return Advice(verdict, ratio, p, d, sug_p, total - sug_p, max(1, math.ceil(need_p)),
                  max(1, math.ceil(need_d)), pi_p, pi_d, ttft90, tpot90, len(samples), slo,
                  tuple(reasons))


def _decode_pressure(decoders: Sequence[NodeLoad], running: int, waiting: int, kv_wait: int,
                     tpot90: float | None, slo: Slo, reasons: list[str]) -> float:
    terms: dict[str, float] = {}
    if tpot90 is not None:
        terms["TPOT p90 / SLO"] = tpot90 / slo.tpot_s
    if waiting > 0:  # the decoders' queue, its share held up by decoding (vs waiting for KV)
        terms["queued at the decoders"] = 1 + waiting / max(1, running + kv_wait)
    pages = sum(n.pages_total for n in decoders)
    used = pages - sum(n.pages_free for n in decoders)
    if pages > 0:
        terms["KV pages in use / 0.9"] = used / pages / KV_TARGET
    pi = min(MAX_PRESSURE, max(terms.values(), default=0.0))
    tpot = f"TPOT p90 {1000 * tpot90:.1f} ms" if tpot90 is not None else "no TPOT yet"
    why = max(terms, key=lambda k: terms[k]) if terms else "no signal"
    reasons.append(f"Decode: {len(decoders)} nodes, {running} running, {waiting} queued, "
                   f"KV pages {used}/{pages} in use, {tpot} (SLO {1000 * slo.tpot_s:g} ms): "
                   f"pressure {pi:.2f} ({why}).")
    return pi


def _prefill_pressure(prefillers: Sequence[NodeLoad], p: int, running: int, waiting: int,
                      kv_wait: int, samples: Sequence[Sample], slo: Slo,
                      reasons: list[str]) -> float:
    remote = [s for s in samples if s.timings is not None
              and "prefill_queue" in s.timings and "prefill_compute" in s.timings]
    if len(remote) >= MIN_SAMPLES:
        queues = [s.timings["prefill_queue"] / 1000 for s in remote if s.timings]
        computes = [s.timings["prefill_compute"] / 1000 for s in remote if s.timings]
        q, c = sum(queues) / len(queues), sum(computes) / len(computes)
        rho = q / (q + c) if q + c > 0 else 0.0
        rest = max(0.0, percentile([s.ttft_s for s in remote]) - percentile(queues))
        budget = slo.ttft_s - rest
        if budget <= 0:
            target = RHO_MIN
            reasons.append(f"Even with no prefill queueing TTFT p90 would be about "
                           f"{1000 * rest:.0f} ms, over the {1000 * slo.ttft_s:g} ms SLO: more "
                           "prefillers cannot meet it alone (shorter prompts, faster prefill "
                           "such as --tp, or a looser SLO).")
        else:
            target = min(RHO_MAX, max(RHO_MIN, budget / (budget + c)))
        how = (f"prefill queue {1000 * q:.0f} ms and compute {1000 * c:.0f} ms on average over "
               f"{len(remote)} requests -> utilisation {rho:.2f}; the TTFT SLO "
               f"({1000 * slo.ttft_s:g} ms) allows {target:.2f}")
    else:
        if prefillers:  # their own queues
            in_pipe = float(sum(n.running + n.waiting for n in prefillers))
        else:  # requests holding a decoder seat for KV, plus their share of the decoders' queue
            in_pipe = kv_wait + (waiting * kv_wait / (running + kv_wait)
                                 if running + kv_wait else 0.0)
        n = in_pipe / p
        rho, target = n / (1 + n), RHO_STATS
        how = (f"{in_pipe:.0f} requests in the prefill pipeline, {n:.1f} per prefiller -> "
               f"utilisation {rho:.2f} (M/M/1, from Stats: fewer than {MIN_SAMPLES} timed "
               f"requests); target {RHO_STATS}")
    pi = min(MAX_PRESSURE, rho / target)
    reasons.append(f"Prefill: {p} nodes, {how}: pressure {pi:.2f}.")
    return pi


# ------------------------------------------------------------------ what the router observed


class LatencyWindow:
    """Recent requests' TTFT / TPOT, fed by the router as it relays them (time passed in).

    ``start`` when a request is placed, ``tokens`` per chunk, ``finish`` with its terminal
    message: a ``Finished`` (stop or length) that streamed a token becomes a ``Sample``;
    anything else is dropped. Samples older than ``horizon_s`` or beyond ``max_samples`` go."""

    def __init__(self, horizon_s: float = 60.0, max_samples: int = 512,
                 max_live: int = 1 << 16):
        self.horizon_s = horizon_s
        self.max_live = max_live
        self._live: OrderedDict[str, list[float]] = OrderedDict()  # start, first, last, tokens
        self._done: deque[tuple[float, Sample]] = deque(maxlen=max_samples)

    def start(self, key: str, now: float) -> None:
        self._live[key] = [now, -1.0, -1.0, 0.0]
        while len(self._live) > self.max_live:  # bounded even if a finish never comes
            self._live.popitem(last=False)

    def tokens(self, key: str, n: int, now: float) -> None:
        c = self._live.get(key)
        if c is None or n <= 0:
            return
        if c[1] < 0:
            c[1] = now
        c[2] = now
        c[3] += n

    def finish(self, key: str, terminal: object, now: float) -> None:
        c = self._live.pop(key, None)
        if c is None or c[1] < 0 or not isinstance(terminal, Finished):
            return
        if terminal.reason not in ("stop", "length"):
            return
        start, first, last, n = c
        tpot = (last - first) / (n - 1) if n > 1 else None
        self.add(Sample(first - start, tpot, terminal.timings), now)

    def add(self, sample: Sample, now: float) -> None:
        self._done.append((now, sample))

    def samples(self, now: float) -> list[Sample]:
        while self._done and self._done[0][0] < now - self.horizon_s:
            self._done.popleft()
        return [s for _, s in self._done]


def advise_from_stats(stats: Sequence[Stats], window: LatencyWindow, slo: Slo,
                      now: float) -> Advice:
    """``advise`` over the router's live peers' last Stats and its window."""
    return advise([NodeLoad.from_stats(s) for s in stats], window.samples(now), slo)
