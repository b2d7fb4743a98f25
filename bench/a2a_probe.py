"""Expert parallelism's all-to-all against the copy rate between the GPUs (issue 40, part 1).

One process per GPU (NCCL, ``torch.multiprocessing``). For each row count (tokens x top-k
rows of one MoE layer's dispatch, split evenly over the ranks), the median time of
``all_to_all_single`` of ``[rows, hidden]`` bf16 (what ``disagg.model.ep`` sends twice a layer:
dispatch and combine, plus the small count and metadata exchanges, timed too as ``counts``),
and of a plain ``tensor.copy_`` of the same bytes from GPU 0 to GPU 1 (the ceiling). Prints one
JSON line.

    python3 bench/a2a_probe.py [--ranks 2] [--hidden 2048] [--rows 512,4096,32768]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

import torch


def _median_ms(fn: Any, reps: int = 20) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t) * 1000)
    return statistics.median(times)


def _measure(rows: int, size: int, hidden: int, rank: int) -> dict[str, Any]:
    """One row count: the all-to-all, the count exchange and (rank 0) the peer copy."""
    import torch.distributed as dist

    per = rows // size
    x = torch.randn(per * size, hidden, dtype=torch.bfloat16, device="cuda")
    y = torch.empty_like(x)
    split = [per] * size
    counts = torch.full((size,), per, dtype=torch.long, device="cuda")
    got = torch.empty_like(counts)

    def a2a() -> None:
        dist.all_to_all_single(y, x, split, split)

    def meta() -> None:
        dist.all_to_all_single(got, counts)
        got.tolist()

    dist.barrier()
    ms = _median_ms(a2a)
    dist.barrier()
    meta_ms = _median_ms(meta)
    copy_ms = None
    if rank == 0 and size > 1:
        dst = torch.empty_like(x, device="cuda:1")
        copy_ms = _median_ms(lambda: dst.copy_(x, non_blocking=True))
    nbytes = x.numel() * x.element_size()
    dist.barrier()
    return {"rows": rows, "bytes": nbytes, "all_to_all_ms": ms, "counts_ms": meta_ms,
            "peer_copy_ms": copy_ms, "all_to_all_gb_s": nbytes * (size - 1) / size / ms / 1e6,
            "peer_copy_gb_s": None if copy_ms is None else nbytes / copy_ms / 1e6}


def _rank(rank: int, size: int, args: argparse.Namespace, init: str, out: Any) -> None:
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=init, rank=rank, world_size=size)
    res = [_measure(int(r), size, args.hidden, rank) for r in args.rows.split(",")]
    if rank == 0:
        out["result"] = res
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--rows", default="512,4096,32768")
    args = ap.parse_args()
    if torch.cuda.device_count() < args.ranks:
        sys.exit(f"needs {args.ranks} CUDA devices, found {torch.cuda.device_count()}")
    import tempfile

    import torch.multiprocessing as mp

    out = mp.Manager().dict()
    with tempfile.TemporaryDirectory() as d:
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        mp.spawn(_rank, args=(args.ranks, args, f"file://{d}/rdv", out), nprocs=args.ranks)
    print(json.dumps({"ranks": args.ranks, "hidden": args.hidden, "sweep": out["result"]}))


if __name__ == "__main__":
    main()
