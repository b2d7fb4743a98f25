"""The fault matrix with real processes (docs/RELIABILITY.md): prefiller SIGKILL before, during
and after the transfer, decoder SIGKILL while its requests wait for KV, prefiller SIGSTOP past the
decoder's deadline then SIGCONT, client aborts in every phase, a prefiller restarting on the same
address. After each fault: every request terminal within its deadline, every pool full, counters
consistent (started = finished + aborted + errored)."""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

import pytest

import nodes
from disagg.client import AsyncClient
from disagg.protocol import TokenChunk
from nodes import greedy, node, pools_full, prompt, running, stats, wait_for
from tinymodels import NodeProcess, free_port, hf_greedy, make_tiny_model

pytestmark = pytest.mark.fabric

SLOW = {"DISAGG_TEST_LAYER_DELAY_S": "0.05"}  # each layer of each prefill step takes >= 50 ms
LONG = 81  # 80 prefill tokens in chunks of 4: about 20 steps, 2 s of prefill
PEER_TIMEOUT = 1.0
PREFILL_TIMEOUT = 4.0
FAST_FAILURE = ["--heartbeat", "0.2", "--peer-timeout", str(PEER_TIMEOUT),
                "--prefill-timeout", str(PREFILL_TIMEOUT)]
# Upper bound for any request to reach a terminal message after a fault: the prefill deadline,
# the drain after it, a local prefill and the decode, with a wide margin for a loaded 2-core box.
DEADLINE = PREFILL_TIMEOUT + PEER_TIMEOUT + 30.0


def consistent(addr: str) -> None:
    """Pool full, nothing live, counters add up."""
    wait_for(lambda: pools_full(addr), timeout=DEADLINE, what=f"full pool on {addr}")
    s = stats(addr)
    assert s.started == s.finished + s.aborted + s.errored, s
    assert s.transfers_in_flight == 0, s


class Req(nodes.Req):
    """A request in a thread that must end within the fault matrix's deadline."""

    def __init__(self, addr: str, ids: list[int], max_tokens: int = 4, timeout: float = DEADLINE):
        super().__init__(addr, ids, max_tokens, timeout)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model("llama", tmp_path_factory.mktemp("reliability") / "llama")


_refs: dict[tuple[int, int, int], list[int]] = {}


def ref(model_dir: Path, n: int, salt: int, new: int) -> list[int]:
    key = (n, salt, new)
    if key not in _refs:
        _refs[key] = hf_greedy(model_dir, prompt(n, salt), new)
    return _refs[key]


class Rig:
    """A slow prefiller on a fixed address (restartable) and two decoders: one ends failed
    prefills with an error, one prefills them locally."""

    def __init__(self, model_dir: Path, tmp: Path):
        self.model_dir = model_dir
        self.tmp = tmp
        self.p_addr = f"tcp://127.0.0.1:{free_port()}"
        self.p: NodeProcess | None = None
        self.starts = 0
        self.restart_prefiller(wait=False)
        self.d_err, self.de = node("decode", model_dir, tmp, "--num-pages", "96",
                                   "--prefill-peer", self.p_addr, "--on-prefill-failure", "error",
                                   *FAST_FAILURE)
        self.d_loc, self.dl = node("decode", model_dir, tmp, "--num-pages", "96",
                                   "--prefill-peer", self.p_addr, "--on-prefill-failure", "local",
                                   *FAST_FAILURE)
        for proc in (self.p, self.de, self.dl):
            assert proc is not None
            proc.wait_ready()
        self.wait_seen(1)

    @property
    def decoders(self) -> list[str]:
        return [self.d_err, self.d_loc]

    def restart_prefiller(self, wait: bool = True) -> None:
        """(Re)start the prefiller on the same address."""
        if self.p is not None:
            self.p.stop(signal.SIGKILL)
        self.starts += 1
        _, self.p = node("prefill", self.model_dir, self.tmp, "--num-pages", "96",
                         "--max-batch-tokens", "4", addr=self.p_addr, env=SLOW,
                         log=self.tmp / f"p-{self.starts}.log")
        if wait:
            self.p.wait_ready()
            self.wait_seen(1)

    def ensure_prefiller(self) -> None:
        assert self.p is not None
        if self.p.proc.poll() is not None:
            self.restart_prefiller()

    def wait_seen(self, n: int, timeout: float = 30.0) -> None:
        for addr in self.decoders:
            wait_for(lambda a=addr: stats(a).prefill_peers_alive == n, timeout=timeout,
                     what=f"{n} live prefiller(s) seen by {addr}")

    def kill_prefiller(self) -> None:
        assert self.p is not None
        self.p.proc.send_signal(signal.SIGKILL)
        self.p.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.p is not None and self.p.proc.poll() is None:
            self.p.proc.send_signal(signal.SIGCONT)  # in case a test left it stopped
        for proc in (self.p, self.de, self.dl):
            if proc is not None:
                assert proc.stop() == [], "executor processes outlived their node"


