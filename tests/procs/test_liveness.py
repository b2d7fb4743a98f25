"""Liveness under abuse: one client must never hang, stall or fail another (issue: liveness).

Each test reproduces a finding against real node processes: pipelined floods that used to
deadlock the frontend and the scheduler (and a prefill node's messenger and scheduler), a
cancel burst, one client queueing 20,000 requests while another is served, clients that
vanish without aborting, a slow reader whose replies used to be dropped past the socket's
high-water mark, the decode node's remote queue that nobody pumped after the last step, a
queue deadline, and a 10 MB prompt during remote prefills."""

from __future__ import annotations

import threading
import time

import msgspec
import pytest
import zmq

from disagg.client import Client
from disagg.protocol import (
    Abort,
    Error,
    Finished,
    GenerateRequest,
    NodeReply,
    SamplingParams,
    Stats,
    StatsRequest,
)
from disagg.protocol.peer import (
    AbortPrefill,
    KVLayoutDesc,
    PeerReply,
    Ping,
    Pong,
    PrefillFailed,
    PrefillRequest,
)
from nodes import Req, node, pools_full, prompt, running, stats, tokens, wait_for
from tinymodels import add_word_tokenizer, make_tiny_model

ENC = msgspec.msgpack.Encoder()
DEC = msgspec.msgpack.Decoder(NodeReply)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = make_tiny_model("llama", tmp_path_factory.mktemp("liveness") / "llama")
    add_word_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def mixed(model_dir, tmp_path_factory):
    addr, proc = node("mixed", model_dir, tmp_path_factory.mktemp("liveness-mixed"),
                      "--num-pages", "512", "--max-model-len", "256",
                      "--max-requests-per-client", "8192", "--overlap-schedule", "on")
    with running([proc]):
        yield addr


def dealer(addr: str) -> tuple[zmq.Context, zmq.Socket]:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.connect(addr)
    return ctx, sock


def gen(rid: str, ids: list[int], max_tokens: int = 4) -> bytes:
    return ENC.encode(GenerateRequest(rid, prompt_token_ids=ids,
                                      sampling=SamplingParams(max_tokens=max_tokens,
                                                              ignore_eos=True)))


def read_all(sock: zmq.Socket, quiet_ms: int = 2000) -> list[NodeReply]:
    """Every reply until none has come for ``quiet_ms``."""
    out = []
    while sock.poll(quiet_ms):
        out.append(DEC.decode(sock.recv()))
    return out


def is_terminal(m: NodeReply) -> bool:
    return isinstance(m, Finished) or (isinstance(m, Error) and m.request_id is not None)


def read_until(sock: zmq.Socket, terminals: int = 0, want_stats: bool = False,
               timeout: float = 120.0) -> list[NodeReply]:
    """Replies until ``terminals`` terminal ones (and, with ``want_stats``, a Stats) came."""
    out: list[NodeReply] = []
    seen, got_stats = 0, False
    deadline = time.monotonic() + timeout
    while seen < terminals or (want_stats and not got_stats):
        assert time.monotonic() < deadline, f"only {len(out)} replies in {timeout}s"
        if sock.poll(1000):
            out.append(DEC.decode(sock.recv()))
            seen += is_terminal(out[-1])
            got_stats |= isinstance(out[-1], Stats)
    return out


def terminal(msgs: list[NodeReply]) -> dict[str, NodeReply]:
    return {m.request_id: m for m in msgs if is_terminal(m)}


def serves(addr: str) -> list[int]:
    return tokens(addr, [5, 6, 7], 3, timeout=60)


# ------------------------------------------------------------------ floods (finding 1)


