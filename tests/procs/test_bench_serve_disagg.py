"""`disagg-bench serve` against a CPU prefill + decode pair, over ZeroMQ and over HTTP."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from nodes import node, running, wait_for
from tinymodels import TINY, add_word_tokenizer, free_port, make_tiny_model

pytestmark = pytest.mark.fabric

NUM, IN_LEN, OUT_LEN = 12, 24, 5


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bench-pair")
    path = make_tiny_model("llama", tmp / "llama")
    add_word_tokenizer(path)  # text deltas: the HTTP stream has one event per token
    http = f"127.0.0.1:{free_port()}"
    p_metrics, d_metrics = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    p_addr, p = node("prefill", path, tmp, "--num-pages", "256", "--max-batch-tokens", "16",
                     "--metrics-listen", p_metrics)
    d_addr, d = node("decode", path, tmp, "--num-pages", "256", "--prefill-peer", p_addr,
                     "--heartbeat", "0.2", "--http-listen", http, "--metrics-listen", d_metrics)
    with running([p, d], [d_addr]):
        yield d_addr, f"http://{http}", f"http://{p_metrics}", f"http://{d_metrics}"


def bench(out, *args: str) -> dict:
    r = subprocess.run([sys.executable, "-m", "disagg.bench", "serve", *args,
                        "--num-prompts", str(NUM), "--input-len", str(IN_LEN),
                        "--output-len", str(OUT_LEN), "--vocab-size", str(TINY["vocab_size"]),
                        "--request-rate", "40", "--seed", "3", "--timeout", "60", "--wait", "60",
                        "--json", str(out)], capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr
    return json.loads(out.read_text())["summary"]


def check(s: dict) -> None:
    assert s["num_requests"] == s["completed"] == NUM and s["failed"] == 0, s["errors"]
    assert s["total_output_tokens"] == NUM * OUT_LEN
    assert s["total_input_tokens"] == NUM * IN_LEN
    assert s["ttft_ms"]["p50"] <= s["ttft_ms"]["p99"]


def test_bench_over_zeromq_reports_the_ttft_breakdown(pair, tmp_path):
    s = bench(tmp_path / "zmq.json", "--connect", pair[0])
    check(s)
    phases = s["ttft_breakdown_ms"]
    assert {"decode_queue", "kv_wait", "first_step"} <= phases.keys()
    assert phases["kv_wait"]["count"] == NUM


def test_bench_over_http(pair, tmp_path):
    check(bench(tmp_path / "http.json", "--http", pair[1]))


def scrape(url: str) -> dict[str, float]:
    """Every sample of a /metrics page, keyed by name{labels}."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"{url}/metrics", timeout=10).read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}"] = s.value
    return out


def test_metrics_on_both_nodes_count_kv_transfers(pair, tmp_path):
    bench(tmp_path / "m.json", "--connect", pair[0])  # some remote prefills
    p_url, d_url = pair[2], pair[3]
    wait_for(lambda: scrape(p_url).get("disagg_kv_transfer_bytes_total{direction=sent}", 0) > 0,
             what="prefiller counts bytes sent")
    p, d = scrape(p_url), scrape(d_url)
    assert p["disagg_kv_transfer_writes_total{direction=sent}"] > 0
    assert p["disagg_kv_layer_transfer_lag_seconds_count{}"] > 0
    assert d["disagg_kv_transfer_bytes_total{direction=received}"] > 0
    assert d["disagg_kv_transfer_latency_seconds_count{direction=received}"] >= NUM
    # the polled Stats gauges are there for both roles
    assert any(k.startswith("disagg_") and "page" in k for k in p)
    assert any(k.startswith("disagg_") and "page" in k for k in d)