@pytest.fixture(scope="module")
def rig(model_dir, tmp_path_factory):
    r = Rig(model_dir, tmp_path_factory.mktemp("rig"))
    try:
        yield r
    finally:
        r.stop()


@pytest.fixture
def fresh(rig):
    """A live prefiller seen by both decoders; afterwards both decoders consistent."""
    rig.ensure_prefiller()
    rig.wait_seen(1)
    yield rig
    for addr in rig.decoders:
        consistent(addr)


def prefilling(p_addr: str) -> bool:
    s = stats(p_addr)
    return s.running > 0 and s.kv_writes_sent > 0


def served_remotely(model_dir: Path, d_addr: str, salt: int, new: int = 4) -> None:
    """A new request on ``d_addr`` is prefilled by a prefiller and token-exact."""
    before = stats(d_addr).kv_units_received
    r = Req(d_addr, prompt(LONG, salt), new).join()
    assert r.code is None and r.tokens == ref(model_dir, LONG, salt, new)
    assert stats(d_addr).kv_units_received > before, "expected a remote prefill"


def test_prefiller_killed_while_queued_and_mid_transfer_then_restarted(fresh, model_dir):
    rig = fresh
    mid = Req(rig.d_err, prompt(LONG, 1))  # prefilling when the prefiller dies
    wait_for(lambda: prefilling(rig.p_addr), what="prefill under way")
    queued_err = Req(rig.d_err, prompt(LONG, 2))  # accepted by the prefiller, not scheduled
    queued_loc = Req(rig.d_loc, prompt(LONG, 3))
    wait_for(lambda: stats(rig.p_addr).waiting >= 2, what="two prefills queued on the prefiller")
    rig.kill_prefiller()
    for r in (mid, queued_err):
        r.join()
        assert r.code == "prefill_failed", (r.code, r.reason)
    queued_loc.join()
    assert queued_loc.code is None and queued_loc.tokens == ref(model_dir, LONG, 3, 4)
    for addr in rig.decoders:
        consistent(addr)
        assert stats(addr).prefill_peers_alive == 0
    # the same address comes back: both decoders see it alive again and use it
    rig.restart_prefiller()
    for i, addr in enumerate(rig.decoders):
        served_remotely(model_dir, addr, salt=10 + i)
    consistent(rig.p_addr)


def test_prefiller_killed_after_transfer_while_decoding(fresh, model_dir):
    rig = fresh
    new = 200  # long enough to still be decoding when the prefiller dies
    r = Req(rig.d_err, prompt(LONG, 4), new)
    assert r.first.wait(DEADLINE), "no first token"
    rig.kill_prefiller()
    r.join()
    assert r.code is None and r.reason == "length"
    assert r.tokens == ref(model_dir, LONG, 4, new)


def test_decoder_killed_while_its_requests_wait_for_kv(fresh, model_dir, tmp_path):
    rig = fresh
    d_addr, d = node("decode", model_dir, tmp_path, "--num-pages", "96",
                     "--prefill-peer", rig.p_addr, *FAST_FAILURE)
    try:
        d.wait_ready()
        wait_for(lambda: stats(d_addr).prefill_peers_alive == 1, what="prefiller seen")
        reqs = [Req(d_addr, prompt(LONG, 20 + i), timeout=5) for i in range(3)]
        wait_for(lambda: prefilling(rig.p_addr) and stats(rig.p_addr).waiting >= 2,
                 what="one prefill under way, two queued")
        d.proc.send_signal(signal.SIGKILL)
        d.proc.wait(timeout=30)
        for r in reqs:  # the decoder is gone: the clients time out on their own
            r.thread.join(timeout=30)
        # the jobs' deadline is the dead decoder's --prefill-timeout: by then (plus a margin)
        # the prefiller must have given up on them and freed every page
        wait_for(lambda: pools_full(rig.p_addr), timeout=PREFILL_TIMEOUT + 10,
                 what="prefiller pool full")
        s = stats(rig.p_addr)
        assert s.started == s.finished + s.aborted + s.errored and s.transfers_in_flight == 0
        served_remotely(model_dir, rig.d_err, salt=23)
    finally:
        d.stop()
        rig.restart_prefiller()  # do not leave held pages to the next test


B_NEW = 280  # LONG + B_NEW fits the decoder's 96 pages of 4 tokens


