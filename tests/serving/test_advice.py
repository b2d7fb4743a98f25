"""disagg.serving.advice: simulated loads whose right answer is known, the latency window, the
gauges, and the router's endpoint in-process (a fake decode peer answering Stats)."""

from __future__ import annotations

import asyncio
import math

import msgspec
import pytest
import zmq
import zmq.asyncio
from prometheus_client.parser import text_string_to_metric_families

from disagg.protocol import (
    ClientMessage,
    Error,
    Finished,
    GenerateRequest,
    Stats,
    StatsRequest,
    TokenChunk,
    Usage,
)
from disagg.serving.advice import (
    LatencyWindow,
    NodeLoad,
    Sample,
    Slo,
    advise,
    percentile,
)
from disagg.serving.metrics import Metrics

SLO = Slo(ttft_s=1.0, tpot_s=0.05)


def decoders(n, running, waiting=0, kv=0, pages_used=0.5, prefillers=2):
    return [NodeLoad("decode", running, waiting, kv, prefillers, 1000,
                     int(1000 * (1 - pages_used))) for _ in range(n)]


def remote(ttft, tpot, queue_ms, compute_ms, n=40):
    """``n`` finished remote-prefill requests with these latencies."""
    timings = {"decode_queue": 5.0, "prefill_queue": queue_ms, "prefill_compute": compute_ms,
               "kv_wait": queue_ms + compute_ms + 10, "exposed_transfer": 10.0,
               "first_step": 20.0}
    return [Sample(ttft, tpot, timings) for _ in range(n)]


def test_long_prefill_queues_and_ttft_over_slo_with_half_empty_decoders_is_prefill_bound():
    # 2 prefillers: queue 1.5 s per prompt vs 0.2 s compute (TTFT 2 s against 1 s); 2 decoders
    # half full, TPOT 20 ms against 50 ms, nobody queued at the decoders.
    a = advise(decoders(2, running=32, kv=20, pages_used=0.5),
               remote(2.0, 0.020, 1500, 200), SLO)
    assert a.verdict == "prefill-bound"
    assert a.ratio is not None and a.ratio > 1.0  # today 2:2
    assert (a.suggested_prefill, a.suggested_decode) == (3, 1)
    assert a.prefill_pressure > 1 > a.decode_pressure
    assert a.needed_prefill > a.prefill_nodes
    assert "prefill-bound" in a.reasoning and "TTFT" in a.reasoning


def test_full_decode_batches_over_tpot_slo_with_short_prefill_queues_is_decode_bound():
    # decoders queue requests (16 each waiting behind 64 running, KV 97% used), TPOT 80 ms
    # against 50; prefill queues 10 ms, TTFT 0.4 s against 1 s.
    a = advise(decoders(2, running=64, waiting=16, kv=2, pages_used=0.97),
               remote(0.4, 0.080, 10, 200), SLO)
    assert a.verdict == "decode-bound"
    assert a.ratio is not None and a.ratio < 1.0
    assert (a.suggested_prefill, a.suggested_decode) == (1, 3)
    assert a.decode_pressure == pytest.approx(0.080 / 0.050)  # TPOT is the worst term
    assert a.needed_decode == 4  # ceil(2 x 1.6)
    assert a.prefill_pressure < 0.2


def test_both_pools_near_their_slo_is_balanced_and_keeps_the_ratio():
    # prefill: queue 0.3 s, compute 0.2 s, TTFT p90 0.9 s (just within 1 s); TPOT 45 ms of 50
    a = advise(decoders(3, running=40, kv=6, pages_used=0.7, prefillers=2),
               remote(0.9, 0.045, 300, 200), SLO)
    assert a.verdict == "balanced"
    assert a.ratio == pytest.approx(2 / 3)
    assert (a.suggested_prefill, a.suggested_decode) == (2, 3)
    assert 0.5 < a.prefill_pressure < 1.25 and 0.5 < a.decode_pressure < 1.25


def test_light_load_is_balanced_whatever_the_pressures_ratio():
    a = advise(decoders(2, running=2, pages_used=0.05), remote(0.25, 0.010, 1, 200), SLO)
    assert a.verdict == "balanced" and a.ratio == 1.0
    assert "lightly loaded" in a.reasoning


