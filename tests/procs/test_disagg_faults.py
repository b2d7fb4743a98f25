"""Faults with real processes: prefiller killed, decoder killed, client aborts mid-prefill."""

from __future__ import annotations

import asyncio
import signal

import pytest

from disagg.client import AsyncClient
from disagg.protocol import SamplingParams
from nodes import Req, node, pools_full, prompt, running, stats, wait_for
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


def prefilling(p_addr: str) -> bool:
    s = stats(p_addr)
    return s.running > 0 and s.kv_writes_sent > 0


@pytest.fixture(scope="module")
def trio(model_dir, tmp_path_factory):
    """A slow prefiller; decoders that end failed prefills with an error / prefill locally.
    The tests send the same prompt again and again, each to catch a fault during a real
    prefill: no prefix caching here (it would serve the repeats from the caches)."""
    tmp = tmp_path_factory.mktemp("trio")
    nocache = "--no-prefix-caching"
    p_addr, p = node("prefill", model_dir, tmp, "--num-pages", "64", "--max-batch-tokens", "4",
                     "--layerwise-min-tokens", "0",  # its 4-token steps ship layer by layer
                     nocache, env=SLOW)
    d_err = node("decode", model_dir, tmp, "--num-pages", "64", "--prefill-peer", p_addr,
                 "--on-prefill-failure", "error", nocache, *FAST_FAILURE)
    d_loc = node("decode", model_dir, tmp, "--num-pages", "64", "--prefill-peer", p_addr,
                 "--on-prefill-failure", "local", nocache, *FAST_FAILURE,
                 "--overlap-schedule", "on")  # decode steps deferred around the faults
    with running([p, d_err[1], d_loc[1]], [d_err[0], d_loc[0]]):
        yield (p_addr, p), d_err[0], d_loc[0]


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
    req = Req(d_addr, prompt(LONG))
    req.join()
    assert req.tokens == ref
    # with layers this slow, every prefill step shipped layer 0 while layer 1 still computed
    assert stats(p_addr).layerwise_steps - before >= (LONG - 1) // 4 // 2


def test_prefiller_killed_mid_prefill(trio, ref):
    (p_addr, p), d_err, d_loc = trio
    err = Req(d_err, prompt(LONG))
    loc = Req(d_loc, prompt(LONG))
    wait_for(lambda: prefilling(p_addr), what="prefill under way")
    p.proc.send_signal(signal.SIGKILL)
    err.join()
    loc.join()
    assert err.code == "prefill_failed"
    assert loc.code is None and loc.tokens == ref  # prefilled locally instead
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
    with running([p, d], [d_addr]):
        req = Req(d_addr, prompt(LONG), timeout=3)  # its decoder dies: no answer
        wait_for(lambda: prefilling(p_addr), what="prefill under way")
        d.proc.send_signal(signal.SIGKILL)
        req.join(terminal=False)
        wait_for(lambda: pools_full(p_addr), timeout=30, what="prefiller pool full")
        s = stats(p_addr)
        assert s.started == s.finished + s.aborted + s.errored
        assert s.transfers_in_flight == 0


def test_retry_on_another_prefiller(model_dir, tmp_path, ref):
    prefillers = [node("prefill", model_dir, tmp_path, "--num-pages", "64", "--max-batch-tokens",
                       "4", env=SLOW) for _ in range(2)]
    d_addr, d = node("decode", model_dir, tmp_path, "--num-pages", "64", "--prefill-peer",
                     prefillers[0][0], "--prefill-peer", prefillers[1][0],
                     "--on-prefill-failure", "retry", *FAST_FAILURE, "--overlap-schedule", "on")
    with running([p for _, p in prefillers] + [d], [d_addr], prefillers=2):
        req = Req(d_addr, prompt(LONG))
        wait_for(lambda: any(prefilling(a) for a, _ in prefillers), what="prefill under way")
        busy = next(p for a, p in prefillers if prefilling(a))
        busy.proc.send_signal(signal.SIGKILL)
        req.join()
        assert req.code is None and req.tokens == ref  # finished on the other prefiller
        wait_for(lambda: pools_full(d_addr), what="decoder pool full")
