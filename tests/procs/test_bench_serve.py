"""CPU smoke test of ``disagg-bench serve`` against a real mixed node with a tiny model.

Checks accounting only (every request completes with exactly its requested tokens, the
summary adds up, percentiles are ordered); no timing assertions."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tinymodels import TINY, free_port

NUM = 16
IN_LEN = 12
OUT_LEN = 6


@pytest.fixture(scope="module")
def node(shared_node):
    """The shared mixed node: the benchmark's requests all end, leaving its pool free."""
    return shared_node


def bench(*args: str, timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "disagg.bench", "serve", *args],
                          capture_output=True, text=True, timeout=timeout)


def check_ordered(d: dict) -> None:
    assert d["min"] <= d["p50"] <= d["p90"] <= d["p99"] <= d["max"], d


def test_fixed_lengths_all_complete(node, tmp_path):
    out = tmp_path / "fixed.json"
    plot = tmp_path / "fixed.png"
    r = bench("--connect", node, "--connect", node, "--num-prompts", str(NUM),
              "--input-len", str(IN_LEN), "--output-len", str(OUT_LEN),
              "--vocab-size", str(TINY["vocab_size"]), "--request-rate", "50", "--seed", "1",
              "--slo-ttft-ms", "60000", "--slo-tpot-ms", "60000", "--timeout", "60",
              "--json", str(out), "--plot", str(plot))
    assert r.returncode == 0, r.stderr
    assert "TTFT" in r.stdout
    res = json.loads(out.read_text())
    s = res["summary"]
    assert s["num_requests"] == s["completed"] == NUM and s["failed"] == 0, s["errors"]
    assert s["total_input_tokens"] == NUM * IN_LEN
    assert s["total_output_tokens"] == NUM * OUT_LEN
    assert s["request_throughput"] > 0 and s["output_throughput"] > 0
    assert s["total_token_throughput"] > s["output_throughput"]
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms", "tokens_per_s_per_user"):
        check_ordered(s[key])
    assert s["ttft_ms"]["count"] == s["tpot_ms"]["count"] == NUM
    assert s["itl_ms"]["count"] >= NUM  # >= one gap per request (chunks may batch tokens)
    assert s["goodput"]["good_requests"] == NUM  # generous SLOs
    assert s["ttft_breakdown_ms"] == {}  # a mixed node prefills locally: no breakdown
    reqs = res["requests"]
    assert [q["index"] for q in reqs] == list(range(NUM))
    assert {q["node"] for q in reqs} == {node}
    for q in reqs:
        assert q["error"] is None and q["finish_reason"] == "length"
        assert sum(q["chunk_tokens"]) == q["completion_tokens"] == q["output_len"] == OUT_LEN
        assert q["prompt_tokens"] == q["input_len"] == IN_LEN
        assert q["scheduled_time"] <= q["send_time"] <= q["chunk_times"][0] <= q["finish_time"]
        assert q["chunk_times"] == sorted(q["chunk_times"])
        assert q["breakdown"] == {}
    assert plot.read_bytes()[:4] == b"\x89PNG"

    # the comparison plot reads the same JSON
    cmp_png = tmp_path / "cmp.png"
    p = subprocess.run([sys.executable, "-m", "disagg.bench", "plot", str(out), str(out),
                        "-o", str(cmp_png)], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert cmp_png.stat().st_size > 0


def test_sharegpt_with_concurrency_cap(node, tmp_path):
    out = tmp_path / "sharegpt.json"
    r = bench("--connect", node, "--num-prompts", str(NUM), "--workload", "sharegpt",
              "--max-input-len", "48", "--max-output-len", "24", "--max-concurrency", "4", "--warmup", "2",
              "--vocab-size", str(TINY["vocab_size"]), "--timeout", "60", "--quiet",
              "--json", str(out))
    assert r.returncode == 0, r.stderr
    res = json.loads(out.read_text())
    s = res["summary"]
    assert s["completed"] == NUM, s["errors"]
    assert s["total_output_tokens"] == sum(q["output_len"] for q in res["requests"])
    assert all(sum(q["chunk_tokens"]) == q["output_len"] for q in res["requests"])
    assert len({q["input_len"] for q in res["requests"]}) > 1  # lengths vary
    assert s["goodput"] is None
    assert res["warmup"] == {"requests": 2, "errors": []}


def test_bad_requests_are_counted_not_fatal(node, tmp_path):
    out = tmp_path / "bad.json"
    # ids up to 100000 fall outside the tiny vocabulary: the node refuses each request
    r = bench("--connect", node, "--num-prompts", "4", "--input-len", "64", "--output-len", "2",
              "--vocab-size", "100000", "--timeout", "30", "--quiet", "--json", str(out))
    assert r.returncode == 0, r.stderr
    s = json.loads(out.read_text())["summary"]
    assert s["completed"] == 0 and s["failed"] == 4
    assert s["errors"] == {"bad_request": 4}
    assert s["ttft_ms"]["p50"] is None


def test_unreachable_node_fails_fast():
    r = bench("--connect", f"tcp://127.0.0.1:{free_port()}", "--num-prompts", "2",
              "--wait", "0.5", timeout=30)
    assert r.returncode == 2 and "did not answer" in r.stderr


def test_multiturn_conversations_hit_the_prefix_cache(node, tmp_path):
    out = tmp_path / "multiturn.json"
    r = bench("--connect", node, "--workload", "multiturn", "--num-conversations", "4",
              "--num-prompts", "99", "--num-turns", "3", "--system-len", "8", "--user-len", "4", "--output-len", "4",
              "--vocab-size", str(TINY["vocab_size"]), "--request-rate", "20", "--seed", "2",
              "--timeout", "60", "--json", str(out))
    assert r.returncode == 0, r.stderr
    assert "prefix hit rate" in r.stdout
    res = json.loads(out.read_text())
    s = res["summary"]
    assert s["num_requests"] == s["completed"] == 12 and s["failed"] == 0, s["errors"]
    m = s["multiturn"]
    turns = m["turns"]
    assert sorted(turns) == ["0", "1", "2"] and all(t["requests"] == 4 for t in turns.values())
    # turn k resends system (8) + k x (user 4 + answer 4) + user 4 tokens
    assert [turns[k]["prompt_tokens"] for k in "012"] == [4 * 12, 4 * 20, 4 * 28]
    assert turns["2"]["cached_share"] > turns["0"]["cached_share"]
    assert m["prefix_hit_rate"] > 0 and m["node_prefix_hit_rate"] > 0
    assert m["later_turns_ttft_ms"]["count"] == 8
    # no KV tiers on this node (per-tier counts come with --kv-host-cache-mb)
    assert m["tier_hit_tokens"]["host"] == m["tier_hit_tokens"]["disk"] == 0
    assert "later turns TTFT p50" in r.stdout
    recs = [q for q in res["requests"] if q["conversation"] == 0]
    assert [q["turn"] for q in recs] == [0, 1, 2]


def test_top_logprobs_on_every_request(node, tmp_path):
    out = tmp_path / "logprobs.json"
    r = bench("--connect", node, "--num-prompts", "4", "--input-len", str(IN_LEN),
              "--output-len", str(OUT_LEN), "--vocab-size", str(TINY["vocab_size"]),
              "--top-logprobs", "3", "--warmup", "1", "--timeout", "60", "--json", str(out))
    assert r.returncode == 0, r.stderr
    res = json.loads(out.read_text())
    assert res["summary"]["completed"] == 4 and res["config"]["top_logprobs"] == 3
    assert res["warmup"]["errors"] == []
