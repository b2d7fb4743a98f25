"""Time the fused MoE forward (routing + experts + shared) against its rooflines.

Layer shapes of Qwen3-30B-A3B (E=128, k=8, H=2048, I=768) and DeepSeek-V2-Lite (E=64, k=6,
H=2048, I=1408, shared 2816), bf16, random weights and inputs (random router logits: uniform
routing). Each forward is captured in a CUDA graph and its replays timed
(``triton.testing.do_bench_cudagraph``). Decode rows (T = 1, 64, 256) are read against a
memory roofline: the expert weights actually hit (distinct experts chosen across the batch x
3*H*I x 2 bytes, plus the shared expert and the router) over the device copy rate measured in
the same run (a 1 GiB ``copy_``, read + write bytes). Prefill (T = 8192) is read as TFLOP/s of
active FLOPs (2*T*k*3*H*I + 2*T*3*H*S) against a bf16 8192^3 matmul measured in the same run.
The torch loop (``experts_loop``, launched eagerly: it syncs with the host) is timed beside it.

``--sweep`` also tries candidate tiles per (shape, T) by coordinate descent (block_m, then the
gate_up tile, then the down tile), compiling them first in parallel processes, and reports the
fastest (how ``fused_moe.TILE_TABLE`` was chosen). ``--smoke`` runs tiny shapes on CPU under
``TRITON_INTERPRET=1`` to exercise this script without a GPU.

Usage (on a CUDA machine): ``python bench/moe_kernel.py --out DIR [--sweep]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

if "--smoke" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from disagg.kernels import fused_moe  # noqa: E402
from disagg.kernels.fused_moe import (  # noqa: E402
    TILE_TABLE,
    GemmTile,
    MoETiles,
    fused_experts,
    tile_config,
)
from disagg.model.config import MoEArch  # noqa: E402
from disagg.model.moe import MoEMLP, experts_loop  # noqa: E402

MODELS = {  # name -> (arch, hidden)
    "qwen3-30b-a3b": (MoEArch(num_experts=128, top_k=8, intermediate_size=768,
                              sparse_layers=(True,), norm_topk_prob=True), 2048),
    "deepseek-v2-lite": (MoEArch(num_experts=64, top_k=6, intermediate_size=1408,
                                 sparse_layers=(True,), shared_intermediate_size=2816,
                                 router_fp32=True), 2048),
}
SMOKE_MODELS = {"tiny": (MoEArch(num_experts=8, top_k=2, intermediate_size=24,
                                 sparse_layers=(True,), shared_intermediate_size=16), 32)}
TOKENS = (1, 64, 256, 8192)
SWEEP_TOKENS = (1, 64, 256, 2048, 8192)
CUDA = torch.cuda.is_available() and not os.environ.get("TRITON_INTERPRET")
DEVICE = torch.device("cuda" if CUDA else "cpu")


def log(msg: str) -> None:
    print(msg, flush=True)


def bench_ms(fn: Any, graph: bool = True, rep: int = 20) -> float:
    """Mean milliseconds per call: CUDA-graph replays when ``graph``, else launched calls."""
    if not CUDA:
        fn()
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    import triton.testing

    if graph:
        return float(triton.testing.do_bench_cudagraph(fn, rep=rep))
    return float(triton.testing.do_bench(fn, rep=rep))


def ceilings() -> dict[str, float]:
    """The copy rate (bytes read + written per second) and the bf16 matmul rate (FLOP/s)."""
    if not CUDA:
        return {"copy_bytes_s": 1e10, "matmul_flop_s": 1e11}
    n = 1 << 30
    src = torch.empty(n, dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    copy_ms = bench_ms(lambda: dst.copy_(src), graph=False, rep=100)
    m = 8192
    a = torch.randn(m, m, dtype=torch.bfloat16, device=DEVICE)
    b = torch.randn(m, m, dtype=torch.bfloat16, device=DEVICE)
    mm_ms = bench_ms(lambda: a @ b, graph=False, rep=100)
    return {"copy_bytes_s": 2 * n / copy_ms * 1e3, "matmul_flop_s": 2 * m**3 / mm_ms * 1e3}


def make_mlp(arch: MoEArch, hidden: int, seed: int = 0) -> MoEMLP:
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    mlp = MoEMLP(hidden, arch, torch.bfloat16, DEVICE)
    for p in mlp.parameters():
        p.copy_(torch.randn(p.shape, generator=gen, device=DEVICE) * p.shape[-1] ** -0.5)
    return mlp


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm())


def measure(name: str, arch: MoEArch, hidden: int, tokens: int, ceil: dict[str, float]) -> dict:
    mlp = make_mlp(arch, hidden)
    x = torch.randn(tokens, hidden, dtype=torch.bfloat16, device=DEVICE)
    weights, experts = mlp.route(x)
    hit = int(experts.unique().numel())
    e, i, s, k = arch.num_experts, arch.intermediate_size, arch.shared_intermediate_size, arch.top_k
    weight_bytes = 2 * (hit * 3 * hidden * i + 3 * hidden * s + e * hidden)
    flops = 2 * tokens * (k * 3 * hidden * i + 3 * hidden * s)
    mlp.fused = True
    fused_ms = bench_ms(lambda: mlp(x))
    experts_ms = bench_ms(lambda: fused_experts(x, weights, experts, mlp.gate_up, mlp.down))
    mlp.fused = False
    loop_ms = bench_ms(lambda: mlp(x), graph=False)
    ref = experts_loop(x.float(), weights.float(), experts, mlp.gate_up.float(), mlp.down.float())
    err = rel_err(fused_experts(x, weights, experts, mlp.gate_up, mlp.down), ref)
    roof_ms = weight_bytes / ceil["copy_bytes_s"] * 1e3
    row: dict[str, Any] = dict(
        model=name, tokens=tokens, experts_hit=hit, tiles=str(tile_config(tokens, k, e)),
        fused_ms=fused_ms, experts_only_ms=experts_ms, torch_loop_ms=loop_ms,
        weight_bytes=weight_bytes, roofline_ms=roof_ms, x_roofline=fused_ms / roof_ms,
        tflops=flops / fused_ms / 1e9, frac_matmul=flops / fused_ms * 1e3 / ceil["matmul_flop_s"],
        rel_err=err)
    log(f"{name:18s} T={tokens:5d} hit={hit:4d} fused {fused_ms * 1e3:9.1f} us (experts "
        f"{experts_ms * 1e3:9.1f}) loop {loop_ms * 1e3:9.1f} us | roofline "
        f"{roof_ms * 1e3:8.1f} us x{row['x_roofline']:.2f} | {row['tflops']:6.1f} TFLOP/s "
        f"({100 * row['frac_matmul']:.0f}% of matmul) | err {err:.1e}")
    return row


# --- tile sweep -------------------------------------------------------------------------------

UP_TILES = [GemmTile(32, 128, 1, 4, 4), GemmTile(64, 128, 1, 4, 3), GemmTile(32, 256, 1, 4, 3),
            GemmTile(64, 64, 1, 4, 5), GemmTile(16, 128, 1, 4, 4), GemmTile(16, 256, 1, 4, 3)]
DOWN_TILES = [GemmTile(64, 128, 1, 4, 3), GemmTile(32, 128, 1, 4, 4), GemmTile(128, 128, 1, 4, 3),
              GemmTile(64, 256, 1, 4, 2), GemmTile(32, 256, 1, 4, 3)]
BIG_UP = [GemmTile(64, 64, 8, 4, 4), GemmTile(64, 64, 8, 8, 4), GemmTile(128, 64, 8, 8, 3),
          GemmTile(128, 64, 8, 8, 4), GemmTile(128, 64, 8, 4, 3), GemmTile(64, 128, 8, 8, 3)]
BIG_DOWN = [GemmTile(128, 64, 8, 4, 4), GemmTile(128, 64, 8, 8, 4), GemmTile(256, 64, 8, 8, 3),
            GemmTile(128, 128, 8, 8, 3), GemmTile(256, 64, 8, 8, 4)]


def candidates(tokens: int, top_k: int, experts: int) -> tuple[list[int], list[GemmTile],
                                                                  list[GemmTile]]:
    rows = tokens * top_k / experts
    if not CUDA:  # --smoke: a taste of each axis
        return [16, 32], [UP_TILES[0], GemmTile(16, 16, 2, 1, 1)], DOWN_TILES[:2]
    if rows <= 12:
        return [16], UP_TILES, DOWN_TILES
    if rows <= 48:
        return [16, 32, 64], UP_TILES[:2] + BIG_UP[:2], DOWN_TILES[:3] + BIG_DOWN[:2]
    return [64, 128], BIG_UP, BIG_DOWN


def seed(block_m: int, ups: list[GemmTile], downs: list[GemmTile]) -> MoETiles:
    """Where the descent starts for ``block_m``: the table's entry with it, if any."""
    return next((t for _, t in TILE_TABLE if t.block_m == block_m),
                MoETiles(block_m, ups[0], downs[0]))


