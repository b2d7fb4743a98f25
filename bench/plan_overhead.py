"""The prefiller's CPU cost per finished layer: planning a chunk's page writes and handing them
to the transfer engine (the engine's submit is replaced by its bounds check and array work, so
only the messenger side is timed). Qwen3-8B-shaped layout (36 layers, 8 kv heads, head_dim
128, page 16, bf16); destination pages scattered, as on a busy decoder.

    python bench/plan_overhead.py
"""

from __future__ import annotations

import random
import time

import numpy as np

from disagg.fabric.descriptor import check_writes
from disagg.protocol.peer import KVLayoutDesc
from disagg.remote.transfer_plan import Runs, plan_chunk, plan_layer_writes
from disagg.transfer import TransferEngine

L = KVLayoutDesc(num_layers=36, num_pages=20000, num_kv_heads=8, page_size=16, head_dim=128,
                 dtype="bfloat16", element_size=2, hidden_size=4096)


class CheckOnly:
    provider = "check-only"

    def submit(self, src, dst, so, do, ln, imm, timeout=None):  # type: ignore[no-untyped-def]
        so, do, ln = check_writes(src.length, dst.length, so, do, ln)
        (so + 1).astype(np.uint64), (do + 1).astype(np.uint64)


class Region:
    length = L.total_bytes


def main() -> None:
    te = TransferEngine.__new__(TransferEngine)  # no backend: CheckOnly stands in
    te.engine, te.lanes, te.writes_sent, te.bytes_sent = CheckOnly(), 1, 0, 0
    random.seed(0)
    for n in (512, 2048):
        src = list(range(1000, 1000 + n))
        dst = random.sample(range(L.num_pages), n)
        t0 = time.perf_counter()
        for layer in range(L.num_layers):
            te.write(Region(), Region(), Runs.of(plan_layer_writes(L, L, src, dst, layer, seed=3)),
                     5)
        per_layer = (time.perf_counter() - t0) / L.num_layers
        t0 = time.perf_counter()
        plan = plan_chunk(L, L, src, dst, seed=3)
        t1 = time.perf_counter()
        for layer in range(L.num_layers):
            te.write(Region(), Region(), plan.layer((0, 0), layer), 5)
        chunk = (time.perf_counter() - t1) / L.num_layers
        print(f"{n} scattered pages: plan every layer {per_layer * 1e3:.3f} ms/layer; "
              f"plan once {1e3 * (t1 - t0):.2f} ms, then {chunk * 1e3:.3f} ms/layer")


if __name__ == "__main__":
    main()