@pytest.mark.parametrize("kind", ["stats", "duplicates", "aborts"])
def test_a_pipelined_flood_from_one_client_hangs_nobody(mixed, kind):
    """10,000 frames that each get a reply, sent without reading: the node keeps serving
    others, and the flooding client itself once it reads again."""
    ctx, sock = dealer(mixed)
    try:
        if kind == "duplicates":
            sock.send(gen("dup", prompt(8), max_tokens=200))
        frame = {"stats": ENC.encode(StatsRequest()), "duplicates": gen("dup", prompt(8)),
                 "aborts": ENC.encode(Abort("nobody"))}[kind]
        for _ in range(10_000):
            sock.send(frame)
        assert serves(mixed) == serves(mixed)  # another client, served meanwhile
        replies = read_all(sock)
        assert replies, "the flooding client got nothing back"
        codes = {m.code for m in replies if isinstance(m, Error)}
        expected = {"stats": set(), "duplicates": {"duplicate_request"},
                    "aborts": {"unknown_request"}}[kind]
        assert expected <= codes <= expected | {"overloaded"}
        sock.send(ENC.encode(StatsRequest()))  # reading again: served again
        assert isinstance(read_until(sock, want_stats=True)[-1], Stats)
    finally:
        sock.close()
        ctx.term()
    wait_for(lambda: pools_full(mixed), what="pool full")


def test_a_cancel_burst_of_5000_queued_requests(mixed):
    """A legitimate client cancelling 5,000 requests at once: every one ends, pool full."""
    ctx, sock = dealer(mixed)
    n = 5000
    try:
        for i in range(n):
            sock.send(gen(f"r{i}", prompt(6, salt=i), max_tokens=100))
        for i in range(n):
            sock.send(ENC.encode(Abort(f"r{i}")))
        ends = terminal(read_until(sock, terminals=n))
    finally:
        sock.close()
        ctx.term()
    assert set(ends) == {f"r{i}" for i in range(n)}
    assert all(isinstance(m, Finished) for m in ends.values())
    assert sum(m.reason == "abort" for m in ends.values()) > n // 2
    wait_for(lambda: pools_full(mixed), what="pool full")


def test_one_client_queueing_20000_requests_does_not_delay_another(mixed):
    """Round robin over clients: a second client's request finishes while most of the
    flooding client's requests have not even started (FIFO served it after all of them).
    The per-client bound refuses what is past it with ``overloaded``."""
    ctx, sock = dealer(mixed)
    sent = threading.Event()
    got: list[NodeReply] = []
    n = 20_000

    # Encoded before the first send, so the flood arrives as one burst: a sender slower than
    # the node (a loaded machine) would leave no backlog for the other client to wait behind.
    frames = [gen(f"f{i}", prompt(3, salt=i), max_tokens=2) for i in range(n)]

    def flood() -> None:
        for frame in frames:
            sock.send(frame)
        sent.set()
        got.extend(read_until(sock, terminals=n, timeout=300))

    t = threading.Thread(target=flood, daemon=True)
    try:
        at_start = stats(mixed)
        before = at_start.finished
        t.start()
        assert sent.wait(60)
        # A cumulative counter: a momentary "running > 0" can be missed between two polls.
        wait_for(lambda: stats(mixed).started > at_start.started, what="the flood started")
        assert tokens(mixed, prompt(5, salt=99), 4) == tokens(mixed, prompt(5, salt=99), 4)
        done_meanwhile = stats(mixed).finished - before - 1
        t.join(320)
        assert not t.is_alive()
    finally:
        sock.close()
        ctx.term()
    ends = terminal(got)
    admitted = [m for m in ends.values() if isinstance(m, Finished)]
    refused = [m for m in ends.values() if isinstance(m, Error)]
    assert len(admitted) + len(refused) == n
    assert {m.code for m in refused} == {"overloaded"} and len(admitted) >= 8192
    assert done_meanwhile < len(admitted) // 2, "the other client waited behind the flood"
    wait_for(lambda: pools_full(mixed), what="pool full")


# ------------------------------------------------------------------ clients that go away


def test_clients_that_disconnect_without_aborting_have_their_requests_aborted(mixed):
    before = stats(mixed)
    socks = []
    for i in range(50):
        ctx, sock = dealer(mixed)
        sock.send(gen(f"gone{i}", prompt(6, salt=i), max_tokens=240))
        socks.append((ctx, sock))
    wait_for(lambda: stats(mixed).started - before.started == 50, what="all admitted")
    for ctx, sock in socks:
        sock.close()
        ctx.term()
    wait_for(lambda: stats(mixed).aborted - before.aborted == 50, what="50 aborted")
    after = stats(mixed)
    assert after.finished == before.finished  # none ran to completion
    wait_for(lambda: pools_full(mixed), what="pool full")


