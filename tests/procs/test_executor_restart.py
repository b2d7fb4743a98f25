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
from pathlib import Path

import pytest
import zmq.asyncio

import nodes
from disagg.actors.executor_group import ExecutorError, ExecutorGroup, exit_reason
from disagg.client import Client, RequestError
from disagg.config import ConfigError, NodeConfig
from disagg.protocol import TokenChunk
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
