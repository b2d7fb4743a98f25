"""``disagg-bench serve``'s outputs without a node: ``--json`` with a ``--dp`` node's Stats
(``DPRankStats``, an array_like Struct, as objects of named fields), written whole or not at
all, ``--json -`` on stdout; and output tokens over ``--http`` with ``n > 1`` against a fake
gateway streaming as the real one does (an event per choice, several tokens or none)."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
from typing import Any

import msgspec
import pytest
from aiohttp import web

from disagg.bench import report, serve
from disagg.bench.metrics_math import RequestRecord, aggregate, request_tpot
from disagg.bench.transport import ZmqTransport
from disagg.protocol import DPRankStats, Stats


def parse(*argv: str) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    serve.add_arguments(ap)
    return ap.parse_args(list(argv))


def dp_stats() -> Stats:
    return Stats(role="mixed", pages_total=64, pages_free=60, page_size=16, running=2,
                 waiting=0, started=5, finished=3, aborted=0, errored=0, rejected=0,
                 bad_frames=0, preemptions=0,
                 dp_ranks=[DPRankStats(0, 1, 32, 30, 3), DPRankStats(1, 1, 32, 30, 2, 0.5)])


RANKS = [{"rank": 0, "running": 1, "pages_total": 32, "pages_free": 30, "started": 3,
          "all_to_all_s": 0.0},
         {"rank": 1, "running": 1, "pages_total": 32, "pages_free": 30, "started": 2,
          "all_to_all_s": 0.5}]


def result(stats: Any) -> dict[str, Any]:
    rec = RequestRecord(index=0, node="tcp://n", input_len=4, output_len=2, scheduled_time=0.0,
                        send_time=0.0, chunk_times=[0.1, 0.2], chunk_tokens=[1, 1],
                        finish_time=0.2, finish_reason="length", completion_tokens=2)
    return {"label": "t", "summary": aggregate([rec], 1.0),
            "node_stats": {"before": {"tcp://n": stats}, "after": {"tcp://n": stats}}}


class FakeClient:
    async def stats(self, timeout: float) -> Stats:
        return dp_stats()


async def test_zmq_stats_of_a_dp_node_are_plain_with_named_rank_fields():
    t = ZmqTransport.__new__(ZmqTransport)
    t._client = FakeClient()  # type: ignore[assignment]
    stats = await t.stats(1.0)
    assert stats is not None and stats["dp_ranks"] == RANKS and stats["started"] == 5
    json.dumps(stats)  # no Struct left: the stdlib encoder takes it as is


def test_json_of_a_dp_node_names_rank_fields(tmp_path, monkeypatch):
    # the Stats as the transport used to give them: a shallow asdict, DPRankStats inside
    raw = dict(msgspec.structs.asdict(dp_stats()))
    out = tmp_path / "r.json"
    report.write_json(result(raw), str(out))
    got = json.loads(out.read_text())
    assert got["node_stats"]["after"]["tcp://n"]["dp_ranks"] == RANKS
    assert got["summary"]["total_output_tokens"] == 2
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]  # no temporary file left
    assert os.stat(out).st_mode & 0o777 == 0o666 & ~_umask()


def _umask() -> int:
    u = os.umask(0)
    os.umask(u)
    return u


def test_json_failure_leaves_no_file_and_keeps_an_old_one(tmp_path):
    out = tmp_path / "r.json"
    with pytest.raises(TypeError):
        report.write_json(result(object()), str(out))
    assert list(tmp_path.iterdir()) == []
    out.write_text('{"old": 1}')
    with pytest.raises(TypeError):
        report.write_json(result(object()), str(out))
    assert out.read_text() == '{"old": 1}' and list(tmp_path.iterdir()) == [out]


def test_json_dash_is_stdout_and_the_report_goes_to_stderr(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)

    async def fake_run(args: argparse.Namespace) -> dict[str, Any]:
        return result(dict(msgspec.structs.asdict(dp_stats())))

    monkeypatch.setattr(serve, "run_benchmark", fake_run)
    assert serve.main(parse("--json", "-")) == 0
    captured = capsys.readouterr()
    got = json.loads(captured.out)  # stdout: the JSON alone
    assert got["node_stats"]["before"]["tcp://n"]["dp_ranks"] == RANKS
    assert "=== disagg-bench serve: t ===" in captured.err
    assert list(tmp_path.iterdir()) == []  # no file named -


async def fake_gateway(n_seen: list[int]) -> web.AppRunner:
    """/v1/completions streaming as the gateway does with n > 1: one event per choice's
    delta, 4 tokens a choice: "a" (one token), "bc" (two tokens in one event), a token of
    empty text (no event, unless the request asked logprobs: then every event lists its
    tokens), then the choice's finish; then the usage of every choice."""

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "m"}]})

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        n = body.get("n", 1)
        n_seen.append(n)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)

        async def event(obj: dict[str, Any]) -> None:
            await resp.write(b"data: " + json.dumps(obj).encode() + b"\n\n")

        lps = "logprobs" in body  # then a token of empty text has its event, as the gateway's
        steps = (("a", ["a"], None), ("bc", ["b", "c"], None), ("", [""], None),
                 ("", [], "length"))
        for text, tokens, reason in steps:
            if not lps and not text and reason is None:
                continue
            for k in range(n):
                choice = {"index": k, "text": text, "finish_reason": reason}
                if lps:
                    choice["logprobs"] = {"tokens": tokens} if tokens else None
                await event({"choices": [choice], "usage": None})
                await asyncio.sleep(0)
        await event({"choices": [], "usage": {"prompt_tokens": len(body["prompt"]),
                                              "completion_tokens": 4 * n,
                                              "total_tokens": len(body["prompt"]) + 4 * n}})
        await resp.write(b"data: [DONE]\n\n")
        return resp

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", completions)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner


