"""Load through one prefiller and two decoders (real processes, tiny model, CPU): every request
correct (greedy, against ``disagg.llm.LLM`` in-process) and terminal, no page leaks, counters
consistent, and each node's memory (the node and its executor children) stable across runs."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from disagg.client import AsyncClient
from disagg.llm import LLM
from disagg.model.loader import load_model
from disagg.protocol import SamplingParams
from nodes import PAGE, node, pools_full, prompt, running, stats, wait_for
from tinymodels import make_tiny_model, tree_rss_kb

pytestmark = pytest.mark.fabric

NEW = 4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model("llama", tmp_path_factory.mktemp("load") / "llama")


@pytest.fixture(scope="module")
def cluster(model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("load-cluster")
    p_addr, p = node("prefill", model_dir, tmp, "--num-pages", "256", "--max-batch-tokens", "64")
    decoders = [node("decode", model_dir, tmp, "--num-pages", "512", "--prefill-peer", p_addr,
                     "--heartbeat", "0.2") for _ in range(2)]
    with running([p] + [d for _, d in decoders], [a for a, _ in decoders]):
        yield [(p_addr, p)] + decoders


def workload(n: int, salt: int) -> list[list[int]]:
    return [prompt(1 + (i * 7) % 29, salt=salt + i) for i in range(n)]


def expected(model_dir: Path, prompts: list[list[int]]) -> list[list[int]]:
    llm = LLM(load_model(model_dir, "float32"), num_pages=512, page_size=PAGE)
    greedy = SamplingParams(max_tokens=NEW, ignore_eos=True)
    return [o.token_ids for o in llm.generate(prompts, greedy)]


def drive(decoders: list[str], prompts: list[list[int]], concurrency: int) -> list[list[int]]:
    """Every prompt once, at most ``concurrency`` in flight, spread over the decoders."""

    async def run() -> list[list[int]]:
        clients = [AsyncClient(a) for a in decoders]
        sem = asyncio.Semaphore(concurrency)
        greedy = SamplingParams(max_tokens=NEW, ignore_eos=True)

        async def one(i: int, ids: list[int]) -> list[int]:
            async with sem:
                out, _, fin = await clients[i % len(clients)].complete(
                    prompt_token_ids=ids, sampling=greedy, timeout=120)
                assert fin.reason == "length"
                return out

        try:
            return list(await asyncio.gather(*[one(i, p) for i, p in enumerate(prompts)]))
        finally:
            for c in clients:
                await c.close()

    return asyncio.run(run())


def check_nodes(addrs: list[str]) -> None:
    for addr in addrs:
        wait_for(lambda a=addr: pools_full(a), what=f"full pool on {addr}")
        s = stats(addr)
        assert s.started == s.finished + s.aborted + s.errored, s
        assert s.errored == 0 and s.transfers_in_flight == 0, s


def load_runs(cluster, model_dir: Path, n: int, concurrency: int) -> None:
    addrs = [a for a, _ in cluster]
    decoders = addrs[1:]
    rss: list[list[int]] = []
    for run in range(2):
        prompts = workload(n, salt=run * 100_000)
        assert drive(decoders, prompts, concurrency) == expected(model_dir, prompts)
        check_nodes(addrs)
        rss.append([tree_rss_kb(proc.proc.pid) for _, proc in cluster])
    assert stats(decoders[0]).kv_units_received > 0 and stats(decoders[1]).kv_units_received > 0
    for addr, first, second in zip(addrs, rss[0], rss[1], strict=True):
        assert second < first * 1.10, f"{addr}: RSS {first} kB after run 1, {second} kB after run 2"


def test_200_requests_at_concurrency_32(cluster, model_dir):
    load_runs(cluster, model_dir, 200, 32)


@pytest.mark.slow
def test_1000_requests_at_concurrency_128(cluster, model_dir):
    load_runs(cluster, model_dir, 1000, 128)