def test_a_slow_reader_gets_every_terminal_reply(mixed):
    """Replies past the socket's high-water mark wait for the reader instead of vanishing."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVHWM, 10)  # a small receive queue: the node's side fills up
    sock.connect(mixed)
    n = 300
    before = stats(mixed).finished
    try:
        for i in range(n):
            sock.send(gen(f"s{i}", prompt(4, salt=i), max_tokens=8))  # ~2,700 replies
        wait_for(lambda: stats(mixed).finished - before == n, timeout=120, what="all computed")
        ends = terminal(read_until(sock, terminals=n, timeout=60))
    finally:
        sock.close()
        ctx.term()
    assert len(ends) == n and all(isinstance(m, Finished) and m.reason == "length"
                                  for m in ends.values())


# ------------------------------------------------------------------ prefill + decode pair


@pytest.fixture(scope="module")
def pair(model_dir, tmp_path_factory):
    """A prefiller whose steps are slow (16-token chunks, 1 s each: a 180-token prompt takes
    twelve) and a decoder with a 48-page pool, short liveness deadlines and an 8 s queue
    timeout."""
    pytest.importorskip("disagg.fabric._libfabric_cffi")
    tmp = tmp_path_factory.mktemp("liveness-pair")
    p_addr, prefill = node("prefill", model_dir, tmp, "--num-pages", "256",
                           "--max-batch-tokens", "16", env={"DISAGG_TEST_LAYER_DELAY_S": "0.5"})
    d_addr, decode = node("decode", model_dir, tmp, "--prefill-peer", p_addr,
                          "--num-pages", "48", "--heartbeat", "0.2", "--peer-timeout", "1",
                          "--queue-timeout", "8", "--prefill-timeout", "30")
    with running([prefill, decode], decoders=[d_addr]):
        yield p_addr, d_addr


def test_a_remote_prefill_waiting_for_pages_starts_when_the_last_request_ends(pair):
    """48 pages of 4 tokens: A (20-token prompt, 170 out) runs; B (100 tokens), sent once A
    holds 26 pages, needs pages only A's end frees, and after A's last step nothing used to
    pump the remote queue."""
    _, dec = pair
    a = Req(dec, prompt(20), max_tokens=170, timeout=90)
    wait_for(lambda: len(a.tokens) >= 85, what="A holding 26 pages")  # 22 free, B needs 25
    b = Req(dec, prompt(100, salt=1), max_tokens=4, timeout=60)
    a.join()
    b.join()
    assert a.reason == "length" and len(a.tokens) == 170
    assert b.code is None and b.reason == "length" and len(b.tokens) == 4
    wait_for(lambda: pools_full(dec), what="decoder pool full")


def test_a_queued_request_ends_with_timeout_at_its_deadline(pair):
    _, dec = pair
    a = Req(dec, prompt(180, salt=2), max_tokens=4, timeout=90)  # 45 of 48 pages, for ~12 s
    wait_for(lambda: stats(dec).waiting_for_kv == 1, what="A waiting for its KV")
    b = Req(dec, prompt(100, salt=3), max_tokens=4, timeout=60)  # no room until A ends
    b.join()
    assert b.code == "timeout"
    a.join()
    assert a.code is None and a.reason == "length"
    wait_for(lambda: pools_full(dec), what="decoder pool full")


def test_a_10mb_prompt_during_remote_prefills_stalls_nobody(pair):
    """Refused from its size alone (no tokenizing on the event loop): the prefiller is
    never missed for a heartbeat, so the remote prefills in flight finish."""
    _, dec = pair
    big = "w7 " * ((10 << 20) // 3)
    remote = [Req(dec, prompt(30, salt=10 + i), max_tokens=4, timeout=60) for i in range(3)]
    wait_for(lambda: stats(dec).waiting_for_kv > 0, what="remote prefills in flight")
    codes = []
    for _ in range(3):
        c = Client(dec)
        try:
            list(c.generate(prompt=big, sampling=SamplingParams(max_tokens=1), timeout=60))
        except Exception as e:  # noqa: BLE001 - the error code is what we check
            codes.append(getattr(getattr(e, "error", None), "code", repr(e)))
        finally:
            c.close()
    for r in remote:
        r.join()
    assert codes == ["bad_request"] * 3
    assert [r.code for r in remote] == [None] * 3
    assert all(len(r.tokens) == 4 for r in remote)
    assert stats(dec).prefill_peers_alive == 1
    wait_for(lambda: pools_full(dec), what="decoder pool full")


def peer_frame(kind: str, i: int) -> bytes:
    """One frame a decoder could send a prefiller; every one of them gets a reply."""
    if kind == "stats":
        return ENC.encode(StatsRequest())
    if kind == "aborts":
        return ENC.encode(AbortPrefill(f"nobody-{i}"))
    layout = KVLayoutDesc(num_layers=2, num_pages=48, num_kv_heads=2, page_size=4, head_dim=16,
                          dtype="float32", element_size=4, hidden_size=64)
    return ENC.encode(PrefillRequest(  # refused: its descriptors do not decode
        request_id="dup", key=1, prompt_ids=[5, 6, 7], dst_pages=[0], dst_layout=layout,
        dst_kv=b"junk", dst_ctx=b"junk", ctx_offset=0, timeout_s=5.0))


@pytest.mark.parametrize("kind", ["stats", "aborts", "requests"])
def test_a_pipelined_flood_on_the_prefillers_peer_socket(pair, kind):
    """10,000 frames on the prefiller's peer socket, unread (6,000 Stats used to deadlock its
    messenger and scheduler): the decoder's remote prefills keep working."""
    pre, dec = pair
    ctx, sock = dealer(pre)
    try:
        for i in range(10_000):
            sock.send(peer_frame(kind, i))
        r = Req(dec, prompt(30, salt=20), max_tokens=4, timeout=60)
        r.join()
        assert r.code is None and len(r.tokens) == 4
        assert stats(pre).pages_free == stats(pre).pages_total
    finally:
        sock.close()
        ctx.term()
    wait_for(lambda: pools_full(dec), what="decoder pool full")
    assert stats(dec).pages_fenced == 0


