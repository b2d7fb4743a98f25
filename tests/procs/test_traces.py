"""OpenTelemetry traces across the split (``disagg.trace``): a router (in this process, the
SDK's in-memory exporter), a decoder and a prefiller (processes exporting over OTLP/HTTP to a
collector stub here): one trace per request covering the three processes, each span under
the right parent, and a traceparent the client sent honoured."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from disagg import trace
from disagg.actors.router.router import start_router
from disagg.client import Client
from disagg.protocol import Finished, SamplingParams
from nodes import LoopThread, node, prompt, running, wait_for
from tinymodels import free_port

pytest.importorskip("opentelemetry.sdk")
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (  # noqa: E402
    ExportTraceServiceRequest,
)
from opentelemetry.sdk.trace.export.in_memory_span_exporter import (  # noqa: E402
    InMemorySpanExporter,
)

CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"


class Collector:
    """An OTLP/HTTP trace receiver: every span posted, as (service, trace id, span id,
    parent span id, name, event names), ids in hex; and each span's events with their
    attributes (``events``, by span id)."""

    def __init__(self) -> None:
        self.spans: list[tuple[str, str, str, str, str, tuple[str, ...]]] = []
        self.events: dict[str, list[tuple[str, dict[str, object]]]] = {}
        self.lock = threading.Lock()
        collector = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - the http.server name
                body = self.rfile.read(int(self.headers["Content-Length"]))
                req = ExportTraceServiceRequest.FromString(body)
                with collector.lock:
                    for rs in req.resource_spans:
                        service = next(a.value.string_value for a in rs.resource.attributes
                                       if a.key == "service.name")
                        for ss in rs.scope_spans:
                            for s in ss.spans:
                                collector.spans.append((
                                    service, s.trace_id.hex(), s.span_id.hex(),
                                    s.parent_span_id.hex(), s.name,
                                    tuple(e.name for e in s.events)))
                                collector.events[s.span_id.hex()] = [(e.name, {
                                    a.key: getattr(a.value, a.value.WhichOneof("value"))
                                    for a in e.attributes}) for e in s.events]
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def traced(chat_llama, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("traces")
    collector = Collector()
    env = {"OTEL_BSP_SCHEDULE_DELAY": "100"}  # export within 0.1 s of a span's end
    flags = ("--otlp-traces-endpoint", collector.url)
    p_addr, p = node("prefill", chat_llama, tmp, *flags, env=env)
    d_addr, d = node("decode", chat_llama, tmp, "--prefill-peer", p_addr, "--heartbeat",
                     "0.2", *flags, env=env)
    memory = InMemorySpanExporter()
    trace.configure(None, "disagg-router", exporter=memory)
    try:
        with running([p, d], [d_addr]):
            lt = LoopThread()
            r, gw = lt.run(start_router(f"tcp://127.0.0.1:{free_port()}", [d_addr],
                                        "127.0.0.1:0", str(chat_llama), "tiny-llama",
                                        poll_interval=0.2, wait_for_peer=30))
            try:
                yield r, gw, memory, collector
            finally:
                lt.run(gw.stop())
                lt.run(r.stop())
                lt.close()
    finally:
        trace.shutdown()
        collector.close()


def router_spans(memory):
    return [("disagg-router", f"{s.context.trace_id:032x}", f"{s.context.span_id:016x}",
             f"{s.parent.span_id:016x}" if s.parent is not None else "", s.name,
             tuple(e.name for e in s.events)) for s in memory.get_finished_spans()]


def check_trace(spans, tid: str, root_parent: str = "") -> None:
    """The spans of trace ``tid`` cover the three processes and hang together."""
    mine = [s for s in spans if s[1] == tid]
    by = {(svc, name): s for svc, _, _, _, name, _ in mine for s in [
        next(x for x in mine if x[0] == svc and x[4] == name)]}
    assert {s[0] for s in mine} == {"disagg-router", "disagg-decode", "disagg-prefill"}, mine
    router = by[("disagg-router", "router")]
    assert router[3] == root_parent and {"sent", "first_token"} <= set(router[5])
    request = by[("disagg-decode", "request")]
    assert request[3] == router[2]
    phases = {name: s for (svc, name), s in by.items() if svc == "disagg-decode"}
    for name in ("admission", "queue", "remote_prefill", "first_decode_step", "stream"):
        assert phases[name][3] == request[2], (name, mine)
    assert "kv_landed" in phases["remote_prefill"][5]
    assert "dm.req_out" in phases["remote_prefill"][5]  # a hop mark, as an event
    prefill = by[("disagg-prefill", "prefill")]
    assert prefill[3] == phases["remote_prefill"][2]
    assert "p.accepted" in prefill[5]
    for name in ("prefill_queue", "prefill_compute", "kv_settle"):
        assert by[("disagg-prefill", name)][3] == prefill[2], (name, mine)
    # the layers pushed: a step's first and last layer posted, no event per layer
    assert {"kv_first_layer_posted", "kv_last_layer_posted"} <= set(
        by[("disagg-prefill", "prefill_compute")][5]), mine
    ids = [s[2] for s in mine]
    assert len(ids) == len(set(ids))


def test_one_trace_per_request_across_router_decoder_and_prefiller(traced, chat_llama):
    r, _, memory, collector = traced
    sp = SamplingParams(max_tokens=4, ignore_eos=True)
    c = Client(r.address)
    try:
        for i in range(3):
            assert isinstance(list(c.generate(prompt_token_ids=prompt(9, salt=300 + i),
                                              sampling=sp, timeout=60))[-1], Finished)
    finally:
        c.close()
    tids = sorted({s[1] for s in router_spans(memory) if s[4] == "router"})
    assert len(tids) == 3  # one trace per request

    def complete() -> bool:
        with collector.lock:
            return all({("disagg-decode", "request"), ("disagg-prefill", "prefill")}
                       <= {(s[0], s[4]) for s in collector.spans if s[1] == t} for t in tids)

    wait_for(complete, what="every request's spans exported")
    time.sleep(0.3)  # the phases ended just before their request's span
    with collector.lock:
        spans = router_spans(memory) + list(collector.spans)
    for tid in tids:
        check_trace(spans, tid)
    layers = json.loads((chat_llama / "config.json").read_text())["num_hidden_layers"]
    with collector.lock:
        computes = [collector.events[s[2]] for s in collector.spans
                    if s[1] in tids and s[4] == "prefill_compute"]
    assert len(computes) == 3
    for events in computes:  # 9 prompt tokens: one step, each layer a write of its own
        assert [name for name, _ in events] == ["kv_first_layer_posted", "kv_last_layer_posted"]
        first, last = (attrs for _, attrs in events)
        assert first["layers"] == 1 and first["num_layers"] == layers
        assert 0 < first["tokens"] == last["tokens"] <= 9  # the decoder may compute the last
        assert last["layers"] == layers and last["writes"] >= layers and last["bytes"] > 0


def test_a_traceparent_header_joins_the_callers_trace(traced):
    """The OpenAI gateway takes the W3C ``traceparent`` header: the request's spans in all
    three processes belong to the caller's trace, the router's span a child of its span."""
    import urllib.request

    _, gw, memory, collector = traced
    body = json.dumps({"model": "tiny-llama", "prompt": "w5 w6 w7 w8 w9 w10", "max_tokens": 3,
                       "temperature": 0}).encode()
    req = urllib.request.Request(gw.url + "/v1/completions", body, {
        "Content-Type": "application/json",
        "traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        assert resp.status == 200

    def exported() -> bool:
        with collector.lock:
            return {"disagg-decode", "disagg-prefill"} <= {
                s[0] for s in collector.spans if s[1] == CLIENT_TRACE and s[4] in (
                    "request", "prefill")}

    wait_for(exported, what="the caller's trace exported")
    time.sleep(0.3)
    with collector.lock:
        spans = router_spans(memory) + list(collector.spans)
    check_trace(spans, CLIENT_TRACE, root_parent=CLIENT_SPAN)