def test_stats_alone_when_requests_carry_no_timings():
    # no finished request yet: the prefill pipeline per prefiller from waiting_for_kv
    busy_prefill = advise(decoders(2, running=10, kv=40, pages_used=0.5, prefillers=1), [], SLO)
    assert busy_prefill.verdict == "prefill-bound"
    assert "from Stats" in busy_prefill.reasoning
    busy_decode = advise(decoders(2, running=60, waiting=30, kv=1, pages_used=0.98,
                                  prefillers=2), [], SLO)
    assert busy_decode.verdict == "decode-bound"


def test_prefill_nodes_own_stats_count_when_given():
    nodes = decoders(1, running=8, kv=1, prefillers=3) + [
        NodeLoad("prefill", running=1, waiting=30, layer_lag=4)]
    a = advise(nodes, [], SLO)
    assert a.prefill_nodes == 1  # the prefill snapshots themselves, not prefill_peers_alive
    assert a.verdict == "prefill-bound"
    assert "layers computed but not yet shipped" in a.reasoning


def test_an_unreachable_ttft_slo_is_called_out():
    # compute alone (2 s) exceeds the 1 s SLO: no number of prefillers meets it
    a = advise(decoders(2, running=8), remote(2.3, 0.02, 100, 2000), SLO)
    assert a.verdict == "prefill-bound"
    assert "cannot meet it alone" in a.reasoning


@pytest.mark.parametrize("nodes, why", [
    ([], "No decode node"),
    (decoders(2, running=8, prefillers=0), "No prefill node"),
])
def test_unknown_without_both_pools(nodes, why):
    a = advise(nodes, [], SLO)
    assert a.verdict == "unknown" and a.ratio is None and why in a.reasoning
    body = a.to_json()
    assert body["suggested_ratio"] is None and body["verdict"] == "unknown"


def test_to_json_has_the_verdict_ratio_counts_and_reasoning():
    a = advise(decoders(2, running=32, kv=20), remote(2.0, 0.020, 1500, 200), SLO)
    body = msgspec.json.decode(msgspec.json.encode(a.to_json()))
    assert body["verdict"] == "prefill-bound"
    assert body["current"] == {"prefill": 2, "decode": 2, "ratio": 1.0}
    assert body["suggested"] == {"prefill": 3, "decode": 1}
    assert body["slo"] == {"ttft_ms": 1000.0, "tpot_ms": 50.0}
    assert body["observed"]["ttft_p90_ms"] == 2000.0 and body["observed"]["samples"] == 40
    assert isinstance(body["reasoning"], str) and "Prefill:" in body["reasoning"]


def test_percentile_is_nearest_rank():
    assert percentile([3.0, 1.0, 2.0], 0.5) == 2.0
    assert percentile(list(map(float, range(1, 11))), 0.9) == 9.0
    assert percentile([7.0]) == 7.0
    with pytest.raises(ValueError):
        Slo(ttft_s=0)


def test_latency_window_times_requests_and_forgets_old_ones():
    w = LatencyWindow(horizon_s=10.0)
    usage = Usage(5, 3)
    w.start("a", 0.0)
    w.tokens("a", 1, 0.5)
    w.tokens("a", 2, 0.7)  # 3 tokens, last at 0.7: TPOT (0.7 - 0.5) / 2
    w.finish("a", Finished("a", "length", usage, timings={"prefill_queue": 1.0}), 0.8)
    w.start("b", 1.0)
    w.tokens("b", 1, 1.2)
    w.finish("b", Error("timeout", "x", "b"), 1.3)  # errors are not samples
    w.start("c", 1.0)
    w.finish("c", Finished("c", "abort", usage), 1.3)  # nor aborts
    w.start("d", 1.0)
    w.finish("d", Finished("d", "stop", usage), 1.1)  # nor answers without a token
    (s,) = w.samples(5.0)
    assert s.ttft_s == pytest.approx(0.5) and s.tpot_s == pytest.approx(0.1)
    assert s.timings == {"prefill_queue": 1.0}
    assert w.samples(11.0) == []
    assert not w._live


def test_latency_window_stays_bounded():
    w = LatencyWindow(max_samples=4, max_live=8)
    for i in range(20):
        w.start(str(i), 0.0)
        w.tokens(str(i), 1, 0.1)
    assert len(w._live) == 8
    for i in range(12, 20):
        w.finish(str(i), Finished(str(i), "stop", Usage(1, 1)), 0.2)
    assert len(w.samples(0.2)) == 4


