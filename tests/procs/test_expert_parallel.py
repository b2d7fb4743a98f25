"""Expert parallelism (--expert-parallel) and data-parallel attention (--dp) in real nodes:
tiny Qwen3-MoE and DeepSeek-V3 (MLA) models, the experts spread over gloo ranks and the tokens
moved to them by all-to-all, greedy token-exact with transformers."""

from __future__ import annotations

import pytest

from disagg.client import Client
from disagg.protocol import SamplingParams
from tinymodels import NodeProcess, free_port, hf_greedy, make_tiny_model

PAGE = 4
COMMON = ["--page-size", str(PAGE), "--num-pages", "64", "--threads", "1"]


def prompt(n: int, salt: int = 0) -> list[int]:
    return [(7 * i + 11 + salt) % 290 + 5 for i in range(n)]


def generate(c: Client, ids: list[int], n: int) -> list[int]:
    return [t for m in c.generate(prompt_token_ids=ids, sampling=SamplingParams(
        max_tokens=n, ignore_eos=True)) for t in getattr(m, "token_ids", [])]


@pytest.mark.parametrize("kind", ["qwen3_moe", "deepseek_v3"])
def test_tp2_expert_parallel_matches_transformers(kind, tmp_path):
    """--tp 2 --expert-parallel: each rank holds 4 of the 8 experts whole; tokens equal
    transformers' for prompts of one, several and many pages."""
    path = make_tiny_model(kind, tmp_path / kind)
    addr = f"tcp://127.0.0.1:{free_port()}"
    node = NodeProcess(["--model", str(path), "--listen", addr, "--tp", "2", "--expert-parallel",
                        "--max-batch-tokens", "6", *COMMON], tmp_path / "node.log")
    try:
        node.wait_ready()
        c = Client(addr)
        try:
            for n in (1, PAGE + 1, 3 * PAGE + 2):
                assert generate(c, prompt(n), 5) == hf_greedy(path, prompt(n), 5), n
            s = c.stats()
            assert s.pages_free == s.pages_total
        finally:
            c.close()
    finally:
        assert node.stop() == []


@pytest.mark.parametrize("kind, ep", [("qwen3_moe", True), ("deepseek_v3", True),
                                      ("qwen3_moe", False)])
def test_dp2_matches_transformers(kind, ep, tmp_path):
    """--dp 2 (with --expert-parallel: 4 experts a rank, a rank without requests joining each
    step's all-to-all with no rows): concurrent requests spread over both ranks, each rank's
    pool its own; tokens equal transformers'; pools full after."""
    import threading

    path = make_tiny_model(kind, tmp_path / kind)
    addr = f"tcp://127.0.0.1:{free_port()}"
    node = NodeProcess(["--model", str(path), "--listen", addr, "--dp", "2",
                        *(["--expert-parallel"] if ep else []), "--max-batch-tokens", "8",
                        *COMMON], tmp_path / "node.log")
    try:
        node.wait_ready()
        assert len(node.children()) == 2
        c = Client(addr)
        try:
            # one request alone: the other rank idles through its steps
            assert generate(c, prompt(PAGE + 1), 5) == hf_greedy(path, prompt(PAGE + 1), 5)
            lengths = [1, PAGE + 2, 2 * PAGE + 3, 3 * PAGE + 1]
            got: dict[int, list[int]] = {}

            def run(n: int) -> None:
                cc = Client(addr)
                try:
                    got[n] = generate(cc, prompt(n, salt=n), 6)
                finally:
                    cc.close()

            threads = [threading.Thread(target=run, args=(n,)) for n in lengths]
            for t in threads:
                t.start()
            for t in threads:
                t.join(120)
            for n in lengths:
                assert got.get(n) == hf_greedy(path, prompt(n, salt=n), 6), n
            s = c.stats()
            assert s.pages_free == s.pages_total == 128  # two pools of 64
            assert [(r.rank, r.pages_total, r.pages_free, r.running) for r in s.dp_ranks] == [
                (0, 64, 64, 0), (1, 64, 64, 0)]
            assert sum(r.started for r in s.dp_ranks) == 5
            assert all(r.started > 0 for r in s.dp_ranks)  # the concurrent ones spread
            assert all((r.all_to_all_s > 0) == ep for r in s.dp_ranks)
        finally:
            c.close()
    finally:
        assert node.stop() == []
