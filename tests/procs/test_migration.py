"""Request migration through real processes (``disagg.serving.migration``): a node continues a
resumed request (``protocol.Resume``) exactly where another stopped; behind a router, the
streams of a decode node that restarts or is SIGKILLed mid-stream go on on the other decoder
with no token lost or repeated, their text equal to an uninterrupted greedy run.

``DISAGG_TEST_MIGRATION_REQUESTS`` (default 16) sets how many requests stream when the decoder
is killed (docs/RELIABILITY.md records a run at 64)."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import msgspec
import pytest
import zmq

from disagg.actors.router.router import Router, start_router
from disagg.client import AsyncClient, RequestError
from disagg.protocol import (
    Error,
    Finished,
    GenerateRequest,
    NodeReply,
    Resume,
    SamplingParams,
    TokenChunk,
)
from disagg.serving.migration import MigrationPolicy, Progress
from nodes import LoopThread, node, pools_full, prompt, running, wait_for
from tinymodels import free_port

REQUESTS = int(os.environ.get("DISAGG_TEST_MIGRATION_REQUESTS", "16"))
NEW = 40  # output tokens per streamed request
MAX_LEN = 256


def raw(addr: str, req: GenerateRequest, timeout: float = 60.0) -> list[NodeReply]:
    """Every reply to ``req`` (a resumed one included) up to its terminal one."""
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(addr)
    dec = msgspec.msgpack.Decoder(NodeReply)
    out: list[NodeReply] = []
    try:
        sock.send(msgspec.msgpack.encode(req))
        deadline = time.monotonic() + timeout
        while not out or isinstance(out[-1], TokenChunk):
            assert sock.poll(int(1000 * max(0.0, deadline - time.monotonic()))), out
            out.append(dec.decode(sock.recv()))
        return out
    finally:
        sock.close()


def cut(replies: list[NodeReply], k: int, first: GenerateRequest) -> GenerateRequest:
    """The request that resumes ``first`` after its first ``k`` chunks, as the router
    builds it."""
    p = Progress(MigrationPolicy())
    for m in replies[:k]:
        assert isinstance(m, TokenChunk)
        p.on_chunk(m.token_ids, m.text)
    nxt = p.resume(first, f"{first.request_id}.m1")
    assert not isinstance(nxt, str)
    return nxt


@pytest.mark.parametrize("sampling", [
    SamplingParams(max_tokens=24, ignore_eos=True),
    SamplingParams(max_tokens=24, temperature=1.0, top_k=40, seed=7, presence_penalty=0.5,
                   frequency_penalty=0.3, repetition_penalty=1.2, min_tokens=20, logprobs=2),
], ids=["greedy", "seeded-penalties"])
@pytest.mark.parametrize("text", [False, True], ids=["ids", "text"])
def test_a_resumed_request_continues_the_stream_exactly(shared_node, sampling, text):
    """Cut at the first, a middle and the last chunk: the resumed run streams exactly the
    rest (tokens, text, logprobs' tokens), and its usage is the whole request's."""
    first = (GenerateRequest("mig-t", prompt="w5 w9 w12 w7 w30", sampling=sampling) if text
             else GenerateRequest("mig-i", prompt_token_ids=prompt(9, salt=41), sampling=sampling))
    whole = raw(shared_node, first)
    chunks, fin = whole[:-1], whole[-1]
    assert isinstance(fin, Finished) and len(chunks) >= 3, whole
    for k in (1, len(chunks) // 2, len(chunks) - 1):
        rest = raw(shared_node, cut(whole, k, first))
        assert isinstance(rest[-1], Finished), rest
        got = [t for m in rest[:-1] for t in m.token_ids]  # type: ignore[union-attr]
        assert got == [t for m in chunks[k:] for t in m.token_ids], k
        assert "".join(m.text for m in rest[:-1]) == "".join(  # type: ignore[union-attr]
            m.text for m in chunks[k:]), k
        if sampling.logprobs is not None:
            lps = [lp.token_id for m in rest[:-1] for lp in m.logprobs]  # type: ignore[union-attr]
            assert lps == got
        assert rest[-1].reason == fin.reason
        assert rest[-1].usage.prompt_tokens == fin.usage.prompt_tokens
        assert rest[-1].usage.completion_tokens == fin.usage.completion_tokens == len(
            [t for m in chunks for t in m.token_ids])


def test_a_request_resumed_past_its_end_finishes_at_once(shared_node):
    """Its node died between the last token and the Finished: the next node only finishes
    it (EOS streamed: stop; max_tokens streamed: length)."""
    eos = GenerateRequest("mig-e", prompt_token_ids=[5, 6], sampling=SamplingParams(max_tokens=9),
                          resume=Resume([7, 2]))  # the tiny models' EOS is 2
    [fin] = raw(shared_node, eos)
    assert isinstance(fin, Finished) and fin.reason == "stop"
    assert (fin.usage.prompt_tokens, fin.usage.completion_tokens) == (2, 2)
    full = GenerateRequest("mig-l", prompt_token_ids=[5, 6],
                           sampling=SamplingParams(max_tokens=2), resume=Resume([7, 8]))
    [fin] = raw(shared_node, full)
    assert isinstance(fin, Finished) and fin.reason == "length"


# ------------------------------------------------------------------ behind a router


@pytest.fixture(scope="module")
def cluster(chat_llama, tmp_path_factory):
    """A prefiller and two decoders (processes); a router in this process over them."""
    tmp = tmp_path_factory.mktemp("migration")
    p_addr, p = node("prefill", chat_llama, tmp, "--num-pages", "512", "--max-model-len",
                     str(MAX_LEN))
    decoders = dict(node("decode", chat_llama, tmp, "--num-pages", "1024", "--prefill-peer",
                         p_addr, "--heartbeat", "0.2", "--max-model-len", str(MAX_LEN))
                    for _ in range(2))
    with running([p, *decoders.values()], list(decoders)):
        lt = LoopThread()
        r, gw = lt.run(start_router(f"tcp://127.0.0.1:{free_port()}", list(decoders),
                                    "127.0.0.1:0", str(chat_llama), "tiny-llama",
                                    poll_interval=0.2, dead_after=1.5, wait_for_peer=30))
        r.gateway = gw
        wait_for(lambda: len(r.balancer.alive()) == 2, what="both decoders live")
        try:
            yield lt, r, decoders, p_addr
        finally:
            lt.run(gw.stop())
            lt.run(r.stop())
            lt.close()


def workload(n: int) -> list[list[int]]:
    return [prompt(3 + (i * 5) % 23, salt=900 + i) for i in range(n)]


def stream_outcomes(addr: str, prompts: list[list[int]]
                    ) -> list[tuple[list[int], str, Finished | Error]]:
    """Every prompt at once through ``addr``: each stream's tokens, text and its end, a
    Finished or the Error it ended with."""

    async def run() -> list[tuple[list[int], str, Finished | Error]]:
        client = AsyncClient(addr)

        async def one(ids: list[int]) -> tuple[list[int], str, Finished | Error]:
            out: list[int] = []
            text = ""
            try:
                async for m in client.generate(prompt_token_ids=ids, timeout=180,
                                               sampling=SamplingParams(max_tokens=NEW,
                                                                       ignore_eos=True)):
                    if isinstance(m, TokenChunk):
                        out += m.token_ids
                        text += m.text
                    else:
                        return out, text, m
            except RequestError as e:
                return out, text, e.error
            raise AssertionError("no Finished")

        try:
            return list(await asyncio.gather(*[one(ids) for ids in prompts]))
        finally:
            await client.close()

    return asyncio.run(run())


def stream_all(addr: str, prompts: list[list[int]]) -> list[tuple[list[int], str, Finished]]:
    """Every prompt at once through ``addr``: each stream's tokens, text and Finished."""
    got = stream_outcomes(addr, prompts)
    for _, _, end in got:
        assert isinstance(end, Finished), end
    return got  # type: ignore[return-value]


async def streaming_on(r: Router, peer: str, tokens: int) -> int:
    """Requests on ``peer`` that streamed at least ``tokens`` tokens (read on the router's
    loop)."""
    return sum(f.peer == peer and f.progress.streamed >= tokens for f in r.flights.values())


def moved(r: Router, outcome: str) -> float:
    return r.moved.labels(outcome)._value.get()


def kill_when_streaming(lt: LoopThread, r: Router, prompts: list[list[int]], kill) -> tuple[
        list[tuple[list[int], str, Finished]], str, int]:
    """Stream ``prompts`` through the router; once a quarter of them stream on one decoder
    (4 tokens or more each), ``kill(that decoder)``. Returns the streams, the decoder and how
    many requests were streaming on it."""
    import threading

    result: list[tuple[list[int], str, Finished]] = []
    t = threading.Thread(target=lambda: result.extend(stream_all(r.address, prompts)))
    t.start()
    want = max(2, len(prompts) // 4)
    deadline = time.monotonic() + 120
    victim, on_victim = None, 0
    while victim is None:
        assert time.monotonic() < deadline and t.is_alive(), "no decoder ever streamed"
        for peer in r.balancer.order:
            n = lt.run(streaming_on(r, peer, 4))
            if n >= want:
                victim, on_victim = peer, n
                break
        time.sleep(0.02)
    kill(victim)
    t.join(240)
    assert not t.is_alive() and len(result) == len(prompts)
    assert lt.run(in_flight(r)) == {a: 0 for a in r.balancer.peers}  # every move accounted
    return result, victim, on_victim


async def in_flight(r: Router) -> dict[str, int]:
    return {a: p.in_flight for a, p in r.balancer.peers.items()}


def check(result, reference) -> None:
    for (out, text, fin), (ref, ref_text, _) in zip(result, reference, strict=True):
        assert fin.reason == "length" and fin.usage.completion_tokens == NEW, fin
        assert out == ref  # no token lost, none repeated
        assert text == ref_text


def test_streams_of_a_restarting_decoder_move_to_the_other(cluster):
    """An executor of a decoder is killed mid-stream: that node ends its requests
    ``internal`` and restarts in place; the router moves each to the other decoder from the
    exact token."""
    lt, r, decoders, _ = cluster
    prompts = workload(8)
    reference = stream_all(r.address, prompts)  # uninterrupted
    before = moved(r, "moved")

    ready = {a: starts(p) for a, p in decoders.items()}
    result, victim, n = kill_when_streaming(lt, r, prompts, kill_executor_of(decoders))
    check(result, reference)
    assert moved(r, "moved") - before >= n >= 2
    restarted(r, decoders, victim, ready[victim])


def kill_executor_of(decoders):
    def kill(peer: str) -> None:
        [executor] = decoders[peer].children()
        os.kill(executor, signal.SIGKILL)
    return kill


def starts(proc) -> int:
    return proc.log_path.read_text().count("ready: ")


def restarted(r: Router, decoders, victim: str, before: int) -> None:
    """Wait until ``victim`` started again (``before``: its starts until its executor was
    killed) and the router sends it requests again."""
    wait_for(lambda: starts(decoders[victim]) > before, timeout=90, what=f"{victim} restarted")
    wait_for(lambda: len(r.balancer.serving()) == 2, timeout=90, what=f"{victim} serving again")


def test_http_choices_with_stop_strings_and_logprobs_survive_a_restart(cluster):
    """Through the router's OpenAI gateway: completions with n=2 seeded choices, logprobs and
    a stop string met mid-output, while a decoder restarts under them: every response (text,
    logprobs, finish reasons, usage) equal to the same request's uninterrupted one."""
    import threading

    import openai

    lt, r, decoders, _ = cluster
    client = openai.OpenAI(base_url=r.gateway.url + "/v1", api_key="unused", max_retries=0,
                           timeout=120)

    def ask(i: int, stop: list[str] | None) -> dict:
        out = client.completions.create(
            model="tiny-llama", prompt=" ".join(f"w{5 + (i * 7 + j) % 200}" for j in range(6)),
            max_tokens=NEW, n=2, seed=11 + i, temperature=0.8, logprobs=1, stop=stop,
            extra_body={"ignore_eos": True})
        return {"choices": [(c.index, c.text, c.finish_reason, c.logprobs.tokens)
                            for c in sorted(out.choices, key=lambda c: c.index)],
                "usage": (out.usage.prompt_tokens, out.usage.completion_tokens)}

    whole = [ask(i, None) for i in range(6)]
    # a stop string met mid-output of choice 0: the word at a third of its text
    stops = [[w["choices"][0][1].split()[len(w["choices"][0][1].split()) // 3]] for w in whole]
    reference = [ask(i, stops[i]) for i in range(6)]
    assert all(ref["choices"][0][2] == "stop" for ref in reference)
    before = moved(r, "moved")
    got: list[dict | Exception | None] = [None] * 6

    def one(i: int) -> None:
        try:
            got[i] = ask(i, stops[i])
        except openai.APIError as e:  # compared below: none is expected
            got[i] = e

    threads = [threading.Thread(target=one, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    victim = None
    while victim is None:
        assert time.monotonic() < deadline, "no decoder ever streamed"
        for peer in r.balancer.order:
            if lt.run(streaming_on(r, peer, 3)) >= 2:
                victim = peer
                break
        time.sleep(0.01)
    ready = starts(decoders[victim])
    kill_executor_of(decoders)(victim)
    for t in threads:
        t.join(120)
    assert got == reference
    assert moved(r, "moved") > before
    restarted(r, decoders, victim, ready)


async def streamed_on(r: Router, peer: str) -> int:
    """Requests on ``peer`` that streamed a token (read on the router's loop)."""
    return sum(f.peer == peer and f.streamed for f in r.flights.values())


def test_a_stream_past_the_migration_limit_ends_unavailable_and_is_counted(cluster):
    """A router with ``--migration-limit 0`` over the same decoders: a decoder's executor is
    killed mid-stream; every request that decoder held ends ``unavailable`` naming the bound
    (not the node's ``internal``), each counted ``refused``, none moved; the others finish."""
    import threading

    lt, main, decoders, _ = cluster
    r, _ = lt.run(start_router(f"tcp://127.0.0.1:{free_port()}", list(decoders),
                               poll_interval=0.2, dead_after=1.5, wait_for_peer=30,
                               migration=MigrationPolicy(limit=0)))
    try:
        wait_for(lambda: len(r.balancer.alive()) == 2, what="both decoders live")
        prompts = workload(8)
        result: list[tuple[list[int], str, Finished | Error]] = []
        t = threading.Thread(target=lambda: result.extend(stream_outcomes(r.address, prompts)))
        t.start()
        deadline = time.monotonic() + 120
        victim = None
        while victim is None:
            assert time.monotonic() < deadline and t.is_alive(), "no decoder ever streamed"
            for peer in r.balancer.order:  # Progress counts nothing while migration is off
                if lt.run(streamed_on(r, peer)) >= 2:
                    victim = peer
                    break
            time.sleep(0.02)
        ready = starts(decoders[victim])
        kill_executor_of(decoders)(victim)
        t.join(240)
        assert not t.is_alive() and len(result) == len(prompts)
        refused = [end for _, _, end in result if isinstance(end, Error)]
        assert len(refused) >= 2, result
        for end in refused:
            assert end.code == "unavailable", end
            assert end.message.startswith(f"decode node {victim} ended it"), end.message
            assert end.message.endswith("the request was not moved: migration is off "
                                        "(--migration-limit 0)"), end.message
        for out, _, end in result:
            if isinstance(end, Finished):
                assert end.reason == "length" and len(out) == NEW, end
        assert moved(r, "refused") == len(refused) and moved(r, "moved") == 0
        assert lt.run(in_flight(r)) == {a: 0 for a in r.balancer.peers}
    finally:
        lt.run(r.stop())
    restarted(main, decoders, victim, ready)


def test_streams_of_a_killed_decoder_finish_on_the_other_exactly(cluster):
    """A decoder SIGKILLed while streaming: every request completes, each stream's text and
    tokens equal to an uninterrupted greedy run (no token lost or repeated); the survivor
    and the prefiller end with every page free."""
    lt, r, decoders, p_addr = cluster
    prompts = workload(REQUESTS)
    t0 = time.monotonic()
    reference = stream_all(r.address, prompts)
    uninterrupted_s = time.monotonic() - t0
    before = moved(r, "moved")

    def kill_node(peer: str) -> None:
        proc = decoders[peer]
        kids = proc.children()
        proc.proc.send_signal(signal.SIGKILL)
        for k in kids:
            os.kill(k, signal.SIGKILL)

    t0 = time.monotonic()
    result, victim, n = kill_when_streaming(lt, r, prompts, kill_node)
    killed_s = time.monotonic() - t0
    check(result, reference)
    assert moved(r, "moved") - before >= n >= 2
    assert moved(r, "refused") == 0
    survivor = next(a for a in decoders if a != victim)
    for addr in (survivor, p_addr):
        wait_for(lambda a=addr: pools_full(a), what=f"full pool on {addr}")
    print(f"\nmigration: {len(prompts)}/{len(prompts)} complete and exact; {n} streaming on "
          f"the killed decoder, {moved(r, 'moved') - before:.0f} moved; uninterrupted "
          f"{uninterrupted_s:.1f} s, with the kill {killed_s:.1f} s")