def scrape(m: Metrics) -> dict[str, float]:
    out = {}
    for fam in text_string_to_metric_families(m.render().decode()):
        for s in fam.samples:
            out[s.name + "".join(f",{k}={v}" for k, v in sorted(s.labels.items()))] = s.value
    return out


def test_gauges_follow_the_advice():
    m = Metrics()
    current = [advise(decoders(2, running=32, kv=20), remote(2.0, 0.02, 1500, 200), SLO)]
    m.watch_advice(lambda: current[0])
    s = scrape(m)
    assert s["disagg_advice_prefill_decode_ratio"] == pytest.approx(current[0].ratio)
    assert s["disagg_advice_verdict,verdict=prefill-bound"] == 1.0
    assert s["disagg_advice_verdict,verdict=balanced"] == 0.0
    assert s["disagg_advice_nodes,pool=decode"] == 2.0
    assert s["disagg_advice_pressure,pool=prefill"] > 1.0
    current[0] = advise([], [], SLO)
    s = scrape(m)
    assert math.isnan(s["disagg_advice_prefill_decode_ratio"])
    assert s["disagg_advice_verdict,verdict=unknown"] == 1.0


# ------------------------------------------------------------------ the router, in-process


async def fake_decoder(sock: zmq.asyncio.Socket, stats: Stats) -> None:
    """A decode peer: answers Stats; streams two tokens 30 ms apart for each request, with
    prefill timings showing a long queue."""
    enc, dec = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(ClientMessage)
    timings = {"prefill_queue": 1500.0, "prefill_compute": 200.0, "kv_wait": 1710.0}
    while True:
        ident, frame = await sock.recv_multipart()
        msg = dec.decode(frame)
        if isinstance(msg, StatsRequest):
            await sock.send_multipart([ident, enc.encode(stats)])
            continue
        if not isinstance(msg, GenerateRequest):
            continue  # an Abort: nothing to stop here
        rid = msg.request_id
        for tok in (1, 2):
            await asyncio.sleep(0.03)
            await sock.send_multipart([ident, enc.encode(TokenChunk(rid, [tok], "x"))])
        await sock.send_multipart([ident, enc.encode(Finished(rid, "length", Usage(3, 2),
                                                              timings=timings))])


async def test_router_serves_advice_over_http_and_as_gauges():
    import aiohttp

    from disagg.actors.http.http import Gateway
    from disagg.actors.router.router import Router

    ctx = zmq.asyncio.Context()
    peer = ctx.socket(zmq.ROUTER)
    peer.setsockopt(zmq.LINGER, 0)
    port = peer.bind_to_random_port("tcp://127.0.0.1")
    stats = Stats(role="decode", pages_total=1000, pages_free=500, page_size=16, running=32,
                  waiting=0, started=0, finished=0, aborted=0, errored=0, rejected=0,
                  bad_frames=0, preemptions=0, waiting_for_kv=20, prefill_peers_alive=1)
    task = asyncio.create_task(fake_decoder(peer, stats))
    router = Router([f"tcp://127.0.0.1:{port}"], ctx=ctx, poll_interval=0.05,
                    slo=Slo(ttft_s=0.5, tpot_s=0.2))
    gw = Gateway(router, "127.0.0.1:0", "m", tokenizer=None, max_model_len=64,
                 metrics=router.metrics, stats_interval=0.1, stats_label=None)
    try:
        await router.start(wait_for_peer=5)
        await gw.start()
        for i in range(6):
            async for _ in router.generate(prompt_token_ids=[1, 2, 3], request_id=str(i)):
                pass
        async with aiohttp.ClientSession() as http:
            async with http.get(gw.url + "/v1/disagg/advice") as r:
                assert r.status == 200
                body = await r.json()
            async with http.get(gw.url + "/metrics") as r:
                text = await r.text()
        assert body["verdict"] == "prefill-bound", body
        assert body["current"] == {"prefill": 1, "decode": 1, "ratio": 1.0}
        assert body["observed"]["samples"] == 6
        assert 25 <= body["observed"]["tpot_p90_ms"] < 200
        assert body["reasoning"]
        assert 'disagg_advice_verdict{verdict="prefill-bound"} 1.0' in text
        assert "disagg_advice_prefill_decode_ratio" in text
    finally:
        await gw.stop()
        await router.stop()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        peer.close()
        ctx.destroy(linger=0)
