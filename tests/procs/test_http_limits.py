"""What HTTP clients can hold of a node (its gateway in the node process, ``--http-listen``):
1,000 idle or half-sent connections leave ZeroMQ clients and new HTTP requests served, and
are closed; a body over the limit is refused before it is read; an SSE stream nobody reads
is aborted on the node."""

from __future__ import annotations

import json
import resource
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

import nodes
from disagg.client import Client
from disagg.serving.http_limits import fd_reserve
from tinymodels import NodeProcess, free_port

MODEL = "tiny-llama"
NOFILE = (960, 2048)  # the node starts with a soft limit of 960 and may raise it to 2048
PAGES = 1100
MAX_LEN = 4096
TIMEOUT = 4.0  # --http-header-timeout and --http-body-timeout


class LimitedNode(NodeProcess):
    """A node process started under an RLIMIT_NOFILE of ``nofile``."""

    def __init__(self, args: list[str], log_path: Path, nofile: tuple[int, int]):
        self.log_path = log_path
        self.log = open(log_path, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "disagg", *args], stdout=self.log, stderr=subprocess.STDOUT,
            preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, nofile))


@pytest.fixture(scope="module")
def model_dir(chat_llama):
    return chat_llama


@pytest.fixture(scope="module")
def node(model_dir, tmp_path_factory):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard < NOFILE[1] or soft < 1500:
        pytest.skip("the test process needs about 1,500 file descriptors")
    addr = f"tcp://127.0.0.1:{free_port()}"
    port = free_port()
    args = ["--role", "mixed", "--model", str(model_dir), "--listen", addr, "--page-size",
            str(nodes.PAGE), "--threads", "1", "--num-pages", str(PAGES), "--max-model-len",
            str(MAX_LEN), "--served-model-name", MODEL, "--http-listen", f"127.0.0.1:{port}",
            "--http-header-timeout", str(TIMEOUT), "--http-body-timeout", str(TIMEOUT),
            "--http-write-timeout", "1"]
    proc = LimitedNode(args, tmp_path_factory.mktemp("log") / "mixed.log", NOFILE)
    with nodes.running([proc]):
        yield addr, port, proc


def post(port: int, body: dict, timeout: float = 60.0) -> tuple[int, dict]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions",
                                 data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def head(length: int, path: str = "/v1/completions") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {length}\r\n\r\n").encode()


def closed_by_server(sock: socket.socket, deadline: float) -> bytes:
    """What the server sent before closing ``sock`` (AssertionError if it is still open at the
    deadline)."""
    got = b""
    while True:
        sock.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            data = sock.recv(65536)
        except ConnectionResetError:
            return got
        except TimeoutError:
            raise AssertionError(f"the server kept the connection open; it sent "
                                 f"{got[:80]!r}") from None
        if not data:
            return got
        got += data


def node_fds(proc: NodeProcess) -> int:
    return len(list(Path(f"/proc/{proc.proc.pid}/fd").iterdir()))


def fd_limit(proc: NodeProcess) -> int:
    limits = Path(f"/proc/{proc.proc.pid}/limits").read_text()
    return int(next(x for x in limits.splitlines() if x.startswith("Max open files")).split()[3])


def settled_fds(proc: NodeProcess, timeout: float = 30.0) -> int:
    """The node's open fds once it took in the connections made (the same count twice)."""
    deadline = time.monotonic() + timeout
    last = node_fds(proc)
    while time.monotonic() < deadline:
        time.sleep(0.3)
        now = node_fds(proc)
        if now == last:
            return now
        last = now
    return last


def test_the_node_raised_its_fd_limit_to_the_hard_one(node):
    _, _, proc = node
    assert fd_limit(proc) == NOFILE[1]


