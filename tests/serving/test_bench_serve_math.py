"""disagg-bench serve without a node: metric math, workloads, arrivals, deadlines, plots."""

from __future__ import annotations

import asyncio
import math
import statistics
import time
from dataclasses import asdict

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from disagg.bench.metrics_math import (
    RequestRecord,
    aggregate,
    itls,
    meets_slo,
    percentile,
    request_tpot,
    summarize,
    tpot,
)
from disagg.bench.serve import _run_one
from disagg.bench.transport import Done, TokenEvent, Transport, TransportError
from disagg.bench.workload import (
    MIN_TOKEN_ID,
    arrival_times,
    fixed_workload,
    sharegpt_lengths,
    sharegpt_workload,
)
from disagg.protocol import SamplingParams


def test_percentile_interpolates_like_numpy():
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile([5], 99) == 5
    assert percentile([3, 1, 2], 0) == 1 and percentile([3, 1, 2], 100) == 3
    with pytest.raises(ValueError):
        percentile([], 50)
    with pytest.raises(ValueError):
        percentile([1.0], 101)


@given(st.lists(st.floats(-1e6, 1e6), min_size=1, max_size=50), st.floats(0, 100))
def test_percentile_matches_numpy(xs, q):
    assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)), rel=1e-9, abs=1e-6)


@given(st.lists(st.floats(0, 1e4), min_size=1, max_size=50))
def test_summary_is_ordered(xs):
    s = summarize(xs)
    assert s["count"] == len(xs)
    assert s["min"] <= s["p50"] <= s["p90"] <= s["p99"] <= s["max"]
    assert s["mean"] == pytest.approx(statistics.fmean(xs))
    assert s["std"] == pytest.approx(statistics.pstdev(xs), abs=1e-6)


def test_summary_of_nothing_and_scale():
    assert summarize([]) == {"count": 0, "mean": None, "std": None, "min": None, "max": None,
                             "p50": None, "p90": None, "p99": None}
    assert summarize([0.001, 0.003], scale=1e3)["mean"] == pytest.approx(2.0)
    assert set(summarize([1.0], percentiles=(1.0, 99.9))) >= {"p1", "p99_9"}


def test_tpot_and_itl():
    assert tpot(e2e=1.0, ttft=0.1, num_output_tokens=10) == pytest.approx(0.1)
    assert tpot(1.0, 0.1, 1) is None and tpot(1.0, 0.1, 0) is None
    assert itls([1.0, 1.5, 1.5, 2.5]) == [0.5, 0.0, 1.0]
    assert itls([1.0]) == [] and itls([]) == []


def test_tpot_and_itl_of_several_choices_are_each_choices_own():
    """n = 2, each choice 5 tokens 10 ms apart, the choices' events interleaved (choice 1 a
    millisecond behind): TPOT and ITL are one choice's 10 ms, not the request's time over both
    choices' 10 tokens (~5 ms) nor the 1 ms between the choices' events."""
    times = [t for i in range(5) for t in (0.1 + 0.01 * i, 0.101 + 0.01 * i)]
    rec = RequestRecord(index=0, node="h", input_len=4, output_len=5, scheduled_time=0.0,
                        send_time=0.0, chunk_times=times, chunk_tokens=[1] * 10,
                        chunk_choices=[0, 1] * 5, finish_time=0.141)
    assert rec.tpot == pytest.approx((0.041 / 4 + 0.040 / 4) / 2)
    assert itls(rec.chunk_times, rec.chunk_choices) == pytest.approx([0.01] * 8)
    s = aggregate([rec], duration=1.0)
    assert s["tpot_ms"]["p50"] == pytest.approx(10.125)
    assert s["itl_ms"]["p50"] == pytest.approx(10.0)
    one = RequestRecord(index=1, node="h", input_len=4, output_len=5, scheduled_time=0.0,
                        send_time=0.0, chunk_times=times[::2], chunk_tokens=[1] * 5,
                        finish_time=0.141)
    assert one.tpot == pytest.approx(tpot(0.141, 0.1, 5))  # one choice: as before
    assert request_tpot(0.0, 0.2, [0.1, 0.15], [1, 1], [0, 1]) is None  # one token each


def test_slo():
    assert meets_slo(0.1, 0.02, None, None)
    assert meets_slo(0.1, 0.02, 0.1, 0.02)  # at the limit is good
    assert not meets_slo(0.11, 0.02, 0.1, None)
    assert not meets_slo(0.1, 0.03, None, 0.02)
    assert meets_slo(0.1, None, None, 0.02)  # one output token: no TPOT to miss


def _rec(i, send, times, finish, error=None, tokens=None):
    return RequestRecord(index=i, node="n", input_len=10, output_len=len(times),
                         scheduled_time=send, send_time=send, chunk_times=times,
                         chunk_tokens=tokens or [1] * len(times), finish_time=finish,
                         finish_reason="length", error=error)


