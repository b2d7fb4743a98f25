"""Speculative decoding (prompt lookup) in real nodes: a mixed node and a decoder fed by a
prefiller keep greedy output token-exact with transformers while drafts are accepted and
rejected; Stats and Prometheus count them; ``disagg-bench serve --workload copy`` reports the
acceptance rate; pools full afterwards."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import urllib.request

import pytest

from disagg.client import Client
from nodes import PAGE, greedy, node, pools_full, prompt, running, stats, wait_for
from tinymodels import TINY, free_port, hf_greedy, make_tiny_model

SPEC = ["--speculative-method", "ngram", "--num-speculative-tokens", "3"]
PROMPTS = [prompt(6) * 2 + prompt(3), prompt(2 * PAGE + 1), [9] * 10]
NEW = 12


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model("llama", tmp_path_factory.mktemp("spec") / "llama")


def generate(addr: str, ids: list[int]) -> list[int]:
    c = Client(addr)
    try:
        return [t for m in c.generate(prompt_token_ids=ids, sampling=greedy(NEW))
                for t in getattr(m, "token_ids", [])]
    finally:
        c.close()


def test_a_mixed_node_drafts_and_stays_token_exact(model_dir, tmp_path):
    metrics = f"127.0.0.1:{free_port()}"
    addr, proc = node("mixed", model_dir, tmp_path, "--num-pages", "64", "--max-batch-tokens",
                      "8", "--metrics-listen", metrics, *SPEC)
    with running([proc]):
        for ids in PROMPTS:
            assert generate(addr, ids) == hf_greedy(model_dir, ids, NEW), ids
        s = stats(addr)
        assert 0 < s.spec_accepted_tokens < s.spec_draft_tokens

        def exported() -> bool:  # the endpoint polls the node's Stats once a second
            text = urllib.request.urlopen(f"http://{metrics}/metrics", timeout=10).read().decode()
            return all(re.search(rf"disagg_node_spec_{name}_tokens_total{{[^}}]*}} "
                                 rf"{float(value)}\n", text)
                       for name, value in (("draft", s.spec_draft_tokens),
                                           ("accepted", s.spec_accepted_tokens)))

        wait_for(exported, what="Prometheus counters of drafted and accepted tokens")
        out = tmp_path / "copy.json"
        r = subprocess.run([sys.executable, "-m", "disagg.bench", "serve", "--connect", addr,
                            "--workload", "copy", "--num-prompts", "4", "--input-len", "16",
                            "--output-len", "8", "--vocab-size", str(TINY["vocab_size"]),
                            "--warmup", "1", "--timeout", "60", "--json", str(out)],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        spec = json.loads(out.read_text())["summary"]["speculative"]
        assert spec["draft_tokens"] > 0 and 0 <= spec["acceptance_rate"] <= 1
        assert "acceptance rate" in r.stdout
        wait_for(lambda: pools_full(addr), what="full pool")


@pytest.mark.fabric
@pytest.mark.parametrize("method", ["ngram", "draft", "draft-other"])
def test_a_decoder_drafts_after_a_remote_prefill(model_dir, tmp_path, method):
    """With a draft model the prefiller prefills the draft too and ships its pages beside the
    model's: the decoder receives every unit of both regions, and its first drafts already see
    the whole prompt (with the model as its own draft, an upper bound, nearly all are
    accepted; a draft blind to the prompt would propose noise). ``draft-other``: a second tiny
    model of the same vocabulary (another architecture) as the draft."""
    spec, prefill_spec = SPEC, []
    if method.startswith("draft"):
        draft = (model_dir if method == "draft"
                 else make_tiny_model("qwen2", tmp_path / "draft", seed=3))
        spec = prefill_spec = ["--speculative-method", "draft", "--draft-model", str(draft),
                               "--num-speculative-tokens", "2"]
    p_addr, p = node("prefill", model_dir, tmp_path, "--num-pages", "64", "--max-batch-tokens",
                     "5", *prefill_spec)
    d_addr, d = node("decode", model_dir, tmp_path, "--num-pages", "64", "--prefill-peer",
                     p_addr, "--heartbeat", "0.2", *spec)
    with running([p, d], [d_addr]):
        for ids in PROMPTS:
            assert generate(d_addr, ids) == hf_greedy(model_dir, ids, NEW), ids
        s = stats(d_addr)
        assert s.kv_units_received > 0 and s.spec_draft_tokens > 0
        if method.startswith("draft"):  # units: every page of the model's and draft's layers
            layers = 2 * TINY["num_hidden_layers"]
            assert s.kv_units_received == sum(layers * -(-(len(ids) - 1) // PAGE) + 1
                                              for ids in PROMPTS)
        if method == "draft":
            assert s.spec_accepted_tokens >= 0.8 * s.spec_draft_tokens
        for addr in (p_addr, d_addr):
            wait_for(lambda a=addr: pools_full(a), what=f"full pool on {addr}")


def test_a_draft_decoder_refuses_a_prefiller_without_the_draft_by_name(model_dir, tmp_path):
    p_addr, p = node("prefill", model_dir, tmp_path, "--num-pages", "32")
    d_addr, d = node("decode", model_dir, tmp_path, "--num-pages", "32", "--prefill-peer",
                     p_addr, "--heartbeat", "0.2", "--speculative-method", "draft",
                     "--draft-model", str(model_dir))
    with running([p, d]):
        wait_for(lambda: "speculative set-up mismatch" in d.log_path.read_text(),
                 what="the refusal in the decoder's log")
        assert stats(d_addr).prefill_peers_alive == 0


@pytest.mark.fabric
def test_deepseeks_mtp_layer_drafts_on_a_mixed_node_and_across_the_split(tmp_path):
    """The prefiller computes the MTP layer's KV over the prompt and ships it (one more
    region, counted), and its last hidden state in the context slot, from which the decoder's
    first step computes the layer at the last prompt token: the decoder then drafts exactly
    what a mixed node drafts."""
    from tinymodels import add_mtp_layer

    path = add_mtp_layer(make_tiny_model("deepseek_v3", tmp_path / "v3"))
    mtp = ["--speculative-method", "mtp", "--num-speculative-tokens", "2"]
    addr, proc = node("mixed", path, tmp_path, "--num-pages", "64", "--max-batch-tokens", "6",
                      *mtp)
    p_addr, p = node("prefill", path, tmp_path, "--num-pages", "64", "--max-batch-tokens", "5",
                     *mtp)
    d_addr, d = node("decode", path, tmp_path, "--num-pages", "64", "--prefill-peer", p_addr,
                     "--heartbeat", "0.2", *mtp)
    with running([proc, p, d], [d_addr]):
        for ids in PROMPTS[:2]:
            ref = hf_greedy(path, ids, NEW)
            assert generate(addr, ids) == ref, ids
            assert generate(d_addr, ids) == ref, ids
        mixed, split = stats(addr), stats(d_addr)
        assert mixed.spec_draft_tokens > 0
        assert (split.spec_draft_tokens, split.spec_accepted_tokens) == (
            mixed.spec_draft_tokens, mixed.spec_accepted_tokens)
        # the model's layers and the MTP layer's
        layers = json.loads((path / "config.json").read_text())["num_hidden_layers"] + 1
        assert split.kv_units_received == sum(layers * -(-(len(ids) - 1) // PAGE) + 1
                                              for ids in PROMPTS[:2])
        for a in (addr, p_addr, d_addr):
            wait_for(lambda a=a: pools_full(a), what=f"full pool on {a}")


def test_mtp_on_a_split_node_needs_one_executor():
    from disagg.cli.node import build_parser, config_from_args
    from disagg.config import ConfigError

    args = build_parser().parse_args(["--role", "decode", "--prefill-peer", "tcp://127.0.0.1:1",
                                      "--speculative-method", "mtp", "--tp", "2"])
    with pytest.raises(ConfigError, match="mtp on prefill and decode nodes runs with one"):
        config_from_args(args)
