"""Expert parallelism (--expert-parallel) and data-parallel attention (--dp) in real nodes:
tiny Qwen3-MoE and DeepSeek-V3 (MLA) models, the experts spread over gloo ranks and the tokens
moved to them by all-to-all, greedy token-exact with transformers."""

from __future__ import annotations

import threading

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


def generate_at_once(addr: str, lengths: list[int], n: int) -> dict[int, list[int]]:
    """``n`` greedy tokens of ``prompt(k, salt=k)`` for each ``k`` of ``lengths``, all sent at
    once (a client each), so that they spread over the ranks; by length."""
    got: dict[int, list[int]] = {}

    def run(k: int) -> None:
        cc = Client(addr)
        try:
            got[k] = generate(cc, prompt(k, salt=k), n)
        finally:
            cc.close()

    threads = [threading.Thread(target=run, args=(k,)) for k in lengths]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return got


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
            got = generate_at_once(addr, lengths, 6)
            for n in lengths:
                assert got.get(n) == hf_greedy(path, prompt(n, salt=n), 6), n
            s = c.stats()
            assert s.pages_free == s.pages_total == 128  # two pools of 64
            assert [(r.rank, r.pages_total, r.pages_free, r.running) for r in s.dp_ranks] == [
                (0, 64, 64, 0), (1, 64, 64, 0)]
            assert sum(r.started for r in s.dp_ranks) == 5
            assert all(r.started > 0 for r in s.dp_ranks)  # the concurrent ones spread
            assert all((r.all_to_all_s > 0) == ep for r in s.dp_ranks)
            # prefix caching per rank: a next turn reuses the pages of its first turn's rank
            n = 3 * PAGE + 1
            turn = prompt(n, salt=n) + got[n] + prompt(3, salt=7)
            msgs = list(c.generate(prompt_token_ids=turn, sampling=SamplingParams(
                max_tokens=4, ignore_eos=True)))
            assert [t for m in msgs for t in getattr(m, "token_ids", [])] == hf_greedy(
                path, turn, 4)
            assert msgs[-1].usage.cached_tokens >= 3 * PAGE
        finally:
            c.close()
    finally:
        assert node.stop() == []


def test_dp2_tp2_expert_parallel_matches_transformers(tmp_path):
    """--dp 2 --tp 2 --expert-parallel: four executors, a TP subgroup of two per DP rank for
    the attention and dense all-reduces, the whole world of four the EP group (2 experts a
    rank); concurrent requests run on both DP ranks, tokens equal transformers', pools full."""
    path = make_tiny_model("qwen3_moe", tmp_path / "m")
    addr = f"tcp://127.0.0.1:{free_port()}"
    node = NodeProcess(["--model", str(path), "--listen", addr, "--devices", "cpu", "--dp", "2",
                        "--tp", "2", "--expert-parallel", "--max-batch-tokens", "8", *COMMON],
                       tmp_path / "node.log")
    try:
        node.wait_ready()
        assert len(node.children()) == 4
        c = Client(addr)
        try:
            lengths = [2, PAGE + 3, 2 * PAGE + 1]
            got = generate_at_once(addr, lengths, 4)
            for n in lengths:
                assert got.get(n) == hf_greedy(path, prompt(n, salt=n), 4), n
            s = c.stats()
            assert s.pages_free == s.pages_total == 128  # two DP ranks' pools of 64
            assert [(r.rank, r.pages_free, r.running) for r in s.dp_ranks] == [
                (0, 64, 0), (1, 64, 0)]
            assert all(r.started > 0 for r in s.dp_ranks)  # both DP ranks ran
            assert all(r.all_to_all_s > 0 for r in s.dp_ranks)
        finally:
            c.close()
    finally:
        assert node.stop() == []


def test_a_killed_rank_ends_its_requests_and_the_node_restarts(tmp_path):
    """SIGKILL of DP rank 1's executor while both ranks decode (rank 0 waiting in an
    all-to-all with it): every live request ends with an internal error naming the executor,
    the node restarts in place and serves token-exact again with every page free."""
    import os
    import signal

    from nodes import Req, wait_for

    path = make_tiny_model("qwen3_moe", tmp_path / "m")
    addr = f"tcp://127.0.0.1:{free_port()}"
    node = NodeProcess(["--model", str(path), "--listen", addr, "--dp", "2", "--expert-parallel",
                        "--page-size", str(PAGE), "--num-pages", "160", "--threads", "1"],
                       tmp_path / "node.log")
    try:
        node.wait_ready()
        c = Client(addr)
        try:
            want = hf_greedy(path, prompt(6), 4)
            streams = [Req(addr, prompt(5, salt=i), 400) for i in range(2)]
            wait_for(lambda: all(s.tokens for s in streams), what="both decoding")
            assert all(r.running > 0 for r in c.stats().dp_ranks)  # one on each rank
            ranks = sorted(node.children())
            assert len(ranks) == 2
            os.kill(ranks[1], signal.SIGKILL)
            for r in streams:
                r.join()
                assert r.code == "internal" and len(r.tokens) < 400, (r.code, len(r.tokens))
            assert "killed by SIGKILL" in node.log_path.read_text()
            wait_for(lambda: node.log_path.read_text().count("ready") >= 2, timeout=120,
                     what="restarted")
            wait_for(lambda: len(node.children()) == 2, what="two executors again")
            assert generate(c, prompt(6), 4) == want
            s = c.stats()
            assert s.pages_free == s.pages_total and len(s.dp_ranks) == 2
        finally:
            c.close()
    finally:
        assert node.stop() == []


