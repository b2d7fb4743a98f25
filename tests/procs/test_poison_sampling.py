"""One request whose sampling cannot work in float32 (``temperature=1e-45``, ``top_p=1e-300``)
sent over the raw protocol among 31 ordinary ones to a real node: it alone is refused; the
others finish with exactly the tokens they get without it."""

from __future__ import annotations

import msgspec
import pytest
import zmq

import nodes
from disagg.protocol import Error, Finished, TokenChunk

N = 32
POISON_AT = 13
MAX_TOKENS = 4


@pytest.fixture(scope="module")
def node(shared_node):
    """The shared mixed node (its default step budget takes all 32 prompts in one step)."""
    return shared_node


def ordinary(i: int) -> dict:
    """Greedy and seeded sampled requests, alternately."""
    sampling = {"max_tokens": MAX_TOKENS, "ignore_eos": True}
    if i % 2:
        sampling.update(temperature=0.8, top_k=50, top_p=0.9, seed=i)
    return {"type": "generate", "request_id": f"r{i}", "prompt_token_ids": nodes.prompt(6, i),
            "sampling": sampling}


def run_together(addr: str, frames: list[dict], timeout: float = 60.0) -> dict[str, tuple]:
    """Send every frame at once on one raw DEALER socket; request id -> (tokens, terminal)."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(addr)
    try:
        for f in frames:
            sock.send(msgspec.msgpack.encode(f))
        tokens: dict[str, list[int]] = {f["request_id"]: [] for f in frames}
        out: dict[str, tuple] = {}
        while len(out) < len(frames):
            assert sock.poll(int(timeout * 1000)), f"no reply; ended so far: {sorted(out)}"
            msg = msgspec.msgpack.decode(sock.recv(), type=TokenChunk | Finished | Error)
            assert msg.request_id is not None, msg
            if isinstance(msg, TokenChunk):
                tokens[msg.request_id] += msg.token_ids
            else:
                out[msg.request_id] = (tokens[msg.request_id], msg)
        return out
    finally:
        sock.close()
        ctx.term()


@pytest.fixture(scope="module")
def alone(node):
    """The 31 ordinary requests, concurrently, without the poison."""
    return run_together(node, [ordinary(i) for i in range(N) if i != POISON_AT])


@pytest.mark.parametrize("poison, field", [
    ({"temperature": 1e-45, "seed": 1}, "temperature"),
    ({"temperature": 1.0, "top_p": 1e-300, "seed": 1}, "top_p"),
])
def test_poison_request_fails_alone(node, alone, poison, field):
    frames = [ordinary(i) for i in range(N)]
    frames[POISON_AT]["sampling"].update(poison)
    before = nodes.stats(node)
    got = run_together(node, frames)
    bad = got.pop(f"r{POISON_AT}")[1]
    assert all(isinstance(t, Finished) and t.reason == "length" for _, t in alone.values())
    ended = {rid: terminal for rid, (_, terminal) in got.items()}
    assert all(isinstance(t, Finished) and t.reason == "length" for t in ended.values()), ended
    assert {rid: toks for rid, (toks, _) in got.items()} == {r: t for r, (t, _) in alone.items()}
    assert isinstance(bad, Error) and bad.code == "bad_request" and field in bad.message, bad
    after = nodes.stats(node)
    assert after.errored == before.errored and after.rejected == before.rejected + 1
    nodes.wait_for(lambda: nodes.pools_full(node), what="pools full")


@pytest.mark.parametrize("bad_id", [320, -1, 1 << 40])  # the tiny model's vocabulary: 320
def test_a_prompt_id_outside_the_vocabulary_is_named_and_fails_alone(node, alone, bad_id):
    frames = [ordinary(i) for i in range(N)]
    frames[POISON_AT]["prompt_token_ids"][3] = bad_id
    got = run_together(node, frames)
    bad = got.pop(f"r{POISON_AT}")[1]
    assert isinstance(bad, Error) and bad.code == "bad_request", bad
    assert f"token id {bad_id} is outside the vocabulary [0, 320)" in bad.message, bad
    assert {rid: toks for rid, (toks, _) in got.items()} == {r: t for r, (t, _) in alone.items()}
