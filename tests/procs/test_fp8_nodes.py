"""An FP8 checkpoint (the quantizer's block format) served by real nodes: mixed, and
prefill -> decode across mismatched TP (1 -> 2, 2 -> 1), token-exact with transformers reading
the same FP8 directory (its fine-grained FP8 loader, dequantizing on the CPU)."""

from __future__ import annotations

import pytest

from disagg.model.quantize import quantize_dir
from nodes import node, pools_full, running, stats, tokens, wait_for
from tinymodels import hf_greedy, make_tiny_model

pytestmark = pytest.mark.fabric

NEW = 5
PROMPTS = [[9], list(range(11, 17)), list(range(30, 44)), [3 + (i * 41) % 290 for i in range(23)]]


@pytest.fixture(scope="module")
def fp8_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8-nodes")
    src = make_tiny_model("llama", root / "src")
    quantize_dir(src, root / "fp8", (8, 8))  # blocks that TP 2 shards keep whole
    return root / "fp8"


@pytest.fixture(scope="module")
def expected(fp8_dir):
    return [hf_greedy(fp8_dir, p, NEW) for p in PROMPTS]


def test_a_mixed_node_serves_an_fp8_checkpoint(fp8_dir, expected, tmp_path):
    addr, proc = node("mixed", fp8_dir, tmp_path, "--num-pages", "64", "--max-batch-tokens", "6")
    with running([proc]):
        assert [tokens(addr, p, NEW) for p in PROMPTS] == expected
        wait_for(lambda: pools_full(addr), what="full pool")


@pytest.mark.parametrize("p_tp, d_tp", [(1, 2), (2, 1)])
def test_an_fp8_checkpoint_across_the_split_with_mismatched_tp(fp8_dir, expected, tmp_path,
                                                                p_tp, d_tp):
    p_addr, p = node("prefill", fp8_dir, tmp_path, "--num-pages", "64", "--tp", str(p_tp),
                     "--max-batch-tokens", "7")
    d_addr, d = node("decode", fp8_dir, tmp_path, "--num-pages", "64", "--tp", str(d_tp),
                     "--prefill-peer", p_addr, "--heartbeat", "0.2")
    with running([p, d], [d_addr]):
        before = stats(d_addr).kv_units_received
        assert [tokens(d_addr, p, NEW) for p in PROMPTS] == expected
        assert stats(d_addr).kv_units_received > before  # the longer prompts came remotely
        for addr in (p_addr, d_addr):
            wait_for(lambda a=addr: pools_full(a), what=f"full pool on {addr}")


def test_random_weights_with_quantization_fp8(tmp_path):
    """``--random-weights --quantization fp8``: FP8 shapes without a checkpoint; the node's
    tokens are those of the same seed's weights rounded to 128x128 block FP8."""
    import json

    from disagg.llm import LLM
    from disagg.model.config import ModelArch
    from disagg.model.fp8 import Fp8Format
    from disagg.model.loader import random_model
    from disagg.protocol import SamplingParams

    shape = tmp_path / "shape"
    shape.mkdir()
    cfg = json.loads((make_tiny_model("llama", tmp_path / "src") / "config.json").read_text())
    (shape / "config.json").write_text(json.dumps(cfg))
    want = LLM(random_model(ModelArch.from_dir(shape), "float32", "cpu", 5,
                            fp8=Fp8Format("fp8", (128, 128))), num_pages=32, page_size=4)
    expected = [o.token_ids for o in want.generate(PROMPTS, SamplingParams(max_tokens=NEW,
                                                                           ignore_eos=True))]
    addr, proc = node("mixed", shape, tmp_path, "--num-pages", "32", "--random-weights",
                      "--seed", "5", "--quantization", "fp8", "--dtype", "float32")
    with running([proc]):
        assert [tokens(addr, p, NEW) for p in PROMPTS] == expected