def _sweep_plan(models: dict, tokens: tuple[int, ...]) -> list[tuple[int, int, int, MoETiles]]:
    """Every (hidden, inter, top_k, tiles) the sweep may launch, for parallel compilation."""
    plan = []
    for arch, hidden in models.values():
        for t in tokens:
            bms, ups, downs = candidates(t, arch.top_k, arch.num_experts)
            for bm in bms:  # every (block_m, GEMM tile) pair the descent can reach
                start = seed(bm, ups, downs)
                for up in ups:
                    for down in downs:
                        if up == start.up or down == start.down:
                            plan.append((hidden, arch.intermediate_size, arch.top_k,
                                         MoETiles(bm, up, down, start.align_block)))
        for t in (*tokens, *TOKENS):
            plan.append((hidden, arch.intermediate_size, arch.top_k,
                         tile_config(t, arch.top_k, arch.num_experts)))
    return list(dict.fromkeys(plan))


def _compile_one(job: tuple[int, int, int, MoETiles]) -> str:
    hidden, inter, top_k, tiles = job
    dev = DEVICE
    e = 4  # the expert count does not change what compiles (only the weights' size)
    x = torch.randn(8, hidden, dtype=torch.bfloat16, device=dev)
    gate_up = torch.randn(e, 2 * inter, hidden, dtype=torch.bfloat16, device=dev)
    down = torch.randn(e, hidden, inter, dtype=torch.bfloat16, device=dev)
    experts = torch.randint(0, e, (8, top_k), device=dev)
    fused_experts(x, torch.rand(8, top_k, device=dev), experts, gate_up, down, tiles)
    if CUDA:
        torch.cuda.synchronize()
    return str(tiles)