def parse(*argv: str):
    from disagg.cli.node import build_parser, config_from_args

    return config_from_args(build_parser().parse_args(list(argv)))


def test_bad_layouts_refused_by_name_at_parse():
    from disagg.config import ConfigError

    assert parse("--devices", "cpu", "--dp", "2", "--tp", "2").devices == ["cpu"] * 4
    assert parse("--devices", "cpu", "--dp", "2").devices == ["cpu"] * 2
    with pytest.raises(ConfigError, match=r"--dp 2 x --tp 2 needs 4 --devices, got 2"):
        parse("--devices", "cuda:0,cuda:1", "--dp", "2", "--tp", "2")
    with pytest.raises(ConfigError, match="--dp 2 does not divide the 3 --devices"):
        parse("--devices", "cpu,cpu,cpu", "--dp", "2")
    with pytest.raises(ConfigError, match="--dp must be >= 1"):
        parse("--dp", "0")
    with pytest.raises(ConfigError, match="--speculative-method ngram is not served with --dp"):
        parse("--devices", "cpu", "--dp", "2", "--speculative-method", "ngram",
              "--num-speculative-tokens", "2")


@pytest.mark.parametrize("args, message", [
    (["--dp", "3", "--expert-parallel"], "8 experts do not divide over 3 ranks"),
    (["--dp", "2", "--kv-host-cache-mb", "16"], "--dp 2 with --kv-host-cache-mb"),
    (["--tp", "3"], "does not divide the 4 attention heads"),
])
def test_bad_layouts_refused_by_name_at_start(args, message, tmp_path):
    """Before any executor starts: the node exits naming what does not fit."""
    path = make_tiny_model("qwen3_moe", tmp_path / "m")
    node = NodeProcess(["--model", str(path), "--listen", f"tcp://127.0.0.1:{free_port()}",
                        *args, *COMMON], tmp_path / "node.log")
    try:
        assert node.proc.wait(timeout=120) != 0
        assert message in node.log_path.read_text()
    finally:
        node.stop()


@pytest.mark.fabric
@pytest.mark.parametrize("kind, prefill", [("qwen3_moe", "tp2"), ("deepseek_v3", "tp2"),
                                           ("qwen3_moe", "dp2"), ("deepseek_v3", "dp2")])
