"""Prefill and decode nodes as real processes, KV over libfabric on loopback (tcp and shm)."""

from __future__ import annotations

import asyncio
import time

import msgspec
import pytest

from disagg.client import AsyncClient, Client
from disagg.llm import LLM
from disagg.model.loader import load_model
from disagg.protocol import Finished, SamplingParams
from disagg.serving.routing import ROUTE_BLOCK_BYTES
from nodes import PAGE, node, pools_full, prompt, running, stats, tokens, wait_for
from tinymodels import free_port, hf_greedy, make_tiny_model, node_pid, tree_cpu_s

pytestmark = pytest.mark.fabric

LENGTHS = [1, 2, PAGE - 1, PAGE, PAGE + 1, 6 * PAGE - 1]
NEW = 6


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model("llama", tmp_path_factory.mktemp("disagg") / "llama")


@pytest.fixture(scope="module", params=["tcp", "shm"])
def cluster(request, model_dir, tmp_path_factory):
    """One prefiller (small step budget: prompts split into chunks) and two decoders; over
    shm the decoders overlap their decode steps (--overlap-schedule on)."""
    tmp = tmp_path_factory.mktemp(f"cluster-{request.param}")
    fabric = ["--fabric-provider", request.param]
    p_addr, p = node("prefill", model_dir, tmp, "--num-pages", "96", "--max-batch-tokens", "7",
                     *fabric)
    overlap = ["--overlap-schedule", "on" if request.param == "shm" else "off"]
    decoders = [node("decode", model_dir, tmp, "--num-pages", "128", "--prefill-peer", p_addr,
                     "--heartbeat", "0.2", *fabric, *overlap) for _ in range(2)]
    with running([p] + [d for _, d in decoders], [a for a, _ in decoders]):
        yield p_addr, [a for a, _ in decoders]


def greedy(n: int = NEW) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True)


