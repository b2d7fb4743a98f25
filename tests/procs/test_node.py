"""A real mixed node process, driven through its ZeroMQ socket."""

from __future__ import annotations

import asyncio
import signal
import socket
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
import zmq

import nodes
from disagg.actors.executor.executor import cpu_threads
from disagg.client import AsyncClient, Client, RequestError
from disagg.config import ConfigError, check_devices
from disagg.protocol import Error, Finished, SamplingParams, Stats, TokenChunk
from disagg.serving.openai_logprobs import choice_seed
from tinymodels import NodeProcess, add_word_tokenizer, free_port, hf_greedy, make_tiny_model

PAGES = 48
MAX_LEN = 64


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = make_tiny_model("llama", tmp_path_factory.mktemp("node") / "llama")
    add_word_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def node(model_dir, tmp_path_factory):
    # overlapped decoding on (auto turns it on for CUDA only): every test here runs over it
    addr, proc = nodes.node("mixed", model_dir, tmp_path_factory.mktemp("log"), "--num-pages",
                            str(PAGES), "--max-model-len", str(MAX_LEN), "--max-batch-tokens", "16",
                            "--overlap-schedule", "on")
    with nodes.running([proc]):
        yield addr, proc


@pytest.fixture
def raw(node):
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(node[0])
    yield sock
    sock.close()
    ctx.term()


def reply(sock, timeout=30.0):
    assert sock.poll(int(timeout * 1000)), "no reply"
    return msgspec.msgpack.decode(sock.recv(), type=Error | Finished | TokenChunk | Stats)


def generate_frame(**fields):
    base = {"type": "generate", "request_id": "r", "prompt_token_ids": [5, 6, 7]}
    base.update(fields)
    return msgspec.msgpack.encode(base)


def test_greedy_over_the_socket_matches_transformers(node, model_dir):
    client = Client(node[0])
    prompt = [5, 17, 33, 101, 7, 9, 12]
    ids: list[int] = []
    for msg in client.generate(prompt_token_ids=prompt,
                               sampling=SamplingParams(max_tokens=8, ignore_eos=True)):
        if isinstance(msg, TokenChunk):
            ids.extend(msg.token_ids)
        else:
            assert msg.reason == "length" and msg.usage.completion_tokens == 8
    client.close()
    assert ids == hf_greedy(model_dir, prompt, 8)


def test_the_start_phases_are_logged_before_ready_and_kept_in_stats(node):
    lines = node[1].log_path.read_text().splitlines()
    ready = next(i for i, line in enumerate(lines) if "ready:" in line)
    (line,) = [x for x in lines[:ready] if "start phases:" in x]
    on_cpu = ["node_setup", "spawn", "imports", "cuda_init", "weights", "kv_alloc",
              "executor_wait", "node_actors"]  # (triton_warmup, kv_profile, ...: CUDA only)
    for name in on_cpu:
        assert f" {name} " in line, line
    phases = nodes.stats(node[0]).start_phases_s
    assert list(phases) == on_cpu
    assert all(s >= 0 for s in phases.values()) and phases["imports"] > 0


def test_overlapped_decode_steps_are_token_exact(node, model_dir):
    """Concurrent requests ending at different steps (lengths, a stop token) while the node
    launches each decode step before the previous one's tokens are back (aborts over it:
    test_duplicate_request_id_and_abort_frees_pages): greedy tokens equal transformers', steps
    went ahead, every page comes back."""
    before = nodes.stats(node[0]).steps_overlapped
    prompts = [nodes.prompt(n, salt=7) for n in (3, 9, 14, 5)]
    lengths = [10, 3, 12, 7]
    refs = [hf_greedy(model_dir, p, n) for p, n in zip(prompts, lengths, strict=True)]
    reqs = [nodes.Req(node[0], p, n) for p, n in zip(prompts, lengths, strict=True)]
    client = Client(node[0])
    stop = SamplingParams(max_tokens=12, ignore_eos=True, stop_token_ids=[refs[2][5]])
    ids = [t for m in client.generate(prompt_token_ids=prompts[2], sampling=stop)
           if isinstance(m, TokenChunk) for t in m.token_ids]
    client.close()
    assert ids == refs[2][:refs[2].index(refs[2][5]) + 1]
    assert [r.join().tokens for r in reqs] == refs
    assert nodes.stats(node[0]).steps_overlapped > before
    nodes.wait_for(lambda: nodes.pools_full(node[0]), what="every page free")


