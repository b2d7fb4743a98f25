"""FP8 KV pages (``--kv-cache-dtype fp8_e4m3``) across real nodes: a prefill -> decode pair
with FP8 pages on both sides is token-exact with a mixed node with FP8 pages, its prefiller
ships a quarter of the page bytes of a float32 pair (the CPU model dtype) over the same
prompts and units (the context rows stay the model's dtype), and a decoder with float32 pages refuses the FP8 prefiller by name (and
uses its float32 one). FP8 pages also go to and come back from the host KV tier as FP8 bytes."""

from __future__ import annotations

import pytest

from disagg.client import Client
from disagg.protocol import Finished
from nodes import PAGE, greedy, node, pools_full, running, stats, tokens, wait_for
from tinymodels import TINY, add_mtp_layer, make_tiny_model

pytestmark = pytest.mark.fabric

NEW = 5
PROMPTS = [list(range(11, 17)), list(range(30, 44)), [3 + (i * 41) % 290 for i in range(23)]]
FP8 = ("--kv-cache-dtype", "fp8_e4m3")
COMMON = ("--num-pages", "64", "--no-prefix-caching")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_model("llama", tmp_path_factory.mktemp("fp8-kv") / "m")


@pytest.fixture(scope="module")
def m_addr(model, tmp_path_factory):
    """The reference both FP8 pairs are held to: a mixed node with FP8 pages that neither
    caches nor drafts (so what ran on it before changes nothing)."""
    addr, m8 = node("mixed", model, tmp_path_factory.mktemp("fp8-kv-mixed"), *COMMON, *FP8)
    with running([m8]):
        yield addr


def test_an_fp8_pair_matches_an_fp8_mixed_node_and_ships_a_quarter_of_the_bytes(model, m_addr,
                                                                                tmp_path):
    p8_addr, p8 = node("prefill", model, tmp_path, *COMMON, *FP8)
    p32_addr, p32 = node("prefill", model, tmp_path, *COMMON)
    d8_addr, d8 = node("decode", model, tmp_path, *COMMON, *FP8, "--prefill-peer", p8_addr,
                       "--heartbeat", "0.2")
    # a float32 decoder offered both: the FP8 prefiller is refused by name, the other serves
    d32_addr, d32 = node("decode", model, tmp_path, *COMMON, "--prefill-peer", p8_addr,
                         "--prefill-peer", p32_addr, "--heartbeat", "0.2")
    with running([p8, p32, d8, d32], [d8_addr, d32_addr]):
        wait_for(lambda: "KV dtype mismatch: the prefiller's pages are float8_e4m3fn and the "
                 "decoder's float32" in d32.log_path.read_text(), what="the refusal logged")
        want = [tokens(m_addr, p, NEW) for p in PROMPTS]
        before = stats(d8_addr).kv_units_received, stats(d32_addr).kv_units_received
        assert [tokens(d8_addr, p, NEW) for p in PROMPTS] == want
        for p in PROMPTS:
            tokens(d32_addr, p, NEW)
        units8 = stats(d8_addr).kv_units_received - before[0]
        units32 = stats(d32_addr).kv_units_received - before[1]
        assert units8 == units32 > 0  # every prompt came remotely, in the same units
        bytes8, bytes32 = stats(p8_addr).kv_bytes_sent, stats(p32_addr).kv_bytes_sent
        # each request's context write is one float32 hidden row (the model's dtype) either way
        context = len(PROMPTS) * TINY["hidden_size"] * 4
        print(f"kv_bytes_sent fp8 {bytes8} float32 {bytes32} (contexts {context}), "
              f"units {units8}")
        assert (bytes8 - context) * 4 == bytes32 - context
        assert stats(p8_addr).kv_writes_sent > 0
        for addr in (m_addr, p8_addr, p32_addr, d8_addr, d32_addr):
            wait_for(lambda a=addr: pools_full(a), what=f"full pool on {addr}")


