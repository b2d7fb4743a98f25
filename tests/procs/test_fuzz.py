"""Malformed frames on every listening socket (hypothesis): the client socket (a node's ROUTER),
a prefill node's peer socket (ROUTER) and the executor control link (the main process's ROUTER
on ``ipc://``, and the executor process behind it). A few hundred cases per socket in the
default suite, 10,000 under ``-m slow``. Afterwards the node still serves a valid request and
has counted exactly the frames that do not decode."""

from __future__ import annotations

import asyncio

import msgspec
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from disagg.client import Client
from disagg.protocol import ClientMessage, SamplingParams
from disagg.protocol.executor import SeqChunk, StepPlan
from disagg.protocol.peer import PeerRequest
from nodes import PAGE, pools_full, stats, wait_for
from tinymodels import TINY, NodeProcess, add_word_tokenizer, free_port, make_tiny_model

VOCAB = TINY["vocab_size"]
MAX_LEN = 64
FAST, FULL = 200, 10_000

I64 = st.integers(min_value=-(2**63), max_value=2**63 - 1)
WILD_INT = st.one_of(st.integers(-3, 400), I64, st.integers(2**63, 2**64 - 1))
SCALAR = st.one_of(st.none(), st.booleans(), WILD_INT, st.floats(), st.text(max_size=12),
                   st.binary(max_size=12))
ANY = st.recursive(SCALAR, lambda c: st.one_of(
    st.lists(c, max_size=4), st.dictionaries(st.text(max_size=8), c, max_size=4)), max_leaves=16)


def packed(obj_strategy: st.SearchStrategy) -> st.SearchStrategy[list[bytes]]:
    return obj_strategy.map(lambda o: [msgspec.msgpack.encode(o)])


def frames_of(shaped: st.SearchStrategy) -> st.SearchStrategy[list[bytes]]:
    """Random bytes, msgpack of random shapes, multi-frame messages, and ``shaped`` (valid
    messages with out-of-range fields)."""
    return st.one_of(
        st.binary(max_size=200).map(lambda b: [b]),
        packed(ANY),
        st.lists(st.binary(max_size=40), min_size=2, max_size=4),
        packed(shaped),
        packed(shaped),
    )


SAMPLING = st.fixed_dictionaries({}, optional={
    "max_tokens": st.integers(-5, 2**40), "temperature": st.floats(), "top_k": WILD_INT,
    "top_p": st.floats(), "seed": st.one_of(st.none(), WILD_INT),
    "stop_token_ids": st.lists(WILD_INT, max_size=3), "ignore_eos": SCALAR,
    "min_tokens": WILD_INT, "bogus": SCALAR})
CLIENT_MSG = st.fixed_dictionaries(
    {"type": st.sampled_from(["generate", "abort", "stats", "teleport", "", "GENERATE"])},
    optional={"request_id": st.one_of(st.text(max_size=300), WILD_INT),
              "prompt": st.one_of(st.none(), st.text(max_size=40)),
              "prompt_token_ids": st.one_of(st.none(), st.lists(WILD_INT, max_size=MAX_LEN + 4)),
              "sampling": st.one_of(SAMPLING, SCALAR), "v": WILD_INT, "extra": SCALAR})


def decodes(frames: list[bytes], decoder: msgspec.msgpack.Decoder) -> bool:
    if len(frames) != 1:
        return False
    try:
        decoder.decode(frames[0])
    except (msgspec.DecodeError, msgspec.ValidationError):
        return False
    return True


