"""MoE / MLA models across the split on one GPU (#16): a prefill and a decode process sharing
the GPU (cuda-ipc) give a mixed node's greedy output, for a DeepSeek-V2-Lite-shaped and a
Qwen3-30B-A3B-shaped model (full widths, 4 layers, random weights, float32 so that the
decoder's first step -- a decode kernel where the mixed node ran the prompt's last token in a
prefill chunk -- rounds alike), and every remote request's TTFT breakdown is complete. With
``DISAGG_TEST_OUT`` set, the breakdowns are written there as JSON (docs/BENCHMARKS.md)."""

from __future__ import annotations

import asyncio
import json
import os
import random
import sys
from pathlib import Path

import pytest
import torch

from disagg.client import AsyncClient
from disagg.protocol import SamplingParams
from tinymodels import NodeProcess, free_port

BENCH = Path(__file__).resolve().parents[2] / "bench"

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

LAYERS = 4
LENGTHS = [3, 17, 200, 1100]
NEW = 12
BREAKDOWN = ("prefill_queue", "prefill_compute", "exposed_transfer", "decode_queue", "kv_wait",
             "first_step")


def prompt(n: int) -> list[int]:
    rng = random.Random(n)
    return [rng.randrange(1000, 90000) for _ in range(n)]


def start(role: str, model: Path, tmp: Path, *extra: str) -> tuple[str, NodeProcess]:
    addr = f"tcp://127.0.0.1:{free_port()}"
    args = ["--role", role, "--model", str(model), "--random-weights", "--seed", "0",
            "--listen", addr, "--devices", "cuda:0", "--dtype", "float32", "--page-size", "16",
            "--num-pages", "512", "--max-model-len", "2048", "--heartbeat", "0.2",
            "--startup-timeout", "300", *extra]
    return addr, NodeProcess(args, tmp / f"{role}-{addr.rsplit(':', 1)[1]}.log")


async def run(addr: str) -> tuple[list[list[int]], list[dict | None]]:
    c = AsyncClient(addr)
    try:
        outs, timings = [], []
        for n in LENGTHS:
            ids, _, fin = await c.complete(prompt_token_ids=prompt(n),
                                           sampling=SamplingParams(max_tokens=NEW,
                                                                   ignore_eos=True))
            outs.append(ids)
            timings.append(fin.timings)
        return outs, timings
    finally:
        await c.close()


@pytest.mark.parametrize("shape", ["v2lite", "qwen3moe"])
def test_a_split_on_one_gpu_matches_a_mixed_node(shape, tmp_path):
    # bench/ on sys.path only for this import: its kernels.py would shadow the ``kernels``
    # package transformers probes for when it imports a model family
    sys.path.insert(0, str(BENCH))
    try:
        from sparse_engine import SHAPES
    finally:
        sys.path.remove(str(BENCH))

    model = tmp_path / shape
    model.mkdir()
    (model / "config.json").write_text(json.dumps(dict(SHAPES[shape], num_hidden_layers=LAYERS)))
    mixed = start("mixed", model, tmp_path)
    p = start("prefill", model, tmp_path, "--transfer-backend", "cuda-ipc")
    d = start("decode", model, tmp_path, "--transfer-backend", "cuda-ipc", "--prefill-peer",
              p[0])
    procs = [mixed[1], p[1], d[1]]
    try:
        for proc in procs:
            proc.wait_ready(300)

        async def both():
            c = AsyncClient(d[0])
            try:
                for _ in range(300):
                    if (await c.stats()).prefill_peers_alive == 1:
                        break
                    await asyncio.sleep(0.1)
            finally:
                await c.close()
            return await run(mixed[0]), await run(d[0])

        (ref, _), (got, timings) = asyncio.run(both())
        assert got == ref
        assert all(t is not None and set(BREAKDOWN) <= t.keys() for t in timings), timings
        late = [line for proc in procs for line in proc.log_path.read_text().splitlines()
                if "Triton compiled" in line]
        assert late == [], "\n".join(late)
        if out := os.environ.get("DISAGG_TEST_OUT"):
            Path(out, f"ttft_{shape}.json").write_text(json.dumps(
                {"lengths": LENGTHS, "timings_ms": timings}, indent=1))
    finally:
        for proc in procs:
            proc.stop()
