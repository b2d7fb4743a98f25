"""Prometheus metrics of one process (prometheus-client), rendered by the HTTP gateway's /metrics.

``Metrics`` owns its own ``CollectorRegistry`` (so several can live in one test process). Who
feeds what:

- the gateway (or any client-side observer): one ``RequestTimer`` per request -> request counters
  by outcome, TTFT / TPOT / ITL / end-to-end histograms, token counters; ``observe_error(code, type)``;
- a Stats poller: ``update_stats(stats, node)`` -> queue depths, page pool usage, the node's own
  counters (preemptions, started/finished/aborted/errored/rejected), exposed from the last
  snapshot so they stay monotonic per node process;
- the KV transfer path (the prefill and decode messengers, served by ``--metrics-listen``):
  ``observe_transfer(direction, nbytes, writes, latency_s)`` and ``observe_layer_lag(seconds)``.

Every name starts with ``disagg_``; units are seconds, bytes and counts.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from disagg.protocol import Stats

if TYPE_CHECKING:
    from disagg.serving.advice import Advice

CONTENT_TYPE = CONTENT_TYPE_LATEST

# Latency buckets (seconds): token-level latencies are ms-scale on GPU, 100s of ms on CPU.
_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5,
                  0.75, 1.0, 2.5, 5.0, 10.0)
_REQUEST_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0,
                    160.0, 320.0, 640.0)
_TRANSFER_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                     0.5, 1.0, 2.5, 5.0)

OUTCOMES = ("stop", "length", "abort", "error")


_NODE_EXTRA = (
    ("disagg_node_kv_writes_sent", "Fabric writes of KV posted by the node (its Stats).",
     "kv_writes_sent", "counter"),
    ("disagg_node_kv_bytes_sent", "KV bytes sent by the node (its Stats).", "kv_bytes_sent",
     "counter"),
    ("disagg_node_kv_units_received", "KV pages (per layer) and contexts landed on the node.",
     "kv_units_received", "counter"),
    ("disagg_node_kv_junk_immediates", "Decode: immediates refused (unknown or finished key, "
     "or past the expected count): late writes, or a stranger on the fabric.",
     "kv_junk_immediates", "counter"),
    ("disagg_num_requests_waiting_for_kv", "Decode: requests waiting for a prefiller's KV.",
     "waiting_for_kv", "gauge"),
    ("disagg_kv_transfers_in_flight", "KV transfers in flight on the node.",
     "transfers_in_flight", "gauge"),
    ("disagg_kv_layer_lag", "Prefill: layers computed but not yet handed to the engine.",
     "layer_lag", "gauge"),
    ("disagg_prefill_peers_alive", "Decode: prefill peers answering.", "prefill_peers_alive",
     "gauge"),
    ("disagg_kv_pages_cached", "Free KV pages holding a cached prefix (evictable).",
     "pages_cached", "gauge"),
    ("disagg_node_prefix_query_tokens", "Prompt tokens of requests that looked the prefix "
     "cache up.", "prefix_query_tokens", "counter"),
    ("disagg_node_prefix_hit_tokens", "Prompt tokens served from the node's prefix cache.",
     "prefix_hit_tokens", "counter"),
    ("disagg_node_spec_draft_tokens", "Speculative decoding: drafted tokens verified.",
     "spec_draft_tokens", "counter"),
    ("disagg_node_spec_accepted_tokens", "Speculative decoding: drafted tokens accepted.",
     "spec_accepted_tokens", "counter"),
    ("disagg_node_steps_overlapped", "Decode steps launched before their predecessor's "
     "tokens were back (--overlap-schedule).", "steps_overlapped", "counter"),
    *((f"disagg_node_kv_tier_hits_{t}", f"Prefix lookups that found pages in the {t} tier.",
       f"tier_hits_{t}", "counter") for t in ("device", "host", "disk")),
    *((f"disagg_node_kv_tier_hit_tokens_{t}", f"Prompt tokens served from the {t} tier.",
       f"tier_hit_tokens_{t}", "counter") for t in ("device", "host", "disk")),
    ("disagg_node_kv_tier_bytes_to_host", "KV bytes copied device -> host tier.",
     "kv_bytes_to_host", "counter"),
    ("disagg_node_kv_tier_bytes_from_host", "KV bytes copied host tier -> device.",
     "kv_bytes_from_host", "counter"),
    ("disagg_node_kv_tier_bytes_to_disk", "KV bytes written host -> disk tier.",
     "kv_bytes_to_disk", "counter"),
    ("disagg_node_kv_tier_bytes_from_disk", "KV bytes read disk tier -> host.",
     "kv_bytes_from_disk", "counter"),
    ("disagg_kv_host_cache_pages_total", "Pages the host KV tier holds at most.",
     "host_cache_pages_total", "gauge"),
    ("disagg_kv_host_cache_pages_used", "Pages in the host KV tier.", "host_cache_pages_used",
     "gauge"),
    ("disagg_kv_disk_cache_bytes_total", "The disk KV tier's bound in bytes.",
     "disk_cache_bytes_total", "gauge"),
    ("disagg_kv_disk_cache_bytes_used", "Bytes of page files in the disk KV tier.",
     "disk_cache_bytes_used", "gauge"),
    ("disagg_node_kv_pages_from_host", "Prefill: pages shipped straight from the host KV "
     "tier.", "kv_pages_from_host", "counter"),
    *((f"disagg_node_kv_tier_copies_{k}", f"Host KV tier copies {what}.", f"tier_copies_{k}",
       "counter") for k, what in (
        ("waited", "an eviction waited for (the scheduler blocked)"),
        ("expedited", "an eviction made at once (not started yet)"),
        ("voided", "an eviction outwaited (their host entry dropped)"),
        ("skipped", "never made (evicted before sent, or no slot free of pins)"))),
)


class _StatsCollector(Collector):
    """Exposes the last ``Stats`` snapshot of each node as gauges and counters."""

    def __init__(self) -> None:
        self.last: dict[str, Stats] = {}

    def collect(self) -> Iterator[Metric]:
        gauges = {
            "disagg_num_requests_running": ("Requests in the running batch.", "running"),
            "disagg_num_requests_waiting": ("Requests queued for admission.", "waiting"),
            "disagg_kv_pages_total": ("KV cache pages in the pool.", "pages_total"),
            "disagg_kv_pages_free": ("Free KV cache pages.", "pages_free"),
        }
        for name, (doc, field) in gauges.items():
            g = GaugeMetricFamily(name, doc, labels=["node"])
            for node, s in self.last.items():
                g.add_metric([node], float(getattr(s, field)))
            yield g
        usage = GaugeMetricFamily("disagg_kv_page_usage_ratio",
                                  "Fraction of KV cache pages in use (0..1).", labels=["node"])
        for node, s in self.last.items():
            usage.add_metric([node], 1.0 - s.pages_free / s.pages_total if s.pages_total else 0.0)
        yield usage
        pre = CounterMetricFamily("disagg_node_preemptions",
                                  "Preemptions reported by the node.", labels=["node"])
        for node, s in self.last.items():
            pre.add_metric([node], float(s.preemptions))
        yield pre
        # disaggregation fields of Stats (read with getattr: absent on older nodes)
        for name, doc, field, kind in _NODE_EXTRA:
            fam = (CounterMetricFamily if kind == "counter" else GaugeMetricFamily)(
                name, doc, labels=["node"])
            for node, s in self.last.items():
                fam.add_metric([node], float(getattr(s, field, 0)))
            yield fam
        reqs = CounterMetricFamily("disagg_node_requests",
                                   "Request counters reported by the node (its Stats).",
                                   labels=["node", "state"])
        for node, s in self.last.items():
            for state in ("started", "finished", "aborted", "errored", "rejected", "bad_frames"):
                reqs.add_metric([node, state], float(getattr(s, state)))
        yield reqs
        yield from _dp_rank_metrics(self.last)
        sent = CounterMetricFamily("disagg_node_kv_units_sent", "Prefill: KV units (a page's "
                                   "run of one layer) posted from each executor's pages "
                                   "(Stats.kv_units_sent_by_rank).", labels=["node", "rank"])
        for node, s in self.last.items():
            for rank, units in enumerate(getattr(s, "kv_units_sent_by_rank", [])):
                sent.add_metric([node, str(rank)], float(units))
        yield sent


_DP_RANK = (  # Stats.dp_ranks fields as metrics labelled by node and rank (--dp > 1)
    ("disagg_dp_rank_requests_running", "Requests running on a DP attention rank.", "running",
     GaugeMetricFamily),
    ("disagg_dp_rank_kv_pages_free", "Free KV pages of a DP rank's own pool.", "pages_free",
     GaugeMetricFamily),
    ("disagg_dp_rank_kv_pages_total", "KV pages of a DP rank's own pool.", "pages_total",
     GaugeMetricFamily),
    ("disagg_dp_rank_requests_started", "Requests that started on a DP rank.", "started",
     CounterMetricFamily),
    ("disagg_dp_rank_all_to_all_seconds", "Seconds a DP rank's lead executor spent in the "
     "MoE all-to-alls (--expert-parallel).", "all_to_all_s", CounterMetricFamily),
)


def _dp_rank_metrics(last: dict[str, Stats]) -> Iterator[Metric]:
    for name, doc, field, family in _DP_RANK:
        fam = family(name, doc, labels=["node", "rank"])
        for node, s in last.items():
            for r in getattr(s, "dp_ranks", []):
                fam.add_metric([node, str(r.rank)], float(getattr(r, field)))
        yield fam


class _AdviceCollector(Collector):
    """The router's prefill : decode advice (``disagg.serving.advice``), computed per scrape."""

    def __init__(self, advice: Callable[[], Advice]) -> None:
        self.advice = advice

    def collect(self) -> Iterator[Metric]:
        from disagg.serving.advice import VERDICTS

        a = self.advice()
        ratio = GaugeMetricFamily("disagg_advice_prefill_decode_ratio",
                                  "Suggested prefill : decode node ratio (prefill nodes per "
                                  "decode node; NaN while unknown).")
        ratio.add_metric([], math.nan if a.ratio is None else a.ratio)
        yield ratio
        verdict = GaugeMetricFamily("disagg_advice_verdict", "1 for the current verdict "
                                    "(prefill-bound, decode-bound, balanced, unknown), else 0.",
                                    labels=["verdict"])
        for v in VERDICTS:
            verdict.add_metric([v], 1.0 if a.verdict == v else 0.0)
        yield verdict
        pressure = GaugeMetricFamily("disagg_advice_pressure", "Capacity a pool needs to meet "
                                     "its SLO over the capacity it has (1: at the SLO).",
                                     labels=["pool"])
        nodes = GaugeMetricFamily("disagg_advice_nodes", "Live nodes per pool, as the advice "
                                  "counts them.", labels=["pool"])
        needed = GaugeMetricFamily("disagg_advice_needed_nodes", "Nodes a pool needs to meet "
                                   "both SLOs at the current load (what an autoscaler aims "
                                   "at; deploy/autoscaling).", labels=["pool"])
        for pool, pi, n, want in (
                ("prefill", a.prefill_pressure, a.prefill_nodes, a.needed_prefill),
                ("decode", a.decode_pressure, a.decode_nodes, a.needed_decode)):
            pressure.add_metric([pool], math.nan if pi is None else pi)
            nodes.add_metric([pool], float(n))
            needed.add_metric([pool], float(want))
        yield pressure
        yield nodes
        yield needed


