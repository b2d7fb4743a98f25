"""Hop marks: when a request passed each point of the remote-prefill path, across processes;
and the OpenTelemetry traces (below) that make the marks of a traced request span events.

Off (one ``None`` test per mark) unless ``DISAGG_TRACE`` names a directory at import: then every
process appends ``<time> <event> <key> [value]`` lines to ``DIR/<pid>.trace``, one ``os.write`` per mark
on an ``O_APPEND`` descriptor (nothing buffered, so a killed node loses nothing). ``time`` is
``time.monotonic()``, one clock for every process of a host, so the marks of a prefill and a
decode node on one machine line up. ``key`` is the decoder's attempt id (``slot.attempt``)
where the code knows it, else the transfer key (``imm``); ``link`` marks join the two.
``bench/tail_trace.py`` turns the files into per-hop times (the TTFT tail, issue 18).
"""

from __future__ import annotations

import gc
import os
import time
from typing import Any

from disagg.protocol import MAX_TRACEPARENT

_fd: int | None = None


def enable(directory: str) -> None:
    global _fd
    os.makedirs(directory, exist_ok=True)
    _fd = os.open(os.path.join(directory, f"{os.getpid()}.trace"),
                  os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    if _gc_mark not in gc.callbacks:
        gc.callbacks.append(_gc_mark)


def _gc_mark(phase: str, info: dict[str, int]) -> None:
    """The cyclic collector's runs as marks (``gc.start`` / ``gc.stop``, keyed by the
    generation, the stop's value the objects collected): a pause on the serving path shows."""
    mark(f"gc.{phase}", info.get("generation", -1),
         value=info.get("collected", "") if phase == "stop" else "")


def enabled() -> bool:
    return _fd is not None


def mark(event: str, *key: object, value: object = "", at: float | None = None) -> None:
    """Record that the key (its parts joined, so that a caller on a hot path builds no string
    while tracing is off) passed ``event`` now (or at monotonic time ``at``), with an optional
    ``value`` (a no-op unless tracing is on)."""
    if _fd is not None:
        t = time.monotonic() if at is None else at
        os.write(_fd, f"{t:.6f} {event} {''.join(map(str, key))} {value}\n".encode())
    if _bound and (span := _bound.get("".join(map(str, key)))) is not None:
        span.add_event(event, {"value": str(value)} if value != "" else None)


if os.environ.get("DISAGG_TRACE"):
    enable(os.environ["DISAGG_TRACE"])


# ------------------------------------------------------------------ OpenTelemetry traces
#
# Off unless ``configure`` ran (``--otlp-traces-endpoint``): nothing here imports opentelemetry
# before that, and every helper below returns at once on a None span. A request's trace goes
# router -> decoder -> prefiller by a W3C ``traceparent`` in ``GenerateRequest`` and
# ``PrefillRequest``; in each process its phases are spans under one request span (``Phases``),
# and a hop mark keyed by a span's bound key (``bind``: a remote prefill's attempt id) becomes
# an event of that span, as well as a line of the DISAGG_TRACE file when that is on.

_tracer: Any = None
_provider: Any = None
_bound: dict[str, Any] = {}  # hop-mark key -> the span its marks become events of


def configure(endpoint: str | None, service: str, exporter: Any = None) -> None:
    """Export this process's spans (resource ``service.name`` = ``service``) over OTLP/HTTP to
    ``endpoint`` (``http://HOST:4318``: ``/v1/traces`` is added to a URL without a path), in
    batches; or to ``exporter`` (a SpanExporter, each span as it ends: tests)."""
    global _tracer, _provider
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    if exporter is None:
        from urllib.parse import urlsplit

        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        assert endpoint is not None
        if urlsplit(endpoint).path in ("", "/"):
            endpoint = endpoint.rstrip("/") + "/v1/traces"
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    else:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    _provider, _tracer = provider, provider.get_tracer("disagg")


def shutdown() -> None:
    """Export what is left and stop tracing (a no-op while off)."""
    global _tracer, _provider
    if _provider is not None:
        _provider.shutdown()
    _tracer = _provider = None
    _bound.clear()


def tracing() -> bool:
    return _tracer is not None


def start(name: str, parent: Any = None, at_ns: int | None = None, **attrs: Any) -> Any:
    """A new span (None while off) under ``parent``: a span, a ``traceparent`` string (a
    remote parent: one that does not parse starts a new trace), or None (a new trace)."""
    if _tracer is None:
        return None
    from opentelemetry import trace as otel

    if parent is None:
        ctx = None
    elif isinstance(parent, str):
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        ctx = TraceContextTextMapPropagator().extract({"traceparent": parent})
    else:
        ctx = otel.set_span_in_context(parent)
    return _tracer.start_span(name, context=ctx, start_time=at_ns, attributes=attrs or None)


def end(span: Any, **attrs: Any) -> None:
    if span is not None:
        if attrs:
            span.set_attributes(attrs)
        span.end()


def event(span: Any, name: str, **attrs: Any) -> None:
    if span is not None:
        span.add_event(name, attrs or None)


def traceparent(span: Any) -> str | None:
    """The W3C ``traceparent`` of ``span`` (its children's parent elsewhere), None while off."""
    if span is None:
        return None
    from opentelemetry import trace as otel
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    carrier: dict[str, str] = {}
    TraceContextTextMapPropagator().inject(carrier, otel.set_span_in_context(span))
    return carrier.get("traceparent")


def bind(key: str, span: Any) -> None:
    """The hop marks keyed ``key`` become events of ``span`` (until ``unbind``)."""
    if span is not None:
        _bound[key] = span


def unbind(key: str | None) -> None:
    if _bound and key is not None:
        _bound.pop(key, None)


def trace_header(headers: Any) -> str | None:
    """An HTTP request's ``traceparent`` header (W3C trace context) to carry on, None when
    absent or longer than ``MAX_TRACEPARENT`` (its request then starts a new trace)."""
    value = headers.get("traceparent")
    return value if value and len(value) <= MAX_TRACEPARENT else None


class Phases:
    """One request's spans in this process: its request span and the one phase under it that
    is open (admission, queue, prefill, first decode step, stream ...): entering a phase ends
    the last. Every method is a no-op on a request that is not traced (``root`` None)."""

    __slots__ = ("root", "phase", "name")

    def __init__(self, name: str, parent: Any = None, at_ns: int | None = None, **attrs: Any):
        self.root = start(name, parent, at_ns, **attrs)
        self.phase: Any = None
        self.name = ""  # the open phase's

    def enter(self, name: str, at_ns: int | None = None, **attrs: Any) -> Any:
        """End the open phase, open ``name`` (from ``at_ns``, default now); returns its span."""
        if self.root is None:
            return None
        end(self.phase)
        self.phase, self.name = start(name, self.root, at_ns, **attrs), name
        return self.phase

    def end(self, **attrs: Any) -> None:
        """End the open phase and the request span (with ``attrs`` on it)."""
        end(self.phase)
        end(self.root, **attrs)
        self.phase = self.root = None