def test_fp8_pages_with_prefix_caching_and_drafts_across_the_split(model, m_addr, tmp_path):
    """A conversation resent each turn to a drafting (ngram) decoder with FP8 pages: the pages
    it holds in its prefix cache are not written again, drafts are made, and every turn's
    tokens equal a mixed FP8 node's that neither caches nor drafts."""
    spec = ("--speculative-method", "ngram", "--num-speculative-tokens", "3")
    p_addr, p8 = node("prefill", model, tmp_path, "--num-pages", "64", *FP8)
    d_addr, d8 = node("decode", model, tmp_path, "--num-pages", "64", *FP8, *spec,
                      "--prefill-peer", p_addr, "--heartbeat", "0.2")
    history = [5, 6, 7, 8] * 3 + [9, 10]
    with running([p8, d8], [d_addr]):
        client = Client(d_addr)
        try:
            for turn in range(3):
                before = stats(d_addr).kv_units_received
                ids: list[int] = []
                for msg in client.generate(prompt_token_ids=history, sampling=greedy(NEW)):
                    ids += getattr(msg, "token_ids", [])
                assert isinstance(msg, Finished)
                assert ids == tokens(m_addr, history, NEW), f"turn {turn}"
                held = msg.usage.cached_tokens // PAGE
                written = -(-(len(history) - 1) // PAGE) - held
                assert stats(d_addr).kv_units_received - before == 2 * written + 1
                if turn:
                    assert held >= 3
                history = history + ids + [20 + turn, 21 + turn]
        finally:
            client.close()
        assert stats(d_addr).spec_draft_tokens > 0
        for addr in (m_addr, p_addr, d_addr):
            wait_for(lambda a=addr: pools_full(a), what=f"full pool on {addr}")


def test_fp8_pages_in_the_host_tier_of_a_mixed_node_and_a_prefiller(model, m_addr, tmp_path):
    """FP8 pages behind a tiny device pool (#38 with #33): the host tier keeps them as FP8
    bytes (a quarter of float32's page, so four times the slots in the same MiB), a mixed node
    serves later turns from it and a prefiller ships a decoder's prefix straight from it, and
    every turn's tokens equal the FP8 mixed node's that neither caches nor drafts."""
    tier = ("--num-pages", "10", "--kv-host-cache-mb", "1", *FP8)
    x_addr, x = node("mixed", model, tmp_path, *tier)
    p_addr, p8 = node("prefill", model, tmp_path, *tier)
    d_addr, d8 = node("decode", model, tmp_path, "--num-pages", "32", "--no-prefix-caching",
                      *FP8, "--prefill-peer", p_addr, "--heartbeat", "0.2")
    page_bytes = (TINY["num_hidden_layers"] * 2 * TINY["num_key_value_heads"] * PAGE
                  * TINY["hidden_size"] // TINY["num_attention_heads"])  # one byte an element
    histories = [[3 + 29 * c + i for i in range(3 * PAGE + 1)] for c in range(4)]
    with running([x, p8, d8], [d_addr]):
        for turn in range(3):
            for c, hist in enumerate(histories):
                want = tokens(m_addr, hist, NEW)
                assert tokens(x_addr, hist, NEW) == want, f"mixed, turn {turn} conversation {c}"
                assert tokens(d_addr, hist, NEW) == want, f"split, turn {turn} conversation {c}"
                hist += want + [5 + c, 6 + turn]
        for addr in (x_addr, p_addr):
            s = stats(addr)
            assert s.host_cache_pages_total == (1 << 20) // page_bytes, addr
            assert s.tier_hit_tokens_host > 0 and s.kv_bytes_from_host > 0, addr
        assert stats(p_addr).kv_pages_from_host > 0  # shipped to the decoder from host memory
        for addr in (m_addr, x_addr, p_addr, d_addr):
            wait_for(lambda a=addr: pools_full(a), what=f"full pool on {addr}")


def test_mla_latent_in_fp8_with_mtp_drafts_across_the_split(tmp_path):
    """DeepSeek's latent in FP8 pages, its MTP layer drafting: a prefill -> decode pair drafts
    and accepts exactly what a mixed node with FP8 pages does, token-exact."""
    path = add_mtp_layer(make_tiny_model("deepseek_v3", tmp_path / "v3"))
    mtp = ("--speculative-method", "mtp", "--num-speculative-tokens", "2", *FP8)
    m_addr, m8 = node("mixed", path, tmp_path, "--num-pages", "64", *mtp)
    p_addr, p8 = node("prefill", path, tmp_path, "--num-pages", "64", *mtp)
    d_addr, d8 = node("decode", path, tmp_path, "--num-pages", "64", *mtp, "--prefill-peer",
                      p_addr, "--heartbeat", "0.2")
    with running([m8, p8, d8], [d_addr]):
        for ids in PROMPTS[1:]:
            assert tokens(d_addr, ids, NEW) == tokens(m_addr, ids, NEW), ids
        mixed, split = stats(m_addr), stats(d_addr)
        assert mixed.spec_draft_tokens > 0 and split.kv_units_received > 0
        assert (split.spec_draft_tokens, split.spec_accepted_tokens) == (
            mixed.spec_draft_tokens, mixed.spec_accepted_tokens)
        for addr in (m_addr, p_addr, d_addr):
            wait_for(lambda a=addr: pools_full(a), what=f"full pool on {addr}")
