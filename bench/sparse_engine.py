"""MoE and MLA model speed on one CUDA GPU (#16): decode steps at batch 1, 64 and 256 against
the roofline, and an 8k prefill against the matmul rate in active-parameter FLOPs, for a
DeepSeek-V2-Lite-shaped and a Qwen3-30B-A3B-shaped model with random bf16 weights.

    python3 bench/sparse_engine.py --out DIR [--shape v2lite|qwen3moe|both]

Roofline of a decode step: the bytes it must read over the copy rate measured in the same run
(a 1 GiB device copy): every non-expert weight (attention, norms, routers, shared experts,
dense layers, the head), the routed experts the step actually hit (distinct experts per layer,
counted from the step's own routing, x 3·H·I·2 bytes) and the KV of every sequence. Prefill:
2 x active parameters per token (non-expert + top-k experts + shared) x tokens, plus
attention (causal half; MLA absorbed: scores over kv_lora + rope, values over kv_lora), against
a bf16 8192^3 matmul. Decode steps go through ``ModelRunner.execute`` (CUDA graphs when they
capture; the JSON says which), first checked against the eager step. Writes ``sparse.json``.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from experiment_engine import ceilings, decode_plan, median_ms  # noqa: E402

V2_LITE = dict(architectures=["DeepseekV2ForCausalLM"], model_type="deepseek_v2",
               vocab_size=102400, hidden_size=2048, intermediate_size=10944,
               moe_intermediate_size=1408, num_hidden_layers=27, num_attention_heads=16,
               num_key_value_heads=16, n_shared_experts=2, n_routed_experts=64,
               num_experts_per_tok=6, first_k_dense_replace=1, moe_layer_freq=1,
               kv_lora_rank=512, q_lora_rank=None, qk_nope_head_dim=128, qk_rope_head_dim=64,
               v_head_dim=128, routed_scaling_factor=1.0, topk_method="greedy", n_group=1,
               topk_group=1, norm_topk_prob=False, scoring_func="softmax",
               max_position_embeddings=163840, rope_theta=10000.0,
               rope_scaling={"type": "yarn", "factor": 40, "beta_fast": 32, "beta_slow": 1,
                             "mscale": 0.707, "mscale_all_dim": 0.707,
                             "original_max_position_embeddings": 4096},
               rms_norm_eps=1e-6, tie_word_embeddings=False, torch_dtype="bfloat16",
               eos_token_id=100001, bos_token_id=100000)
QWEN3_30B_A3B = dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe",
                     vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                     moe_intermediate_size=768, num_hidden_layers=48, num_attention_heads=32,
                     num_key_value_heads=4, head_dim=128, num_experts=128,
                     num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1,
                     mlp_only_layers=[], max_position_embeddings=40960, rope_theta=1000000.0,
                     rms_norm_eps=1e-6, tie_word_embeddings=False, torch_dtype="bfloat16",
                     eos_token_id=151645)
SHAPES = {"v2lite": V2_LITE, "qwen3moe": QWEN3_30B_A3B}


class HitCounter:
    """Distinct routed experts per MoE layer call, recorded from ``MoEMLP.route`` (torch or
    fused routing) while active."""

    def __init__(self) -> None:
        from disagg.model.moe import MoEMLP

        self.cls, self.orig, self.hits = MoEMLP, MoEMLP.route, []

    def __enter__(self) -> HitCounter:
        orig = self.orig

        def counting(mlp: Any, x: torch.Tensor) -> Any:
            weights, experts = orig(mlp, x)
            self.hits.append(int(torch.unique(experts).numel()))
            return weights, experts

        self.cls.route = counting  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        self.cls.route = self.orig  # type: ignore[method-assign]


def split_params(model: Any) -> tuple[int, int, int]:
    """(non-expert bytes read per step without the embedding, bytes of one routed expert,
    non-expert parameters in linear layers (for FLOPs))."""
    expert_bytes = 0
    other_bytes = other_linear = 0
    for name, p in model.named_parameters():
        if name.endswith((".gate_up", ".down")) and p.dim() == 3:  # stacked routed experts
            expert_bytes += p[0].numel() * p.element_size()
            continue
        if name == "embed" or name.endswith("embed.weight"):
            continue
        other_bytes += p.numel() * p.element_size()
        if p.dim() == 2 and "router" not in name and "lm_head" not in name:
            other_linear += p.numel()
    moe_layers = sum(1 for n, p in model.named_parameters() if n.endswith(".down") and p.dim() == 3)
    from disagg.model.fp8_weights import kept

    for name, w in kept(model).items():  # FP8 weights: one byte each plus the block scales
        if w.dim() == 3:
            expert_bytes += w.q[0].numel() + 4 * w.scale_inv[0].numel()
            moe_layers += name.endswith(".down")
        else:
            other_bytes += w.nbytes()
            other_linear += w.q.numel()
    return other_bytes, expert_bytes // max(1, moe_layers), other_linear


def profile(runner: Any, pages: list[int], page: int, ctx: int) -> dict[str, str]:
    """Top kernels of one eager decode step at batch 1 and 64 (torch profiler, CUDA time)."""
    from torch.profiler import ProfilerActivity, profile

    out = {}
    graphs, runner.graphs = runner.graphs, None
    for batch in (1, 64):
        plan = decode_plan(batch, batch, ctx, page, pages, base=0)
        runner.execute(plan)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            runner.execute(plan)
            torch.cuda.synchronize()
        out[f"b{batch}"] = prof.key_averages().table(sort_by="cuda_time_total", row_limit=18,
                                                     max_name_column_width=70)
        print(f"=== profile b{batch}\n" + out[f"b{batch}"], flush=True)
    runner.graphs = graphs
    return out


def run_shape(name: str, cfg: dict, args: argparse.Namespace, ceil: dict) -> dict:
    from disagg.engine.attention import get_backend
    from disagg.engine.kv_memory import KVAllocation, KVLayout
    from disagg.engine.runner import ModelRunner
    from disagg.model.config import ModelArch
    from disagg.model.loader import random_model
    from disagg.protocol.executor import SeqChunk, StepPlan

    dev = torch.device("cuda:0")
    arch = ModelArch.from_hf_config(cfg)
    res: dict[str, Any] = {"shape": name, "layers": arch.num_layers}
    t = time.perf_counter()
    from disagg.model.fp8 import Fp8Format

    model = random_model(arch, "bfloat16", dev, seed=0,
                         fp8=Fp8Format("fp8", (128, 128)) if args.fp8 else None)
    torch.cuda.synchronize()
    res["random_weights_s"] = time.perf_counter() - t
    page = args.page_size
    per_token = arch.num_layers * arch.kv_parts * arch.num_kv_heads * arch.head_dim * 2
    free = torch.cuda.mem_get_info(dev)[0] - (12 << 30)  # leave room for activations, graphs
    num_pages = min(free // (per_token * page), 64 * (-(-(args.ctx + 1) // page)) * 4 + 2048)
    layout = KVLayout(arch.num_layers, num_pages, arch.num_kv_heads, page, arch.head_dim,
                      model.dtype, arch.kv_parts)
    alloc = KVAllocation.create(layout, dev)
    alloc.tensor.normal_()
    runner = ModelRunner(model, alloc.tensor, get_backend("triton", dev))
    try:
        res["graph_capture_s"] = runner.enable_cuda_graphs(256, args.max_model_len)
    except Exception as e:  # report, and time eager steps
        res["graph_capture_error"] = f"{type(e).__name__}: {e}"[:500]
        runner.graphs = None
    pages = list(range(num_pages))
    random.Random(1).shuffle(pages)
    other_bytes, one_expert, other_linear = split_params(model)
    moe = arch.moe
    res["non_expert_bytes"], res["expert_bytes"] = other_bytes, one_expert
    bw, mm = ceil["copy_bytes_per_s"], ceil["matmul_flops_per_s"]
    res["decode"] = {}
    for batch in (1, 64, 256):
        ctx = min(args.ctx, (num_pages // batch - 2) * page)
        plan = decode_plan(batch, batch, ctx, page, pages, base=0)
        with HitCounter() as hc:  # eager: the step's own routing, and the reference
            runner_graphs, runner.graphs = runner.graphs, None
            eager = runner.execute(plan)[0]
            runner.graphs = runner_graphs
        tokens = runner.execute(plan)[0]
        kv_bytes = sum(c.start_pos + 1 for c in plan.chunks) * per_token
        routed = sum(hc.hits) * one_expert
        roof_ms = (other_bytes + routed + kv_bytes) / bw * 1e3
        step_ms = median_ms(lambda p=plan: runner.execute(p), 20)
        runner_graphs, runner.graphs = runner.graphs, None
        eager_ms = median_ms(lambda p=plan: runner.execute(p), 5)
        runner.graphs = runner_graphs
        row = {"ctx": ctx, "step_ms": step_ms, "eager_step_ms": eager_ms, "roofline_ms": roof_ms,
               "vs_roofline": step_ms / roof_ms, "experts_hit_per_layer":
               sum(hc.hits) / max(1, len(hc.hits)), "kv_bytes": kv_bytes,
               "routed_bytes": routed, "graph": runner.graphs is not None,
               "argmax_agree_with_eager": sum(a == b for a, b in zip(tokens, eager, strict=True)),
               "tokens_per_s": batch / step_ms * 1e3}
        res["decode"][f"b{batch}"] = row
        print(name, "decode", batch, row, flush=True)
    if args.profile:
        res["profile"] = profile(runner, pages, page, args.ctx)
    n = args.prefill
    rng = random.Random(3)
    pplan = StepPlan(3, [SeqChunk(0, [rng.randrange(1000, 100000) for _ in range(n)], 0,
                                  pages[: -(-n // page)], True)], 0)
    runner.execute(pplan)
    prefill_ms = median_ms(lambda: runner.execute(pplan), 3)
    moe_layers = sum(moe.sparse_layers) if moe else 0
    active = other_linear + (moe.top_k * one_expert // 2 if moe else 0) * moe_layers
    if arch.mla is not None:
        a = arch.mla
        attn = 2 * arch.num_layers * arch.num_heads * (2 * a.kv_lora_rank + a.qk_rope_head_dim) \
            * n * (n + 1) / 2
    else:
        attn = 4 * arch.num_layers * arch.num_heads * arch.head_dim * n * (n + 1) / 2
    flops = 2 * active * n + attn + 2 * arch.vocab_size * arch.hidden_size
    res["prefill"] = {"tokens": n, "active_flops": flops, "step_ms": prefill_ms,
                      "flops_per_s": flops / (prefill_ms / 1e3),
                      "fraction_of_matmul": flops / (prefill_ms / 1e3) / mm}
    print(name, "prefill", res["prefill"], flush=True)
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--shape", default="both", choices=["v2lite", "qwen3moe", "both"])
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--prefill", type=int, default=8192)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--profile", action="store_true", help="kernel tables of eager steps")
    ap.add_argument("--fp8", action="store_true",
                    help="block-FP8 weights (128x128, kept as FP8: the FP8 GEMMs and experts)")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    dev = torch.device("cuda:0")
    torch.cuda.set_device(dev)
    import triton

    res: dict[str, Any] = {"gpu": torch.cuda.get_device_name(dev), "torch": torch.__version__,
                           "triton": triton.__version__, "ceilings": ceilings(dev)}
    for name in (SHAPES if args.shape == "both" else [args.shape]):
        try:
            res[name] = run_shape(name, SHAPES[name], args, res["ceilings"])
        except Exception as e:  # the other shape still runs
            res[name] = {"error": f"{type(e).__name__}: {e}"[:1000]}
            print(name, "failed:", res[name]["error"], flush=True)
        (out / "sparse.json").write_text(json.dumps(res, indent=1))
        gc.collect()  # the shape's model, cache and graphs
        torch.cuda.empty_cache()
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