def test_a_thousand_idle_and_half_sent_connections_leave_clients_served(node):
    addr, port, proc = node
    half_body = json.dumps({"model": MODEL, "prompt": "w5 w6", "max_tokens": 2}).encode()
    socks = []
    try:
        for i in range(1000):
            s = socket.create_connection(("127.0.0.1", port), timeout=30)
            socks.append(s)
            if i % 3 == 1:  # half a request head
                s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Le")
            elif i % 3 == 2:  # a whole head, half its body
                s.sendall(head(len(half_body)) + half_body[: len(half_body) // 2])
        # however many connections HTTP holds, half the node's fd table stays free ...
        limit = fd_limit(proc)
        assert limit - settled_fds(proc) >= fd_reserve(limit) - 64
        # ... so ZeroMQ clients are served, and so is a new HTTP request
        assert nodes.tokens(addr, nodes.prompt(5), 3) != []
        c = Client(addr)
        try:
            assert c.stats(timeout=30).pages_total == PAGES
        finally:
            c.close()
        status, payload = post(port, {"model": MODEL, "prompt": "w5 w6", "max_tokens": 3,
                                      "temperature": 0, "ignore_eos": True})
        assert status == 200 and payload["usage"]["completion_tokens"] == 3, payload
        # every one of the thousand is closed by the server: past the cap (the oldest idle
        # ones, or a 503), or at the header or body timeout (a 408 for a half body)
        deadline = time.monotonic() + 60
        answers = [closed_by_server(s, deadline) for s in socks]
    finally:
        for s in socks:
            s.close()
    for i, got in enumerate(answers):
        assert got == b"" or got.startswith((b"HTTP/1.1 503", b"HTTP/1.1 408")), (i, got[:80])
    assert any(got.startswith(b"HTTP/1.1 408") for got in answers)
    assert nodes.tokens(addr, nodes.prompt(5), 3) != []


def test_half_sent_requests_are_closed_after_the_timeouts(node):
    _, port, _ = node
    silent = socket.create_connection(("127.0.0.1", port), timeout=30)
    half_head = socket.create_connection(("127.0.0.1", port), timeout=30)
    half_head.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
    half_body = socket.create_connection(("127.0.0.1", port), timeout=30)
    half_body.sendall(head(100) + b'{"prompt": ')
    deadline = time.monotonic() + TIMEOUT + 30
    try:
        assert closed_by_server(silent, deadline) == b""
        assert closed_by_server(half_head, deadline) == b""
        got = closed_by_server(half_body, deadline)
        assert got.startswith(b"HTTP/1.1 408") and b'"timeout"' in got, got
    finally:
        for s in (silent, half_head, half_body):
            s.close()


def test_a_body_over_the_limit_is_refused_before_it_is_read(node):
    _, port, _ = node
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    try:
        sock.sendall(head(100 << 20))  # 100 MiB declared, none sent
        got = closed_by_server(sock, time.monotonic() + 30)
    finally:
        sock.close()
    assert got.startswith(b"HTTP/1.1 413"), got
    assert b"larger than" in got and b"Connection: close" in got, got


def test_an_sse_stream_nobody_reads_is_aborted_on_the_node(node):
    addr, port, _ = node
    before = nodes.stats(addr)
    body = json.dumps({"model": MODEL, "prompt": "w5 w6", "max_tokens": MAX_LEN - 16,
                       "temperature": 0, "ignore_eos": True, "stream": True}).encode()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a small window fills fast
    sock.settimeout(30)
    sock.connect(("127.0.0.1", port))
    try:
        sock.sendall(head(len(body)) + body)
        got = b""
        while b"data: " not in got:
            got += sock.recv(1024)
        assert got.startswith(b"HTTP/1.1 200")
        # ... and read no more: the gateway's writes stall, it aborts the request
        deadline = time.monotonic() + 60
        while True:
            s = nodes.stats(addr)
            if s.aborted > before.aborted and s.running == 0 and s.waiting == 0:
                break
            assert time.monotonic() < deadline, f"the request was not aborted: {s}"
            time.sleep(0.1)
        assert s.finished == before.finished  # it did not run to the end
        assert s.pages_free == s.pages_total == PAGES
        closed_by_server(sock, time.monotonic() + 30)  # and the connection dropped
    finally:
        sock.close()
