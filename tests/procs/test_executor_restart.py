"""An executor process that dies (SIGKILL) ends its node's live requests with an ``internal``
error; the node restarts in place on the same addresses and serves again, token-exact, with every
page free and no memory or fd left over from the dead incarnation; restarts are bounded."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import msgspec
import pytest
import zmq
import zmq.asyncio

import nodes
from disagg.actors.executor.executor_group import ExecutorError, ExecutorGroup, exit_reason
from disagg.actors.frontend.front_door import FrontDoor, refusal
from disagg.client import Client, RequestError
from disagg.config import ConfigError, NodeConfig
from disagg.protocol import Abort, Error, GenerateRequest, NodeReply, StatsRequest, TokenChunk
from disagg.supervisor import RestartPolicy, pin_listen
from nodes import greedy, node, pools_full, prompt, running, stats, wait_for
from tinymodels import NodeProcess, make_tiny_model

# ---- the pure parts -----------------------------------------------------------------------------


def test_restart_policy_bounds_restarts_within_the_window():
    p = RestartPolicy(max_restarts=2, window_s=10.0)
    assert p.allow(0.0) and p.allow(1.0)
    assert not p.allow(5.0)  # a third within 10 s
    assert not p.allow(9.9)
    assert p.allow(10.5)  # the first one left the window
    assert not p.allow(10.6)
    assert not RestartPolicy(max_restarts=0).allow(0.0)
    with pytest.raises(ConfigError, match="--max-restarts"):
        RestartPolicy(max_restarts=-1)
    with pytest.raises(ConfigError, match="--restart-window"):
        RestartPolicy(window_s=0)


def test_pin_listen_keeps_the_port_a_node_got():
    cfg = NodeConfig(listen="tcp://127.0.0.1:0")
    assert pin_listen(cfg, "tcp://127.0.0.1:41234").listen == "tcp://127.0.0.1:41234"
    assert pin_listen(cfg, None) is cfg


def test_exit_reason_names_the_signal():
    assert exit_reason(-signal.SIGKILL) == "was killed by SIGKILL"
    assert exit_reason(3) == "exited with code 3"


def test_refusal_answers_every_kind_of_frame_with_when_to_retry():
    gen = GenerateRequest("r1", prompt_token_ids=[5, 6])
    e = refusal(gen, "the node is restarting", 2.2)
    assert (e.code, e.request_id) == ("unavailable", "r1")  # terminal for the request
    assert e.message == "the node is restarting; retry after 3 s"
    assert refusal(gen, "x", 0.01).message == "x; retry after 1 s"
    e = refusal(Abort("r1"), "x", 2.0)
    assert (e.code, e.request_id) == ("unavailable", None)  # frame-level: nothing to end
    assert e.message == "abort of 'r1' not taken: x; retry after 2 s"
    assert refusal(StatsRequest(), "x", 2.0) == Error("unavailable", "x; retry after 2 s")
    assert refusal("could not decode", "x", 2.0) == Error("bad_frame", "could not decode")
    assert refusal(gen, "stopping", 2.0, "shutting_down") == Error("shutting_down", "stopping",
                                                                   "r1")


def test_a_front_door_answers_while_no_node_serves_and_hands_its_socket_on():
    enc, dec = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(NodeReply)

    async def main() -> None:
        door = FrontDoor("tcp://127.0.0.1:0")
        sock, monitor = await door.lend()
        ctx = zmq.asyncio.Context()
        client = ctx.socket(zmq.DEALER)
        client.setsockopt(zmq.LINGER, 0)
        client.connect(sock.getsockopt_string(zmq.LAST_ENDPOINT))
        try:
            door.retry_after_s = 4.5
            door.refuse("the node is restarting")
            door.refuse("twice is once")
            await client.send(enc.encode(GenerateRequest("r1", prompt_token_ids=[1])))
            await client.send(enc.encode(StatsRequest()))
            await client.send(b"\xc1")
            replies = [dec.decode(await asyncio.wait_for(client.recv(), 10)) for _ in range(3)]
            assert replies == [
                Error("unavailable", "the node is restarting; retry after 5 s", "r1"),
                Error("unavailable", "the node is restarting; retry after 5 s"),
                Error("bad_frame", replies[2].message)]  # type: ignore[union-attr]
            assert door.refused == 3
            # the next node's frontend gets the same socket and is its one reader
            assert await door.lend() == (sock, monitor)
            await client.send(enc.encode(StatsRequest()))
            assert await sock.poll(10_000) and len(await sock.recv_multipart()) == 2
            assert not await client.poll(300), "answered by the door after it was lent"
        finally:
            client.close()
            ctx.term()
            await door.close()
        assert door.sock is None and door.ctx is None

    asyncio.run(main())


def test_the_metrics_endpoint_keeps_polling_a_node_that_answers_with_errors():
    # a restarting node answers Stats with `unavailable`: the poller skips, it must not stop
    from disagg.actors.http.metrics_server import MetricsServer
    from disagg.serving.metrics import Metrics

    async def main() -> None:
        door = FrontDoor("tcp://127.0.0.1:0")
        sock, _ = await door.lend()
        door.refuse("the node is restarting")
        server = MetricsServer(sock.getsockopt_string(zmq.LAST_ENDPOINT), "127.0.0.1:0",
                               Metrics(), interval_s=0.05)
        await server.start()
        try:
            for _ in range(200):
                if door.refused >= 3:
                    break
                await asyncio.sleep(0.05)
            assert door.refused >= 3, "the poller stopped at the first Error"
        finally:
            await server.stop()
            await door.close()

    asyncio.run(main())


def test_watch_raises_when_an_executor_dies(tmp_path):
    async def main() -> None:
        ctx = zmq.asyncio.Context()
        group = ExecutorGroup(NodeConfig(), str(tmp_path), ctx)
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        group.procs.append(child)
        try:
            watch = asyncio.ensure_future(group.watch())
            done, _ = await asyncio.wait({watch}, timeout=0.3)
            assert not done, "watch() must wait while the executor lives"
            child.kill()
            with pytest.raises(ExecutorError, match=rf"executor 0 \(pid {child.pid}\) was killed by SIGKILL"):
                await asyncio.wait_for(watch, 30)
        finally:
            child.kill()
            child.wait()
            group.sock.close()
            ctx.term()

    asyncio.run(main())


# ---- real nodes ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model("llama", tmp_path_factory.mktemp("restart") / "llama")


def executor_pid(proc: NodeProcess) -> int:
    kids = proc.children()
    assert len(kids) == 1, kids
    return kids[0]


def kill_executor(proc: NodeProcess) -> int:
    pid = executor_pid(proc)
    os.kill(pid, signal.SIGKILL)
    return pid


def readies(proc: NodeProcess) -> list[str]:
    """The node's 'ready:' lines so far (one per start)."""
    return [line for line in proc.log_path.read_text().splitlines() if "ready:" in line]