def test_a_conversation_reuses_cached_pages_token_exact(node, model_dir):
    """Each turn resends the conversation: later turns take the earlier prompt and answer
    from the prefix cache (usage.cached_tokens, Stats), tokens equal transformers', and every
    page is free (some cached) when idle."""
    client = Client(node[0])
    history = [5, 17, 33, 101, 7, 9, 12, 40, 41]
    before = client.stats()
    cached: list[int] = []
    for turn in range(3):
        ids: list[int] = []
        for msg in client.generate(prompt_token_ids=history,
                                   sampling=SamplingParams(max_tokens=5, ignore_eos=True)):
            if isinstance(msg, TokenChunk):
                ids.extend(msg.token_ids)
            else:
                cached.append(msg.usage.cached_tokens)
        assert ids == hf_greedy(model_dir, history, 5), f"turn {turn}"
        history = history + ids + [60 + turn, 61 + turn]
    after = client.stats()
    client.close()
    assert cached[1] >= 8 and cached[2] > cached[1]  # whole 4-token pages of the last turn
    assert after.prefix_hit_tokens - before.prefix_hit_tokens == sum(cached)
    assert after.pages_free == after.pages_total and after.pages_cached > 0


def test_text_prompt_streams_text(node):
    client = Client(node[0])
    chunks = list(client.generate(prompt="w5 w17 w33", sampling=SamplingParams(max_tokens=4,
                                                                               ignore_eos=True)))
    client.close()
    text = "".join(c.text for c in chunks if isinstance(c, TokenChunk))
    assert text.strip() and all(w.startswith("w") for w in text.split())
    assert isinstance(chunks[-1], Finished) and chunks[-1].usage.prompt_tokens == 3


@pytest.mark.parametrize(
    "frame, code",
    [
        (b"\xc1\xff garbage", "bad_frame"),
        (msgspec.msgpack.encode([1, 2, 3]), "bad_frame"),
        (msgspec.msgpack.encode({"type": "teleport", "request_id": "x"}), "bad_frame"),
        (generate_frame(request_id=7), "bad_frame"),
        (generate_frame(prompt_token_ids=[]), "bad_request"),
        (generate_frame(prompt_token_ids=None, prompt=""), "bad_request"),
        (generate_frame(prompt="w1", prompt_token_ids=[1]), "bad_request"),
        (generate_frame(prompt_token_ids=list(range(3, 3 + MAX_LEN))), "bad_request"),
        (generate_frame(sampling={"max_tokens": 0}), "bad_request"),
        (generate_frame(sampling={"max_tokens": -5}), "bad_request"),
        (generate_frame(sampling={"temperature": -1.0}), "bad_request"),
        (generate_frame(prompt_token_ids=[5, 320]), "bad_request"),
        (generate_frame(prompt_token_ids=[-1]), "bad_request"),
        (generate_frame(request_id=""), "bad_request"),
    ],
)
def test_bad_input_gets_error_and_node_keeps_serving(node, raw, frame, code):
    raw.send(frame)
    msg = reply(raw)
    assert isinstance(msg, Error) and msg.code == code, msg
    raw.send(generate_frame(request_id="ok", sampling={"max_tokens": 2, "ignore_eos": True}))
    msgs = [reply(raw), reply(raw), reply(raw)]
    assert isinstance(msgs[-1], Finished) and msgs[-1].reason == "length"


def test_multi_frame_message_rejected(node, raw):
    raw.send_multipart([b"a", b"b"])
    msg = reply(raw)
    assert isinstance(msg, Error) and msg.code == "bad_frame"


def test_duplicate_request_id_and_abort_frees_pages(node, raw):
    long = {"max_tokens": 50, "ignore_eos": True}
    raw.send(generate_frame(request_id="dup", sampling=long))
    first = reply(raw)
    assert isinstance(first, TokenChunk)
    raw.send(generate_frame(request_id="dup", sampling=long))
    raw.send(msgspec.msgpack.encode({"type": "abort", "request_id": "dup"}))
    seen = []
    while True:
        msg = reply(raw)
        seen.append(msg)
        if isinstance(msg, Finished):
            break
    errors = [m for m in seen if isinstance(m, Error)]
    assert [e.code for e in errors] == ["duplicate_request"]
    assert seen[-1].reason == "abort" and seen[-1].usage.completion_tokens < 50
    raw.send(msgspec.msgpack.encode({"type": "stats"}))
    stats = reply(raw)
    assert isinstance(stats, Stats)
    assert stats.pages_free == stats.pages_total == PAGES
    assert stats.running == stats.waiting == 0
    assert stats.started == stats.finished + stats.aborted + stats.errored
    assert stats.aborted >= 1 and stats.rejected >= 1