def precompile(models: dict, tokens: tuple[int, ...], workers: int) -> None:
    plan = _sweep_plan(models, tokens)
    start = time.perf_counter()
    ctx = torch.multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(workers, mp_context=ctx) as pool:
        list(pool.map(_compile_one, plan))
    log(f"precompiled {len(plan)} tile variants in {time.perf_counter() - start:.0f} s")


def parts(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, mlp: MoEMLP,
          tiles: MoETiles, rep: int) -> dict[str, float]:
    """Milliseconds of each stage of ``fused_experts`` (align, gate_up, down, k-sum)."""
    t, h = x.shape
    k, e, i = experts.shape[1], mlp.gate_up.shape[0], mlp.gate_up.shape[1] // 2
    aligned = fused_moe.align(experts, e, tiles.block_m, tiles.align_block)
    act = torch.empty(t * k, i, dtype=x.dtype, device=x.device)
    y = torch.empty(t, k, h, dtype=x.dtype, device=x.device)
    w = weights.reshape(-1).contiguous()
    return {
        "align": bench_ms(lambda: fused_moe.align(experts, e, tiles.block_m, tiles.align_block),
                          rep=rep),
        "gate_up": bench_ms(lambda: fused_moe._gemm(x, mlp.gate_up, act, None, aligned, k, True,
                                                    tiles.block_m, tiles.up), rep=rep),
        "down": bench_ms(lambda: fused_moe._gemm(act, mlp.down, y.view(t * k, h), w, aligned, 1,
                                                 False, tiles.block_m, tiles.down), rep=rep),
        "sum": bench_ms(lambda: y.sum(1), rep=rep),
    }