def wait_restarted(proc: NodeProcess, starts: int) -> None:
    wait_for(lambda: len(readies(proc)) >= starts or proc.proc.poll() is not None, timeout=120,
             what=f"start {starts}")
    assert proc.proc.poll() is None, proc.log_path.read_text()


def fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def kv_mappings(pid: int) -> int:
    """Mappings of executors' KV memfds in a process (one per live executor)."""
    return Path(f"/proc/{pid}/maps").read_text().count("memfd:disagg-kv")


class Stream:
    """One greedy request in a thread: its tokens and the Error (code, message) it ended with."""

    def __init__(self, addr: str, ids: list[int], max_tokens: int):
        self.tokens: list[int] = []
        self.error: tuple[str, str] | None = None
        self.first = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(addr, ids, max_tokens), daemon=True)
        self.thread.start()

    def _run(self, addr: str, ids: list[int], max_tokens: int) -> None:
        client = Client(addr)
        try:
            for msg in client.generate(prompt_token_ids=ids, sampling=greedy(max_tokens),
                                       timeout=60):
                if isinstance(msg, TokenChunk):
                    self.tokens += msg.token_ids
                    self.first.set()
        except RequestError as e:
            self.error = (e.error.code, e.error.message)
        finally:
            client.close()

    def join(self) -> Stream:
        self.thread.join(timeout=90)
        assert not self.thread.is_alive(), "request never ended"
        return self


