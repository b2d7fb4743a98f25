"""Decode attention tiles for bf16 and FP8 KV pages (#33: FP8 pages were no faster than bf16).

Sweeps ``paged_decode_attention``'s launch (``block_n``, warps, pipelining stages, split count)
at Qwen3-8B's attention shape (32 q heads, 8 kv heads, head_dim 128, pages of 16, scattered
block tables) for bf16 and ``float8_e4m3fn`` pages, batch 1 and 64 at ctx 4096 (``--batches``), timing
CUDA-graph replays (``bench/kernels.py`` ``bench_ms``), and reports each configuration's
achieved K/V read rate against the device copy rate measured in the same run. The best FP8
configuration is checked against the torch reference on the dequantized pages.

    python3 bench/decode_kv_sweep.py --out DIR      (DIR/decode_kv_sweep.json; CUDA only)
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from functools import partial
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels import HKV, HQ, Cache, D, bench_ms, decode_lens, log, rel_err  # noqa: E402

from disagg.kernels import reference  # noqa: E402
from disagg.kernels.decode import default_num_splits, paged_decode_attention  # noqa: E402

TILES = [(64, 4, 2), (64, 4, 3), (64, 4, 4), (128, 4, 2), (128, 4, 3), (128, 8, 2),
         (128, 8, 3), (256, 8, 2), (256, 8, 3)]


def copy_rate(device: torch.device) -> float:
    """Bytes/s of a 1 GiB device-to-device copy (read + write counted)."""
    a = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    ms = bench_ms(lambda: b.copy_(a))
    return 2 * a.numel() / (ms * 1e-3)


def kv_bytes(lens: list[int], elt: int) -> int:
    return sum(lens) * HKV * D * 2 * elt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=".")
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--ctx", type=int, default=4096)
    args = ap.parse_args()
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(3)
    copy = copy_rate(dev)
    log(f"copy rate {copy / 1e12:.2f} TB/s")
    res: dict[str, Any] = {"copy_TBps": copy / 1e12, "rows": [], "best": {}}
    batches = [int(b) for b in args.batches.split(",")]
    pages = max(batches) * math.ceil(args.ctx / 16) + 64
    base = Cache(pages, 16, dev, torch.bfloat16)
    scales = torch.ones(HKV, dtype=torch.float32, device=dev)
    caches = {"bf16": (base.k, base.v, None),
              "fp8": (base.k.to(torch.float8_e4m3fn), base.v.to(torch.float8_e4m3fn),
                      (scales, scales))}
    for batch in batches:
        lens = decode_lens(batch, args.ctx, gen)
        bt, sl = base.tables(lens, gen)
        q = torch.randn(batch, HQ, D, dtype=torch.bfloat16, device=dev)
        auto = default_num_splits(batch, HKV, args.ctx, 64)
        for name, (k, v, kvs) in caches.items():
            nbytes = kv_bytes(lens, k.element_size())
            best: tuple[float, dict[str, int]] = (float("inf"), {})
            for block_n, warps, stages in TILES:
                for splits in sorted({auto, auto * 2}):
                    cfg = dict(num_splits=splits, block_n=block_n, num_warps=warps,
                               num_stages=stages)
                    try:
                        ms = bench_ms(partial(paged_decode_attention, q, k, v, bt, sl, D**-0.5,
                                              kv_scales=kvs, **cfg))
                    except Exception as e:  # a tile the compiler rejects (shared memory)
                        log(f"  {name} B={batch} {cfg}: failed {type(e).__name__}")
                        continue
                    tbps = nbytes / (ms * 1e-3) / 1e12
                    res["rows"].append(dict(kv=name, batch=batch, ctx=args.ctx, us=ms * 1e3,
                                            TBps=tbps, **cfg))
                    log(f"  {name} B={batch} {cfg}: {ms * 1e3:.1f} us {tbps:.2f} TB/s "
                        f"({tbps * 1e12 / copy:.0%} of copy)")
                    if ms < best[0]:
                        best = (ms, cfg)
            default = next((r for r in res["rows"] if r["kv"] == name and r["batch"] == batch
                            and r["block_n"] == 64 and r["num_warps"] == 4
                            and r["num_stages"] == 2 and r["num_splits"] == auto), None)
            res["best"][f"{name}_B{batch}"] = dict(us=best[0] * 1e3, **best[1],
                                                   default_us=default and default["us"])
            log(f"{name} B={batch}: best {best[1]} {best[0] * 1e3:.1f} us; default "
                f"{default and round(default['us'], 1)} us")
            if name == "fp8" and best[1]:
                out = paged_decode_attention(q, k, v, bt, sl, D**-0.5, kv_scales=kvs, **best[1])
                ref = reference.paged_decode_attention(
                    q.float(), k.float(), v.float(), bt, sl, D**-0.5)  # scales are 1
                err = rel_err(out.float(), ref)
                res["best"][f"{name}_B{batch}"]["rel_err"] = err
                log(f"  fp8 best config rel err vs reference {err:.2e}")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "decode_kv_sweep.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
