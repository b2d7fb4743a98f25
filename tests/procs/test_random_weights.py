"""``--random-weights``: a node whose model directory holds only ``config.json``."""

from __future__ import annotations

import json

import pytest
import torch

from disagg.client import Client
from disagg.config import ConfigError, ExecutorConfig
from disagg.llm import LLM
from disagg.model.config import ModelArch
from disagg.model.loader import random_model
from disagg.protocol import SamplingParams, TokenChunk
from tinymodels import TINY, NodeProcess, free_port

CONFIG = dict(TINY, architectures=["Qwen3ForCausalLM"], model_type="qwen3", head_dim=32,
              eos_token_id=2, bos_token_id=1, torch_dtype="float32")


@pytest.fixture(scope="module")
def config_only(tmp_path_factory):
    path = tmp_path_factory.mktemp("rw") / "qwen3-shape"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(CONFIG))
    return path


def test_random_model_is_seeded(config_only):
    arch = ModelArch.from_dir(config_only)
    a, b, c = (random_model(arch, "float32", "cpu", s) for s in (7, 7, 8))
    for (name, pa), (_, pb), (_, pc) in zip(a.named_parameters(), b.named_parameters(),
                                            c.named_parameters(), strict=True):
        assert torch.equal(pa, pb), name
        if not name.endswith("norm"):
            assert not torch.equal(pa, pc), name


def test_random_weights_needs_a_model_dir():
    with pytest.raises(ConfigError, match="--random-weights"):
        ExecutorConfig(random_weights=True).validate()
    with pytest.raises(ConfigError, match="--gpu-memory-utilization"):
        ExecutorConfig(gpu_memory_utilization=1.5).validate()


def test_node_serves_random_weights(config_only, tmp_path):
    """No safetensors, no tokenizer: the node serves token ids, and its greedy tokens equal the
    in-process engine's over the same seeded weights."""
    prompt = [5, 6, 7, 8, 9]
    want = LLM(random_model(ModelArch.from_dir(config_only), "float32", "cpu", 3), num_pages=32,
               page_size=4).generate([prompt], SamplingParams(max_tokens=6, ignore_eos=True))
    addr = f"tcp://127.0.0.1:{free_port()}"
    proc = NodeProcess(["--role", "mixed", "--model", str(config_only), "--random-weights",
                        "--seed", "3", "--listen", addr, "--page-size", "4", "--num-pages", "32",
                        "--threads", "1"], tmp_path / "node.log")
    try:
        proc.wait_ready()
        client = Client(addr)
        got: list[int] = []
        for msg in client.generate(prompt_token_ids=prompt,
                                   sampling=SamplingParams(max_tokens=6, ignore_eos=True),
                                   timeout=60):
            if isinstance(msg, TokenChunk):
                got.extend(msg.token_ids)
        client.close()
        assert got == want[0].token_ids
        assert "random weights" in (tmp_path / "node.log").read_text()
    finally:
        assert proc.stop() == []
