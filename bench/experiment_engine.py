"""Engine speed on one CUDA GPU: decode step (CUDA graph vs eager) and 8k prefill of a model
shape with random weights, against the roofline and the matmul rate measured in the same run.

    python3 bench/experiment_engine.py --out DIR   # Qwen3-8B shape by default

Checks first that a graph-replayed decode step gives the eager step's logits and that the
layer counter bumped inside the graph reaches ``base + num_layers``. Writes ``engine.json`` and
``profile.txt`` (torch profiler tables of one eager decode step and one prefill step).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import torch

QWEN3_8B = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=151936,
                hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0,
                tie_word_embeddings=False, torch_dtype="bfloat16", eos_token_id=151645)


def ceilings(dev: torch.device) -> dict[str, float]:
    from triton.testing import do_bench

    a = torch.empty(1 << 29, dtype=torch.int16, device=dev).random_()  # 1 GiB
    b = torch.empty_like(a)
    ms = do_bench(lambda: b.copy_(a), warmup=50, rep=300, return_mode="median")
    copy = 2 * a.numel() * 2 / (ms / 1e3)
    x = torch.randn(8192, 8192, dtype=torch.bfloat16, device=dev)
    y = torch.randn(8192, 8192, dtype=torch.bfloat16, device=dev)
    ms = do_bench(lambda: x @ y, warmup=50, rep=300, return_mode="median")
    return {"copy_bytes_per_s": copy, "matmul_flops_per_s": 2 * 8192**3 / (ms / 1e3)}


def decode_plan(step: int, batch: int, ctx: int, page: int, pages: list[int], base: int):
    from disagg.protocol.executor import SeqChunk, StepPlan

    rng = random.Random(step)
    per = -(-(ctx + 1) // page)
    chunks = []
    for i in range(batch):
        n = ctx - rng.randint(0, 6)
        table = pages[i * per:(i + 1) * per]
        chunks.append(SeqChunk(i, [rng.randrange(1000, 100000)], n - 1, table, True))
    return StepPlan(step, chunks, batch, counter_base=base)


def median_ms(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def event_ms(fn, reps: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    out = []
    for _ in range(reps):
        start.record()
        fn()
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end))
    return statistics.median(out)


def overlapped_step_ms(runner, plan, steps: int) -> float:
    """Per-step time of decode steps run as an overlapping executor runs them: step N+1 (the
    same sequences as follow chunks, its plan through msgpack as it would arrive) is launched
    before step N's tokens are taken, so its host work (decode, flattening, copies, launch)
    overlaps N's device work."""
    import msgspec

    from disagg.protocol.executor import StepPlan

    wire = msgspec.msgpack.encode(StepPlan(
        plan.step_id + 1, [msgspec.structs.replace(c, follow=True) for c in plan.chunks],
        plan.num_decodes, defer=True))
    dec = msgspec.msgpack.Decoder(StepPlan)
    runner.execute(plan)
    torch.cuda.synchronize()
    launched = runner.launch(plan)
    for _ in range(3):  # warm-up (first uses)
        nxt = runner.launch(dec.decode(wire))
        launched.wait()
        launched = nxt
    host = []
    # the clock runs from one step's end (the last wait) to the end of the ``steps``-th step
    # after it; the step still in flight after the loop is not counted
    t = time.perf_counter()
    for _ in range(steps):
        t0 = time.perf_counter()
        nxt = runner.launch(dec.decode(wire))
        host.append(time.perf_counter() - t0)
        launched.wait()
        launched = nxt
    elapsed = time.perf_counter() - t
    launched.wait()
    print(f"overlapped B={len(plan.chunks)}: launch host ms p50 "
          f"{1e3 * statistics.median(host):.3f} max {1e3 * max(host):.3f}", flush=True)
    return elapsed / steps * 1e3