class Metrics:
    """All metrics of one process. Thread-safe (prometheus-client's own locking)."""

    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.requests = Counter("disagg_requests", "Requests ended, by outcome "
                                "(stop, length, abort, error).", ["outcome"], registry=r)
        self.errors = Counter("disagg_request_errors", "Requests refused or failed, by error "
                              "code (a node's code, or the gateway's own such as "
                              "model_not_found; none when the error has no code) and type (the "
                              "OpenAI error type answered; none on the client protocol).",
                              ["code", "type"], registry=r)
        self.prompt_tokens = Counter("disagg_prompt_tokens", "Prompt tokens of ended requests.",
                                     registry=r)
        self.generation_tokens = Counter("disagg_generation_tokens",
                                         "Output tokens streamed to clients.", registry=r)
        self.ttft = Histogram("disagg_time_to_first_token_seconds",
                              "Request arrival to its first output token.",
                              buckets=_TOKEN_BUCKETS + (20.0, 40.0, 80.0), registry=r)
        self.tpot = Histogram("disagg_time_per_output_token_seconds",
                              "Per request: (last token - first token) / (outputs - 1).",
                              buckets=_TOKEN_BUCKETS, registry=r)
        self.itl = Histogram("disagg_inter_token_latency_seconds",
                             "Gap between consecutive token chunks of a stream, per token.",
                             buckets=_TOKEN_BUCKETS, registry=r)
        self.e2e = Histogram("disagg_e2e_request_latency_seconds",
                             "Request arrival to its last message.",
                             buckets=_REQUEST_BUCKETS, registry=r)
        self.in_flight = Gauge("disagg_requests_in_flight",
                               "Requests this process is streaming now.", registry=r)
        # KV transfer (fed by the disaggregation path; zero until it is wired)
        self.kv_bytes = Counter("disagg_kv_transfer_bytes", "KV cache bytes moved over the fabric.",
                                ["direction"], registry=r)
        self.kv_writes = Counter("disagg_kv_transfer_writes", "Fabric writes of KV pages.",
                                 ["direction"], registry=r)
        self.transfer_latency = Histogram("disagg_kv_transfer_latency_seconds",
                                          "Per request: first KV write posted to last completion.",
                                          ["direction"], buckets=_TRANSFER_BUCKETS, registry=r)
        self.layer_lag = Histogram("disagg_kv_layer_transfer_lag_seconds",
                                   "Layer finished on the prefiller to its pages written.",
                                   buckets=_TRANSFER_BUCKETS, registry=r)
        for d in ("sent", "received"):  # make both series visible before the first transfer
            self.kv_bytes.labels(d)
            self.kv_writes.labels(d)
        for o in OUTCOMES:
            self.requests.labels(o)
        self._stats = _StatsCollector()
        r.register(self._stats)

    # ------------------------------------------------------------------ feeding

    def start_request(self, now: float | None = None) -> RequestTimer:
        return RequestTimer(self, time.monotonic() if now is None else now)

    def observe_error(self, code: str | None, type: str | None = None) -> None:
        """One error: its machine code and its OpenAI type, each ``none`` when absent."""
        self.errors.labels(code or "none", type or "none").inc()

    def update_stats(self, stats: Stats, node: str = "local") -> None:
        self._stats.last[node] = stats

    def forget_node(self, node: str) -> None:
        self._stats.last.pop(node, None)

    def watch_advice(self, advice: Callable[[], Advice]) -> None:
        """Expose ``advice()`` (called at each scrape) as the ``disagg_advice_*`` gauges."""
        self.registry.register(_AdviceCollector(advice))

    def observe_transfer(self, direction: str, nbytes: int, writes: int = 1,
                         latency_s: float | None = None) -> None:
        """``direction`` is ``sent`` (prefill side) or ``received`` (decode side)."""
        self.kv_bytes.labels(direction).inc(nbytes)
        self.kv_writes.labels(direction).inc(writes)
        if latency_s is not None:
            self.transfer_latency.labels(direction).observe(latency_s)

    def observe_layer_lag(self, seconds: float) -> None:
        self.layer_lag.observe(seconds)

    # ------------------------------------------------------------------ reading

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return bytes(generate_latest(self.registry))