@pytest.mark.parametrize("bad_id", [320, -1])  # the tiny model's vocabulary: 320
def test_a_prefill_request_with_an_id_outside_the_vocabulary_is_refused_by_name(pair, bad_id):
    """A prefiller checks a request's ids while it decodes them; one outside the vocabulary
    gets the same refusal as before (after the plain decode), an in-vocabulary request with
    junk descriptors gets past the ids to the descriptor check."""
    pre, _ = pair
    ctx, sock = dealer(pre)
    try:
        sock.send(ENC.encode(Ping(1)))
        assert sock.poll(10_000)
        pong = msgspec.msgpack.decode(sock.recv(), type=PeerReply)
        assert isinstance(pong, Pong)
        replies = {}
        for rid, ids in (("bad", [5, bad_id, 7]), ("good", [5, 6, 7])):
            sock.send(ENC.encode(PrefillRequest(
                request_id=rid, key=1, prompt_ids=ids, dst_pages=[0], dst_layout=pong.layout,
                dst_kv=b"junk", dst_ctx=b"junk", ctx_offset=0, timeout_s=5.0)))
            assert sock.poll(10_000)
            replies[rid] = msgspec.msgpack.decode(sock.recv(), type=PeerReply)
    finally:
        sock.close()
        ctx.term()
    bad, good = replies["bad"], replies["good"]
    assert isinstance(bad, PrefillFailed) and bad.request_id == "bad" and bad.code == "bad_request"
    assert bad.message == "token id outside the vocabulary", bad
    assert isinstance(good, PrefillFailed) and "descriptor" in good.message, good