def overlapped_gaps(runner, plan, steps: int = 6) -> dict:
    """Where the device idles between overlapped decode steps: a profile of ``steps`` steps,
    the device work sorted by start, every gap over 5 us between one item's end and the next
    one's start (their names), summed per step."""
    import msgspec
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from disagg.protocol.executor import StepPlan

    follow = StepPlan(plan.step_id + 1,
                      [msgspec.structs.replace(c, follow=True) for c in plan.chunks],
                      plan.num_decodes, defer=True)
    launched = runner.launch(plan)
    launched.wait()
    launched = runner.launch(plan)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            nxt = runner.launch(follow)
            launched.wait()
            launched = nxt
        launched.wait()
    ev = sorted((e for e in prof.events() if e.device_type == DeviceType.CUDA),
                key=lambda e: e.time_range.start)
    gaps = []
    for a, b in zip(ev, ev[1:], strict=False):
        g = b.time_range.start - a.time_range.end
        if g > 5:
            gaps.append((g, a.name[:40], b.name[:40]))
    gaps.sort(reverse=True)
    busy = sum(e.time_range.end - e.time_range.start for e in ev)
    span = ev[-1].time_range.end - ev[0].time_range.start if ev else 0
    return {"steps": steps, "span_ms": span / 1e3, "busy_ms": busy / 1e3,
            "gap_ms_per_step": sum(g for g, _, _ in gaps) / 1e3 / steps,
            "top": [(round(g, 1), x, y) for g, x, y in gaps[:12]]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--prefill", type=int, default=8192)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--fp8", action="store_true",
                    help="block-FP8 weights (128x128, kept as FP8: the FP8 GEMMs)")
    ap.add_argument("--kv-fp8", action="store_true", help="FP8 KV pages (fp8_e4m3)")
    ap.add_argument("--quick", action="store_true",
                    help="decode steps only (graph, overlapped, B=1 profile): no eager steps, "
                         "prefill or full profiles")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from disagg.engine.attention import get_backend
    from disagg.engine.kv_memory import KVAllocation, KVLayout
    from disagg.engine.runner import ModelRunner
    from disagg.kernels.counter import LayerCounter
    from disagg.model.config import ModelArch
    from disagg.model.loader import random_model
    from disagg.protocol.executor import SeqChunk, StepPlan

    dev = torch.device("cuda:0")
    torch.cuda.set_device(dev)
    res: dict = {"gpu": torch.cuda.get_device_name(dev), "torch": torch.__version__}
    import triton

    res["triton"] = triton.__version__
    res["ceilings"] = ceilings(dev)
    arch = ModelArch.from_hf_config(QWEN3_8B)
    t = time.perf_counter()
    from disagg.model.fp8 import Fp8Format
    from disagg.model.fp8_weights import kept
    from disagg.model.fp8_weights import weight_bytes as fp8_weight_bytes

    model = random_model(arch, "bfloat16", dev, seed=0,
                         fp8=Fp8Format("fp8", (128, 128)) if args.fp8 else None)
    res["fp8_weights"] = len(kept(model))
    kv_dtype = torch.float8_e4m3fn if args.kv_fp8 else model.dtype
    torch.cuda.synchronize()
    res["random_weights_s"] = time.perf_counter() - t
    page = args.page_size
    per = -(-(args.ctx + 1) // page)
    num_pages = args.batch * per + -(-args.prefill // page) + 8
    layout = KVLayout(arch.num_layers, num_pages, arch.num_kv_heads, page, arch.head_dim,
                      kv_dtype, arch.kv_parts)
    alloc = KVAllocation.create(layout, dev, kv_scales=model.kv_scales_id if args.kv_fp8 else "",
                                model_dtype=model.dtype)
    for layer in alloc.tensor:  # per layer: FP8 pages have no normal_
        layer.copy_(torch.randn(layer.shape, dtype=torch.bfloat16, device=dev))
    counter = LayerCounter.create(dev)
    runner = ModelRunner(model, alloc.tensor, get_backend("triton", dev), counter)
    res["graph_capture_s"] = runner.enable_cuda_graphs(256, args.max_model_len)
    pages = list(range(num_pages))
    random.Random(1).shuffle(pages)
    dpages, ppages = pages[: args.batch * per], pages[args.batch * per:]

    # 1. correctness: graph replay == eager, counter bumped inside the graph
    plan = decode_plan(1, args.batch, args.ctx, page, dpages, base=1000)
    graphs = runner.graphs
    assert graphs is not None
    b = graphs.buckets[[i for i, x in enumerate(graphs.buckets) if x >= args.batch][0]]
    g_tokens = runner.execute(plan)[0]
    g_logits = graphs.outputs[b][0][: args.batch].clone()
    res["counter_after_graph"] = counter.read()
    runner.graphs = None
    e_tokens = runner.execute(plan)[0]
    host = runner.build(plan)
    with torch.inference_mode():
        hid = model(host[0], host[1], alloc.tensor, host[2], runner.backend)
        e_logits = model.logits(hid)
    rel = float((g_logits - e_logits).norm() / e_logits.norm())
    res["check"] = {"graph_vs_eager_logits_rel_l2": rel,
                    "argmax_agree": sum(a == b for a, b in zip(g_tokens, e_tokens, strict=True)),
                    "rows": args.batch,
                    "counter_ok": res["counter_after_graph"] == 1000 + arch.num_layers}
    print("check", res["check"], flush=True)
    # the timings: graphs as a decode or mixed node captures them, without the layer counter
    # (only a prefill node keeps one, and it runs no decode graphs)
    counted = runner
    runner = ModelRunner(model, alloc.tensor, runner.backend)
    res["graph_capture_s"] = runner.enable_cuda_graphs(256, args.max_model_len)
    # short prompts, eager: a prefill node's step (the prompt but its last token, the layer
    # counter bumped after every layer, nothing sampled) and a mixed node's (all of it, sampled)
    res["short_prefill"] = {}
    for n in (17, 130):
        ids = [random.Random(n).randrange(1000, 100000) for _ in range(n)]
        table = ppages[: -(-n // page)]
        split = StepPlan(6, [SeqChunk(0, ids[:-1], 0, table, False)], 0, counter_base=5000)
        mixed = StepPlan(7, [SeqChunk(0, ids, 0, table, True)], 0)
        counted.execute(split)
        runner.execute(mixed)
        res["short_prefill"][n] = {
            "prefill_node_step_ms": median_ms(lambda p=split: counted.execute(p), 20),
            "prefill_node_step_no_counter_ms": median_ms(lambda p=split: runner.execute(p), 20),
            "mixed_node_step_ms": median_ms(lambda p=mixed: runner.execute(p), 20)}
    print("short_prefill", res["short_prefill"], flush=True)
    graphs = runner.graphs
    assert graphs is not None
    runner.execute(plan)  # the graph's inputs: the plan's (the replay below reads them)

    # 2. decode step timings
    kv_bytes = sum(c.start_pos + 1 for c in plan.chunks) * layout.page_bytes // page
    kv_bytes *= arch.num_layers
    weight_bytes = fp8_weight_bytes(model)
    bw = res["ceilings"]["copy_bytes_per_s"]
    roof_ms = (weight_bytes + kv_bytes) / bw * 1e3
    replay_ms = event_ms(lambda: graphs.graphs[b].replay(), 30)
    graph_step_ms = median_ms(lambda: runner.execute(plan), 30)
    overlapped_ms = overlapped_step_ms(runner, plan, 30)
    one = decode_plan(4, 1, args.ctx, page, dpages, base=0)
    b1 = {"graph_step_ms": median_ms(lambda: runner.execute(one), 30),
          "overlapped_step_ms": overlapped_step_ms(runner, one, 30),
          "graph_replay_ms": event_ms(lambda: graphs.graphs[1].replay(), 30)}
    import disagg.model.ops as ops

    eager_step_ms = eager_unfused_ms = float("nan")
    if not args.quick:
        runner.graphs = None
        eager_step_ms = median_ms(lambda: runner.execute(plan), 10)
        ops.FUSED = False
        eager_unfused_ms = median_ms(lambda: runner.execute(plan), 10)
        ops.FUSED = True
        runner.graphs = graphs
    t = time.perf_counter()
    for _ in range(200):
        runner.check_plan(plan)
    host_ms = (time.perf_counter() - t) / 200 * 1e3
    res["decode"] = {
        "batch": args.batch, "ctx": args.ctx, "weight_bytes": weight_bytes, "kv_bytes": kv_bytes,
        "roofline_ms": roof_ms, "graph_replay_ms": replay_ms, "graph_step_ms": graph_step_ms,
        "eager_step_ms": eager_step_ms, "eager_unfused_step_ms": eager_unfused_ms,
        "flatten_plan_ms": host_ms, "overlapped_step_ms": overlapped_ms,
        "overlapped_vs_roofline": overlapped_ms / roof_ms, "batch1_ctx": args.ctx, "batch1": b1,
        "graph_step_vs_roofline": graph_step_ms / roof_ms,
        "replay_vs_roofline": replay_ms / roof_ms}
    print("decode", res["decode"], flush=True)
    for bb in (1, 16, 128, 256):
        ctx_b = min(args.ctx, (len(pages) // bb - 1) * page - 8)
        p2 = decode_plan(2, bb, ctx_b, page, pages, base=0)
        res["decode"][f"graph_step_ms_b{bb}_ctx{ctx_b}"] = median_ms(
            lambda p2=p2: runner.execute(p2), 10)

    if args.quick:  # the B=1 step's kernels (eager: the same kernels, launched one by one)
        from torch.profiler import ProfilerActivity, profile

        res["decode"]["overlapped_gaps"] = overlapped_gaps(runner, plan)
        print("gaps", res["decode"]["overlapped_gaps"], flush=True)

        runner.graphs = None
        runner.execute(one)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            runner.execute(one)
            torch.cuda.synchronize()
        runner.graphs = graphs
        (out / "profile_b1.txt").write_text(prof.key_averages().table(
            sort_by="cuda_time_total", row_limit=30, max_name_column_width=60))
        (out / "engine.json").write_text(json.dumps(res, indent=1))
        counter.close()
        print(json.dumps(res["decode"], indent=1))
        return

    # 3. prefill of args.prefill tokens in one step (eager)
    n = args.prefill
    rng = random.Random(3)
    pplan = StepPlan(3, [SeqChunk(0, [rng.randrange(1000, 100000) for _ in range(n)], 0,
                                  ppages[: -(-n // page)], True)], 0)
    runner.execute(pplan)
    prefill_ms = median_ms(lambda: runner.execute(pplan), 5)
    ops.FUSED = False
    prefill_unfused_ms = median_ms(lambda: runner.execute(pplan), 3)
    ops.FUSED = True
    lin = sum(p.numel() for nm, p in model.named_parameters()
              if nm not in ("embed", "lm_head") and p.dim() == 2)
    lin += sum(w.q.numel() for w in kept(model).values())
    attn = 4 * arch.num_layers * arch.num_heads * arch.head_dim * n * (n + 1) / 2
    flops = 2 * lin * n + attn + 2 * arch.vocab_size * arch.hidden_size
    mm = res["ceilings"]["matmul_flops_per_s"]
    res["prefill"] = {"tokens": n, "model_flops": flops, "step_ms": prefill_ms,
                      "unfused_step_ms": prefill_unfused_ms,
                      "flops_per_s": flops / (prefill_ms / 1e3),
                      "fraction_of_matmul": flops / (prefill_ms / 1e3) / mm}
    print("prefill", res["prefill"], flush=True)

    # 4. profiles (eager decode step, prefill step)
    from torch.profiler import ProfilerActivity, profile

    text = []
    for name, p in ((f"eager decode B={args.batch} ctx={args.ctx}", plan),
                    (f"prefill {n}", pplan)):
        runner.graphs = None
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            runner.execute(p)
            torch.cuda.synchronize()
        runner.graphs = graphs
        text.append(f"=== {name}\n" + prof.key_averages().table(
            sort_by="cuda_time_total", row_limit=25, max_name_column_width=60))
    (out / "profile.txt").write_text("\n".join(text))
    (out / "engine.json").write_text(json.dumps(res, indent=1))
    counter.close()
    print(json.dumps({k: res[k] for k in ("check", "decode", "prefill")}, indent=1))


if __name__ == "__main__":
    main()
