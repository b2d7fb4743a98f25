"""Security of the data plane with real processes (issue 22): a prefiller writes only into
memory the requesting decoder proved it owns, an endpoint that never answers starves nobody,
and a decoder steers away from a prefiller whose jobs time out."""

from __future__ import annotations

import socket
import threading
import time

import msgspec
import pytest
import zmq

from disagg.fabric.descriptor import decode_descriptor
from disagg.protocol.peer import ChallengeAnswer, Ping, Pong, PrefillFailed
from nodes import PAGE, Req, node, pools_full, prompt, running, stats, wait_for
from tinymodels import free_port, hf_greedy, make_tiny_model

pytestmark = pytest.mark.fabric

ENC = msgspec.msgpack.Encoder()
NOT_OWNED = "not owned by the requester"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model("llama", tmp_path_factory.mktemp("dataplane") / "llama")


class FakePrefiller:
    """A ROUTER a decoder takes for a prefiller: it answers Pings with the real prefiller's
    Pong (same layout and transport, nothing queued) and keeps every PrefillRequest it gets;
    ``refuse``: answers them ``overloaded`` at once, else never (its jobs time out)."""

    def __init__(self, real: str, refuse: bool):
        self.addr = f"tcp://127.0.0.1:{free_port()}"
        self.refuse = refuse
        self.requests: list[dict] = []
        self.ctx = zmq.Context()
        probe = self.ctx.socket(zmq.DEALER)
        probe.connect(real)
        probe.send(ENC.encode(Ping(0)))
        assert probe.poll(30000), "the real prefiller did not answer a Ping"
        self.pong = msgspec.msgpack.decode(probe.recv(), type=Pong)
        probe.close(0)
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.bind(self.addr)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.stop.is_set():
            if not self.sock.poll(100):
                continue
            peer, data = self.sock.recv_multipart()
            msg = msgspec.msgpack.decode(data)
            if msg.get("type") == "ping":
                pong = msgspec.structs.replace(self.pong, seq=msg["seq"])
                self.sock.send_multipart([peer, ENC.encode(pong)])
            elif msg.get("type") == "prefill":
                self.requests.append(msg)
                if self.refuse:
                    self.sock.send_multipart([peer, ENC.encode(PrefillFailed(
                        msg["request_id"], "overloaded", "fake"))])

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        self.sock.close(0)
        self.ctx.term()


def attack(p_addr: str, frames: list[bytes], wait_s: float = 30.0) -> list[dict]:
    """Send these PrefillRequests from a fresh DEALER; the replies about them that came within
    wait_s. A Challenge is answered with a guess (zeros): the attacker cannot read the nonce."""
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.connect(p_addr)
    try:
        for f in frames:
            s.send(f)
        replies: list[dict] = []
        deadline = time.monotonic() + wait_s
        while len(replies) < len(frames) and s.poll(max(1, int((deadline - time.monotonic()) * 1000))):
            msg = msgspec.msgpack.decode(s.recv())
            if msg["type"] == "challenge":
                s.send(ENC.encode(ChallengeAnswer(msg["id"], bytes(16 * msg["lanes"]))))
            else:
                replies.append(msg)
        return replies
    finally:
        s.close(0)
        ctx.term()


def captured_request(model_dir, fake: FakePrefiller, d_addr: str) -> dict:
    """A real PrefillRequest of the victim decoder, as a peer it talks to saw it (the leak an
    attacker needs: its descriptors)."""
    for i in range(40):
        if fake.requests:
            return fake.requests[0]
        Req(d_addr, prompt(9, salt=100 + i), max_tokens=1).join()
    raise AssertionError("the decoder never sent the fake prefiller a request")


@pytest.fixture(scope="module")
def victim(model_dir, tmp_path_factory):
    """A prefiller, a decoder using it and a fake prefiller that refuses (to capture one of
    the decoder's PrefillRequests), local prefill on failure."""
    tmp = tmp_path_factory.mktemp("victim")
    p_addr, p = node("prefill", model_dir, tmp, "--num-pages", "160", "--max-batch-tokens", "16",
                     "--ownership-timeout", "1")
    with running([p]):
        fake = FakePrefiller(p_addr, refuse=True)
        d_addr, d = node("decode", model_dir, tmp, "--num-pages", "128", "--prefill-peer", p_addr,
                         "--prefill-peer", fake.addr, "--heartbeat", "0.2",
                         "--on-prefill-failure", "local")
        try:
            with running([d], [d_addr], prefillers=2):
                yield p_addr, d_addr, captured_request(model_dir, fake, d_addr)
        finally:
            fake.close()


