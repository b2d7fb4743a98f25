"""The batch-1 decode step's projections (issues 18, 33 and 39): Qwen3-8B's one-row GEMVs and
the kernel sequences of one layer around them, fused (the norm or SiLU-mul as the GEMV's
prologue, ``disagg.kernels.gemv`` / ``fp8_gemv``) against unfused (``fused.rms_norm`` /
``fused.silu_mul``, then the GEMV), with bf16 and block-FP8 weights; plus a tile sweep of the
FP8 GEMV (``fp8_gemv.GemvTile``: rows per program, blocks per step, warps, stages, split-K).

Each figure is the median time of one call from a CUDA graph of 20 calls that cycle over copies
of the weights spanning 256 MB (read from HBM, not L2), as ``bench/fp8_gemm.py`` times them;
the copy rate is measured in the same run. Sequences: ``norm_qkv`` (residual add + RMSNorm,
qkv), ``norm_gate_up`` (the same, gate_up) and ``silu_down`` (SiLU-mul, down); ``per_layer``
sums the three and ``per_step_saved_ms`` is 36 layers' difference.

    python3 bench/gemv_probe.py --out DIR [--budget-s 100]
    TRITON_INTERPRET=1 python3 bench/gemv_probe.py --out DIR --device cpu   # dry run, tiny
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fp8_gemm import L2_SPAN, fp8_quantize, graph_us, rel  # noqa: E402  (this directory)

from disagg.kernels import fp8_gemv, gemv  # noqa: E402
from disagg.kernels.fp8_gemv import GemvTile  # noqa: E402
from disagg.model import fused  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096),
          "down": (4096, 12288)}
TINY = {"qkv": (192, 256), "o": (128, 128), "gate_up": (384, 256), "down": (128, 384)}
LAYERS = 36
EPS = 1e-6
TOL = 8e-3  # relative L2 error of a bf16 output against the float32 reference
BF16_TILES = ((16, 256), (16, 512), (32, 256), (8, 512), (8, 1024))
FP8_TILES = tuple(GemvTile(*t) for t in (
    (16, 4, 2, 4), (16, 1, 2, 8), (16, 2, 2, 6), (16, 4, 4, 4), (8, 4, 2, 6), (32, 2, 4, 4),
    (8, 8, 4, 3), (64, 1, 8, 3), (32, 4, 4, 3), (16, 8, 4, 3), (16, 4, 4, 6), (32, 4, 8, 4),
    (16, 4, 2, 4, 2), (16, 4, 2, 4, 4), (8, 4, 2, 6, 2), (16, 2, 2, 6, 4), (32, 4, 4, 3, 4),
    (16, 8, 4, 3, 2)))
SEQUENCES = {"norm_qkv": "qkv", "norm_gate_up": "gate_up", "silu_down": "down"}


def timed_us(fn: Any, copies: int, dev: torch.device) -> float:
    """``fn(i)``'s time (i: the weight copy): a CUDA graph's (``fp8_gemm.graph_us``) or, on
    the CPU dry run, the wall time of one call."""
    if dev.type == "cuda":
        return graph_us(fn, copies)
    fn(0)
    t0 = time.perf_counter()
    fn(0)
    return (time.perf_counter() - t0) * 1e6


def copy_rate(dev: torch.device) -> float | None:
    if dev.type != "cuda":
        return None
    src = torch.empty(1 << 29, dtype=torch.int16, device=dev)
    dst = torch.empty_like(src)
    return 2 * src.numel() * 2 / (graph_us(lambda i: dst.copy_(src), 1) * 1e-6) / 1e12


class Shape:
    """One projection's operands: ``copies`` of its bf16 and FP8 weights and a layer's rows."""

    def __init__(self, n: int, k: int, dev: torch.device, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        w = torch.randn(n, k, generator=gen) * 0.02
        wq, ws = fp8_quantize(w)
        self.n, self.k = n, k
        self.copies = max(1, min(8, math.ceil(L2_SPAN / (n * k)))) if dev.type == "cuda" else 1
        self.bf = [w.to(dev, torch.bfloat16) for _ in range(self.copies)]
        self.fp8 = [(wq.to(dev), ws.to(dev)) for _ in range(self.copies)]
        bf = dict(device=dev, dtype=torch.bfloat16)
        self.x = (torch.randn(1, k, generator=gen) * 2).to(**bf)
        self.delta = torch.randn(1, k, generator=gen).to(**bf)
        self.norm_w = (1 + 0.1 * torch.randn(k, generator=gen)).to(**bf)
        self.gate_up = (torch.randn(1, 2 * k, generator=gen) * 2).to(**bf)
        deq = wq.float() * ws.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
        self.w_ref = {"bf16": self.bf[0].float(), "fp8": deq.to(dev)}


def sweep(s: Shape, dev: torch.device, deadline: float, tiny: bool) -> dict[str, Any]:
    """One row through cuBLAS bf16, the bf16 GEMV's tiles and the FP8 GEMV's tiles."""
    row: dict[str, Any] = {"N": s.n, "K": s.k, "bf16_tiles": {}, "fp8_tiles": {}}
    if dev.type == "cuda":
        row["cublas_bf16_us"] = timed_us(lambda i: F.linear(s.x, s.bf[i]), s.copies, dev)
    truth = {p: s.x.float() @ w.T for p, w in s.w_ref.items()}
    table = {"bf16": gemv.tiles(s.n, s.k), "fp8": fp8_gemv.gemv_tile(s.n, s.k)}
    for prec, tiles in (("bf16", BF16_TILES), ("fp8", FP8_TILES)):
        first = table[prec]
        cands = [first] + ([] if tiny else [t for t in tiles if t != first])
        best = None
        for t in cands:
            if best is not None and time.monotonic() > deadline:
                break
            if prec == "bf16":
                def call(i: int, t: Any = t) -> torch.Tensor:
                    return gemv.gemv(s.x, s.bf[i], tile=t)
            else:
                def call(i: int, t: Any = t) -> torch.Tensor:
                    return fp8_gemv.fp8_gemv(s.x, *s.fp8[i], t)
            name = "x".join(map(str, t)) if prec == "bf16" else tile_name(t)
            try:
                err = rel(call(0), truth[prec])
                us = timed_us(call, s.copies, dev)
            except Exception as e:  # a tile that does not compile or fit: recorded, skipped
                row[f"{prec}_tiles"][name] = {"error": f"{type(e).__name__}: {e}"[:300]}
                continue
            wbytes = s.n * s.k * (2 if prec == "bf16" else 1)
            row[f"{prec}_tiles"][name] = {"us": us, "err": err, "TBps": wbytes / us / 1e6}
            if err <= TOL and (best is None or us < best[0]):
                best = (us, name, t)
        row[f"{prec}_table"] = row[f"{prec}_tiles"].get(
            "x".join(map(str, first)) if prec == "bf16" else tile_name(first))
        row[f"{prec}_best"] = None if best is None else {"us": best[0], "tile": best[1]}
        row[f"_{prec}_best_tile"] = None if best is None else best[2]
    return row


def tile_name(t: GemvTile) -> str:
    return f"{t.bn}r{t.sub}b{t.warps}w{t.stages}s" + (f"k{t.split}" if t.split > 1 else "")


def sequence(name: str, s: Shape, prec: str, fuse: bool, tile: Any) -> Any:
    """``fn(i)`` running one of SEQUENCES on weight copy ``i``."""
    if name == "silu_down":
        if prec == "bf16":
            return (lambda i: gemv.silu_gemv(s.gate_up, s.bf[i], tile=tile)) if fuse else \
                (lambda i: gemv.gemv(fused.silu_mul(s.gate_up), s.bf[i], tile=tile))
        return (lambda i: fp8_gemv.fp8_silu_gemv(s.gate_up, *s.fp8[i], tile)) if fuse else \
            (lambda i: fp8_gemv.fp8_gemv(fused.silu_mul(s.gate_up), *s.fp8[i], tile))
    args = (s.x, s.delta, s.norm_w, EPS)
    if fuse:
        if prec == "bf16":
            return lambda i: gemv.norm_gemv(*args, s.bf[i], tile=tile)[0]
        return lambda i: fp8_gemv.fp8_norm_gemv(*args, *s.fp8[i], tile)[0]

    def unfused(i: int) -> torch.Tensor:
        h, _ = fused.rms_norm(s.delta, s.norm_w, EPS, residual=s.x)
        if prec == "bf16":
            return gemv.gemv(h, s.bf[i], tile=tile)
        return fp8_gemv.fp8_gemv(h, *s.fp8[i], tile)
    return unfused


def sequences(shapes: dict[str, Shape], sweeps: dict[str, Any], dev: torch.device
              ) -> dict[str, Any]:
    """Each sequence fused and unfused, bf16 and FP8, at the table's tile (the fused FP8 one
    also at the plain sweep's best tile)."""
    out: dict[str, Any] = {}
    for prec in ("bf16", "fp8"):
        res: dict[str, Any] = {}
        for name, proj in SEQUENCES.items():
            s = shapes[proj]
            if name == "silu_down":
                g, u = s.gate_up.float().chunk(2, -1)
                act = (F.silu(g) * u).to(torch.bfloat16)
            else:
                r = s.x + s.delta
                act = (s.norm_w * (r.float() * torch.rsqrt(r.float().pow(2).mean(-1, True)
                                                            + EPS)).to(torch.bfloat16))
            ref = act.float() @ s.w_ref[prec].T
            table = gemv.tiles(s.n, s.k) if prec == "bf16" else fp8_gemv.gemv_tile(s.n, s.k)
            entry: dict[str, Any] = {}
            for fuse in (False, True):
                key = "fused" if fuse else "unfused"
                fn = sequence(name, s, prec, fuse, table)
                entry[f"{key}_err"] = rel(fn(0), ref)
                entry[f"{key}_us"] = timed_us(fn, s.copies, dev)
            best = sweeps[proj].get(f"_{prec}_best_tile")
            if prec == "fp8" and best is not None and best != table:
                fn = sequence(name, s, prec, True, best)
                entry["fused_at_plain_best_us"] = timed_us(fn, s.copies, dev)
                entry["plain_best_tile"] = tile_name(best)
            res[name] = entry
        un = sum(v["unfused_us"] for v in res.values())
        fu = sum(v["fused_us"] for v in res.values())
        res["per_layer"] = {"unfused_us": un, "fused_us": fu,
                            "per_step_saved_ms": (un - fu) * LAYERS / 1e3}
        out[prec] = res
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="directory for gemv.json")
    ap.add_argument("--budget-s", type=float, default=100.0,
                    help="after this many seconds the sweeps time only the table's tiles")
    ap.add_argument("--device", default="cuda", help="cuda, or cpu for a dry run (tiny shapes)")
    args = ap.parse_args()
    start = time.monotonic()
    dev = torch.device(args.device)
    tiny = dev.type != "cuda"
    torch.backends.cuda.matmul.allow_tf32 = False
    res: dict[str, Any] = {
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "torch": torch.__version__, "triton": triton.__version__, "copy_TBps": copy_rate(dev)}
    print(res, flush=True)
    shapes = {name: Shape(n, k, dev, seed) for seed, (name, (n, k))
              in enumerate((TINY if tiny else SHAPES).items())}
    sweeps = {}
    for name, s in shapes.items():
        sweeps[name] = sweep(s, dev, start + args.budget_s, tiny)
        r = sweeps[name]
        print(f"{name:>8} [{s.n}x{s.k}] cuBLAS bf16 {r.get('cublas_bf16_us', float('nan')):.1f}"
              f" us | bf16 gemv best {r['bf16_best']} | fp8 gemv table {r['fp8_table']} best "
              f"{r['fp8_best']}", flush=True)
    res["sequences"] = sequences(shapes, sweeps, dev)
    for prec, rows in res["sequences"].items():
        for name, v in rows.items():
            print(f"{prec:>5} {name:>13} {json.dumps(v)}", flush=True)
    for r in sweeps.values():
        r.pop("_bf16_best_tile"), r.pop("_fp8_best_tile")
    res["gemv"] = sweeps
    res["fp8_table_line"] = {f"({r['N']}, {r['K']})": r["fp8_best"] for r in sweeps.values()}
    res["wall_s"] = time.monotonic() - start
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gemv.json").write_text(json.dumps(res, indent=1))
    print(f"wrote {out / 'gemv.json'} in {res['wall_s']:.0f} s", flush=True)


if __name__ == "__main__":
    main()
