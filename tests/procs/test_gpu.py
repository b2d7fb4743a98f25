"""The engine on CUDA: parity with transformers per attention backend, and a node whose KV
memory (cuMem, exported by fd) is mapped into the main process. Runs on the lent GPUs only."""

from __future__ import annotations

import asyncio

import pytest
import torch

from disagg.config import CacheConfig, ExecutorConfig, NodeConfig
from disagg.llm import LLM
from disagg.model.loader import load_model
from disagg.protocol import SamplingParams
from tinymodels import hf_greedy, make_tiny_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

PROMPTS = [[5], [5, 17], [5, 17, 33, 101, 7, 9, 12], list(range(3, 40))]


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_cuda_greedy_matches_transformers(tmp_path, kind, backend):
    path = make_tiny_model(kind, tmp_path / kind)
    refs = [hf_greedy(path, p, 8) for p in PROMPTS]
    model = load_model(path, "float32", "cuda:0")
    llm = LLM(model, num_pages=64, page_size=16, max_batch_tokens=16, attention_backend=backend)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=8, ignore_eos=True))
    assert [o.token_ids for o in outs] == refs


@pytest.mark.parametrize("kind", ["qwen3_moe", "qwen2_moe", "deepseek_v2", "deepseek_v3"])
def test_cuda_moe_and_mla_greedy_matches_transformers(tmp_path, kind):
    """MoE / MLA on CUDA in float32 (the MoE loop; MLA on the Triton latent kernels and on the
    torch backend), with and without prompt-lookup speculation."""
    from disagg.engine.speculative import Speculation

    path = make_tiny_model(kind, tmp_path / kind)
    refs = [hf_greedy(path, p, 8) for p in PROMPTS]
    model = load_model(path, "float32", "cuda:0")
    backends = ["triton", "torch"] if "deepseek" in kind else ["triton"]
    for backend, spec in [(b, s) for b in backends for s in (None, Speculation("ngram", 3))]:
        llm = LLM(model, num_pages=64, page_size=16, max_batch_tokens=16,
                  attention_backend=backend, speculative=spec)
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=8, ignore_eos=True))
        assert [o.token_ids for o in outs] == refs, (backend, spec)


@pytest.mark.parametrize("kind", ["qwen3_moe", "deepseek_v2"])
def test_moe_and_mla_decode_from_cuda_graphs_as_eager(tmp_path, kind):
    """bf16 MoE (fused kernel) and MLA (Triton latent kernels) decode steps replayed from CUDA
    graphs give the eager steps' tokens, plain and with drafts."""
    from disagg.engine.speculative import Speculation

    path = make_tiny_model(kind, tmp_path / kind)
    model = load_model(path, "bfloat16", "cuda:0")
    prompts = PROMPTS + [[9] * 12, [5, 6, 7, 8] * 4]
    for spec in (None, Speculation("ngram", 3)):
        outs = []
        for graphs in (False, True):
            llm = LLM(model, num_pages=64, page_size=16, max_batch_tokens=64,
                      attention_backend="triton", speculative=spec)
            llm.runner.pin_decode_splits(16, 512)
            if graphs:
                llm.runner.enable_cuda_graphs(16, 512, spec_tokens=3 if spec else 0)
            outs.append([o.token_ids for o in llm.generate(prompts, SamplingParams(
                max_tokens=16, ignore_eos=True))])
            if graphs:
                g = llm.runner.spec_graphs if spec else llm.runner.graphs
                assert g is not None and g.replays > 0
        assert outs[0] == outs[1], spec


def test_cuda_graphs_with_drafts_match_eager(tmp_path):
    """Decode steps carrying drafts replay their own CUDA graphs (sequences padded to 1 + K
    rows): the same tokens as eager steps and as transformers (float32), drafts accepted."""
    from disagg.engine.speculative import Speculation

    path = make_tiny_model("llama", tmp_path / "llama")
    model = load_model(path, "float32", "cuda:0")
    prompts = PROMPTS + [[9] * 12, [5, 6, 7, 8] * 4]
    spec = Speculation("ngram", 3)
    outs = []
    for graphs in (False, True):
        llm = LLM(model, num_pages=64, page_size=16, max_batch_tokens=64,
                  attention_backend="triton", speculative=spec)
        if graphs:
            llm.runner.enable_cuda_graphs(16, 512, spec_tokens=3)
        outs.append([o.token_ids for o in llm.generate(prompts, SamplingParams(
            max_tokens=16, ignore_eos=True))])
        if graphs:
            assert llm.runner.spec_graphs is not None and llm.runner.spec_graphs.replays > 0
            assert llm.scheduler.spec_accepted_tokens > 0
    assert outs[0] == outs[1] == [hf_greedy(path, p, 16) for p in prompts]


def test_cuda_node_maps_executor_kv(tmp_path):
    from disagg.client import AsyncClient
    from disagg.node import Node

    path = make_tiny_model("qwen3", tmp_path / "qwen3")
    prompt = PROMPTS[2]
    ref = hf_greedy(path, prompt, 8)

    async def main() -> tuple[list[int], float]:
        cfg = NodeConfig(listen="tcp://127.0.0.1:0", devices=["cuda:0"],
                         executor=ExecutorConfig(model=str(path), dtype="float32"),
                         cache=CacheConfig(page_size=16, num_pages=32))
        node = Node(cfg)
        await node.start()
        try:
            assert node.address is not None
            client = AsyncClient(node.address)
            ids, _, fin = await client.complete(
                prompt_token_ids=prompt, sampling=SamplingParams(max_tokens=8, ignore_eos=True))
            await client.close()
            assert node.executors is not None
            kv, _keep = node.executors.kv_views[0]
            assert kv.is_cuda
            return ids, float(kv.float().abs().sum())
        finally:
            await node.stop()

    ids, mass = asyncio.run(main())
    assert ids == ref
    assert mass > 0  # the main process sees what the executor wrote into its cache
