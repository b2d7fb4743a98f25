"""Where a prefix hit's step goes (issues 38, 39, 34): on an H100 a 4k device hit's TTFT was
20.7 ms where a batch-1 decode step at 4k takes ~6 ms, and n=8's step prefilling 7 x 16 fresh
tokens over 2k cached ones took 39 ms from the plan's arrival to its launch.

On the 8B shape with random weights, eager steps as a mixed node runs a prefix hit: NEW fresh
tokens over CTX cached ones (one sequence, or SEQS sequences at once), timed end to end
(``execute``: host work, launch and the device) and from launch to return (host only), eager
and replayed from the decode graphs with every token a row (``cuda_graphs.rows_step``, whatever
its key-row budget), plus torch-profiler tables of the eager 4k hit. Then the
attention alone, per layer: the chunked-prefill kernel on a NEW-token chunk over CTX (what the
step runs) against the split decode kernel on NEW rows, each seeing its own causal prefix (the
same output: checked).

    python3 bench/prefix_hit_probe.py --out DIR
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from experiment_engine import QWEN3_8B, median_ms  # noqa: E402  (this directory)
from fp8_gemm import graph_us  # noqa: E402

CASES = ((0, 17, 1), (0, 130, 1), (2048, 16, 1), (4096, 16, 1), (4096, 64, 1), (4096, 128, 1),
         (2048, 16, 7), (8192, 16, 1), (8192, 64, 1))


def step_plan(step: int, ctx: int, new: int, seqs: int, pages: list[int], page: int):
    from disagg.protocol.executor import SeqChunk, StepPlan

    rng = random.Random(step)
    per = -(-(ctx + new) // page)
    chunks = [SeqChunk(i, [rng.randrange(1000, 100000) for _ in range(new)], ctx,
                       pages[i * per:(i + 1) * per], True) for i in range(seqs)]
    return StepPlan(step, chunks, 0)


def host_launch_ms(runner, plan, reps: int = 10) -> float:
    out = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        launched = runner.launch(plan)
        out.append((time.perf_counter() - t) * 1e3)
        launched.wait()
    return sorted(out)[len(out) // 2]


def attention_us(ctx: int, new: int, dev: torch.device) -> dict:
    """Per-layer attention of a NEW-token chunk over CTX cached tokens (8B heads, page 16)."""
    from disagg.kernels.decode import paged_decode_attention
    from disagg.kernels.prefill import paged_prefill_attention

    hq, hkv, d, page = 32, 8, 128, 16
    n_pages = -(-(ctx + new) // page)
    k = torch.randn(n_pages + 4, hkv, page, d, dtype=torch.bfloat16, device=dev)
    v = torch.randn_like(k)
    table = torch.randperm(n_pages + 4, device=dev)[:n_pages].to(torch.int32)[None, :]
    q = torch.randn(new, hq, d, dtype=torch.bfloat16, device=dev)
    seq = torch.tensor([ctx + new], dtype=torch.int32, device=dev)
    cu = torch.tensor([0, new], dtype=torch.int32, device=dev)
    rows = torch.arange(ctx + 1, ctx + new + 1, dtype=torch.int32, device=dev)
    tables = table.expand(new, -1).contiguous()
    scale = d ** -0.5
    a = paged_prefill_attention(q, k, v, table, seq, cu, scale, max_q_len=new)
    b = paged_decode_attention(q, k, v, tables, rows, scale, max_seq_len=ctx + new)
    return {"prefill_kernel": graph_us(lambda i: paged_prefill_attention(
                q, k, v, table, seq, cu, scale, max_q_len=new), 1),
            "decode_kernel_rows": graph_us(lambda i: paged_decode_attention(
                q, k, v, tables, rows, scale, max_seq_len=ctx + new), 1),
            "max_abs_diff": float((a.float() - b.float()).abs().max())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--page-size", type=int, default=16)
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    from torch.profiler import ProfilerActivity, profile

    from disagg.engine import cuda_graphs
    from disagg.engine.attention import get_backend
    from disagg.engine.kv_memory import KVAllocation, KVLayout
    from disagg.engine.runner import ModelRunner
    from disagg.model.config import ModelArch
    from disagg.model.loader import random_model

    dev = torch.device("cuda:0")
    torch.cuda.set_device(dev)
    res: dict = {"gpu": torch.cuda.get_device_name(dev), "torch": torch.__version__,
                 "attention_us": {}, "steps": {}}
    for ctx, new in ((2048, 16), (4096, 16), (4096, 64), (8192, 16), (4096, 128)):
        r = attention_us(ctx, new, dev)
        res["attention_us"][f"{ctx}+{new}"] = r
        print("attention", ctx, new, {k: round(x, 2) for k, x in r.items()}, flush=True)
    arch = ModelArch.from_hf_config(QWEN3_8B)
    model = random_model(arch, "bfloat16", dev, seed=0)
    page = a.page_size
    num_pages = 8 * (-(-(8192 + 64) // page)) + 8
    layout = KVLayout(arch.num_layers, num_pages, arch.num_kv_heads, page, arch.head_dim,
                      model.dtype, arch.kv_parts)
    alloc = KVAllocation.create(layout, dev, model_dtype=model.dtype)
    for layer in alloc.tensor:
        layer.normal_()
    runner = ModelRunner(model, alloc.tensor, get_backend("triton", dev))
    runner.enable_cuda_graphs(256, 16384)
    pages = list(range(num_pages))
    random.Random(1).shuffle(pages)
    for i, (ctx, new, seqs) in enumerate(CASES):
        plan = step_plan(10 + i, ctx, new, seqs, pages, page)
        r = {}
        for how, budget in (("eager", 0), ("rows", 1 << 30)):
            cuda_graphs.ROWS_KV_BUDGET = budget
            replays = runner.graphs.replays
            first = runner.execute(plan)[0]  # first use
            r[how] = {"step_ms": median_ms(lambda p=plan: runner.execute(p), 10),
                      "launch_host_ms": host_launch_ms(runner, plan),
                      "replayed": runner.graphs.replays > replays, "tokens": first}
        r["same_tokens"] = r["eager"].pop("tokens") == r["rows"].pop("tokens")
        res["steps"][f"{seqs}x({ctx}+{new})"] = r
        print("step", seqs, ctx, new, r, flush=True)
    cuda_graphs.ROWS_KV_BUDGET = 0
    plan = step_plan(99, 4096, 16, 1, pages, page)
    runner.execute(plan)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        runner.execute(plan)
        torch.cuda.synchronize()
    (a.out / "profile_hit_4k.txt").write_text(prof.key_averages().table(
        sort_by="cuda_time_total", row_limit=30, max_name_column_width=60))
    (a.out / "profile_hit_4k_cpu.txt").write_text(prof.key_averages().table(
        sort_by="cpu_time_total", row_limit=30, max_name_column_width=60))
    (a.out / "prefix_hit.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
