"""Faults with real processes: prefiller killed, decoder killed, client aborts mid-prefill."""

from __future__ import annotations

import asyncio
import signal
import threading

import pytest
from test_disagg import node, pools_full, prompt, stats, wait_for

from disagg.client import AsyncClient, Client, RequestError
from disagg.protocol import SamplingParams, TokenChunk
from tinymodels import hf_greedy, make_tiny_model

pytestmark = pytest.mark.fabric

SLOW = {"DISAGG_TEST_LAYER_DELAY_S": "0.05"}  # each layer of each prefill step takes >= 50 ms
LONG = 81  # 80 prefill tokens in chunks of 4: about 20 steps, 2 s of prefill
FAST_FAILURE = ["--heartbeat", "0.2", "--peer-timeout", "1.0"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model("llama", tmp_path_factory.mktemp("faults") / "llama")


@pytest.fixture(scope="module")
def ref(model_dir):
    return hf_greedy(model_dir, prompt(LONG), 4)


class Background:
    """Run one request in a thread; keep its tokens or its error."""

    def __init__(self, addr: str, ids: list[int], max_tokens: int = 4, timeout: float = 60):
        self.tokens: list[int] = []
        self.error: RequestError | TimeoutError | None = None
        self.reason: str | None = None
        self.thread = threading.Thread(target=self._run, args=(addr, ids, max_tokens, timeout))
        self.thread.start()

    def _run(self, addr: str, ids: list[int], max_tokens: int, timeout: float) -> None:
        client = Client(addr)
        try:
            for msg in client.generate(prompt_token_ids=ids, timeout=timeout,
                                       sampling=SamplingParams(max_tokens=max_tokens,
                                                               ignore_eos=True)):
                if isinstance(msg, TokenChunk):
                    self.tokens += msg.token_ids
                else:
                    self.reason = msg.reason
        except (RequestError, TimeoutError) as e:
            self.error = e
        finally:
            client.close()

    def join(self) -> None:
        self.thread.join(timeout=60)
        assert not self.thread.is_alive(), "request did not end"


def prefilling(p_addr: str) -> bool:
    s = stats(p_addr)
    return s.running > 0 and s.kv_writes_sent > 0


@pytest.fixture(scope="module")
def trio(model_dir, tmp_path_factory):
    """A slow prefiller; decoders that end failed prefills with an error / prefill locally."""
    tmp = tmp_path_factory.mktemp("trio")
    p_addr, p = node("prefill", model_dir, tmp, "--num-pages", "64", "--max-batch-tokens", "4",
                     env=SLOW)
    d_err = node("decode", model_dir, tmp, "--num-pages", "64", "--prefill-peer", p_addr,
                 "--on-prefill-failure", "error", *FAST_FAILURE)
    d_loc = node("decode", model_dir, tmp, "--num-pages", "64", "--prefill-peer", p_addr,
                 "--on-prefill-failure", "local", *FAST_FAILURE)
    procs = [p, d_err[1], d_loc[1]]
    try:
        for proc in procs:
            proc.wait_ready()
        for addr in (d_err[0], d_loc[0]):
            wait_for(lambda a=addr: stats(a).prefill_peers_alive == 1, what="prefiller seen")
        yield (p_addr, p), d_err[0], d_loc[0]
    finally:
        for proc in procs:
            assert proc.stop() == []


def test_client_abort_during_prefill_frees_pages_on_both_sides(trio, ref):
    (p_addr, _), _, d_addr = trio
    sampling = SamplingParams(max_tokens=4, ignore_eos=True)

    async def run() -> None:
        client = AsyncClient(d_addr)
        try:
            # abort while queued / prefilling, and again once layer writes are flowing
            for when in ("early", "transfer"):
                rid = f"abort-{when}"
                task = asyncio.create_task(client.complete(
                    prompt_token_ids=prompt(LONG), sampling=sampling, request_id=rid))
                await asyncio.to_thread(wait_for, lambda: stats(d_addr).waiting_for_kv == 1)
                if when == "transfer":
                    await asyncio.to_thread(wait_for, lambda: prefilling(p_addr))
                await client.abort(rid)
                _, _, fin = await task
                assert fin.reason == "abort"
                await asyncio.to_thread(wait_for, lambda: pools_full(d_addr))
                await asyncio.to_thread(wait_for, lambda: pools_full(p_addr))
            # stale writes of the aborted attempts never complete a new request
            ids, _, fin = await client.complete(prompt_token_ids=prompt(LONG), sampling=sampling)
            assert ids == ref and fin.reason == "length"
        finally:
            await client.close()

    asyncio.run(run())
    d = stats(d_addr)
    assert d.aborted == 2 and d.started == d.finished + d.aborted + d.errored


def test_layer_writes_start_before_the_step_ends(trio, ref):
    (p_addr, _), _, d_addr = trio
    before = stats(p_addr).layerwise_steps
    req = Background(d_addr, prompt(LONG))
    req.join()
    assert req.tokens == ref
    # with layers this slow, every prefill step shipped layer 0 while layer 1 still computed
    assert stats(p_addr).layerwise_steps - before >= (LONG - 1) // 4 // 2


def test_prefiller_killed_mid_prefill(trio, ref):
    (p_addr, p), d_err, d_loc = trio
    err = Background(d_err, prompt(LONG))
    loc = Background(d_loc, prompt(LONG))
    wait_for(lambda: prefilling(p_addr), what="prefill under way")
    p.proc.send_signal(signal.SIGKILL)
    err.join()
    loc.join()
    assert isinstance(err.error, RequestError) and err.error.error.code == "prefill_failed"
    assert loc.error is None and loc.tokens == ref  # prefilled locally instead
    for addr in (d_err, d_loc):
        wait_for(lambda a=addr: pools_full(a), what="decoder pool full")
        s = stats(addr)
        assert s.prefill_peers_alive == 0
        assert s.started == s.finished + s.aborted + s.errored


def test_decoder_killed_prefiller_frees_pages(model_dir, tmp_path):
    p_addr, p = node("prefill", model_dir, tmp_path, "--num-pages", "64", "--max-batch-tokens",
                     "4", "--prefill-timeout", "3", env=SLOW)
    d_addr, d = node("decode", model_dir, tmp_path, "--num-pages", "64", "--prefill-peer", p_addr,
                     "--heartbeat", "0.2")
    try:
        p.wait_ready()
        d.wait_ready()
        wait_for(lambda: stats(d_addr).prefill_peers_alive == 1, what="prefiller seen")
        req = Background(d_addr, prompt(LONG), timeout=3)  # its decoder dies: no answer
        wait_for(lambda: prefilling(p_addr), what="prefill under way")
        d.proc.send_signal(signal.SIGKILL)
        req.join()
        wait_for(lambda: pools_full(p_addr), timeout=30, what="prefiller pool full")
        s = stats(p_addr)
        assert s.started == s.finished + s.aborted + s.errored
        assert s.transfers_in_flight == 0
    finally:
        assert p.stop() == []
        d.stop()


def test_retry_on_another_prefiller(model_dir, tmp_path, ref):
    prefillers = [node("prefill", model_dir, tmp_path, "--num-pages", "64", "--max-batch-tokens",
                       "4", env=SLOW) for _ in range(2)]
    d_addr, d = node("decode", model_dir, tmp_path, "--num-pages", "64", "--prefill-peer",
                     prefillers[0][0], "--prefill-peer", prefillers[1][0],
                     "--on-prefill-failure", "retry", *FAST_FAILURE)
    procs = [p for _, p in prefillers] + [d]
    try:
        for proc in procs:
            proc.wait_ready()
        wait_for(lambda: stats(d_addr).prefill_peers_alive == 2, what="both prefillers seen")
        req = Background(d_addr, prompt(LONG))
        wait_for(lambda: any(prefilling(a) for a, _ in prefillers), what="prefill under way")
        busy = next(p for a, p in prefillers if prefilling(a))
        busy.proc.send_signal(signal.SIGKILL)
        req.join()
        assert req.error is None and req.tokens == ref  # finished on the other prefiller
        wait_for(lambda: pools_full(d_addr), what="decoder pool full")
    finally:
        for proc in procs:
            proc.stop()
