"""disagg.serving.metrics: the exposition parses, request timing feeds the histograms."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from disagg.protocol import Stats
from disagg.serving.metrics import Metrics


def samples(m: Metrics) -> dict[str, float]:
    out = {}
    for fam in text_string_to_metric_families(m.render().decode()):
        for s in fam.samples:
            out[s.name + "".join(f",{k}={v}" for k, v in sorted(s.labels.items()))] = s.value
    return out


def test_request_timer_feeds_histograms():
    m = Metrics()
    t = m.start_request(now=10.0)
    t.on_tokens(1, now=10.5)  # TTFT 0.5
    t.on_tokens(2, now=10.7)  # two tokens 0.1 apart
    t.on_tokens(1, now=10.8)
    t.finish("length", prompt_tokens=7, now=11.0)
    t.finish("length", now=12.0)  # once only
    s = samples(m)
    assert s["disagg_requests_total,outcome=length"] == 1
    assert s["disagg_requests_total,outcome=stop"] == 0
    assert s["disagg_time_to_first_token_seconds_sum"] == 0.5
    assert s["disagg_inter_token_latency_seconds_count"] == 3
    assert abs(s["disagg_time_per_output_token_seconds_sum"] - 0.1) < 1e-9
    assert s["disagg_e2e_request_latency_seconds_sum"] == 1.0
    assert s["disagg_generation_tokens_total"] == 4 and s["disagg_prompt_tokens_total"] == 7
    assert s["disagg_requests_in_flight"] == 0


def test_errors_stats_and_transfers():
    m = Metrics()
    m.start_request().finish("error", error_code="bad_request")
    m.observe_error("model_not_found", "invalid_request_error")
    m.update_stats(Stats("decode", 100, 25, 16, 3, 4, 10, 5, 1, 0, 2, 0, 6), node="n1")
    m.observe_transfer("sent", 4096, writes=2, latency_s=0.002)
    m.observe_transfer("received", 1024)
    m.observe_layer_lag(0.0005)
    s = samples(m)
    assert s["disagg_request_errors_total,code=bad_request,type=none"] == 1
    assert s["disagg_request_errors_total,code=model_not_found,type=invalid_request_error"] == 1
    assert s["disagg_kv_page_usage_ratio,node=n1"] == 0.75
    assert s["disagg_num_requests_running,node=n1"] == 3
    assert s["disagg_num_requests_waiting,node=n1"] == 4
    assert s["disagg_node_preemptions_total,node=n1"] == 6
    assert s["disagg_node_requests_total,node=n1,state=rejected"] == 2
    assert s["disagg_kv_transfer_bytes_total,direction=sent"] == 4096
    assert s["disagg_kv_transfer_writes_total,direction=sent"] == 2
    assert s["disagg_kv_transfer_writes_total,direction=received"] == 1
    assert s["disagg_kv_transfer_latency_seconds_count,direction=sent"] == 1
    assert s["disagg_kv_layer_transfer_lag_seconds_count"] == 1
    m.forget_node("n1")
    assert "disagg_num_requests_running,node=n1" not in samples(m)


def test_two_instances_do_not_collide():
    a, b = Metrics(), Metrics()
    a.observe_error("x")
    assert samples(b).get("disagg_request_errors_total,code=x,type=none") is None
    assert samples(a)["disagg_request_errors_total,code=x,type=none"] == 1


def test_error_codes_and_types_are_separate_labels():
    m = Metrics()
    m.observe_error(None, "invalid_request_error")  # e.g. bad JSON: a type, no code
    m.observe_error("bad_request", "invalid_request_error")
    m.observe_error("timeout", "server_error")
    t = m.start_request()
    t.finish("error", 3, "unavailable", error_type="server_error")
    m.start_request().finish("error", 1, None, error_type="server_error")
    m.start_request().finish("abort", 1)  # not an error
    s = {k: v for k, v in samples(m).items() if k.startswith("disagg_request_errors_total")}
    assert s == {
        "disagg_request_errors_total,code=none,type=invalid_request_error": 1,
        "disagg_request_errors_total,code=bad_request,type=invalid_request_error": 1,
        "disagg_request_errors_total,code=timeout,type=server_error": 1,
        "disagg_request_errors_total,code=unavailable,type=server_error": 1,
        "disagg_request_errors_total,code=none,type=server_error": 1,
    }


def test_disaggregation_fields_of_stats():
    m = Metrics()
    m.update_stats(Stats("prefill", 10, 10, 16, 0, 0, 1, 1, 0, 0, 0, 0, 0, kv_writes_sent=12,
                         kv_bytes_sent=4096, layer_lag=2), node="p")
    s = samples(m)
    assert s["disagg_node_kv_writes_sent_total,node=p"] == 12
    assert s["disagg_node_kv_bytes_sent_total,node=p"] == 4096
    assert s["disagg_kv_layer_lag,node=p"] == 2


def test_units_sent_per_source_rank():
    m = Metrics()
    m.update_stats(Stats("prefill", 10, 10, 16, 0, 0, 1, 1, 0, 0, 0, 0, 0,
                         kv_units_sent_by_rank=[30, 18]), node="p")
    m.update_stats(Stats("decode", 10, 10, 16, 0, 0, 1, 1, 0, 0, 0, 0, 0), node="d")
    s = {k: v for k, v in samples(m).items() if k.startswith("disagg_node_kv_units_sent")}
    assert s == {"disagg_node_kv_units_sent_total,node=p,rank=0": 30,
                 "disagg_node_kv_units_sent_total,node=p,rank=1": 18}
