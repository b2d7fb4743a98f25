"""How fast the KV tiers' copies run on one GPU (issue 38): ``copy_pages`` out (device pages
-> pinned host slots) and in (back), for PAGES pages of a Qwen3-8B-shaped KV (36 layers, 8 kv
heads, head_dim 128, page 16, bf16: 2.25 MiB a page) between the device layout and the
slot-major pinned host pool, with the slots in one run or scattered.

    python bench/tier_copy_probe.py [PAGES]
"""

from __future__ import annotations

import random
import sys
import time

import torch

from disagg.engine.kv_tiers import Copy
from disagg.engine.tier_copy import copy_pages


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 256
    layers, num_pages, slots_total = 36, 4096, 8192
    pb = 2 * 8 * 16 * 128 * 2
    dev = torch.randint(0, 255, (layers, num_pages, pb), dtype=torch.uint8, device="cuda")
    host = torch.empty((slots_total, layers, pb), dtype=torch.uint8, pin_memory=True)
    stream = torch.cuda.Stream()
    pages = tuple(range(100, 100 + n))
    rng = random.Random(0)
    for name, slots in (("one run", tuple(range(n))),
                        ("scattered", tuple(rng.sample(range(slots_total), n)))):
        for kind in ("out", "in"):
            copy = Copy(0, kind, pages, slots)
            copy_pages(copy, [dev], [host], stream)  # warm
            t0 = time.perf_counter()
            reps = 5
            for _ in range(reps):
                copy_pages(copy, [dev], [host], stream)
            dt = (time.perf_counter() - t0) / reps
            gb = n * layers * pb / 1e9
            print(f"{kind:>3} {n} pages ({gb:.2f} GB), slots {name}: {1e3 * dt:.1f} ms, "
                  f"{gb / dt:.1f} GB/s")


if __name__ == "__main__":
    main()