def test_abort_unknown_request(node, raw):
    raw.send(msgspec.msgpack.encode({"type": "abort", "request_id": "never"}))
    msg = reply(raw)
    assert isinstance(msg, Error) and msg.code == "unknown_request"


def test_client_error_raises(node):
    client = Client(node[0])
    with pytest.raises(RequestError, match="max_tokens"):
        list(client.generate(prompt_token_ids=[1], sampling=SamplingParams(max_tokens=0)))
    client.close()


def test_client_choices_one_prefill_each_seeded_like_its_own_request(node):
    """``n`` through the Python clients: choice j draws what one request seeded
    ``choice_seed(seed, j)`` draws; choice 0 goes first, the others take its prompt's pages
    from the prefix cache; the sync client fans out the same; a refusal raises."""
    prompt = list(range(3, 43))  # 40 tokens: whole pages for the later choices to reuse
    sp = SamplingParams(max_tokens=6, temperature=1.0, seed=77, ignore_eos=True)

    async def run():
        client = AsyncClient(node[0])
        try:
            firsts = [j async for j, _ in client.choices(3, prompt_token_ids=prompt,
                                                          sampling=sp, cache_salt="async")]
            got = await client.complete_choices(3, prompt_token_ids=prompt, sampling=sp,
                                                cache_salt="async-2")
            singles = [await client.complete(
                prompt_token_ids=prompt, cache_salt=f"single-{j}",
                sampling=msgspec.structs.replace(sp, seed=choice_seed(77, j)))
                for j in range(3)]
            with pytest.raises(RequestError, match="outside the vocabulary"):
                await client.complete_choices(2, prompt_token_ids=[10**6], sampling=sp)
            return firsts, got, singles
        finally:
            await client.close()

    firsts, got, singles = asyncio.run(run())
    assert firsts[0] == 0 and sorted(set(firsts)) == [0, 1, 2]
    assert [ids for ids, _, _ in got] == [ids for ids, _, _ in singles]
    assert len({tuple(ids) for ids, _, _ in got}) > 1  # the choices differ
    usage = [fin.usage for _, _, fin in got]
    assert usage[0].cached_tokens == 0 and all(u.cached_tokens >= 32 for u in usage[1:])
    client = Client(node[0])
    try:
        ids: dict[int, list[int]] = {0: [], 1: [], 2: []}
        ends = {}
        for j, msg in client.choices(3, prompt_token_ids=prompt, sampling=sp):
            if isinstance(msg, TokenChunk):
                ids[j] += msg.token_ids
            else:
                ends[j] = msg.reason
        assert [ids[j] for j in range(3)] == [i for i, _, _ in got]
        assert ends == {0: "length", 1: "length", 2: "length"}
        with pytest.raises(RequestError, match="max_tokens"):
            list(client.choices(2, prompt_token_ids=[1], sampling=SamplingParams(max_tokens=0)))
    finally:
        client.close()
    assert nodes.stats(node[0]).running == 0


def test_client_choices_ask_prompt_logprobs_once(node):
    """``prompt_logprobs`` with n choices through the Python clients: only choice 0 asks them
    (it computes the whole prompt), the others take the prompt from the prefix cache and their
    first chunk carries choice 0's prompt logprobs."""
    prompt = list(range(50, 90))  # 40 tokens: whole pages for the later choices to reuse
    sp = SamplingParams(max_tokens=3, temperature=1.0, seed=5, ignore_eos=True,
                        prompt_logprobs=2)

    def check(replies, salt):
        firsts = {j: msg.prompt_logprobs for j, msg in reversed(replies)
                  if isinstance(msg, TokenChunk)}  # each choice's first chunk
        assert len(firsts[0]) == len(prompt) - 1, salt
        assert firsts[1] == firsts[2] == firsts[0], salt
        usage = {j: msg.usage for j, msg in replies if isinstance(msg, Finished)}
        assert usage[0].cached_tokens == 0 and usage[1].cached_tokens >= 32, salt
        assert usage[2].cached_tokens >= 32, salt

    async def run():
        client = AsyncClient(node[0])
        try:
            return [item async for item in client.choices(3, prompt_token_ids=prompt,
                                                           sampling=sp, cache_salt="lp-async")]
        finally:
            await client.close()

    check(asyncio.run(run()), "async")
    client = Client(node[0])
    try:
        check(list(client.choices(3, prompt_token_ids=prompt, sampling=sp,
                                  cache_salt="lp-sync")), "sync")
    finally:
        client.close()


