"""A job's late writes into an aborted attempt's window (real processes, libfabric tcp).

A decoder that aborts a remote prefill keeps the attempt's window (its registrations' keys)
until the attempt's page fence lifts, so writes its prefiller already had on their way land
in the fenced pages. Revoked at once (before), the first such write carried a key the decoder
no longer held, libfabric 1.17's tcp receiver dropped the whole connection, and the writes of
every other job on it failed: an innocent request sharing that prefiller was prefilled
locally (``transfer_failed``)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from disagg.client import AsyncClient
from disagg.protocol import SamplingParams
from nodes import node, pools_full, prompt, running, stats, wait_for
from tinymodels import hf_greedy, make_tiny_model

pytestmark = pytest.mark.fabric

WRAPPER = str(Path(__file__).with_name("late_abort_prefiller.py"))
# each layer of a prefill step takes 0.5 s (a step of the tiny llama's 2 layers: 1 s); the
# prefiller reads each AbortPrefill 3 s late, so the aborted job computes and writes meanwhile
SLOW = {"DISAGG_TEST_LAYER_DELAY_S": "0.5", "DISAGG_TEST_ABORT_LATE_S": "3.0"}
SHORT, LONG = 41, 81  # 40 and 80 prefill tokens: one step of 48 holds a short one and 8 more
SAMPLING = SamplingParams(max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model("llama", tmp_path_factory.mktemp("late_writes") / "llama")


@pytest.fixture(scope="module")
def pair(model_dir, tmp_path_factory):
    """A slow prefiller that takes aborts late; a decoder that prefills locally what its
    prefiller fails (so a failed transfer shows as KV units never received, not an error)."""
    tmp = tmp_path_factory.mktemp("pair")
    nocache = "--no-prefix-caching"  # every request is prefilled, and remotely
    p_addr, p = node("prefill", model_dir, tmp, "--num-pages", "128", "--max-batch-tokens", "48",
                     "--layerwise-min-tokens", "0", nocache, env=SLOW, entry=[WRAPPER])
    d_addr, d = node("decode", model_dir, tmp, "--num-pages", "64", "--prefill-peer", p_addr,
                     "--on-prefill-failure", "local", nocache, "--heartbeat", "0.2",
                     "--peer-timeout", "3")
    with running([p, d], [d_addr]):
        yield p_addr, d_addr


def test_an_abort_crossing_its_jobs_writes_fails_no_other_request(pair, model_dir):
    p_addr, d_addr = pair
    blocker, aborted, victim = prompt(SHORT, 1), prompt(SHORT, 2), prompt(LONG, 3)
    refs = {n: hf_greedy(model_dir, ids, 4) for n, ids in (("b", blocker), ("v", victim))}

    async def run() -> dict[str, int]:
        client = AsyncClient(d_addr)
        try:
            # alone first: the KV units each prompt's transfer lands here
            units = {}
            for name, ids in (("b", blocker), ("v", victim)):
                before = stats(d_addr).kv_units_received
                got, _, fin = await client.complete(prompt_token_ids=ids, sampling=SAMPLING)
                assert got == refs[name] and fin.reason == "length"
                units[name] = stats(d_addr).kv_units_received - before
            d0, p0 = stats(d_addr), stats(p_addr)
            # the blocker's step computes while the aborted request and the victim reach the
            # prefiller: the next step holds both, and per layer the aborted job's writes go
            # first, the victim's behind them on the same connection
            tasks = {}
            for name, ids in (("b", blocker), ("a", aborted), ("v", victim)):
                tasks[name] = asyncio.create_task(client.complete(
                    prompt_token_ids=ids, sampling=SAMPLING, request_id=name))
                await asyncio.to_thread(wait_for,
                                        lambda n=len(tasks): stats(d_addr).waiting_for_kv == n)
            # aborted here at once, read by the prefiller 3 s late: its job's writes, all
            # posted meanwhile, reach the decoder after the abort
            await client.abort("a")
            _, _, fin = await tasks["a"]
            assert fin.reason == "abort"
            for name in ("b", "v"):
                got, _, fin = await tasks[name]
                assert got == refs[name] and fin.reason == "length", name
        finally:
            await client.close()
        return {"units": d0.kv_units_received + units["b"] + units["v"],
                "p_done": p0.finished + p0.aborted, "p_errored": p0.errored}

    want = asyncio.run(run())
    # the victim's KV came by transfer, none of it prefilled here
    assert stats(d_addr).kv_units_received == want["units"]
    wait_for(lambda: pools_full(d_addr) and pools_full(p_addr), what="pools full")
    d, p = stats(d_addr), stats(p_addr)
    assert d.pages_fenced == 0 and d.transfers_in_flight == 0
    # no write of the three jobs failed, the aborted one's landing in its fenced pages (it
    # normally finishes before its abort is read); before, its first write dropped the
    # connection, and it and the victim failed transfer_failed
    assert p.errored == want["p_errored"]
    assert p.finished + p.aborted == want["p_done"] + 3
    assert d.started == d.finished + d.aborted + d.errored
