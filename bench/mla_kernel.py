"""MLA latent-attention kernels (``disagg.kernels.mla``) on one CUDA device.

Decode: batch 1/64/256 at a 4k context, 16 heads (DeepSeek-V2-Lite) and 128 (V3 at TP1), page
16, timed with ``triton.testing.do_bench_cudagraph``; bandwidth counts the latent bytes read
(``B * ctx * 576 * 2``) against a 1 GiB ``copy_`` measured in the same run (bytes read +
written per second) and a 1 GiB ``sum`` (bytes read per second). Prefill: one 8k causal prompt,
TFLOP/s in absorbed FLOPs (``2 * (576 + 512)`` a visible query-key pair and head) against a
bf16 8192^3 matmul. With
``--sweep`` a few tile choices per shape are timed too. Prints a table; ``--out DIR`` writes
``mla_kernel.json``.

    python bench/mla_kernel.py --sweep --out /tmp/mla
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

import torch
import triton
from triton.testing import do_bench_cudagraph

from disagg.kernels import mla

LAT, ROPE, PAGE = 512, 64, 16
SCALE = 192**-0.5


def copy_rates() -> tuple[float, float]:
    """Bytes per second moved by a 1 GiB ``copy_`` (read + written) and read by a 1 GiB
    ``sum`` (read only), timed launch by launch like ``bench/experiment_engine.py``'s ceiling
    (a 1 GiB copy replayed from a graph read 35% slower on an H200: 2.7 against 4.2 TB/s)."""
    from triton.testing import do_bench

    src = torch.randn(1 << 29, dtype=torch.float32, device="cuda").to(torch.bfloat16)
    dst = torch.empty_like(src)
    nbytes = src.numel() * 2
    copy_ms = do_bench(lambda: dst.copy_(src), warmup=50, rep=300, return_mode="median")
    sum_ms = do_bench(lambda: src.sum(dtype=torch.float32), warmup=50, rep=300,
                      return_mode="median")
    return 2 * nbytes / (copy_ms * 1e-3), nbytes / (sum_ms * 1e-3)


def matmul_tflops() -> float:
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    ms = do_bench_cudagraph(lambda: a @ b)
    return 2 * 8192**3 / (ms * 1e-3) / 1e12


def cache_for(batch: int, ctx: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    width = math.ceil(ctx / PAGE)
    pages = batch * width
    cache = torch.randn(pages, 1, PAGE, LAT + ROPE, dtype=torch.bfloat16, device="cuda")
    bt = torch.randperm(pages, device="cuda").to(torch.int32).view(batch, width)
    sl = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    return cache, bt, sl


def bench_decode(batch: int, heads: int, ctx: int, tiles: tuple[int, int, int, int] | None,
                 copy_rate: float, read_rate: float) -> dict[str, Any]:
    cache, bt, sl = cache_for(batch, ctx)
    q = torch.randn(batch, heads, LAT + ROPE, dtype=torch.bfloat16, device="cuda")
    out = torch.empty(batch, heads, LAT, dtype=torch.bfloat16, device="cuda")

    def run() -> None:
        mla.mla_decode(q, cache, bt, sl, SCALE, LAT, max_seq_len=ctx, out=out, tiles=tiles)

    run()
    ms = do_bench_cudagraph(run)
    nbytes = batch * ctx * (LAT + ROPE) * 2
    rate = nbytes / (ms * 1e-3)
    used = mla.tiles_used("decode", tiles or mla.decode_tiles(heads, 2))
    return dict(kind="decode", batch=batch, heads=heads, ctx=ctx, tiles=list(used),
                us=ms * 1e3, gbps=rate / 1e9, of_copy=rate / copy_rate, of_read=rate / read_rate,
                tflops=batch * ctx * heads * 2 * (LAT + ROPE + LAT) / (ms * 1e-3) / 1e12)


def bench_prefill(heads: int, n: int, tiles: tuple[int, int, int, int] | None,
                  mm: float) -> dict[str, Any]:
    cache, bt, sl = cache_for(1, n)
    q = torch.randn(n, heads, LAT + ROPE, dtype=torch.bfloat16, device="cuda")
    cu = torch.tensor([0, n], dtype=torch.int32, device="cuda")
    out = torch.empty(n, heads, LAT, dtype=torch.bfloat16, device="cuda")

    def run() -> None:
        mla.mla_prefill(q, cache, bt, sl, cu, SCALE, LAT, max_q_len=n, out=out, tiles=tiles)

    run()
    ms = do_bench_cudagraph(run)
    flops = heads * n * (n + 1) / 2 * 2 * (LAT + ROPE + LAT)
    tflops = flops / (ms * 1e-3) / 1e12
    used = mla.tiles_used("prefill", tiles or mla.prefill_tiles(2))
    return dict(kind="prefill", heads=heads, tokens=n, tiles=list(used), ms=ms,
                tflops=tflops, of_matmul=tflops / mm)


def flashinfer_note() -> str:
    try:
        import flashinfer  # noqa: F401
    except ImportError:
        return "flashinfer not importable: no comparison"
    return "flashinfer importable (comparison not implemented)"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--prefill-tokens", type=int, default=8192)
    ap.add_argument("--sweep", action="store_true", help="also time a few tile choices")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    rows: list[dict[str, Any]] = []
    copy_rate, read_rate = copy_rates()
    mm = matmul_tflops()
    name = torch.cuda.get_device_name()
    print(f"{name}: copy_ {copy_rate / 1e9:.0f} GB/s (read + written), sum {read_rate / 1e9:.0f} "
          f"GB/s read; bf16 matmul {mm:.0f} TFLOP/s; triton {triton.__version__}; "
          f"{flashinfer_note()}")

    def save() -> None:
        if args.out is not None:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "mla_kernel.json").write_text(json.dumps(dict(
                device=name, copy_gbps=copy_rate / 1e9, read_gbps=read_rate / 1e9,
                matmul_tflops=mm, rows=rows),
                indent=1))

    dec_sweep: dict[int, list[tuple[int, int, int, int] | None]] = {
        16: [None, (16, 32, 2, 4), (16, 32, 3, 4), (16, 16, 4, 4), (16, 32, 4, 4)],
        128: [None, (32, 64, 2, 4)],
    }
    for heads in (16, 128):
        for batch in (1, 64, 256):
            for tiles in (dec_sweep[heads] if args.sweep else [None]):
                try:
                    r = bench_decode(batch, heads, args.ctx, tiles, copy_rate, read_rate)
                except Exception as e:  # a tile choice that does not compile
                    print(f"decode B={batch} H={heads} tiles={tiles}: {type(e).__name__}")
                    continue
                rows.append(r)
                print(f"decode  B={batch:<4d} H={heads:<4d} ctx={args.ctx} tiles={r['tiles']}: "
                      f"{r['us']:8.1f} us  {r['gbps']:5.0f} GB/s = {100 * r['of_copy']:3.0f}% of "
                      f"copy_, {100 * r['of_read']:3.0f}% of sum  {r['tflops']:4.0f} TFLOP/s",
                      flush=True)
                save()
    pre_sweep: list[tuple[int, int, int, int] | None] = [None, (32, 64, 2, 4)]
    for heads in (16, 128):
        for tiles in (pre_sweep if args.sweep else [None]):
            try:
                r = bench_prefill(heads, args.prefill_tokens, tiles, mm)
            except Exception as e:
                print(f"prefill H={heads} tiles={tiles}: {type(e).__name__}")
                continue
            rows.append(r)
            print(f"prefill H={heads:<4d} {args.prefill_tokens} causal tiles={r['tiles']}: "
                  f"{r['ms']:8.2f} ms  {r['tflops']:6.1f} TFLOP/s  {100 * r['of_matmul']:5.1f}% "
                  "of matmul", flush=True)
            save()


if __name__ == "__main__":
    main()
