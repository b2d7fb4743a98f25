"""Seeded sampling with and without speculative decoding: how many seeded requests draw other
tokens batched, with prompt lookup (several K, a token budget that cuts the drafts) or a draft
model, than alone without speculation. In-process engine, random weights (no files); prompts
repeat a random segment, temperatures from near-greedy (drafts often kept) to 1.

    python3 bench/seeded_speculation.py --device cuda --graphs --out DIR   # or --device cpu

Prints and writes ``seeded_speculation.json``: per set-up the requests that differ from their
run alone, the drafts proposed and accepted.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch

SHAPES = {
    "small": dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=2048,
                  hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                  num_attention_heads=8, num_key_value_heads=4, head_dim=32,
                  max_position_embeddings=1024, rms_norm_eps=1e-6, rope_theta=10000.0,
                  tie_word_embeddings=False, eos_token_id=0),
    "qwen3-0.6b": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3",
                       vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                       num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                       head_dim=128, max_position_embeddings=4096, rms_norm_eps=1e-6,
                       rope_theta=1000000.0, tie_word_embeddings=True, eos_token_id=0),
}
KINDS = [(0.01, 0, 1.0), (0.05, 0, 1.0), (0.2, 0, 0.95), (0.5, 40, 1.0), (1.0, 0, 0.9)]


def requests(n: int, vocab: int, max_tokens: int, greedy: bool = False):
    from disagg.protocol import SamplingParams

    prompts, params = [], []
    for i in range(n):
        rng = random.Random(i)
        seg = [rng.randrange(1, vocab) for _ in range(rng.randint(3, 12))]
        tail = [rng.randrange(1, vocab) for _ in range(rng.randint(0, 6))]
        prompts.append(seg * rng.randint(2, 4) + tail)
        t, k, p = KINDS[i % len(KINDS)]
        params.append(SamplingParams(max_tokens=max_tokens, ignore_eos=True,
                                     temperature=0.0 if greedy else t,
                                     top_k=k, top_p=p, seed=rng.getrandbits(63)))
    return prompts, params


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--shape", default="small", choices=sorted(SHAPES))
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--requests", type=int, default=100)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--small-budget", type=int, default=0,
                    help="a token budget that cuts the drafts (default: requests + 12)")
    ap.add_argument("--greedy", action="store_true", help="every request greedy (a baseline)")
    ap.add_argument("--graphs", action="store_true", help="CUDA graphs (speculative ones too)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()

    from disagg.engine.speculative import Speculation
    from disagg.llm import LLM
    from disagg.model.config import ModelArch
    from disagg.model.loader import random_model

    dev = torch.device(args.device)
    cfg = SHAPES[args.shape]
    arch = ModelArch.from_hf_config(cfg)
    model = random_model(arch, args.dtype, dev, seed=0)
    small = args.small_budget or args.requests + 12
    prompts, params = requests(args.requests, arch.vocab_size, args.max_tokens,
                               args.greedy)
    pages = sum(-(-(len(p) + args.max_tokens + 9) // 16) for p in prompts) + 16
    max_len = 256

    def engine(budget: int = 4096, spec: Speculation | None = None, draft_model=None) -> LLM:
        llm = LLM(model, num_pages=pages, page_size=16, max_batch_tokens=budget,
                  max_model_len=max_len, speculative=spec, draft_model=draft_model)
        if args.graphs and dev.type == "cuda":
            llm.runner.enable_cuda_graphs(min(args.requests, 128), max_len,
                                          spec.tokens if spec and spec.method == "ngram" else 0)
        return llm

    t0 = time.perf_counter()
    alone_llm = engine()
    alone = [alone_llm.generate([pr], [p])[0].token_ids for pr, p in zip(prompts, params, strict=True)]
    res: dict = {"device": str(dev), "torch": torch.__version__, "shape": args.shape,
                 "dtype": args.dtype, "graphs": args.graphs, "greedy": args.greedy, "requests": args.requests,
                 "max_tokens": args.max_tokens, "alone_s": round(time.perf_counter() - t0, 1),
                 "runs": []}
    if dev.type == "cuda":
        res["gpu"] = torch.cuda.get_device_name(dev)
    setups = [("batched, no speculation", 4096, None, None)]
    for k in (3, 8):
        for budget in (4096, small):
            setups.append((f"ngram K={k} budget {budget}", budget, Speculation("ngram", k), None))
    # the target as its own draft: its greedy drafts are often the low-temperature draws
    setups.append((f"draft model (the target) K=3 budget {small}", small,
                   Speculation("draft", 3), model))
    for name, budget, spec, d in setups:
        t = time.perf_counter()
        llm = engine(budget, spec, d)
        outs = [o.token_ids for o in llm.generate(prompts, params)]
        differ = [i for i, (a, b) in enumerate(zip(outs, alone, strict=True)) if a != b]
        s = llm.scheduler
        row = {"setup": name, "differ": len(differ), "of": len(alone),
               "differ_ids": differ[:20], "drafted": s.spec_draft_tokens,
               "accepted": s.spec_accepted_tokens, "s": round(time.perf_counter() - t, 1)}
        res["runs"].append(row)
        print(json.dumps(row), flush=True)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "seeded_speculation.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
