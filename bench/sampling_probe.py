"""Seeded sampling's device cost at a decode batch (issue 39: sampled TPOT <= 1.03x greedy):
the batch's argmax (what a greedy step takes), the exponential race alone, the race with top-p
applied by its kernel (``disagg.kernels.sample_race``: race, check the winner, no sort), the
``torch.topk`` that gives top-k's floor and the race above it, the sort path top-p replaced
(``filter_batch`` then the race), and ``draw`` as the engine calls it (the temperature
division, the keys, the race; host work included).

Logits are float32 ``[B, V]`` (Qwen3's vocabulary by default) drawn three ways: flat (random
weights give nearly uniform rows: top-p 0.95 keeps ~95% of the vocabulary), moderate and
peaked (a trained model's: top-p keeps a few tokens). Kernel rows are CUDA-graph replays of 20
calls (``bench/fp8_gemm.py``'s ``graph_us``); the sort path and ``draw`` (which build tensors
from host lists) are timed with events over 20 calls after a warm-up.

    python3 bench/sampling_probe.py --out DIR [--batch 64] [--vocab 151936] [--sweep]

``--sweep`` also times the race kernel alone and with top-p at every (logits per loop step,
warps) pair of ``SWEEP_BLOCKS`` x ``SWEEP_WARPS`` (the module's ``BLOCK`` / ``WARPS``), each
checked against the sort path's tokens.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fp8_gemm import graph_us  # noqa: E402  (this directory)

from disagg.engine.sampling import draw, draw_seed  # noqa: E402
from disagg.kernels import sample_race  # noqa: E402
from disagg.kernels.sample_race import filter_batch, race  # noqa: E402

SCALES = {"flat": 0.05, "moderate": 1.0, "peaked": 4.0}
SWEEP_BLOCKS = (1024, 2048, 4096, 8192)
SWEEP_WARPS = (4, 8, 16)


def event_us(fn, reps: int = 20) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) * 1e3 / reps


def probe(x: torch.Tensor, keys: torch.Tensor, a: argparse.Namespace) -> dict:
    b, dev = x.shape[0], x.device
    no_floor = torch.full((b,), float("-inf"), device=dev)
    no_p = torch.ones(b, dtype=torch.float32, device=dev)
    on_p = torch.full((b,), a.top_p, dtype=torch.float32, device=dev)
    floor = torch.topk(x, a.top_k, dim=-1).values[:, -1].contiguous()
    kept = filter_batch(x, [0] * b, [a.top_p] * b).isfinite().sum(-1)
    p_rows = [(a.temperature, 0, a.top_p, 7, i) for i in range(b)]
    k_rows = [(a.temperature, a.top_k, 1.0, 7, i) for i in range(b)]
    sort_path = race(filter_batch(x, [0] * b, [a.top_p] * b), keys)
    return {
        "top_p_kept_tokens_mean": float(kept.float().mean()),
        "argmax": graph_us(lambda i: x.argmax(dim=-1), 1),
        "race": graph_us(lambda i: race(x, keys, no_floor, no_p), 1),
        "race_top_p": graph_us(lambda i: race(x, keys, no_floor, on_p), 1),
        "topk_floor": graph_us(lambda i: torch.topk(x, a.top_k, dim=-1), 1),
        "race_top_k_floor": graph_us(lambda i: race(x, keys, floor, no_p), 1),
        "sort_then_race_top_p": event_us(
            lambda: race(filter_batch(x, [0] * b, [a.top_p] * b), keys)),
        "draw_top_p": event_us(lambda: draw(x, p_rows)),
        "draw_top_k": event_us(lambda: draw(x, k_rows)),
        "kernel_equals_sort_path": race(x, keys, no_floor, on_p).tolist() == sort_path.tolist(),
    }


def sweep(x: torch.Tensor, keys: torch.Tensor, top_p: float) -> dict:
    """The race kernel's time alone and with top-p at each (BLOCK, WARPS), and whether its
    tokens equal the sort path's."""
    b, dev = x.shape[0], x.device
    no_floor = torch.full((b,), float("-inf"), device=dev)
    no_p = torch.ones(b, dtype=torch.float32, device=dev)
    on_p = torch.full((b,), top_p, dtype=torch.float32, device=dev)
    want = race(filter_batch(x, [0] * b, [top_p] * b), keys).tolist()
    keep = sample_race.BLOCK, sample_race.WARPS
    out = {}
    try:
        for block in SWEEP_BLOCKS:
            for warps in SWEEP_WARPS:
                sample_race.BLOCK, sample_race.WARPS = block, warps
                try:
                    same = race(x, keys, no_floor, on_p).tolist() == want
                    out[f"{block}x{warps}"] = {
                        "race": graph_us(lambda i: race(x, keys, no_floor, no_p), 1),
                        "race_top_p": graph_us(lambda i: race(x, keys, no_floor, on_p), 1),
                        "equals_sort_path": same}
                except Exception as e:  # noqa: BLE001  (out of registers: say so, go on)
                    out[f"{block}x{warps}"] = {"error": repr(e)[:200]}
    finally:
        sample_race.BLOCK, sample_race.WARPS = keep
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--top-p", type=float, default=0.95)
    ap.add_argument("--top-k", type=int, default=50)
    ap.add_argument("--sweep", action="store_true", help="time every (BLOCK, WARPS) pair")
    a = ap.parse_args()
    dev = torch.device("cuda:0")
    b, v = a.batch, a.vocab
    g = torch.Generator(device=dev).manual_seed(0)
    keys = torch.tensor([draw_seed(7, i) for i in range(b)], dtype=torch.int64, device=dev)
    result: dict = {"device": torch.cuda.get_device_name(dev), "batch": b, "vocab": v,
                    "temperature": a.temperature, "top_p": a.top_p, "top_k": a.top_k,
                    "torch": torch.__version__, "us": {}}
    for name, scale in SCALES.items():
        x = torch.randn(b, v, device=dev, generator=g) * scale
        r = probe(x, keys, a)
        result["us"][name] = r
        print(name, {k: round(val, 1) if isinstance(val, float) else val
                     for k, val in r.items()}, flush=True)
        if a.sweep:
            r["sweep"] = sweep(x, keys, a.top_p)
            for cfg, t in r["sweep"].items():
                print(" ", name, cfg, {k: round(val, 1) if isinstance(val, float) else val
                                        for k, val in t.items()}, flush=True)
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "sampling_probe.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