def test_disaggregated_greedy_matches_transformers(cluster, model_dir):
    p_addr, (d_addr, _) = cluster
    before = stats(d_addr).kv_units_received
    client = Client(d_addr)
    try:
        for n in LENGTHS:
            ids = []
            for msg in client.generate(prompt_token_ids=prompt(n), sampling=greedy()):
                ids += getattr(msg, "token_ids", [])
            assert ids == hf_greedy(model_dir, prompt(n), NEW), f"prompt length {n}"
            assert isinstance(msg, Finished)
            if n == 1:
                assert msg.timings is None  # prefilled locally
            else:  # the TTFT breakdown of a remote prefill
                assert msg.timings is not None
                t = msg.timings
                assert {"decode_queue", "kv_wait", "first_step", "wake_up"} <= t.keys()
                if "exposed_transfer" in t:  # the PrefillDone came before the Finished
                    # one clock on one host: the parts of what the split added add up to it
                    parts = ("decode_queue", "request_trip", "prefill_queue",
                             "transfer_tail", "completion_signal", "wake_up")
                    assert sum(t[k] for k in parts) == pytest.approx(
                        t["exposed_transfer"], abs=0.01)
                # the signal may beat the prefiller's own completion event: not clipped
                assert all(v >= 0 for k, v in t.items() if k != "completion_signal")
    finally:
        client.close()
    # every prompt longer than one token came through the prefiller: 2 layers x pages + context
    expected = sum(2 * -(-(n - 1) // PAGE) + 1 for n in LENGTHS if n > 1)
    assert stats(d_addr).kv_units_received - before == expected
    assert stats(p_addr).kv_writes_sent > 0


def test_64_concurrent_requests_two_decoders(cluster, model_dir, request):
    p_addr, decoders = cluster
    lengths = [1 + (i * 7) % 29 for i in range(64)]
    prompts = [prompt(n, salt=i) for i, n in enumerate(lengths)]
    llm = LLM(load_model(model_dir, "float32"), num_pages=512, page_size=PAGE)
    expected = [o.token_ids for o in llm.generate(prompts, greedy())]

    async def run() -> list[list[int]]:
        clients = [AsyncClient(a) for a in decoders]
        try:
            outs = await asyncio.gather(*[
                clients[i % 2].complete(prompt_token_ids=p, sampling=greedy(), timeout=120)
                for i, p in enumerate(prompts)])
            return [ids for ids, _, _ in outs]
        finally:
            for c in clients:
                await c.close()

    assert asyncio.run(run()) == expected
    for addr in [p_addr, *decoders]:
        wait_for(lambda a=addr: pools_full(a), what=f"full pool on {addr}")
        s = stats(addr)
        assert s.started == s.finished + s.aborted + s.errored
        assert s.errored == 0
    overlapped = [stats(a).steps_overlapped for a in decoders]
    on = request.node.callspec.params["cluster"] == "shm"  # the decoders' --overlap-schedule
    assert all(overlapped) if on else not any(overlapped)


def test_bad_peer_frames_do_not_stop_the_prefiller(cluster):
    import msgspec
    import zmq

    p_addr, (d_addr, _) = cluster
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 5000)  # deliver before close
    sock.connect(p_addr)
    sock.send(b"\x00garbage")
    sock.send(msgspec.msgpack.encode({"type": "prefill", "request_id": "x"}))
    sock.close()
    ctx.term()
    wait_for(lambda: stats(p_addr).bad_frames >= 2, what="bad frames counted")
    client = Client(d_addr)
    try:
        msgs = list(client.generate(prompt_token_ids=prompt(9), sampling=greedy(2)))
    finally:
        client.close()
    assert msgs[-1].reason == "length"


def test_a_prefill_node_answers_a_clients_ping_and_refuses_its_requests(cluster, capsys):
    """A client pointed at a prefill node gets a Pong to its ping (disagg-client's first
    contact) and bad_request naming the node's role for a generate or abort, at once; each is
    counted in bad_frames (a frame the peer socket does not serve), none logged as garbage."""
    from disagg.cli.client import main
    from disagg.client import RequestError
    from disagg.protocol import Abort, Error, NodeReply

    p_addr, _ = cluster
    bad_frames = stats(p_addr).bad_frames
    role = "this is a prefill node: send requests to a decode or mixed node"
    client = Client(p_addr)
    try:
        with pytest.raises(RequestError) as e:
            list(client.generate(prompt="hi", request_id="r1", timeout=10))
        assert e.value.error == Error("bad_request", role, "r1")
        assert client.ping(timeout=10).draining is False
        client.sock.send(msgspec.msgpack.encode(Abort("r1")))
        assert client.sock.poll(10_000)
        reply = msgspec.msgpack.decode(client.sock.recv(), type=NodeReply)
        assert reply == Error("bad_request", f"abort of 'r1' not taken: {role}")
    finally:
        client.close()
    with pytest.raises(SystemExit) as exit_:
        main(["--connect", p_addr, "--prompt", "hi", "--timeout", "10"])
    assert exit_.value.code == 1
    assert capsys.readouterr().err == f"disagg-client: bad_request: {role}\n"
    # frames it does not serve, counted like a decoder's garbage (answered, not logged):
    # generate, ping and abort above, then the command line's ping and generate
    assert stats(p_addr).bad_frames == bad_frames + 5


def test_short_prompts_prefill_locally_and_no_prefiller_means_local(cluster, model_dir, tmp_path,
                                                                    request):
    p_addr, _ = cluster
    fabric = ["--fabric-provider", request.node.callspec.params["cluster"]]
    dead = f"tcp://127.0.0.1:{free_port()}"  # nobody listens here
    d_addr, d = node("decode", model_dir, tmp_path, "--num-pages", "64", "--prefill-peer", p_addr,
                     "--local-prefill-max-tokens", "8", "--heartbeat", "0.2", *fabric)
    lone_addr, lone = node("decode", model_dir, tmp_path, "--num-pages", "64", "--prefill-peer",
                           dead, "--heartbeat", "0.2", *fabric)
    with running([d, lone], [d_addr]):
        for addr, n, remote in [(d_addr, 9, False), (d_addr, 10, True), (lone_addr, 20, False)]:
            before = stats(addr).kv_units_received
            assert tokens(addr, prompt(n), NEW) == hf_greedy(model_dir, prompt(n), NEW)
            assert (stats(addr).kv_units_received > before) == remote, (addr, n)
        assert stats(lone_addr).prefill_peers_alive == 0


def test_decoder_with_another_transport_refuses_the_prefiller(cluster, model_dir, tmp_path, request):
    p_addr, _ = cluster
    other = "shm" if request.node.callspec.params["cluster"] == "tcp" else "tcp"
    d_addr, d = node("decode", model_dir, tmp_path, "--num-pages", "64", "--prefill-peer", p_addr,
                     "--heartbeat", "0.2", "--fabric-provider", other)
    with running([d]):  # served, but prefilled locally: the prefiller is never counted alive
        assert tokens(d_addr, prompt(9), NEW) == hf_greedy(model_dir, prompt(9), NEW)
        s = stats(d_addr)
        assert s.prefill_peers_alive == 0 and s.kv_units_received == 0
    assert "transport mismatch" in d.log_path.read_text()


def test_writes_striped_over_several_lanes(model_dir, tmp_path):
    """A prefiller with two fabric lanes feeding a decoder with three, runs cut to single pages
    (--fabric-stripe-bytes 1): token-exact, one write per page per layer plus the context."""
    from tinymodels import TINY

    p_addr, p = node("prefill", model_dir, tmp_path, "--num-pages", "64", "--max-batch-tokens",
                     "7", "--fabric-lanes", "2", "--fabric-stripe-bytes", "1")
    d_addr, d = node("decode", model_dir, tmp_path, "--num-pages", "64", "--prefill-peer", p_addr,
                     "--heartbeat", "0.2", "--fabric-lanes", "3")
    with running([p, d], [d_addr]):
        for n in (PAGE + 1, 6 * PAGE - 1):
            before = stats(p_addr).kv_writes_sent
            assert tokens(d_addr, prompt(n), NEW) == hf_greedy(model_dir, prompt(n), NEW)
            pages = -(-(n - 1) // PAGE)  # the prompt but its last token is prefilled remotely
            assert stats(p_addr).kv_writes_sent - before == TINY["num_hidden_layers"] * pages + 1
        # the same prompt extended: the decoder holds its full pages (skip_pages), the lanes
        # carry only the pages after them
        longer = prompt(6 * PAGE - 1) + prompt(2 * PAGE, salt=71)
        before = stats(p_addr).kv_writes_sent
        assert tokens(d_addr, longer, NEW) == hf_greedy(model_dir, longer, NEW)
        held = (6 * PAGE - 1) // PAGE
        pages = -(-(len(longer) - 1) // PAGE) - held
        assert stats(p_addr).kv_writes_sent - before == TINY["num_hidden_layers"] * pages + 1
        for addr in (p_addr, d_addr):
            wait_for(lambda a=addr: pools_full(a), what=f"full pool on {addr}")


def test_a_conversation_across_the_split_moves_only_the_uncached_pages(cluster, model_dir):
    """Each turn resends the conversation to a decoder: the pages it holds in its prefix cache
    (the earlier prompt and answer) are not written again; tokens stay equal to
    transformers'."""
    _, (_, d_addr) = cluster
    history = prompt(3 * PAGE + 2, salt=777)
    client = Client(d_addr)
    try:
        for turn in range(3):
            before = stats(d_addr).kv_units_received
            ids: list[int] = []
            for msg in client.generate(prompt_token_ids=history, sampling=greedy()):
                ids += getattr(msg, "token_ids", [])
            assert isinstance(msg, Finished)
            assert ids == hf_greedy(model_dir, history, NEW), f"turn {turn}"
            held = msg.usage.cached_tokens // PAGE  # pages the decoder had cached
            written = -(-(len(history) - 1) // PAGE) - held
            assert stats(d_addr).kv_units_received - before == 2 * written + 1  # layers x pages
            if turn:
                assert held >= 3  # at least the previous turn's full prompt pages
            history = history + ids + prompt(2, salt=900 + turn)
    finally:
        client.close()
    wait_for(lambda: pools_full(d_addr), what="decoder pool full")


def test_a_prefiller_ships_pages_from_its_own_cache_to_a_decoder_that_lacks_them(cluster,
                                                                                model_dir):
    """Decoder A's prompt leaves its pages in the prefiller's cache; decoder B (which never
    saw it) sends the same conversation on: the prefiller computes only the new pages and
    writes the cached ones at once, every page B needs lands, tokens equal transformers'."""
    p_addr, (a_addr, b_addr) = cluster
    base = prompt(4 * PAGE + 1, salt=555)
    assert tokens(a_addr, base, NEW) == hf_greedy(model_dir, base, NEW)
    hit = stats(p_addr).prefix_hit_tokens
    before = stats(b_addr).kv_units_received
    longer = base + prompt(PAGE + 2, salt=556)
    client = Client(b_addr)
    try:
        ids: list[int] = []
        for msg in client.generate(prompt_token_ids=longer, sampling=greedy()):
            ids += getattr(msg, "token_ids", [])
    finally:
        client.close()
    assert ids == hf_greedy(model_dir, longer, NEW)
    prefiller_hit = stats(p_addr).prefix_hit_tokens - hit
    assert prefiller_hit >= 4 * PAGE  # base's full pages, cached
    # the prefiller's hit is in the request's usage though B held none of it
    assert isinstance(msg, Finished) and msg.usage.cached_tokens == prefiller_hit
    # B held nothing: every page of the prompt (all but its last token) was written
    assert stats(b_addr).kv_units_received - before == 2 * -(-(len(longer) - 1) // PAGE) + 1
    for addr in (p_addr, a_addr, b_addr):
        wait_for(lambda a=addr: pools_full(a), what=f"full pool on {addr}")


def test_a_decoder_sends_a_conversations_turns_to_the_prefiller_holding_it(model_dir, tmp_path):
    """Two prefillers: each turn of one conversation goes to the prefiller that prefilled the
    previous turns (its prefix cache holds them), token-exact."""
    p1_addr, p1 = node("prefill", model_dir, tmp_path, "--num-pages", "64")
    p2_addr, p2 = node("prefill", model_dir, tmp_path, "--num-pages", "64")
    d_addr, d = node("decode", model_dir, tmp_path, "--num-pages", "96", "--prefill-peer",
                     p1_addr, "--prefill-peer", p2_addr, "--heartbeat", "0.2")
    with running([p1, p2, d], [d_addr], prefillers=2):
        # the decoder's routing keys cover its prompts' msgpack in blocks of bytes: two of them
        n = next(n for n in range(ROUTE_BLOCK_BYTES // 3, 512)
                 if len(msgspec.msgpack.encode(prompt(n, salt=31))) >= 2 * ROUTE_BLOCK_BYTES + 3)
        history = prompt(n, salt=31)
        for turn in range(3):
            out = tokens(d_addr, history, NEW)
            assert out == hf_greedy(model_dir, history, NEW), f"turn {turn}"
            history = history + out + prompt(5, salt=40 + turn)
        started = sorted(stats(a).started for a in (p1_addr, p2_addr))
        assert started == [0, 3]  # every turn on the same prefiller


def test_fabric_endpoints_bound_to_their_hosts_addresses(model_dir, tmp_path):
    """``--fabric-address``: a prefiller's endpoint on 127.0.0.2 writes into a decoder's on
    127.0.0.3 (distinct loopback addresses acting as hosts); each advertises its own."""
    import asyncio

    from disagg.fabric import make_backend

    async def bound(address: str) -> bytes:
        engine = make_backend("fabric", "tcp", address=address).start()
        try:
            return bytes(engine.address)
        finally:
            await engine.close()

    assert bytes([127, 0, 0, 2]) in asyncio.run(bound("127.0.0.2"))[:8]
    p_addr, p = node("prefill", model_dir, tmp_path, "--num-pages", "64",
                     "--fabric-address", "127.0.0.2")
    d_addr, d = node("decode", model_dir, tmp_path, "--num-pages", "64", "--prefill-peer", p_addr,
                     "--heartbeat", "0.2", "--fabric-address", "127.0.0.3")
    with running([p, d], [d_addr]):
        n = 3 * PAGE + 1
        assert tokens(d_addr, prompt(n, salt=8), NEW) == hf_greedy(model_dir, prompt(n, salt=8),
                                                                   NEW)
        assert stats(d_addr).kv_units_received > 0
        for addr in (p_addr, d_addr):
            wait_for(lambda a=addr: pools_full(a), what=f"full pool on {addr}")


def test_idle_nodes_leave_the_cores_alone(cluster):
    """No process busy-waits while idle: over 4 s with no request, a prefill node and a
    decode node (their messengers, schedulers, fabric progress and executors) use a small
    fraction of one core each (a spinning loop would use most of one)."""
    p_addr, d_addrs = cluster
    pids = [node_pid(a) for a in (p_addr, *d_addrs)]
    time.sleep(0.5)
    before = [tree_cpu_s(p) for p in pids]
    time.sleep(4.0)
    used = [tree_cpu_s(p) - b for p, b in zip(pids, before, strict=True)]
    assert max(used) < 1.0, f"CPU seconds in 4 s idle: {used}"