def test_prefill_to_decode_dp2_expert_parallel(kind, prefill, tmp_path):
    """Prefill --tp 2 or --dp 2 --expert-parallel -> decode --dp 2 --expert-parallel: the
    decoder's rank reserves the pages and names its own executors (a TP 1 layout to the
    prefiller); a --dp prefiller runs each job on any of its ranks and writes from that rank's
    executor once every rank computed the layer; the planner maps the layouts (TP 2 -> 1: GQA
    heads rebuilt, MLA's pages shared between both source replicas; TP 1 -> 1 one-to-one), the unit counts exact;
    tokens equal transformers' and both decoder ranks take requests; a second turn extending
    the first takes its pages from the decoder rank's prefix cache (usage.cached_tokens) and
    only the pages after them are written; every pool full after."""
    from disagg.model.config import ModelArch
    from disagg.protocol.peer import KVLayoutDesc
    from disagg.remote.transfer_plan import request_units, shard_kv_heads
    from nodes import pools_full, stats, wait_for

    path = make_tiny_model(kind, tmp_path / kind)
    arch = ModelArch.from_dir(path)

    def desc(tp: int) -> KVLayoutDesc:
        per, replicas = shard_kv_heads(arch.num_kv_heads, tp)
        return KVLayoutDesc(arch.num_layers, 64, per, PAGE, arch.head_dim, "float32", 4,
                            arch.hidden_size, tp, replicas, arch.layout_kind, arch.kv_parts)

    p_addr, d_addr = (f"tcp://127.0.0.1:{free_port()}" for _ in range(2))
    p_args = ["--tp", "2"] if prefill == "tp2" else ["--dp", "2", "--expert-parallel"]
    p_tp = 2 if prefill == "tp2" else 1
    p = NodeProcess(["--role", "prefill", "--model", str(path), "--listen", p_addr, *p_args,
                     "--max-batch-tokens", "5", *COMMON], tmp_path / "p.log")
    d = NodeProcess(["--role", "decode", "--model", str(path), "--listen", d_addr, "--dp", "2",
                     "--expert-parallel", "--prefill-peer", p_addr, "--heartbeat", "0.2",
                     "--local-prefill-max-tokens", "0", *COMMON], tmp_path / "d.log")
    try:
        p.wait_ready()
        d.wait_ready()
        c = Client(d_addr)
        try:
            wait_for(lambda: c.stats().prefill_peers_alive > 0, timeout=60, what="prefiller")
            for n in (2, PAGE + 1, 3 * PAGE + 2):  # no shared prefix: every page is sent
                before = c.stats().kv_units_received
                ids = prompt(n, salt=50 + n)
                out = generate(c, ids, 5)
                assert out == hf_greedy(path, ids, 5), n
                assert c.stats().kv_units_received - before == request_units(
                    desc(p_tp), desc(1), n - 1), n
            # a second turn extends the first (its prompt and answer): the decoder rank holding
            # them in its prefix cache reserves the new pages after them and the prefiller
            # writes only those; 4 full pages cached, more than the prefiller ever saw (the
            # prompt but its last token: 3 full pages), so the hit is the decoder's
            turn = ids + out + prompt(PAGE + 1, salt=90)
            before = c.stats().kv_units_received
            msgs = list(c.generate(prompt_token_ids=turn, sampling=SamplingParams(
                max_tokens=5, ignore_eos=True)))
            assert [t for m in msgs for t in getattr(m, "token_ids", [])] == hf_greedy(
                path, turn, 5)
            held = msgs[-1].usage.cached_tokens
            assert held == 4 * PAGE, held
            assert c.stats().kv_units_received - before == request_units(
                desc(p_tp), desc(1), len(turn) - 1, skip_pages=held // PAGE)
            lengths = [3, PAGE + 3, 2 * PAGE + 1, 3 * PAGE + 3]
            got = generate_at_once(d_addr, lengths, 5)
            for n in lengths:
                assert got.get(n) == hf_greedy(path, prompt(n, salt=n), 5), n
            ranks = c.stats().dp_ranks
            assert len(ranks) == 2 and all(r.started > 0 for r in ranks)
        finally:
            c.close()
        ps = stats(p_addr)
        assert ps.kv_writes_sent > 0
        if prefill == "dp2":  # the concurrent jobs ran on both prefiller ranks
            assert len(ps.dp_ranks) == 2 and all(r.started > 0 for r in ps.dp_ranks)
        wait_for(lambda: pools_full(d_addr) and pools_full(p_addr), what="pools full")
    finally:
        assert p.stop() == [] and d.stop() == []


@pytest.mark.fabric
@pytest.mark.parametrize("kind", ["qwen3_moe", "deepseek_v3"])
def test_prefill_dp2_expert_parallel_to_decode_tp2(kind, tmp_path):
    """The reverse shape: prefill --dp 2 --expert-parallel (each rank a TP 1 layout to its
    peers) -> decode --tp 2, planned by the same planner (TP 1 -> 2: GQA heads split, MLA's
    latent to both replicas): tokens equal transformers', unit counts exact, pools full."""
    from disagg.model.config import ModelArch
    from disagg.protocol.peer import KVLayoutDesc
    from disagg.remote.transfer_plan import request_units, shard_kv_heads
    from nodes import pools_full, wait_for

    path = make_tiny_model(kind, tmp_path / kind)
    arch = ModelArch.from_dir(path)

    def desc(tp: int) -> KVLayoutDesc:
        per, replicas = shard_kv_heads(arch.num_kv_heads, tp)
        return KVLayoutDesc(arch.num_layers, 64, per, PAGE, arch.head_dim, "float32", 4,
                            arch.hidden_size, tp, replicas, arch.layout_kind, arch.kv_parts)

    p_addr, d_addr = (f"tcp://127.0.0.1:{free_port()}" for _ in range(2))
    p = NodeProcess(["--role", "prefill", "--model", str(path), "--listen", p_addr, "--dp", "2",
                     "--expert-parallel", "--max-batch-tokens", "5", *COMMON],
                    tmp_path / "p.log")
    d = NodeProcess(["--role", "decode", "--model", str(path), "--listen", d_addr, "--tp", "2",
                     "--prefill-peer", p_addr, "--heartbeat", "0.2",
                     "--local-prefill-max-tokens", "0", *COMMON], tmp_path / "d.log")
    try:
        p.wait_ready()
        d.wait_ready()
        c = Client(d_addr)
        try:
            wait_for(lambda: c.stats().prefill_peers_alive > 0, timeout=60, what="prefiller")
            for n in (2, PAGE + 1, 3 * PAGE + 2):
                before = c.stats().kv_units_received
                ids = prompt(n, salt=70 + n)
                assert generate(c, ids, 5) == hf_greedy(path, ids, 5), n
                assert c.stats().kv_units_received - before == request_units(
                    desc(1), desc(2), n - 1), n
        finally:
            c.close()
        wait_for(lambda: pools_full(d_addr) and pools_full(p_addr), what="pools full")
    finally:
        assert p.stop() == [] and d.stop() == []
