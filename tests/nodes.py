"""Helpers for tests that run nodes as real processes: start a set of them, ask a node its
Stats, wait for a condition, run a request in a thread, put the HTTP gateway in front; the
shape of the mixed node the process tests share (``shared_node`` in tests/procs/conftest.py)."""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections.abc import Callable, Coroutine, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from disagg.client import Client, RequestError
from disagg.protocol import SamplingParams, Stats, TokenChunk
from tinymodels import NodeProcess, add_word_tokenizer, free_port

PAGE = 4
# the shared mixed node: the chat llama's name behind its gateway, its pool, its context limit
SHARED_MODEL = "tiny-llama"
SHARED_PAGES = 160
SHARED_MAX_LEN = 512
CHAT_TEMPLATE = ("{% for m in messages %}w3 {{ m['content'] }} w4 {% endfor %}"
                 "{% if add_generation_prompt %}w5{% endif %}")


def prompt(n: int, salt: int = 0) -> list[int]:
    rng = random.Random(n * 1000 + salt)
    return [rng.randrange(3, 300) for _ in range(n)]


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True)


def node(role: str, model_dir: Path, tmp_path: Path, *extra: str, env: dict[str, str] | None = None,
         addr: str | None = None, log: Path | None = None,
         entry: Sequence[str] = ("-m", "disagg")) -> tuple[str, NodeProcess]:
    """A node process (not yet ready) listening on ``addr`` (a free loopback port by default);
    ``entry``: what the interpreter runs (a test's wrapper script in place of the node)."""
    addr = addr or f"tcp://127.0.0.1:{free_port()}"
    args = ["--role", role, "--model", str(model_dir), "--listen", addr, "--page-size", str(PAGE),
            "--threads", "1", *extra]
    log = log or tmp_path / f"{role}-{addr.rsplit(':', 1)[1]}.log"
    return addr, NodeProcess(args, log, env=env, entry=entry)


@contextmanager
def running(procs: list[NodeProcess], decoders: Sequence[str] = (),
            prefillers: int = 1) -> Iterator[None]:
    """Wait until every process is ready and every decoder sees ``prefillers`` live prefill
    peers; on the way out stop the ones still running and check no executor outlived them."""
    try:
        for proc in procs:
            proc.wait_ready()
        for addr in decoders:
            wait_for(lambda a=addr: stats(a).prefill_peers_alive == prefillers,
                     what="prefiller seen")
        yield
    finally:
        orphans = []
        for proc in procs:  # a node a test killed is not asked to have tidied up
            alive = proc.proc.poll() is None
            left = proc.stop()
            orphans += left if alive else []
        assert orphans == [], "executor processes outlived their node"


def stats(addr: str, timeout: float = 10.0) -> Stats:
    c = Client(addr)
    try:
        return c.stats(timeout=timeout)
    finally:
        c.close()


def wait_for(cond: Callable[[], bool], timeout: float = 30.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.1)
    raise AssertionError(f"{what} not reached in {timeout}s")


def pools_full(addr: str) -> bool:
    s = stats(addr)
    return s.pages_free == s.pages_total and s.running == s.waiting == s.waiting_for_kv == 0


class Req:
    """One greedy request in a thread (sync client): its tokens, finish reason or error code,
    how long it took; ``first`` is set on the first token."""

    def __init__(self, addr: str, ids: list[int], max_tokens: int = 4, timeout: float = 60.0):
        self.ids = ids
        self.timeout = timeout
        self.tokens: list[int] = []
        self.reason: str | None = None
        self.code: str | None = None
        self.elapsed: float | None = None
        self.first = threading.Event()
        self._t0 = time.monotonic()
        self.thread = threading.Thread(target=self._run, args=(addr, max_tokens), daemon=True)
        self.thread.start()

    def _run(self, addr: str, max_tokens: int) -> None:
        client = Client(addr)
        try:
            for msg in client.generate(prompt_token_ids=self.ids, timeout=self.timeout,
                                       sampling=greedy(max_tokens)):
                if isinstance(msg, TokenChunk):
                    self.tokens += msg.token_ids
                    self.first.set()
                else:
                    self.reason = msg.reason
        except RequestError as e:
            self.code = e.error.code
        except TimeoutError:
            self.code = "client_timeout"
        finally:
            self.elapsed = time.monotonic() - self._t0
            client.close()

    def join(self, terminal: bool = True) -> Req:
        """Wait for the end; a request must end with a terminal message within its timeout
        (``terminal=False``: a test that killed its node expects none)."""
        self.thread.join(timeout=self.timeout + 10)
        assert not self.thread.is_alive(), "request never ended"
        if not terminal:
            return self
        assert self.code != "client_timeout", "no terminal message within the deadline"
        assert self.elapsed is not None and self.elapsed < self.timeout
        return self