def test_aggregate_accounting_and_goodput():
    recs = [
        _rec(0, 0.0, [0.1, 0.2, 0.3], 0.3),  # ttft 100 ms, tpot 100 ms
        _rec(1, 0.5, [0.55, 0.56, 0.57, 0.58], 0.58),  # ttft 50 ms, tpot 10 ms
        _rec(2, 1.0, [1.5], 1.5),  # ttft 500 ms, one token: no tpot
        _rec(3, 1.0, [], None, error="timeout: no completion within 1s"),
        _rec(4, 1.0, [], None, error="bad_request: token id 999 outside the vocabulary"),
    ]
    s = aggregate(recs, duration=2.0, slo_ttft=0.2, slo_tpot=0.05)
    assert s["num_requests"] == 5 and s["completed"] == 3 and s["failed"] == 2
    assert s["errors"] == {"timeout": 1, "bad_request": 1}
    assert s["total_output_tokens"] == 3 + 4 + 1 and s["total_input_tokens"] == 30
    assert s["request_throughput"] == pytest.approx(1.5)
    assert s["output_throughput"] == pytest.approx(4.0)
    assert s["total_token_throughput"] == pytest.approx(19.0)
    assert s["ttft_ms"]["count"] == 3 and s["ttft_ms"]["p50"] == pytest.approx(100.0)
    assert s["tpot_ms"]["count"] == 2 and s["tpot_ms"]["mean"] == pytest.approx(55.0)
    assert s["itl_ms"]["count"] == 2 + 3
    assert s["e2e_ms"]["max"] == pytest.approx(500.0)
    assert s["tokens_per_s_per_user"]["max"] == pytest.approx(100.0)
    g = s["goodput"]
    assert g["good_requests"] == 1  # only request 1 meets both (0 misses TPOT, 2 misses TTFT)
    assert g["request_goodput"] == pytest.approx(0.5) and g["fraction"] == pytest.approx(0.2)
    assert s["ttft_breakdown_ms"] == {}
    assert aggregate(recs, 2.0)["goodput"] is None


def test_multi_token_chunks_count_tokens_not_chunks():
    r = _rec(0, 0.0, [0.1, 0.4], 0.4, tokens=[1, 3])
    assert r.num_output_tokens == 4 and r.tpot == pytest.approx(0.1)
    assert aggregate([r], 1.0)["itl_ms"]["count"] == 1


def test_breakdown_summarised_when_present():
    r = _rec(0, 0.0, [0.1, 0.2], 0.2)
    r.breakdown = {"prefill_queue": 3.0, "transfer_tail": 1.0}
    s = aggregate([r, _rec(1, 0.0, [0.1], 0.1)], 1.0)
    assert s["ttft_breakdown_ms"]["prefill_queue"]["count"] == 1
    assert s["ttft_breakdown_ms"]["transfer_tail"]["p50"] == 1.0


def test_fixed_workload_is_seeded_and_in_vocab():
    a = fixed_workload(8, 12, 5, vocab_size=50, seed=3)
    assert a == fixed_workload(8, 12, 5, vocab_size=50, seed=3)
    assert a != fixed_workload(8, 12, 5, vocab_size=50, seed=4)
    assert all(s.input_len == 12 and s.output_len == 5 for s in a)
    assert all(MIN_TOKEN_ID <= t < 50 for s in a for t in s.prompt_token_ids)
    assert len({tuple(s.prompt_token_ids) for s in a}) == 8
    with pytest.raises(ValueError, match="vocab"):
        fixed_workload(1, 4, 4, vocab_size=5, seed=0)


def test_sharegpt_lengths_realistic_and_clipped():
    lens = sharegpt_lengths(4000, seed=0, max_input_len=100_000, max_output_len=100_000)
    ins = [i for i, _ in lens]
    outs = [o for _, o in lens]
    assert 150 < statistics.median(ins) < 210 and 250 < statistics.fmean(ins) < 350
    assert 125 < statistics.median(outs) < 175 and 170 < statistics.fmean(outs) < 240
    clipped = sharegpt_lengths(500, seed=0, max_input_len=64, max_output_len=16)
    assert all(4 <= i <= 64 and 1 <= o <= 16 for i, o in clipped)
    w = sharegpt_workload(20, vocab_size=320, seed=1, max_input_len=64, max_output_len=16)
    assert [(s.input_len, s.output_len) for s in w] == sharegpt_lengths(20, 1, 64, 16)


