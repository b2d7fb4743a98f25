"""KV tiers on nodes (CPU): conversations whose KV is several times the device pool, through a
mixed node and a prefill -> decode pair with host tiers; the host tier serves most hits, every
output equals transformers' greedy one, usage counts every tier's tokens, and the pools (and
the host tier's pins) are whole at the end."""

from __future__ import annotations

import pytest

from disagg.client import Client
from disagg.protocol import Finished, SamplingParams
from nodes import PAGE, node, pools_full, running, stats, wait_for
from tinymodels import hf_greedy, make_tiny_model

CONVERSATIONS = 4
TURNS = 3
NEW = 3


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model("llama", tmp_path_factory.mktemp("tiers") / "llama")


def converse(addr: str, model_dir) -> list[int]:
    """Every conversation's turns, round robin; checks each turn's tokens against
    transformers and returns each later turn's cached tokens."""
    histories = [[3 + 29 * c + i for i in range(3 * PAGE + 1)] for c in range(CONVERSATIONS)]
    cached: list[int] = []
    client = Client(addr)
    try:
        for turn in range(TURNS):
            for c, hist in enumerate(histories):
                msgs = list(client.generate(prompt_token_ids=hist, sampling=SamplingParams(
                    max_tokens=NEW, ignore_eos=True), timeout=60))
                ids = [t for m in msgs for t in getattr(m, "token_ids", [])]
                fin = msgs[-1]
                assert isinstance(fin, Finished), fin
                assert ids == hf_greedy(model_dir, hist, NEW), f"turn {turn} conversation {c}"
                if turn:
                    cached.append(fin.usage.cached_tokens)
                hist += ids + [5 + c, 6 + turn]
    finally:
        client.close()
    return cached


def test_a_mixed_node_serves_later_turns_from_its_host_tier(model_dir, tmp_path):
    """... with a disk directory it cannot write: named in its log, no disk tier, served."""
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    log = tmp_path / "mixed.log"
    # 10 pages of 4 tokens; four conversations of 13-24 tokens each: a few turns at a time
    addr, proc = node("mixed", model_dir, tmp_path, "--num-pages", "10",
                      "--kv-host-cache-mb", "1", "--kv-disk-cache-dir", str(blocker / "kv"),
                      log=log)
    with running([proc]):
        assert f"--kv-disk-cache-dir {blocker / 'kv'} is not writable" in log.read_text()
        assert stats(addr).disk_cache_bytes_total == 0
        cached = converse(addr, model_dir)
        assert all(n >= 3 * PAGE for n in cached), cached  # every later turn hit some tier
        wait_for(lambda: pools_full(addr), what="idle pool")
        s = stats(addr)
        assert s.tier_hit_tokens_host > s.tier_hit_tokens_device
        assert s.tier_hit_tokens_host + s.tier_hit_tokens_device == s.prefix_hit_tokens
        assert s.prefix_hit_tokens == sum(cached)  # usage counts every tier
        assert s.kv_bytes_from_host > 0 and s.kv_bytes_to_host > 0  # (a page may reload twice)
        assert 0 < s.host_cache_pages_used <= s.host_cache_pages_total


def test_a_prefiller_serves_a_decoders_prefix_from_its_host_tier(model_dir, tmp_path):
    p_addr, p = node("prefill", model_dir, tmp_path, "--num-pages", "10",
                     "--kv-host-cache-mb", "1")
    # the decoder keeps no cache of its own: every turn's prefix comes from the prefiller
    d_addr, d = node("decode", model_dir, tmp_path, "--num-pages", "32", "--prefill-peer",
                     p_addr, "--no-prefix-caching", "--heartbeat", "0.2")
    with running([p, d], [d_addr]):
        cached = converse(d_addr, model_dir)
        assert all(n >= 3 * PAGE for n in cached), cached
        for a in (p_addr, d_addr):
            wait_for(lambda a=a: pools_full(a), what=f"idle pool on {a}")
        s = stats(p_addr)
        assert s.tier_hits_host > 0 and s.tier_hit_tokens_host > s.tier_hit_tokens_device
        assert s.kv_bytes_from_host > 0
        # shipped from host memory, as they reloaded for the turn's compute
        assert s.kv_pages_from_host >= s.tier_hit_tokens_host // PAGE > 0


def test_a_decoders_host_tier_serves_its_multi_turn_hits(model_dir, tmp_path):
    """The decoder's small pool lets the earlier turns go to its host tier; before asking
    the prefiller, it brings them back into its device cache and sends them as skip_pages."""
    p_addr, p = node("prefill", model_dir, tmp_path, "--num-pages", "64", "--no-prefix-caching")
    d_addr, d = node("decode", model_dir, tmp_path, "--num-pages", "10", "--prefill-peer",
                     p_addr, "--kv-host-cache-mb", "1", "--heartbeat", "0.2")
    with running([p, d], [d_addr]):
        cached = converse(d_addr, model_dir)
        assert all(n >= 3 * PAGE for n in cached), cached  # the prefiller caches nothing
        for a in (p_addr, d_addr):
            wait_for(lambda a=a: pools_full(a), what=f"idle pool on {a}")
        s = stats(d_addr)
        assert s.tier_hits_host > 0 and s.kv_bytes_from_host > 0
        assert s.tier_hit_tokens_host + s.tier_hit_tokens_device == s.prefix_hit_tokens


def test_a_node_spills_its_host_tier_to_disk_and_reads_it_back(model_dir, tmp_path):
    """More distinct pages than the 1 MiB host tier holds (512 pages of the tiny model): the
    oldest spill to the disk tier; sent again, those prompts' prefixes come back from disk,
    with the same greedy tokens as the first time."""
    addr, proc = node("mixed", model_dir, tmp_path, "--num-pages", "32", "--kv-host-cache-mb",
                      "1", "--kv-disk-cache-dir", str(tmp_path / "kv"))
    prompts = [[3 + (97 * p + 7 * i) % 300 for i in range(16 * PAGE + 1)] for p in range(40)]
    with running([proc]):
        client = Client(addr)
        try:
            def greedy(ids: list[int]) -> list[int]:
                return [t for m in client.generate(prompt_token_ids=ids, sampling=SamplingParams(
                    max_tokens=2, ignore_eos=True), timeout=60) for t in getattr(m, "token_ids", [])]

            first = [greedy(p) for p in prompts]
            wait_for(lambda: stats(addr).disk_cache_bytes_used > 0, what="pages on disk")
            again = [greedy(p) for p in prompts[:8]]  # the oldest: in no tier above disk
        finally:
            client.close()
        assert again == first[:8]
        s = stats(addr)
        assert s.tier_hit_tokens_disk == 8 * 16 * PAGE and s.kv_bytes_from_disk > 0, s
        assert 0 < s.disk_cache_bytes_used <= s.disk_cache_bytes_total
        wait_for(lambda: pools_full(addr), what="idle pool")