def fuzz_socket(addr: str, frames: st.SearchStrategy[list[bytes]],
                decoder: msgspec.msgpack.Decoder, n: int) -> int:
    """Send ``n`` fuzzed messages from one DEALER; returns how many must count as bad frames."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 5000)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.connect(addr)
    bad = 0

    @settings(max_examples=n, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(frames)
    def one(msg: list[bytes]) -> None:
        nonlocal bad
        bad += not decodes(msg, decoder)
        sock.send_multipart(msg)
        while sock.poll(0):  # drain replies as we go
            sock.recv_multipart()

    try:
        one()
    finally:
        sock.close()
        ctx.term()
    return bad


# ------------------------------------------------------------------ client socket (mixed node)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = make_tiny_model("llama", tmp_path_factory.mktemp("fuzz") / "llama")
    add_word_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def mixed(model_dir, tmp_path_factory):
    addr = f"tcp://127.0.0.1:{free_port()}"
    proc = NodeProcess(["--role", "mixed", "--model", str(model_dir), "--listen", addr,
                        "--page-size", str(PAGE), "--num-pages", "64", "--max-model-len",
                        str(MAX_LEN), "--threads", "1"],
                       tmp_path_factory.mktemp("fuzz-mixed") / "node.log")
    try:
        proc.wait_ready()
        yield addr
    finally:
        assert proc.stop() == []


def still_serves(addr: str) -> None:
    c = Client(addr)
    try:
        msgs = list(c.generate(prompt_token_ids=[5, 6, 7], timeout=60,
                               sampling=SamplingParams(max_tokens=2, ignore_eos=True)))
    finally:
        c.close()
    assert msgs[-1].reason == "length"


def check_client_fuzz(addr: str, n: int) -> None:
    before = stats(addr).bad_frames
    bad = fuzz_socket(addr, frames_of(CLIENT_MSG), msgspec.msgpack.Decoder(ClientMessage), n)
    assert bad > 0
    wait_for(lambda: stats(addr).bad_frames - before == bad, what=f"{bad} bad frames counted")
    still_serves(addr)
    wait_for(lambda: pools_full(addr), timeout=300, what="accepted fuzz requests ended")
    s = stats(addr)
    assert s.started == s.finished + s.aborted + s.errored


def test_fuzz_client_socket(mixed):
    check_client_fuzz(mixed, FAST)


@pytest.mark.slow
def test_fuzz_client_socket_10k(mixed):
    check_client_fuzz(mixed, FULL)


# ------------------------------------------------------------------ peer socket (prefill node)


@pytest.fixture(scope="module")
def prefiller(model_dir, tmp_path_factory):
    pytest.importorskip("disagg.fabric._libfabric_cffi")
    addr = f"tcp://127.0.0.1:{free_port()}"
    proc = NodeProcess(["--role", "prefill", "--model", str(model_dir), "--listen", addr,
                        "--page-size", str(PAGE), "--num-pages", "64", "--threads", "1"],
                       tmp_path_factory.mktemp("fuzz-prefill") / "node.log")
    try:
        proc.wait_ready()
        yield addr
    finally:
        assert proc.stop() == []


def layout_dicts() -> st.SearchStrategy:
    """The prefiller's real layout (tiny llama, page 4, float32) with one field perturbed,
    or random values."""
    real = {"num_layers": TINY["num_hidden_layers"], "num_pages": 64,
            "num_kv_heads": TINY["num_key_value_heads"], "page_size": PAGE,
            "head_dim": TINY["hidden_size"] // TINY["num_attention_heads"], "dtype": "float32",
            "element_size": 4, "hidden_size": TINY["hidden_size"]}
    perturbed = st.tuples(st.sampled_from(sorted(real)), WILD_INT).map(
        lambda kv: {**real, kv[0]: kv[1]})
    return st.one_of(st.just(real), perturbed, st.dictionaries(st.text(max_size=8), SCALAR))


PEER_MSG = st.one_of(
    st.fixed_dictionaries({"type": st.just("prefill")}, optional={
        "request_id": st.one_of(st.text(max_size=20), WILD_INT), "key": WILD_INT,
        "prompt_ids": st.lists(WILD_INT, max_size=40), "dst_pages": st.lists(WILD_INT, max_size=12),
        "dst_layout": layout_dicts(), "dst_kv": st.one_of(st.binary(max_size=64), SCALAR),
        "dst_ctx": st.binary(max_size=64), "ctx_offset": WILD_INT,
        "timeout_s": st.one_of(st.floats(), WILD_INT), "v": WILD_INT}),
    st.fixed_dictionaries({"type": st.sampled_from(["abort_prefill", "ping", "stats", "pong",
                                                    "prefill_done", "x"])},
                          optional={"request_id": SCALAR, "seq": WILD_INT, "extra": SCALAR}),
)


def check_peer_fuzz(addr: str, n: int) -> None:
    before = stats(addr).bad_frames
    bad = fuzz_socket(addr, frames_of(PEER_MSG), msgspec.msgpack.Decoder(PeerRequest), n)
    assert bad > 0
    wait_for(lambda: stats(addr).bad_frames - before == bad, what=f"{bad} bad frames counted")
    wait_for(lambda: pools_full(addr), what="no fuzzed prefill holds pages")
    s = stats(addr)
    assert s.started == s.finished + s.aborted + s.errored and s.kv_writes_sent == 0


def test_fuzz_peer_socket(prefiller):
    check_peer_fuzz(prefiller, FAST)


@pytest.mark.slow
def test_fuzz_peer_socket_10k(prefiller):
    check_peer_fuzz(prefiller, FULL)


# ------------------------------------------------------------------ executor link (in-process)


@pytest.fixture(scope="module")
def executors(model_dir, tmp_path_factory):
    """A real executor process behind an in-process ``ExecutorGroup`` (the main process's
    side of the ``ipc://`` control link)."""
    import zmq.asyncio

    from disagg.actors.executor.executor_group import ExecutorGroup
    from disagg.config import CacheConfig, ExecutorConfig, NodeConfig

    cfg = NodeConfig(executor=ExecutorConfig(model=str(model_dir), threads=1),
                     cache=CacheConfig(page_size=PAGE, num_pages=32),
                     run_dir=str(tmp_path_factory.mktemp("fuzz-exec")))
    loop = asyncio.new_event_loop()
    ctx = zmq.asyncio.Context()
    group = ExecutorGroup(cfg, str(cfg.run_dir), ctx)
    loop.run_until_complete(group.start())
    try:
        yield loop, group
    finally:
        loop.run_until_complete(group.stop())
        ctx.destroy(linger=0)
        loop.close()


CHUNK = st.builds(
    SeqChunk, slot=WILD_INT, token_ids=st.lists(st.one_of(st.integers(-2, VOCAB + 2), I64),
                                                max_size=12),
    start_pos=st.one_of(st.integers(-2, 40), I64),
    block_table=st.lists(st.one_of(st.integers(-2, 34), I64), max_size=12), sample=st.booleans(),
    want_hidden=st.booleans(), temperature=st.floats(), top_k=st.one_of(st.integers(-2, 400), I64),
    top_p=st.floats(), seed=I64, output_index=I64)
PLAN = st.builds(StepPlan, step_id=st.integers(0, 2**62), chunks=st.lists(CHUNK, max_size=4),
                 num_decodes=st.integers(-2, 6), counter_base=I64)
VALID = StepPlan(1, [SeqChunk(0, [5, 6, 7], 0, [0], True)], 0)


def check_executor_fuzz(executors, n: int) -> None:
    loop, group = executors

    @settings(max_examples=n, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(PLAN)
    def one(plan: StepPlan) -> None:
        result, _ = loop.run_until_complete(group.step(plan))
        assert result.step_id == plan.step_id
        # a plan that touches the cache out of bounds is refused, never run
        if result.error is None:
            assert all(0 <= p < 32 for c in plan.chunks for p in c.block_table)
            assert all(0 <= t < VOCAB for c in plan.chunks for t in c.token_ids)

    one()
    result, _ = loop.run_until_complete(group.step(VALID))
    assert result.error is None and len(result.token_ids) == 1
    assert all(p.poll() is None for p in group.procs)


def test_fuzz_executor_plans(executors):
    check_executor_fuzz(executors, FAST)


@pytest.mark.slow
def test_fuzz_executor_plans_10k(executors):
    check_executor_fuzz(executors, FULL)


def test_garbage_on_the_executor_control_socket(executors):
    loop, group = executors
    ctx = zmq.Context()
    intruder = ctx.socket(zmq.DEALER)
    intruder.setsockopt(zmq.LINGER, 1000)
    intruder.connect(group.control)
    try:
        # a forged result with two tokens: taken as the step's, the step would yield two
        for frames in ([b"\xc1junk"], [b"a", b"b", b"c"],
                       [msgspec.msgpack.encode(["result", VALID.step_id, [1, 1]])]):
            seen = group.bad_frames + group.foreign_frames
            intruder.send_multipart(frames)
            for _ in range(200):  # steps until the group has read the intruder's frame
                result, _ = loop.run_until_complete(group.step(VALID))
                assert result.error is None and len(result.token_ids) == 1
                if group.bad_frames + group.foreign_frames > seen:
                    break
            assert group.bad_frames + group.foreign_frames == seen + 1
    finally:
        intruder.close()
        ctx.term()


def test_garbage_command_to_the_executor_process(model_dir, tmp_path):
    import zmq.asyncio

    from disagg.actors.executor.executor_group import ExecutorError, ExecutorGroup
    from disagg.config import CacheConfig, ExecutorConfig, NodeConfig

    cfg = NodeConfig(executor=ExecutorConfig(model=str(model_dir), threads=1),
                     cache=CacheConfig(page_size=PAGE, num_pages=32), run_dir=str(tmp_path))

    async def run() -> None:
        ctx = zmq.asyncio.Context()
        group = ExecutorGroup(cfg, str(tmp_path), ctx)
        await group.start()
        try:
            await group.sock.send_multipart([group._identities[0], b"\xc1junk"])
            try:
                result, _ = await group.step(VALID)
            except ExecutorError as e:
                raise AssertionError(f"the executor died: {e}") from e
            assert result.error is None
        finally:
            await group.stop()
            ctx.destroy(linger=0)

    asyncio.run(run())