def test_a_peer_naming_a_live_decoders_memory_is_refused_and_the_victims_are_unharmed(
        victim, model_dir):
    p_addr, d_addr, req = victim
    ids = [prompt(13, salt=i) for i in range(6)]
    want = [hf_greedy(model_dir, x, 120) for x in ids]
    victims = [Req(d_addr, x, max_tokens=120) for x in ids]

    def live() -> bool:  # holding pages on the decoder: decoding, or their KV on its way
        s = stats(d_addr)
        return s.running + s.waiting_for_kv >= 3

    wait_for(live, what="victims live")
    # every page of the victim decoder, with the attacker's own prompt
    forged = [ENC.encode({**req, "request_id": f"evil{i}", "key": 12345 + i,
                          "prompt_ids": prompt(128 * PAGE - 1, salt=7 + i),
                          "dst_pages": list(range(128))}) for i in range(4)]
    replies = attack(p_addr, forged)
    assert [r["type"] for r in replies] == ["prefill_failed"] * 4
    assert all(r["code"] == "bad_request" and NOT_OWNED in r["message"] for r in replies)
    assert [v.join().tokens for v in victims] == want
    assert stats(p_addr).kv_writes_sent > 0  # the victims were prefilled there
    wait_for(lambda: pools_full(p_addr) and pools_full(d_addr), what="pools full")


def test_an_endpoint_that_never_answers_starves_nobody(victim, model_dir):
    """260 requests naming a TCP listener that accepts and never answers: none takes a job
    slot or a page; the legitimate requests meanwhile finish token-exact."""
    p_addr, d_addr, req = victim
    hole = socket.socket()
    hole.bind(("127.0.0.1", 0))
    hole.listen(1024)
    try:
        def moved(encoded: bytes) -> bytes:
            d = decode_descriptor(encoded)
            assert len(d.address) == 16  # sockaddr_in: family, port, address, zeros
            addr = d.address[:2] + hole.getsockname()[1].to_bytes(2, "big") + d.address[4:]
            return msgspec.structs.replace(d, address=addr, handle=b"").encode()

        evil = {**req, "dst_kv": moved(req["dst_kv"]), "dst_ctx": moved(req["dst_ctx"]),
                "dst_kv_ranks": [moved(x) for x in req["dst_kv_ranks"]]}
        flood = [ENC.encode({**evil, "request_id": f"hole{i}", "key": 999 + i})
                 for i in range(260)]
        replies: list[dict] = []
        t = threading.Thread(target=lambda: replies.extend(attack(p_addr, flood)), daemon=True)
        t.start()
        ids = [prompt(17, salt=50 + i) for i in range(6)]
        legit = [Req(d_addr, x, max_tokens=4) for x in ids]
        assert [r.join().tokens for r in legit] == [hf_greedy(model_dir, x, 4) for x in ids]
        assert all(r.code is None for r in legit)
        t.join(60)
        assert len(replies) == 260
        assert {r["code"] for r in replies} <= {"bad_request", "overloaded"}
        assert sum(NOT_OWNED in r["message"] for r in replies) >= 1
        assert stats(p_addr).kv_units_received == 0
        wait_for(lambda: pools_full(p_addr), what="prefiller pool full")
    finally:
        hole.close()


def test_the_decoder_prefers_a_healthy_prefiller_to_one_whose_jobs_time_out(model_dir,
                                                                            tmp_path):
    p_addr, p = node("prefill", model_dir, tmp_path, "--num-pages", "64")
    with running([p]):
        fake = FakePrefiller(p_addr, refuse=False)  # answers Pings, never prefills
        d_addr, d = node("decode", model_dir, tmp_path, "--num-pages", "64", "--prefill-peer",
                         p_addr, "--prefill-peer", fake.addr, "--heartbeat", "0.2",
                         "--prefill-timeout", "1", "--on-prefill-failure", "local")
        try:
            with running([d], [d_addr], prefillers=2):
                i = 0
                while len(fake.requests) < 2:  # ties are broken at random
                    Req(d_addr, prompt(9, salt=i), max_tokens=2).join()
                    i += 1
                    assert i < 40, "the fake prefiller was never chosen"
                seen = len(fake.requests)
                ids = [prompt(9, salt=200 + j) for j in range(5)]  # well within the 10 s back-off
                outs = [Req(d_addr, x, max_tokens=2).join() for x in ids]
                assert [r.tokens for r in outs] == [hf_greedy(model_dir, x, 2) for x in ids]
                assert len(fake.requests) == seen  # all went to the healthy prefiller
        finally:
            fake.close()