def test_mixed_node_serves_again_after_an_executor_is_killed_under_load(model_dir, tmp_path):
    # overlapped decoding on: the kill lands while a deferred step is in flight
    addr, proc = node("mixed", model_dir, tmp_path, "--num-pages", "512", "--max-model-len", "500",
                      "--overlap-schedule", "on")
    with running([proc]):
        ref = nodes.tokens(addr, prompt(9, 1), 8)
        fd_count, pid = fds(proc.proc.pid), executor_pid(proc)
        assert kv_mappings(proc.proc.pid) == 1
        load = [Stream(addr, prompt(8, i), 480) for i in range(4)]  # long: decoding at the kill
        for s in load:
            assert s.first.wait(60), "no first token"
        assert kill_executor(proc) == pid
        for s in load:
            s.join()
            assert s.error is not None and len(s.tokens) < 480, "the request outlived its executor"
            code, message = s.error
            assert code == "internal" and f"executor 0 (pid {pid}) was killed by SIGKILL" in message
        wait_restarted(proc, 2)
        assert executor_pid(proc) != pid
        assert nodes.tokens(addr, prompt(9, 1), 8) == ref
        wait_for(lambda: pools_full(addr), what="every page free")
        # the dead incarnation's KV mapping, registrations and sockets are gone
        assert kv_mappings(proc.proc.pid) == 1
        wait_for(lambda: fds(proc.proc.pid) <= fd_count, timeout=10,
                 what=f"at most the {fd_count} open fds of before the kill")


def test_restarts_are_bounded_and_keep_the_port_it_got(model_dir, tmp_path):
    log = tmp_path / "bounded.log"
    proc = NodeProcess(["--model", str(model_dir), "--listen", "tcp://127.0.0.1:0", "--threads",
                        "1", "--num-pages", "64", "--max-restarts", "1"], log)
    with running([proc]):
        addr = re.search(r"on (tcp://\S+)", readies(proc)[0]).group(1)  # type: ignore[union-attr]
        ref = nodes.tokens(addr, prompt(5), 4)
        kill_executor(proc)
        wait_restarted(proc, 2)
        assert f"on {addr} " in readies(proc)[1], "restarted on another address"
        assert nodes.tokens(addr, prompt(5), 4) == ref
        kill_executor(proc)  # a second restart within the window is one too many
        assert proc.proc.wait(timeout=60) == 1
        assert "giving up: 1 restarts within 600 s" in log.read_text()


@pytest.mark.fabric
def test_prefill_and_decode_nodes_serve_remote_prefills_again_after_executor_kills(model_dir,
                                                                                  tmp_path):
    # the same prompt again after each restart must be prefilled remotely again: no caches
    fast = ["--heartbeat", "0.2", "--peer-timeout", "1", "--prefill-timeout", "4",
            "--no-prefix-caching"]
    p_addr, p = node("prefill", model_dir, tmp_path, "--num-pages", "96", "--max-batch-tokens",
                     "4", "--no-prefix-caching",
                     env={"DISAGG_TEST_LAYER_DELAY_S": "0.05"})  # prefills of 2 s
    d_addr, d = node("decode", model_dir, tmp_path, "--num-pages", "96", "--prefill-peer", p_addr,
                     "--on-prefill-failure", "error", *fast)
    long = 81
    with running([p, d], decoders=[d_addr]):
        ref = nodes.tokens(d_addr, prompt(long, 1), 4)
        load = [Stream(d_addr, prompt(long, 2 + i), 4) for i in range(2)]
        wait_for(lambda: stats(p_addr).running > 0 and stats(p_addr).kv_writes_sent > 0,
                 what="a prefill under way")
        kill_executor(p)
        for s in load:  # failed as the prefiller's jobs are lost; never hung
            assert s.join().error is not None
        wait_restarted(p, 2)
        wait_for(lambda: stats(d_addr).prefill_peers_alive == 1, what="prefiller alive again")
        before = stats(d_addr).kv_units_received
        assert nodes.tokens(d_addr, prompt(long, 1), 4) == ref
        assert stats(d_addr).kv_units_received > before, "expected a remote prefill"
        # the decoder's own executor: it restarts, links to the prefiller again, prefills remotely
        kill_executor(d)
        wait_restarted(d, 2)
        wait_for(lambda: stats(d_addr).prefill_peers_alive == 1, what="prefiller seen again")
        assert nodes.tokens(d_addr, prompt(long, 1), 4) == ref
        assert stats(d_addr).kv_units_received > 0, "expected a remote prefill"
        for addr in (p_addr, d_addr):
            wait_for(lambda a=addr: pools_full(a), what=f"every page free on {addr}")


