"""The OpenTelemetry side of ``disagg.trace``: off, nothing imports opentelemetry and every
helper is a no-op; on, a request's phases are children of its span, a traceparent carries a
trace across a process boundary, and hop marks bound to a span become its events."""

from __future__ import annotations

import subprocess
import sys

import pytest

from disagg import trace


def test_off_nothing_imports_opentelemetry_and_the_helpers_do_nothing() -> None:
    code = ("import sys, disagg.cli.node, disagg.node, disagg.actors.router.router, "
            "disagg.actors.http.http, disagg.trace as t\n"
            "p = t.Phases('request', '00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01')\n"
            "assert p.root is None and p.enter('queue') is None and t.start('x') is None\n"
            "t.mark('p.accepted', 'k'); p.end(); t.end(None); t.event(None, 'e')\n"
            "assert t.traceparent(None) is None and not t.tracing()\n"
            "print(sorted(m for m in sys.modules if m.startswith('opentelemetry')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_trace_header_takes_a_bounded_traceparent() -> None:
    tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    assert trace.trace_header({"traceparent": tp}) == tp
    assert trace.trace_header({}) is None
    assert trace.trace_header({"traceparent": "0" * 200}) is None


@pytest.fixture
def spans():
    pytest.importorskip("opentelemetry.sdk")
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    memory = InMemorySpanExporter()
    trace.configure(None, "test", exporter=memory)
    try:
        yield memory
    finally:
        trace.shutdown()


def test_phases_hang_under_the_request_and_a_traceparent_crosses_processes(spans) -> None:
    caller = trace.start("router")
    tp = trace.traceparent(caller)
    assert tp is not None and tp.startswith("00-")
    p = trace.Phases("request", tp, request_id="r1")  # as a node, from the wire
    p.enter("admission")
    p.enter("queue")
    remote = p.enter("remote_prefill")
    trace.bind("7.0", remote)
    trace.mark("dm.req_out", 7, ".0")  # a hop mark keyed by the attempt id: an event
    trace.unbind("7.0")
    trace.mark("dm.kv", "7.0")  # unbound: no event
    prefiller = trace.Phases("prefill", trace.traceparent(remote))
    prefiller.enter("prefill_queue")
    prefiller.end(outcome="done")
    p.enter("stream")
    p.end(outcome="length")
    trace.end(caller)
    got = {s.name: s for s in spans.get_finished_spans()}
    assert set(got) == {"router", "request", "admission", "queue", "remote_prefill",
                        "prefill", "prefill_queue", "stream"}
    assert len({s.context.trace_id for s in got.values()}) == 1
    parent = {name: s.parent.span_id if s.parent else None for name, s in got.items()}
    assert parent["router"] is None
    assert parent["request"] == got["router"].context.span_id
    for name in ("admission", "queue", "remote_prefill", "stream"):
        assert parent[name] == got["request"].context.span_id
    assert parent["prefill"] == got["remote_prefill"].context.span_id
    assert parent["prefill_queue"] == got["prefill"].context.span_id
    assert [e.name for e in got["remote_prefill"].events] == ["dm.req_out"]
    assert got["request"].attributes["outcome"] == "length"


def test_a_traceparent_that_does_not_parse_starts_a_new_trace(spans) -> None:
    p = trace.Phases("request", "garbage")
    p.end()
    [s] = spans.get_finished_spans()
    assert s.parent is None