async def bench_fake_gateway(*args: str) -> tuple[list[int], dict[str, Any]]:
    """``disagg-bench serve --http`` with ``args`` against ``fake_gateway``: (the n each
    request asked, the result)."""
    n_seen: list[int] = []
    runner = await fake_gateway(n_seen)
    try:
        port = runner.addresses[0][1]
        res = await serve.run_benchmark(parse(
            "--http", f"http://127.0.0.1:{port}", "--input-len", "5", "--output-len", "4",
            "--wait", "5", "--timeout", "10", *args))
    finally:
        await runner.cleanup()
    return n_seen, res


async def test_http_n2_output_tokens_are_every_choices_usage():
    n_seen, res = await bench_fake_gateway("--n", "2", "--num-prompts", "4")
    assert n_seen == [2] * 4
    s = res["summary"]
    assert s["completed"] == 4
    assert all(q["completion_tokens"] == 8 for q in res["requests"])
    assert all(len(q["chunk_times"]) == 4 for q in res["requests"])  # events with text
    assert s["total_output_tokens"] == 32 == sum(q["completion_tokens"] for q in res["requests"])
    assert s["output_throughput"] == pytest.approx(32 / s["duration_s"])
    for q in res["requests"]:  # each event's choice, so TPOT and ITL are per choice
        assert q["chunk_choices"] == [0, 1, 0, 1]
    tpots = sorted(request_tpot(q["send_time"], q["finish_time"], q["chunk_times"],
                                q["chunk_tokens"], q["chunk_choices"]) for q in res["requests"])
    assert s["tpot_ms"]["p50"] == pytest.approx(1e3 * (tpots[1] + tpots[2]) / 2)
    json.loads(report.result_json(res))


async def test_http_events_count_their_logprob_tokens_when_asked():
    """With logprobs asked, a token of empty text is still an event (the first token is the
    first event, whatever its text) and each event counts the tokens it lists."""
    _, res = await bench_fake_gateway("--n", "2", "--num-prompts", "2", "--top-logprobs", "0")
    assert res["summary"]["completed"] == 2
    for q in res["requests"]:
        assert q["chunk_choices"] == [0, 1, 0, 1, 0, 1]
        assert q["chunk_tokens"] == [1, 1, 2, 2, 1, 1]
