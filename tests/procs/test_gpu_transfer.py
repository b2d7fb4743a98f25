"""Prefill node on GPU0, decode node on GPU1, KV over cuda-ipc (cuMem fd import) and over the
fabric with host staging, and a prefill node that replays the decode graphs for its small
prompt steps (``DISAGG_PREFILL_GRAPHS``, the default; the other nodes run with
``--enforce-eager``); greedy outputs must equal a mixed node's. Two GPUs
of one host (or one: ``DISAGG_TEST_DECODE_DEVICE`` below)."""

from __future__ import annotations

import os
import random

import pytest
import torch

from disagg.client import Client
from disagg.protocol import SamplingParams
from tinymodels import NodeProcess, free_port, make_tiny_model

# The decode nodes' device: GPU1 by default; DISAGG_TEST_DECODE_DEVICE=cuda:0 runs every
# node on one GPU (a prefill and a decode process sharing it), for one-GPU machines.
DECODE_DEVICE = os.environ.get("DISAGG_TEST_DECODE_DEVICE", "cuda:1")
GPUS = 1 if DECODE_DEVICE == "cuda:0" else 2

pytestmark = [
    pytest.mark.gpu,
    *([pytest.mark.multi_gpu] if GPUS > 1 else []),
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < GPUS,
                       reason=f"needs {GPUS} GPU(s)"),
]

PAGE = 16
LENGTHS = [2, PAGE - 1, PAGE, PAGE + 1, 3 * PAGE + 5, 150]
NEW = 8


def prompt(n: int) -> list[int]:
    rng = random.Random(n)
    return [rng.randrange(3, 300) for _ in range(n)]


def start(role: str, model_dir, tmp, device: str, *extra: str, eager: bool = True,
          env: dict[str, str] | None = None) -> tuple[str, NodeProcess]:
    addr = f"tcp://127.0.0.1:{free_port()}"
    args = ["--role", role, "--model", str(model_dir), "--listen", addr, "--devices", device,
            "--dtype", "float32", "--page-size", str(PAGE), "--num-pages", "128",
            *(["--enforce-eager"] if eager else []), "--heartbeat", "0.2", *extra]
    return addr, NodeProcess(args, tmp / f"{role}-{addr.rsplit(':', 1)[1]}.log", env=env)


def run(addr: str) -> list[list[int]]:
    c = Client(addr)
    try:
        outs = []
        for n in LENGTHS:
            ids: list[int] = []
            for msg in c.generate(prompt_token_ids=prompt(n),
                                  sampling=SamplingParams(max_tokens=NEW, ignore_eos=True)):
                ids += getattr(msg, "token_ids", [])
            outs.append(ids)
        return outs
    finally:
        c.close()


def stats(addr: str):
    c = Client(addr)
    try:
        return c.stats(timeout=10)
    finally:
        c.close()


LOGS: list = []  # the module's node logs (test_nothing_compiles_after_ready reads them)


@pytest.fixture(scope="module")
def nodes(tmp_path_factory):
    """All nodes start together: a mixed reference on GPU0, and per backend a prefill node on
    GPU0 feeding a decode node on GPU1 (or GPU0: ``DISAGG_TEST_DECODE_DEVICE``)."""
    tmp = tmp_path_factory.mktemp("gpu-transfer")
    model_dir = make_tiny_model("llama", tmp / "llama")
    mixed = start("mixed", model_dir, tmp, "cuda:0")
    pairs = {}
    draft = ["--speculative-method", "draft", "--draft-model", str(model_dir),
             "--num-speculative-tokens", "2"]  # the model as its own draft, shipped too
    for backend, extra in (("cuda-ipc", ["--transfer-backend", "cuda-ipc"]),
                           ("fabric", ["--transfer-backend", "fabric", "--fabric-provider", "shm"])):
        for name, more in ((backend, []), (f"{backend}+draft", draft)):
            p = start("prefill", model_dir, tmp, "cuda:0", *extra, *more)
            d = start("decode", model_dir, tmp, DECODE_DEVICE, "--prefill-peer", p[0], *extra,
                      *more)
            pairs[name] = (p, d)
    # a prefill node replaying the decode graphs for its small prompt steps (rows_step)
    ipc = ["--transfer-backend", "cuda-ipc"]
    p = start("prefill", model_dir, tmp, "cuda:0", *ipc, eager=False,
              env={"DISAGG_PREFILL_GRAPHS": "1"})
    pairs["cuda-ipc+graphs"] = (p, start("decode", model_dir, tmp, DECODE_DEVICE,
                                         "--prefill-peer", p[0], *ipc))
    procs = [mixed[1]] + [x[1] for pair in pairs.values() for x in pair]
    LOGS[:] = [proc.log_path for proc in procs]
    try:
        for proc in procs:
            proc.wait_ready(180)
        yield mixed[0], {b: (p[0], d[0]) for b, (p, d) in pairs.items()}
    finally:
        for proc in procs:
            proc.stop()


@pytest.mark.parametrize("backend", ["cuda-ipc", "fabric", "cuda-ipc+draft", "fabric+draft",
                                     "cuda-ipc+graphs"])
def test_prefill_gpu0_decode_gpu1_matches_mixed(nodes, backend):
    import time

    mixed, pairs = nodes
    p_addr, d_addr = pairs[backend]
    deadline = time.monotonic() + 30
    while stats(d_addr).prefill_peers_alive != 1:
        assert time.monotonic() < deadline, "decoder never saw its prefiller"
        time.sleep(0.1)
    ref = run(mixed)
    before = stats(d_addr).kv_units_received
    assert run(d_addr) == ref
    # every prompt came through the prefiller: layers x pages + one context write each (with
    # the draft: its layers' pages too, staged into the GPU with the model's over the fabric)
    layers = 4 if backend.endswith("+draft") else 2
    expected = sum(layers * -(-(n - 1) // PAGE) + 1 for n in LENGTHS)
    s = stats(d_addr)
    assert s.kv_units_received - before == expected
    assert stats(p_addr).kv_writes_sent > 0
    if backend.endswith("+draft"):  # drafts that saw the shipped prompt: nearly all accepted
        assert s.spec_accepted_tokens >= 0.8 * s.spec_draft_tokens > 0
    if backend.endswith("+graphs"):  # the short prompts' steps replayed the decode graphs
        log = next(path for path in LOGS if f"prefill-{p_addr.rsplit(':', 1)[1]}" in path.name)
        assert "captured decode CUDA graphs" in log.read_text()


def test_nothing_compiles_after_ready(nodes):
    """The prompts above (short and long, every backend, prefill and decode nodes) compiled
    no Triton kernel after their node said ready (disagg.kernels.compile_watch logs any)."""
    run(nodes[0])  # once more on the mixed node, all lengths
    late = [line for log in LOGS for line in log.read_text().splitlines()
            if "Triton compiled" in line]
    assert late == [], "\n".join(late)