def test_arrivals():
    assert arrival_times(5, math.inf, seed=0) == [0.0] * 5
    ts = arrival_times(5000, 50.0, seed=0)
    assert ts[0] == 0.0 and all(b >= a for a, b in zip(ts, ts[1:], strict=False))
    assert ts[-1] / len(ts) == pytest.approx(1 / 50, rel=0.05)  # mean gap 1/rate
    gaps = np.diff(ts)
    assert np.std(gaps) / np.mean(gaps) == pytest.approx(1.0, rel=0.1)  # exponential: CV 1
    regular = np.diff(arrival_times(5000, 50.0, seed=0, burstiness=100.0))
    assert np.std(regular) / np.mean(regular) < 0.2
    assert arrival_times(10, 5.0, seed=1) == arrival_times(10, 5.0, seed=1)
    with pytest.raises(ValueError):
        arrival_times(3, 0.0, seed=0)


class FakeTransport(Transport):
    """Scripted replies: ``mode`` ok | hang | error."""

    def __init__(self, mode: str):
        self.address = f"fake:{mode}"
        self.mode = mode

    async def generate(self, spec, request_id, sampling, timeout):
        if self.mode == "error":
            raise TransportError("bad_request", "token id outside the vocabulary")
        for _ in range(sampling.max_tokens):
            await asyncio.sleep(0.001)
            yield TokenEvent(time.perf_counter(), 1)
            if self.mode == "hang":
                await asyncio.sleep(3600)
        yield Done(time.perf_counter(), "length", spec.input_len, sampling.max_tokens)

    async def stats(self, timeout):
        return None

    async def close(self):
        pass


@pytest.mark.parametrize("mode,error", [("ok", None), ("hang", "timeout"),
                                        ("error", "bad_request")])
async def test_run_one_records_every_outcome(mode, error):
    spec = fixed_workload(1, 4, 3, vocab_size=100, seed=0)[0]
    rec = RequestRecord(index=0, node=mode, input_len=4, output_len=3, scheduled_time=0.0)
    t0 = time.perf_counter()
    await _run_one(FakeTransport(mode), spec, rec, t0, SamplingParams(max_tokens=3),
                   timeout=0.2, run_id="t", sem=asyncio.Semaphore(1))
    if error is None:
        assert rec.ok and rec.num_output_tokens == 3 and rec.completion_tokens == 3
        assert rec.ttft is not None and rec.ttft >= 0
    else:
        assert not rec.ok and rec.error.startswith(error)
    assert asdict(rec)["breakdown"] == {}


def test_plot_writes_png(tmp_path):
    pytest.importorskip("matplotlib")
    from disagg.bench.plot import plot_runs

    recs = [_rec(0, 0.0, [0.1, 0.2, 0.3], 0.3), _rec(1, 0.5, [0.55, 0.6], 0.6)]
    res = {"label": "x", "requests": [asdict(r) for r in recs]}
    out = tmp_path / "p.png"
    plot_runs([res, res], out, labels=["a", "b"])
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_multiturn_workload_resends_the_history_with_the_answers():
    from disagg.bench.workload import multiturn_workload

    convs = multiturn_workload(3, 2, system_len=5, user_len=3, output_len=2, vocab_size=100,
                               seed=1)
    assert all(c.system == convs[0].system for c in convs)  # one shared system prompt
    assert convs[0].users != convs[1].users
    c = convs[1]
    assert c.prompt(0, []) == c.system + c.users[0]
    assert c.prompt(1, [[7, 8]]) == c.system + c.users[0] + [7, 8] + c.users[1]
    assert multiturn_workload(3, 2, 5, 3, 2, 100, 1) == convs  # seeded


def test_multiturn_summary_per_turn():
    from disagg.bench.metrics_math import RequestRecord, multiturn_summary

    def rec(turn, ttft, cached, prompt=10):
        r = RequestRecord(index=turn, node="n", input_len=prompt, output_len=1,
                          scheduled_time=0.0, send_time=0.0, chunk_times=[ttft],
                          chunk_tokens=[1], finish_time=ttft, finish_reason="length",
                          prompt_tokens=prompt, completion_tokens=1, cached_tokens=cached,
                          conversation=0, turn=turn)
        return r

    m = multiturn_summary([rec(0, 0.2, 0), rec(1, 0.1, 8), rec(1, 0.1, 6), rec(2, 0.3, 9)])
    assert m["turns"][1]["cached_share"] == 0.7 and m["turns"][0]["cached_share"] == 0.0
    assert m["ttft_p50_vs_first_turn"] == {1: 0.5, 2: 1.5}
    assert abs(m["prefix_hit_rate"] - 23 / 40) < 1e-12
    later = m["later_turns_ttft_ms"]  # turns 1 and 2 together, not turn 0
    assert later["count"] == 3 and abs(later["p50"] - 100.0) < 1e-9
    assert abs(later["max"] - 300.0) < 1e-9