# ---- requests across restarts -------------------------------------------------------------------


def threads(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


class Retrier:
    """A long-lived client (one socket) sending greedy requests back to back while ``go`` is
    set, as a client that retries does: at once after ``error internal``, after a short pause
    after ``unavailable`` (which says when to retry). Every outcome is kept: ``finished``, the
    error code, or ``unanswered`` (no terminal message within the deadline)."""

    def __init__(self, addr: str, ids: list[int], max_tokens: int, go: threading.Event,
                 timeout: float = 30.0):
        self.ids, self.max_tokens, self.go, self.timeout = ids, max_tokens, go, timeout
        self.outcomes: list[str] = []
        self.hints: list[str] = []  # the messages of the unavailable errors
        self.busy = threading.Event()  # a request of it is in flight
        self.closing = False
        self.client = Client(addr)
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            while not self.closing:
                if not self.go.wait(0.1):
                    continue
                self.busy.set()
                self.outcomes.append(self._one())
                self.busy.clear()
                if self.outcomes[-1] == "unavailable":
                    time.sleep(0.2)
        finally:
            self.busy.clear()
            self.client.close()

    def _one(self) -> str:
        try:
            for _ in self.client.generate(prompt_token_ids=self.ids, timeout=self.timeout,
                                          sampling=greedy(self.max_tokens)):
                pass
        except RequestError as e:
            if e.error.code == "unavailable":
                self.hints.append(e.error.message)
            return e.error.code
        except TimeoutError:
            return "unanswered"
        return "finished"

    def close(self) -> None:
        self.closing = True
        self.thread.join(timeout=self.timeout + 10)
        assert not self.thread.is_alive(), "a request never ended"


def idle(clients: list[Retrier], go: threading.Event) -> None:
    go.clear()
    wait_for(lambda: not any(c.busy.is_set() for c in clients), timeout=60,
             what="every client's last request ended")


def footprint(pid: int) -> tuple[int, int, int]:
    """(open fds, threads, KV mappings) of the node process."""
    return fds(pid), threads(pid), kv_mappings(pid)


def serve_across_kills(proc: NodeProcess, addr: str, clients: list[Retrier],
                       go: threading.Event, kills: int) -> list[tuple[int, int, int]]:
    """Kill the executor ``kills`` times while every client has a request in flight; after each
    restart let each client finish one request again, then measure the node idle. Returns
    the footprint before the first kill and after each restart."""
    go.set()
    wait_for(lambda: all("finished" in c.outcomes for c in clients), timeout=60,
             what="each client served once")
    idle(clients, go)
    seen = [footprint(proc.proc.pid)]
    for k in range(kills):
        done = [len(c.outcomes) for c in clients]
        go.set()
        wait_for(lambda: all(c.busy.is_set() for c in clients), what="every client busy")
        kill_executor(proc)
        wait_restarted(proc, k + 2)
        wait_for(lambda d=done: all("finished" in c.outcomes[n + 1:]  # type: ignore[misc]
                                    for c, n in zip(clients, d, strict=True)),
                 timeout=60, what=f"each client served again after restart {k + 1}")
        idle(clients, go)
        wait_for(lambda: pools_full(addr), what="every page free")
        seen.append(settled(proc.proc.pid, seen[0]))
    return seen


def settled(pid: int, before: tuple[int, int, int]) -> tuple[int, int, int]:
    """The footprint once it is back within ``before`` (a closed connection's fd goes a little
    after its client), or as it is after 10 s."""
    deadline = time.monotonic() + 10
    now = footprint(pid)
    while any(a > b for a, b in zip(now, before, strict=True)) and time.monotonic() < deadline:
        time.sleep(0.2)
        now = footprint(pid)
    return now


def assert_every_request_answered(clients: list[Retrier], kills: int) -> None:
    outcomes = [o for c in clients for o in c.outcomes]
    assert outcomes.count("unanswered") == 0, outcomes
    assert set(outcomes) <= {"finished", "internal", "unavailable"}, outcomes
    assert outcomes.count("internal") >= kills, "the kills ended no request"
    for hint in (h for c in clients for h in c.hints):
        assert re.search(r"(restarting|stopping) after executor failure: .*; retry after \d+ s",
                         hint), hint


def assert_flat(seen: list[tuple[int, int, int]]) -> None:
    fd0, threads0, maps0 = seen[0]
    assert maps0 >= 1
    for fd, n, maps in seen[1:]:
        assert maps == maps0, f"KV mappings {maps0} -> {maps} across restarts: {seen}"
        assert n <= threads0, f"threads {threads0} -> {n} across restarts: {seen}"
        assert fd <= fd0, f"open fds {fd0} -> {fd} across restarts: {seen}"


def check_clients_across_kills(proc, addr: str, clients: list, go: threading.Event,
                               kills: int) -> None:
    """Serve ``clients`` across ``kills`` executor deaths of ``proc``, then check that every
    request was answered and the node's fds, threads and mappings stayed flat."""
    try:
        seen = serve_across_kills(proc, addr, clients, go, kills)
    finally:
        go.clear()
        for c in clients:
            c.close()
    assert_every_request_answered(clients, kills)
    assert_flat(seen)


@pytest.mark.parametrize("kills", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_clients_that_retry_at_once_are_answered_across_restarts_of_a_mixed_node(model_dir,
                                                                                 tmp_path, kills):
    # requests sent while the node restarts are answered (unavailable, retry-after) or served:
    # none is lost to a socket that closes; the node's fds, threads and mappings stay flat
    addr, proc = node("mixed", model_dir, tmp_path, "--num-pages", "128", "--max-model-len",
                      "200", "--overlap-schedule", "on")
    go = threading.Event()
    with running([proc]):
        clients = [Retrier(addr, prompt(8, i), 120, go) for i in range(8)]
        check_clients_across_kills(proc, addr, clients, go, kills)


@pytest.mark.fabric
@pytest.mark.parametrize("kills", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_steady_load_on_a_decode_node_across_executor_kills_leaves_nothing_hung(model_dir,
                                                                                tmp_path, kills):
    # a decoder's restarts: every request in flight or arriving reaches a terminal message;
    # the dead executor's KV mapping and fabric registrations are released before the new one's
    # (the prefiller never dies here: a peer timeout of 1 s once declared it dead on a loaded
    # box, 3 s after the decoder's restart, and failed requests with prefill_failed)
    fast = ["--heartbeat", "0.2", "--peer-timeout", "3", "--prefill-timeout", "10",
            "--no-prefix-caching"]
    p_addr, p = node("prefill", model_dir, tmp_path, "--num-pages", "96", "--no-prefix-caching")
    d_addr, d = node("decode", model_dir, tmp_path, "--num-pages", "96", "--prefill-peer", p_addr,
                     "--max-model-len", "200", "--on-prefill-failure", "error", *fast)
    go = threading.Event()
    with running([p, d], decoders=[d_addr]):
        clients = [Retrier(d_addr, prompt(12 + 8 * i, i), 60, go) for i in range(4)]
        check_clients_across_kills(d, d_addr, clients, go, kills)