class RequestTimer:
    """Latency bookkeeping of one request as seen by a client of the node."""

    def __init__(self, metrics: Metrics, start: float):
        self.m = metrics
        self.start = start
        self.first: float | None = None
        self.last: float | None = None
        self.tokens = 0
        self.done = False
        metrics.in_flight.inc()

    def on_tokens(self, n: int, now: float | None = None) -> None:
        """``n`` new output tokens arrived (one chunk)."""
        if n <= 0:
            return
        t = time.monotonic() if now is None else now
        if self.first is None:
            self.first = t
            self.m.ttft.observe(t - self.start)
        elif self.last is not None:
            gap = (t - self.last) / n
            for _ in range(n):
                self.m.itl.observe(gap)
        self.last = t
        self.tokens += n
        self.m.generation_tokens.inc(n)

    def finish(self, outcome: str, prompt_tokens: int = 0, error_code: str | None = None,
               now: float | None = None, error_type: str | None = None) -> None:
        """End the request once: ``outcome`` in stop | length | abort | error (an error with a
        code or a type also counts in ``disagg_request_errors``)."""
        if self.done:
            return
        self.done = True
        t = time.monotonic() if now is None else now
        self.m.in_flight.dec()
        self.m.requests.labels(outcome).inc()
        if error_code is not None or error_type is not None:
            self.m.observe_error(error_code, error_type)
        self.m.prompt_tokens.inc(prompt_tokens)
        self.m.e2e.observe(t - self.start)
        if self.first is not None and self.last is not None and self.tokens > 1:
            self.m.tpot.observe((self.last - self.first) / (self.tokens - 1))