def sweep(name: str, arch: MoEArch, hidden: int, tokens: int) -> dict:
    mlp = make_mlp(arch, hidden)
    x = torch.randn(tokens, hidden, dtype=torch.bfloat16, device=DEVICE)
    weights, experts = mlp.route(x)
    rep = 50 if tokens >= 2048 else 20

    tried: dict[str, float] = {}

    def run(tiles: MoETiles) -> float:
        ms = bench_ms(lambda: fused_experts(x, weights, experts, mlp.gate_up, mlp.down, tiles),
                      rep=rep)
        tried[str(tiles)] = min(ms, tried.get(str(tiles), ms))
        return tried[str(tiles)]

    bms, ups, downs = candidates(tokens, arch.top_k, arch.num_experts)
    best = min((seed(bm, ups, downs) for bm in bms), key=run)
    for field, options in (("up", ups), ("down", downs)):
        variants = [dataclasses.replace(best, up=t) if field == "up"
                    else dataclasses.replace(best, down=t) for t in options]
        best = min(variants, key=run)
    table = tile_config(tokens, arch.top_k, arch.num_experts)
    table_ms = run(table)
    split = parts(x, weights, experts, mlp, table, rep)
    log(f"sweep {name:18s} T={tokens:5d}: best {tried[str(best)] * 1e3:8.1f} us {best}; "
        f"table {table_ms * 1e3:8.1f} us = " + " + ".join(f"{k} {v * 1e3:.1f}"
                                                       for k, v in split.items()))
    return dict(model=name, tokens=tokens, best=str(best), best_ms=tried[str(best)],
                table_ms=table_ms, table_parts=split, tried=tried)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--no-bench", action="store_true", help="only the sweep")
    ap.add_argument("--sweep-tokens", type=str, default=",".join(map(str, SWEEP_TOKENS)))
    ap.add_argument("--workers", type=int, default=12, help="compile processes for --sweep")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on CPU (interpreter)")
    args = ap.parse_args()
    models = SMOKE_MODELS if args.smoke else MODELS
    tokens = (1, 5) if args.smoke else TOKENS
    results: dict[str, Any] = {"device": torch.cuda.get_device_name() if CUDA else "cpu"}
    ceil = ceilings()
    results["ceilings"] = ceil
    log(f"copy {ceil['copy_bytes_s'] / 1e12:.2f} TB/s (read + write), bf16 matmul "
        f"{ceil['matmul_flop_s'] / 1e12:.0f} TFLOP/s")

    def save() -> None:
        if args.out is not None:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "moe_kernel.json").write_text(json.dumps(results, indent=1))

    sweep_tokens = (1, 20) if args.smoke else tuple(map(int, args.sweep_tokens.split(",")))
    with torch.no_grad():
        if args.sweep:  # compile everything in parallel first (the table's tiles too)
            precompile(models, sweep_tokens, args.workers)
        if not args.no_bench:
            results["rows"] = []
            for name, (arch, hidden) in models.items():
                for t in tokens:
                    results["rows"].append(measure(name, arch, hidden, t, ceil))
                    save()
        if args.sweep:
            results["sweep"] = []
            for name, (arch, hidden) in models.items():
                for t in sweep_tokens:
                    results["sweep"].append(sweep(name, arch, hidden, t))
                    save()
    save()


if __name__ == "__main__":
    main()