def test_sigint_stops_every_child(model_dir, tmp_path):
    addr = f"tcp://127.0.0.1:{free_port()}"
    proc = NodeProcess(["--model", str(model_dir), "--listen", addr, "--num-pages", "8",
                        "--threads", "1"], tmp_path / "n.log")
    proc.wait_ready()
    kids = proc.children()
    assert kids, "the node should have an executor child"
    assert proc.stop(signal.SIGINT) == []
    assert proc.proc.returncode == 0


def test_ready_is_logged_once_the_http_gateway_and_metrics_accept(model_dir, tmp_path):
    http, metrics = free_port(), free_port()
    log = tmp_path / "n.log"
    proc = NodeProcess(["--model", str(model_dir), "--listen", f"tcp://127.0.0.1:{free_port()}",
                        "--num-pages", "8", "--threads", "1", "--http-listen",
                        f"127.0.0.1:{http}", "--metrics-listen", f"127.0.0.1:{metrics}"], log)
    try:
        proc.wait_ready()  # the first line with 'ready' in it
        for port in (http, metrics):  # accepts at once: no retry
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
        lines = log.read_text().splitlines()
        ready = next(i for i, line in enumerate(lines) if "ready:" in line)
        assert any("HTTP gateway ready on" in line for line in lines[:ready])
    finally:
        assert proc.stop() == []


def test_the_executors_are_spawned_before_the_node_imports_torch():
    """Cold start: a node spawns its executors before its own process imports torch (seconds
    of import, which then overlap theirs): nothing on the way there imports it."""
    code = ("import sys\n"
            "from disagg.cli.node import build_parser, config_from_args, cuda_devices\n"
            "from disagg.actors.executor.executor_group import early_spawn\n"
            "from disagg.model.default import resolve_model\n"
            "cfg = config_from_args(build_parser().parse_args(['--devices', 'cpu']))\n"
            "cuda_devices(['cuda:0'])\n"
            "print('torch' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def cmdline(path: Path) -> str:
    try:
        return path.read_bytes().decode(errors="replace")
    except OSError:  # gone meanwhile
        return ""


def test_a_start_failing_after_the_early_spawn_leaves_no_executor(model_dir):
    """The executors spawned before the node's checks (``early_spawn``) are stopped when a
    check then refuses the start (--dp with a host KV tier, refused in ``Node.start``)."""
    listen = f"tcp://127.0.0.1:{free_port()}"  # in each executor's --config: finds them
    out = subprocess.run([sys.executable, "-m", "disagg", "--model", str(model_dir),
                          "--devices", "cpu", "--dp", "2", "--kv-host-cache-mb", "4",
                          "--threads", "1", "--listen", listen],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and "--kv-host-cache-mb" in out.stderr
    left = [p for p in Path("/proc").glob("[0-9]*/cmdline") if listen in cmdline(p)]
    assert left == [], "an executor spawned early outlived the refused start"


def test_cuda_device_without_cuda_is_a_one_line_error(model_dir):
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    out = subprocess.run([sys.executable, "-m", "disagg", "--model", str(model_dir),
                          "--devices", "cuda:0", "--listen", "tcp://127.0.0.1:0"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "disagg-node: --devices cuda:0: no CUDA device is available here (use --devices cpu)"]


def test_check_devices():
    check_devices(["cpu", "cpu"], 0)
    check_devices(["cuda:0", "cuda:1"], 2)
    with pytest.raises(ConfigError, match="no CUDA device"):
        check_devices(["cuda:0"], 0)
    with pytest.raises(ConfigError, match=r"cuda:2: only 2 CUDA device\(s\)"):
        check_devices(["cuda:2"], 2)


def test_default_threads_share_the_cores_among_executors():
    assert cpu_threads(0, 1, 8) == 7  # one executor: the cores less one for the main process
    assert cpu_threads(0, 2, 8) == 3  # --tp 2 on the CPU: a share each, not 2 x 7
    assert cpu_threads(0, 1, 2) == 1  # a 2-core box: 1 (2 ran 10-20x slower when busy)
    assert cpu_threads(0, 4, 2) == 1
    assert cpu_threads(0, 1, 1) == 1
    assert cpu_threads(3, 2, 8) == 3  # --threads wins