@pytest.mark.parametrize("resume", [
    # resumed before the job's deadline: it reads the queued AbortPrefill and stops
    "before_job_deadline",
    # past it: it posts nothing more of the job (the absolute deadline travels with it)
    "after_job_deadline",
])
def test_prefiller_stopped_past_the_deadline_then_resumed(fresh, model_dir, resume):
    """SIGSTOP the prefiller mid-transfer until the decoder declares it dead and ends the
    request; while the decoder reuses those pages for a new prompt (prefilled locally, no live
    prefiller), SIGCONT the prefiller. Its late writes must not corrupt the new request, nor
    count for anything."""
    rig = fresh
    assert rig.p is not None
    a = Req(rig.d_err, prompt(LONG, 30))
    sent = time.monotonic()
    wait_for(lambda: prefilling(rig.p_addr), what="prefill under way")
    rig.p.proc.send_signal(signal.SIGSTOP)
    try:
        a.join()
        assert a.code == "prefill_failed"
        wait_for(lambda: stats(rig.d_err).prefill_peers_alive == 0, what="prefiller dead")
        # a write of the failed attempt may still land: its pages stay fenced, not free
        s = stats(rig.d_err)
        assert s.pages_fenced > 0 and s.pages_free + s.pages_fenced == s.pages_total, s
        if resume == "after_job_deadline":
            time.sleep(max(0.0, sent + PREFILL_TIMEOUT + 0.5 - time.monotonic()))
        # a new prompt in the pages the failed request held; long enough to be decoding
        # when the prefiller wakes up
        b = Req(rig.d_err, prompt(LONG, 31), B_NEW)
        assert b.first.wait(DEADLINE)
    finally:
        rig.p.proc.send_signal(signal.SIGCONT)
    b.join()
    assert b.code is None and b.tokens == ref(model_dir, LONG, 31, B_NEW), \
        "late writes of the stopped prefiller corrupted a request that reused the pages"
    rig.wait_seen(1)
    consistent(rig.p_addr)
    consistent(rig.d_err)
    served_remotely(model_dir, rig.d_err, salt=32)


@pytest.fixture(scope="module")
def small_decoder(rig, tmp_path_factory):
    """A decoder whose pool holds one long prompt: a second one queues at the decoder."""
    rig.ensure_prefiller()
    tmp = tmp_path_factory.mktemp("small")
    addr, d = node("decode", rig.model_dir, tmp, "--num-pages", "24",
                   "--prefill-peer", rig.p_addr, *FAST_FAILURE)
    with running([d]):
        yield addr


def test_client_abort_in_every_phase(fresh, small_decoder, model_dir):
    rig = fresh
    d_addr = small_decoder
    wait_for(lambda: stats(d_addr).prefill_peers_alive == 1, what="prefiller seen")

    async def run() -> None:
        client = AsyncClient(d_addr)

        def go(rid: str, ids: list[int], new: int = 4) -> asyncio.Task:
            return asyncio.create_task(client.complete(prompt_token_ids=ids, sampling=greedy(new),
                                                       request_id=rid, timeout=DEADLINE))

        async def until(cond, what: str) -> None:
            await asyncio.to_thread(wait_for, cond, DEADLINE, what)

        try:
            # waiting for KV (prefill under way) and queued at the decoder (no pages for it)
            waiting = go("waiting", prompt(LONG, 40))
            await until(lambda: prefilling(rig.p_addr), "prefill under way")
            queued = go("queued", prompt(LONG, 41))
            await until(lambda: stats(d_addr).waiting_for_kv == 2, "second prompt queued")
            for rid, task in (("queued", queued), ("waiting", waiting)):
                await client.abort(rid)
                _, _, fin = await asyncio.wait_for(task, DEADLINE)
                assert fin.reason == "abort", rid
            # decoding (a short prompt, prefilled remotely, many tokens)
            stream = client.generate(prompt_token_ids=prompt(9, 42), sampling=greedy(80),
                                     request_id="decoding", timeout=DEADLINE)
            first = await stream.__anext__()
            assert isinstance(first, TokenChunk)
            await client.abort("decoding")
            msgs = [first] + [m async for m in stream]
            last = msgs[-1]
            assert not isinstance(last, TokenChunk) and last.reason == "abort" and last.usage.completion_tokens < 80
            # nothing stale completes a new request in the same pages
            ids, _, fin = await client.complete(prompt_token_ids=prompt(LONG, 43),
                                                sampling=greedy(4), timeout=DEADLINE)
            assert ids == ref(model_dir, LONG, 43, 4) and fin.reason == "length"
        finally:
            await client.close()

    asyncio.run(run())
    consistent(d_addr)
    consistent(rig.p_addr)
    assert stats(d_addr).aborted == 3
