"""The start's parallel warm-up (disagg.engine.warmup): which executors capture decode graphs
(CPU), and on a GPU that the warm-up on its scratch cache leaves nothing for the sequential
warm-ups on the real cache (another page count) to compile."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from disagg.config import ExecutorConfig, NodeConfig, SchedulerConfig
from disagg.engine.warmup import graphs_refusal
from disagg.model.ep import ExpertParallel
from disagg.model.tp import TensorParallel

QWEN3 = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=1000,
             hidden_size=256, intermediate_size=512, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=64,
             max_position_embeddings=4096, rms_norm_eps=1e-6, rope_theta=1e6,
             tie_word_embeddings=False, torch_dtype="bfloat16")


def test_graphs_are_captured_only_where_the_executor_can_replay_them():
    cuda = NodeConfig(devices=["cuda:0"])
    triton = SimpleNamespace(name="triton")
    dense = SimpleNamespace(arch=SimpleNamespace(moe=None), dtype=torch.bfloat16)
    one = TensorParallel()
    assert graphs_refusal(cuda, one, triton, dense) is None
    assert graphs_refusal(NodeConfig(devices=["cpu"]), one, triton, dense) == ""
    eager = NodeConfig(devices=["cuda:0"], executor=ExecutorConfig(cuda_graphs=False))
    assert graphs_refusal(eager, one, triton, dense) == ""
    assert "--tp > 1" in str(graphs_refusal(cuda, TensorParallel(0, 2), triton, dense))
    assert "--expert-parallel" in str(graphs_refusal(
        cuda, TensorParallel(ep=ExpertParallel(0, 2)), triton, dense))
    assert "triton" in str(graphs_refusal(cuda, one, SimpleNamespace(name="torch"), dense))
    moe32 = SimpleNamespace(arch=SimpleNamespace(moe=object()), dtype=torch.float32)
    assert "MoE" in str(graphs_refusal(cuda, one, triton, moe32))


def test_prefill_nodes_capture_graphs_unless_told_not_to_or_drafting(monkeypatch):
    triton = SimpleNamespace(name="triton")
    dense = SimpleNamespace(arch=SimpleNamespace(moe=None), dtype=torch.bfloat16)
    prefill = NodeConfig(devices=["cuda:0"], role="prefill")
    drafting = NodeConfig(devices=["cuda:0"], role="prefill", scheduler=SchedulerConfig(
        speculative_method="draft", num_speculative_tokens=2))
    monkeypatch.setenv("DISAGG_PREFILL_GRAPHS", "0")
    assert graphs_refusal(prefill, TensorParallel(), triton, dense) == ""
    monkeypatch.delenv("DISAGG_PREFILL_GRAPHS")  # the default
    assert graphs_refusal(prefill, TensorParallel(), triton, dense) is None
    assert graphs_refusal(drafting, TensorParallel(), triton, dense) == ""
    assert "--tp > 1" in str(graphs_refusal(prefill, TensorParallel(0, 2), triton, dense))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_parallel_warm_up_leaves_nothing_to_compile(tmp_path):
    from triton import knobs

    from disagg.engine.attention import get_backend
    from disagg.engine.kv_memory import KVLayout
    from disagg.engine.runner import ModelRunner, profile_peak_memory
    from disagg.engine.sampling import sample_device
    from disagg.engine.warmup import parallel_warmup
    from disagg.model.config import ModelArch
    from disagg.model.loader import random_model
    from disagg.protocol.executor import SeqChunk

    (tmp_path / "config.json").write_text(json.dumps(QWEN3))
    dev = torch.device("cuda")
    model = random_model(ModelArch.from_dir(tmp_path), "bfloat16", dev, seed=3)
    backend = get_backend("triton", dev)
    page, max_len, max_tokens, max_running = 16, 1024, 512, 48
    report = parallel_warmup(model, backend, page, torch.bfloat16, max_running, max_tokens,
                             max_running, max_len, True, 8)
    assert report.failed == [] and report.jobs >= 3  # the decode buckets, the prefill steps, ...
    # (10 jobs on an H100, 2026-12-07: the run stopped at this line when it asked for > 10)
    arch = model.arch
    kv = torch.zeros(KVLayout(arch.num_layers, 203, arch.num_kv_heads, page, arch.head_dim,
                              torch.bfloat16, arch.kv_parts).shape, dtype=torch.bfloat16,
                     device=dev)
    compiled: list[str] = []
    knobs.runtime.jit_post_compile_hook = lambda **kw: compiled.append(kw.get("repr", ""))
    try:
        runner = ModelRunner(model, kv, backend)
        runner.enable_cuda_graphs(max_running, max_len)  # and the eager decode launch shapes
        runner.warm_prefill(max_tokens, max_len)
        profile_peak_memory(model, backend, page, max_tokens, max_running, max_len)
        rows = [SeqChunk(slot=i, token_ids=[1], start_pos=0, block_table=[0], sample=True,
                         temperature=0.8, top_p=0.9, seed=i) for i in range(5)]
        sample_device(torch.randn(5, arch.vocab_size, device=dev), rows)  # the race kernel
        torch.cuda.synchronize()
    finally:
        knobs.runtime.jit_post_compile_hook = None
    assert compiled == []
