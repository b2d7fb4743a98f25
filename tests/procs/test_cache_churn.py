"""Multi-turn traffic with prefix caching through a prefill/decode pair on a small decode
pool: conversations share system prompts and resend their history every turn, so the turns
queued for a remote prefill find their earlier turns in the decoder's cache. Before the
decoder took a queued request's cached pages only with the rest of its pages (all or
nothing), those waiting requests held the pool between them and the node stopped for good."""

from __future__ import annotations

import asyncio
import random

import pytest

from disagg.client import AsyncClient
from disagg.protocol import Finished, SamplingParams
from nodes import PAGE, node, pools_full, running, stats, tokens, wait_for
from tinymodels import make_tiny_model

pytestmark = pytest.mark.fabric

CONVERSATIONS = 32
TURNS = 5
NEW = 4
SYSTEMS = [[3 + 17 * s + i for i in range(5 * PAGE)] for s in range(3)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model("llama", tmp_path_factory.mktemp("churn") / "llama")


async def conversation(client: AsyncClient, c: int, rng: random.Random,
                       outcomes: list[str]) -> int:
    """Turns of one conversation; returns the prompt tokens its turns found cached."""
    history = list(SYSTEMS[c % len(SYSTEMS)])
    cached = 0
    for _ in range(TURNS):
        history += [rng.randrange(3, 300) for _ in range(rng.randrange(2, 2 * PAGE))]
        try:
            ids, _, fin = await client.complete(
                prompt_token_ids=history, sampling=SamplingParams(max_tokens=NEW,
                                                                  ignore_eos=True),
                timeout=60)
        except TimeoutError:
            outcomes.append("hung")
            return cached
        outcomes.append(fin.reason if isinstance(fin, Finished) else "error")
        cached += fin.usage.cached_tokens
        history += ids
    return cached


def test_multi_turn_traffic_with_caching_on_a_small_decode_pool_never_wedges(model_dir,
                                                                             tmp_path):
    p_addr, p = node("prefill", model_dir, tmp_path, "--num-pages", "96")
    # 48 pages of 4 tokens: at most a handful of the conversations' turns fit at once
    d_addr, d = node("decode", model_dir, tmp_path, "--num-pages", "48", "--prefill-peer",
                     p_addr, "--heartbeat", "0.2", "--queue-timeout", "120")
    with running([p, d], [d_addr]):
        async def run() -> tuple[list[str], int]:
            clients = [AsyncClient(d_addr) for _ in range(4)]
            outcomes: list[str] = []
            try:
                hits = await asyncio.gather(*[
                    conversation(clients[c % 4], c, random.Random(c), outcomes)
                    for c in range(CONVERSATIONS)])
            finally:
                for cl in clients:
                    await cl.close()
            return outcomes, sum(hits)

        outcomes, cached = asyncio.run(run())
        assert outcomes.count("length") == CONVERSATIONS * TURNS, (
            f"{outcomes.count('hung')} hung, {outcomes.count('error')} errors; decoder "
            f"{stats(d_addr)}")
        assert cached > 0  # the turns did hit the decoder's (or the prefiller's) cache
        assert tokens(d_addr, [5], NEW)  # a one-token prompt (no prefiller needed) is served
        for addr in (p_addr, d_addr):
            wait_for(lambda a=addr: pools_full(a), what=f"full pool on {addr}")
            s = stats(addr)
            assert s.started == s.finished + s.aborted + s.errored and s.errored == 0
