"""Probe (issue 18, batch-1 decode): how fast the batch-1 projections of the Qwen3-8B shape run
through cuBLAS (``F.linear`` at M=1, ``torch.mv``) and through a plain Triton GEMV, each timed
from a CUDA graph of 20 launches, against the copy rate measured in the same run.

    python3 bench/gemv_probe.py [--out DIR]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096),
          "down": (4096, 12288), "lm_head": (151936, 4096)}


@triton.jit
def _gemv(w_ptr, x_ptr, out_ptr, N, K, BN: tl.constexpr, BK: tl.constexpr):
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    acc = tl.zeros((BN, BK), dtype=tl.float32)
    for k0 in tl.range(0, K, BK, num_stages=4):
        k = k0 + tl.arange(0, BK)
        w = tl.load(w_ptr + n[:, None].to(tl.int64) * K + k[None, :],
                    mask=(n[:, None] < N) & (k[None, :] < K), other=0.0)
        x = tl.load(x_ptr + k, mask=k < K, other=0.0)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    tl.store(out_ptr + n, tl.sum(acc, 1).to(out_ptr.dtype.element_ty), mask=n < N)


def gemv(w, x, out, bn, bk, warps):
    n, k = w.shape
    _gemv[(triton.cdiv(n, bn),)](w, x, out, n, k, BN=bn, BK=bk, num_warps=warps)


def graph_us(fn, reps=20):
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        fn()
        with torch.cuda.graph(g, stream=s):
            for _ in range(reps):
                fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(10):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / reps)
    return sorted(times)[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda:0")
    src = torch.empty(1 << 29, dtype=torch.int16, device=dev)
    dst = torch.empty_like(src)
    copy_bps = 2 * src.numel() * 2 / (graph_us(lambda: dst.copy_(src), 5) * 1e-6)
    src = dst = torch.empty(0)
    res = {"copy_TBps": copy_bps / 1e12, "shapes": {}}
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, dtype=torch.bfloat16, device=dev) * 0.02
        x = torch.randn(1, k, dtype=torch.bfloat16, device=dev)
        ref = F.linear(x.float(), w.float())[0]
        out = torch.empty(n, dtype=torch.bfloat16, device=dev)
        row = {"linear_us": graph_us(lambda w=w, x=x: F.linear(x, w)),
               "mv_us": graph_us(lambda w=w, x=x: torch.mv(w, x[0]))}
        best = None
        for bn, bk, warps in ((8, 512, 4), (16, 256, 4), (16, 512, 4), (32, 256, 4),
                              (8, 1024, 8), (4, 1024, 4), (16, 512, 8)):
            gemv(w, x[0], out, bn, bk, warps)
            err = float((out.float() - ref).abs().max() / ref.abs().max())
            us = graph_us(lambda w=w, x=x, out=out, c=(bn, bk, warps): gemv(w, x[0], out, *c))
            row[f"triton_{bn}x{bk}w{warps}_us"] = us
            if err < 2e-2 and (best is None or us < best[0]):
                best = (us, f"{bn}x{bk}w{warps}")
        row["best_triton"] = best
        gb = n * k * 2
        row["TBps"] = {key: gb / (v * 1e-6) / 1e12 for key, v in row.items()
                       if key.endswith("_us")}
        res["shapes"][name] = row
        print(name, {kk: (round(v, 2) if isinstance(v, float) else v) for kk, v in row.items()
                     if kk != "TBps"}, flush=True)
    print(json.dumps(res, indent=1))
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "gemv.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
