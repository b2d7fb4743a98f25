"""Greedy outputs token-exact against Hugging Face transformers, in-process engine."""

from __future__ import annotations

import pytest
import torch

from disagg.llm import LLM
from disagg.model.config import ModelArch
from disagg.model.loader import load_model
from disagg.protocol import SamplingParams
from tinymodels import hf_greedy

PAGE = 4
NEW = 6
LENGTHS = [1, 2, PAGE - 1, PAGE, PAGE + 1, 3 * PAGE + 2]


def prompt(n: int, salt: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(1000 + n + salt)
    return torch.randint(3, 300, (n,), generator=g).tolist()


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def arch_case(request, tiny_models):
    path = tiny_models[request.param]
    refs = {n: hf_greedy(path, prompt(n), NEW) for n in LENGTHS}
    return path, refs


def greedy(n=NEW):
    return SamplingParams(max_tokens=n, ignore_eos=True)


@pytest.mark.parametrize("budget", [2048, 3])
def test_greedy_matches_transformers(arch_case, budget):
    path, refs = arch_case
    llm = LLM(load_model(path, "float32"), num_pages=64, page_size=PAGE, max_batch_tokens=budget)
    for n in LENGTHS:  # one at a time
        assert llm.generate([prompt(n)], greedy())[0].token_ids == refs[n], f"prompt length {n}"
    outs = llm.generate([prompt(n) for n in LENGTHS], greedy())  # all in one batch
    assert [o.token_ids for o in outs] == [refs[n] for n in LENGTHS]
    assert llm.pool.num_free == llm.pool.num_pages


def test_arch_features_detected(tiny_models):
    llama = ModelArch.from_dir(tiny_models["llama"])
    qwen2 = ModelArch.from_dir(tiny_models["qwen2"])
    qwen3 = ModelArch.from_dir(tiny_models["qwen3"])
    assert llama.rope_scaling and not llama.qkv_bias and not llama.qk_norm
    assert qwen2.qkv_bias and not qwen2.qk_norm
    assert qwen3.qk_norm and qwen3.head_dim == 32


def test_alone_equals_batched_and_seeded_sampling_reproducible(tiny_models):
    model = load_model(tiny_models["qwen2"], "float32")
    llm = LLM(model, num_pages=128, page_size=PAGE, max_batch_tokens=64)
    lengths = [1, 5, 9, 2, 17, 4, 12, 7]
    params = [SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.0 if i % 2 else 0.9,
                             top_k=0 if i % 3 else 20, top_p=1.0 if i % 4 else 0.8, seed=100 + i)
              for i in range(8)]
    prompts = [prompt(n, salt=7) for n in lengths]
    batched = llm.generate(prompts, params)
    alone = [llm.generate([p], [sp])[0] for p, sp in zip(prompts, params, strict=True)]
    assert [o.token_ids for o in batched] == [o.token_ids for o in alone]
    again = llm.generate([prompts[0]], [params[0]])[0]
    assert again.token_ids == alone[0].token_ids
    other_seed = llm.generate([prompts[0]], [SamplingParams(max_tokens=8, ignore_eos=True,
                                                            temperature=0.9, seed=5)])[0]
    assert other_seed.token_ids != alone[0].token_ids  # the seed matters


def test_preemption_small_pool_still_correct(tiny_models):
    path = tiny_models["llama"]
    model = load_model(path, "float32")
    prompts = [prompt(n, salt=3) for n in (6, 9, 5, 11, 7, 8)]
    roomy = LLM(model, num_pages=128, page_size=PAGE).generate(prompts, greedy(10))
    tight = LLM(model, num_pages=10, page_size=PAGE)  # 40 tokens for six 15-21 token sequences
    outs = tight.generate(prompts, greedy(10))
    assert tight.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outs] == [o.token_ids for o in roomy]
    assert all(o.finish_reason == "length" for o in outs)
    assert tight.pool.num_free == tight.pool.num_pages
    assert outs[0].token_ids == hf_greedy(path, prompts[0], 10)


def test_eos_stops_generation(tiny_models):
    model = load_model(tiny_models["qwen3"], "float32")
    llm = LLM(model, num_pages=64, page_size=PAGE)
    first = llm.generate([prompt(5)], greedy(4))[0].token_ids
    # make the first greedy token an EOS id of the request: it must stop right there
    stop = llm.generate([prompt(5)], SamplingParams(max_tokens=4, stop_token_ids=[first[0]]))[0]
    assert stop.token_ids == first[:1] and stop.finish_reason == "stop"