# ---- HTTP --------------------------------------------------------------------------------------


class LoopThread:
    """An asyncio loop in a thread, so sync tests can drive async servers."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, Any], timeout: float = 60.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


def chat_model(path: Path) -> None:
    """Give a tiny model directory a word tokenizer and a chat template."""
    import json

    add_word_tokenizer(path)
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": CHAT_TEMPLATE, "bos_token": "w1", "eos_token": "w2"}))


@contextmanager
def gateway(addr: str, model_dir: Path, model_name: str) -> Iterator[Any]:
    """The OpenAI gateway (in a loop thread) in front of the node at ``addr``."""
    from disagg.actors.http.http import start_http_gateway

    lt = LoopThread()
    gw = lt.run(start_http_gateway(addr, "127.0.0.1:0", str(model_dir), model_name=model_name,
                                   stats_interval=0.2))
    try:
        yield gw
    finally:
        lt.run(gw.stop())
        lt.close()


@contextmanager
def openai_client(base_url: str) -> Iterator[Any]:
    import openai

    with openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0,
                       timeout=60) as client:
        yield client


def tokens(addr: str, ids: list[int], max_tokens: int, timeout: float = 60.0) -> list[int]:
    """The greedy output of one request (sync client)."""
    c = Client(addr)
    try:
        return [t for m in c.generate(prompt_token_ids=ids, sampling=greedy(max_tokens),
                                      timeout=timeout)
                for t in getattr(m, "token_ids", [])]
    finally:
        c.close()


class FakeClientNode:
    """A ROUTER socket on loopback served from a thread, standing in for a node to a client:
    every client message it gets is kept in ``got``; with ``pings`` each Ping is answered with
    a Pong (a client's first contact), with ``generate`` each GenerateRequest with one token
    and ``Finished``, or ``bad_request`` when it is invalid (as a node's intake would). Neither:
    a port that takes connections and never speaks."""

    def __init__(self, pings: bool = True, generate: bool = True) -> None:
        import zmq

        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.address = f"tcp://127.0.0.1:{self.sock.bind_to_random_port('tcp://127.0.0.1')}"
        self.pings, self.generate = pings, generate
        self.got: list[Any] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        import msgspec

        from disagg.protocol import (
            ClientMessage,
            Error,
            Finished,
            GenerateRequest,
            Ping,
            Pong,
            Usage,
        )

        enc, dec = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(ClientMessage)
        while not self.stop.is_set():
            if not self.sock.poll(50):
                continue
            ident, frame = self.sock.recv_multipart()
            msg = dec.decode(frame)
            self.got.append(msg)
            replies: list[Any] = []
            if isinstance(msg, Ping) and self.pings:
                replies = [Pong()]
            elif isinstance(msg, GenerateRequest) and self.generate:
                rid, bad = msg.request_id, msg.validate()
                replies = ([Error("bad_request", bad, rid)] if bad is not None else
                           [TokenChunk(rid, [7], "x"), Finished(rid, "length", Usage(3, 1))])
            for r in replies:
                self.sock.send_multipart([ident, enc.encode(r)])

    @property
    def requests(self) -> list[Any]:
        """The GenerateRequests among ``got``."""
        from disagg.protocol import GenerateRequest

        return [m for m in self.got if isinstance(m, GenerateRequest)]

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        self.sock.close()
        self.ctx.term()
