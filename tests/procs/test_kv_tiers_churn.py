"""KV tiers under churn (CPU, one mixed node with 10 device pages and a host tier): many
clients at once whose prefixes bounce between the tiers stay token-exact and leave every
page free; clients that abort or disconnect while their prefix comes back from the host tier
leak nothing; a second tenant (another cache salt) gets no tier hit on the first's prompt;
the executor killed while tier copies are in flight: the node restarts and serves exactly."""

from __future__ import annotations

import threading

import pytest

from disagg.client import Client
from disagg.protocol import Finished, SamplingParams
from nodes import PAGE, node, pools_full, running, stats, wait_for
from tinymodels import hf_greedy, make_tiny_model

from .test_executor_restart import kill_executor, readies, wait_restarted

NEW = 3


@pytest.fixture(scope="module")
def tiered(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("churn")
    model_dir = make_tiny_model("llama", tmp / "llama")
    addr, proc = node("mixed", model_dir, tmp, "--num-pages", "10", "--kv-host-cache-mb", "1")
    with running([proc]):
        yield addr, model_dir, proc


def ask(addr: str, ids: list[int], salt: str | None = None) -> tuple[list[int], Finished]:
    client = Client(addr)
    try:
        msgs = list(client.generate(prompt_token_ids=ids, sampling=SamplingParams(
            max_tokens=NEW, ignore_eos=True), cache_salt=salt, timeout=120))
    finally:
        client.close()
    fin = msgs[-1]
    assert isinstance(fin, Finished), fin
    return [t for m in msgs for t in getattr(m, "token_ids", [])], fin


def flood(addr: str, base: int) -> None:
    """Prompts that take every device page: what was cached goes to the host tier."""
    for i in range(2):
        ask(addr, [base + 7 * i + j % 250 for j in range(9 * PAGE)])


def test_many_clients_whose_prefixes_bounce_between_tiers_are_exact_and_leak_nothing(tiered):
    addr, model_dir, _ = tiered
    families = [[3 + 37 * f + i for i in range(3 * PAGE)] for f in range(4)]
    prompts = [fam + [200 + k, 201 + k] for fam in families for k in range(3)]  # 12 clients
    before = stats(addr)
    for round_ in range(2):
        got: dict[int, list[int] | BaseException] = {}

        def one(i: int, got: dict = got) -> None:
            try:
                got[i] = ask(addr, prompts[i])[0]
            except BaseException as e:  # noqa: BLE001 - reported below
                got[i] = e

        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=180)
        for i, p in enumerate(prompts):
            assert got.get(i) == hf_greedy(model_dir, p, NEW), f"round {round_} client {i}"
        flood(addr, 100 + round_)
    wait_for(lambda: pools_full(addr), what="idle pool")
    s = stats(addr)
    assert s.tier_hit_tokens_host > before.tier_hit_tokens_host  # the host tier served
    assert 0 < s.host_cache_pages_used <= s.host_cache_pages_total


def test_clients_aborting_or_disconnecting_during_a_host_tier_reload_leak_nothing(tiered):
    addr, model_dir, _ = tiered
    prompt = [11 + i for i in range(6 * PAGE + 1)]
    ask(addr, prompt)
    for attempt in range(4):
        flood(addr, 150 + attempt)  # the prompt's pages: host tier only
        client = Client(addr)
        try:
            stream = client.generate(prompt_token_ids=prompt, sampling=SamplingParams(
                max_tokens=50, ignore_eos=True), timeout=60)
            if attempt % 2:
                next(stream)  # one message in, then the client leaves (an abort)
                stream.close()
        finally:
            client.close()  # even %: gone before any answer (a disconnect)
    wait_for(lambda: pools_full(addr), what="idle pool after aborts")
    flood(addr, 190)
    ids, fin = ask(addr, prompt)
    assert ids == hf_greedy(model_dir, prompt, NEW)
    assert fin.usage.cached_tokens == 6 * PAGE  # served from the host tier
    wait_for(lambda: pools_full(addr), what="idle pool")


def test_a_second_tenant_gets_no_tier_hit_on_the_first_tenants_prompt(tiered):
    addr, model_dir, _ = tiered
    prompt = [23 + 3 * i for i in range(5 * PAGE + 1)]
    ask(addr, prompt, salt="alice")
    flood(addr, 210)  # alice's pages: in the host tier now
    before = stats(addr)
    ids, fin = ask(addr, prompt, salt="bob")
    assert ids == hf_greedy(model_dir, prompt, NEW) and fin.usage.cached_tokens == 0
    after = stats(addr)
    assert after.tier_hit_tokens_host == before.tier_hit_tokens_host
    assert after.tier_hit_tokens_device == before.tier_hit_tokens_device
    flood(addr, 230)
    _, fin = ask(addr, prompt, salt="alice")  # alice's own prefix still hits
    assert fin.usage.cached_tokens == 5 * PAGE


def test_the_executor_killed_while_tier_copies_are_in_flight_restarts_and_serves_exactly(
        tiered):
    addr, model_dir, proc = tiered
    prompts = [[41 + 5 * c + i for i in range(4 * PAGE + 1)] for c in range(3)]
    for p in prompts:
        ask(addr, p)
    starts = len(readies(proc))
    load = threading.Thread(target=lambda: _swallow(lambda: flood(addr, 250)))
    load.start()  # pages go to the host tier (copies out) while the executor dies
    kill_executor(proc)
    load.join(timeout=120)
    wait_restarted(proc, starts + 1)
    for p in prompts:  # the host tier's entries: served only as the KV they hold
        assert ask(addr, p)[0] == hf_greedy(model_dir, p, NEW)
    wait_for(lambda: pools_full(addr), what="idle pool after the restart")
    s = stats(addr)
    assert s.host_cache_pages_used <= s.host_cache_pages_total


def _swallow(fn) -> None:
    try:
        fn()
    except Exception:  # noqa: BLE001 - the flood's requests end with the executor
        pass
