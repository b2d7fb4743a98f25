"""Small prompt steps replayed as decode rows (``cuda_graphs.rows_step``): which steps qualify,
and, on the CPU, the runner's path with a stand-in for the decode graphs that computes what a
replay computes (every token a decode row over its own causal prefix) eagerly: the tokens equal
the eager chunked steps', for fresh prompts, prefix hits, sampled rows, penalties and
overlapped decoding's follow chunks. On CUDA the graphs themselves run it (the gpu test)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from disagg.engine.cuda_graphs import rows_step
from disagg.kernels.interface import AttentionMetadata
from disagg.llm import LLM
from disagg.model.loader import load_model
from disagg.protocol import SamplingParams
from disagg.protocol.executor import SeqChunk

PAGE = 4


def chunks_of(*spec: tuple[int, int]) -> list[SeqChunk]:
    """(start, tokens) per chunk, pages 0.. enough for each."""
    return [SeqChunk(i, list(range(10, 10 + n)), start, list(range(-(-(start + n) // PAGE))),
                     True) for i, (start, n) in enumerate(spec)]


def host_of(chunks: list[SeqChunk]) -> tuple[np.ndarray, np.ndarray]:
    pos = np.concatenate([np.arange(c.start_pos, c.start_pos + len(c.token_ids))
                          for c in chunks])
    w = max(len(c.block_table) for c in chunks)
    tables = np.zeros((len(chunks), w), dtype=np.int32)
    for i, c in enumerate(chunks):
        tables[i, :len(c.block_table)] = c.block_table
    return pos, tables


def test_a_prefix_hit_chunk_becomes_rows_with_its_sequences_table():
    chunks = chunks_of((7, 1), (40, 5))  # a decode and 5 fresh tokens over 40 cached
    pos, tables = host_of(chunks)
    rows = rows_step(chunks, pos, tables, [], 64, 16)
    assert rows is not None and rows.shape == (6, tables.shape[1])
    assert (rows[0] == tables[0]).all() and all((rows[i] == tables[1]).all() for i in range(1, 6))


def test_a_prefill_nodes_chunks_with_context_rows_become_rows():
    chunks = chunks_of((0, 8), (5, 1))  # a prompt's chunk; a 2-token prompt's one token
    pos, tables = host_of(chunks)
    assert rows_step(chunks, pos, tables, [7, 8], 64, 16) is not None
    assert rows_step(chunks[1:], pos[8:], tables[1:], [0], 64, 16) is not None
    assert rows_step(chunks[1:], pos[8:], tables[1:], [], 64, 16) is None  # a decode


@pytest.mark.parametrize(("chunks", "hidden", "max_rows", "max_pages", "budget"), [
    (chunks_of((7, 1), (9, 1)), [], 64, 16, 1 << 17),  # decodes only: the graphs as they are
    (chunks_of((0, 65)), [], 64, 32, 1 << 17),  # more tokens than the largest bucket
    (chunks_of((60, 4)), [], 64, 8, 1 << 17),  # a table wider than the graphs'
    (chunks_of((100, 4)), [], 64, 64, 400),  # 101 + 102 + 103 + 104 key rows > 400
])
def test_steps_a_decode_graph_cannot_take_as_rows(chunks, hidden, max_rows, max_pages, budget):
    pos, tables = host_of(chunks)
    assert rows_step(chunks, pos, tables, hidden, max_rows, max_pages, budget) is None


@pytest.mark.parametrize("field", [{"prompt_rows": 2}, {"num_draft": 1}, {"draft_tokens": 2}])
def test_chunks_wanting_what_a_decode_graph_does_not_compute_stay_eager(field):
    import msgspec

    chunks = [msgspec.structs.replace(c, **field) for c in chunks_of((0, 6))]
    pos, tables = host_of(chunks)
    assert rows_step(chunks, pos, tables, [], 64, 16) is None


class EagerRows:
    """What ``DecodeGraphs.run`` computes, eagerly on the CPU: every token a decode row (its
    sequence's table, its position + 1 keys), follow rows filled from ``tokens[src]``."""

    def __init__(self, runner, max_rows: int = 64, max_pages: int = 64) -> None:
        self.runner = runner
        self.buckets = [max_rows]
        self.max_pages = max_pages
        self.rows_steps = 0
        self.last_hidden: torch.Tensor | None = None

    def fits(self, num_seqs: int, max_pages: int) -> bool:
        return num_seqs <= self.buckets[-1] and max_pages <= self.max_pages

    def run(self, token_ids, positions, slots, tables, fill=None):
        r = self.runner
        t = int(token_ids.shape[0])
        self.rows_steps += int(tables.shape[0] == t and len(set(map(tuple, tables))) < t)
        ids = torch.from_numpy(token_ids.copy())
        if fill is not None:
            rows, src, tokens = fill
            ids[torch.from_numpy(rows)] = tokens[torch.from_numpy(src)].cpu()
        meta = AttentionMetadata(
            slot_mapping=torch.from_numpy(slots.copy()),
            block_tables=torch.from_numpy(np.ascontiguousarray(tables)),
            seq_lens=torch.from_numpy((positions + 1).astype(np.int32)),
            cu_seqlens_q=torch.arange(t + 1, dtype=torch.int32), num_decodes=t, max_q_len=1,
            max_seq_len=int(positions.max()) + 1)
        with torch.inference_mode():
            hidden = r.model(ids, torch.from_numpy(positions.copy()), r.kv, meta, r.backend)
            logits = r.model.logits(hidden)
        self.last_hidden = hidden
        return logits, logits.argmax(dim=-1)

    def hidden_rows(self, rows: list[int]) -> torch.Tensor:
        assert self.last_hidden is not None
        return self.last_hidden[rows].clone()


def conversation(llm: LLM) -> list[list[int]]:
    """Two turns of three conversations (the second turns hit the prefix cache), greedy and
    seeded sampling with a penalty."""
    greedy = SamplingParams(max_tokens=6, ignore_eos=True)
    sampled = SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.9, top_p=0.9,
                             seed=5, presence_penalty=0.5)
    prompts = [[3 + (i * 7 + j) % 90 for j in range(9 + 4 * i)] for i in range(3)]
    first = llm.generate(prompts, [greedy, sampled, greedy])
    turns = [p + o.token_ids + [11, 12, 13] for p, o in zip(prompts, first, strict=True)]
    second = llm.generate(turns, [greedy, sampled, greedy])
    return [o.token_ids for o in first + second]


@pytest.mark.parametrize("overlap", [False, True])
def test_rows_steps_give_the_eager_steps_tokens(tiny_models, overlap):
    model = load_model(tiny_models["qwen3"], "float32")
    want = conversation(LLM(model, num_pages=96, page_size=PAGE, attention_backend="torch",
                            overlap=overlap))
    llm = LLM(model, num_pages=96, page_size=PAGE, attention_backend="torch", overlap=overlap)
    llm.runner.graphs = rows = EagerRows(llm.runner)  # type: ignore[assignment]
    assert conversation(llm) == want
    assert rows.rows_steps >= 2  # the first turns' prompts and the second turns' hits


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_rows_steps_replay_the_decode_graphs_token_exact(tiny_models):
    """On CUDA, prompts and prefix hits replay the decode graphs as rows; greedy tokens equal
    the eager run's."""
    model = load_model(tiny_models["qwen3"], "float32", device="cuda")
    want = conversation(LLM(model, num_pages=96, page_size=PAGE))
    llm = LLM(model, num_pages=96, page_size=PAGE)
    llm.runner.enable_cuda_graphs(64, 256)
    graphs = llm.runner.graphs
    assert graphs is not None
    before = graphs.replays
    got = conversation(llm)
    assert got[0] == want[0] and got[2] == want[2] and got[3] == want[3] and got[5] == want[5]
    assert graphs.replays - before >= 2 + 5 * 2


def test_the_budget_counts_prompt_rows_not_the_decodes_beside_them():
    chunks = chunks_of((900, 1), (950, 1), (10, 4))  # two long decodes, 4 tokens over 10
    pos, tables = host_of(chunks)
    assert rows_step(chunks, pos, tables, [], 64, 512, 11 + 12 + 13 + 14) is not None
    assert rows_step(chunks, pos, tables, [], 64, 512, 11 + 12 + 13 + 13) is None


def test_a_prefill_nodes_context_rows_from_rows_steps_equal_the_eager_steps(tiny_models):
    """A prefill node's step (the prompt less its last token, its context row wanted, nothing
    sampled) gives the eager step's context rows, and the cache rows after it are equal."""
    from disagg.engine.attention import get_backend
    from disagg.engine.runner import ModelRunner
    from disagg.protocol.executor import StepPlan

    model = load_model(tiny_models["qwen2"], "float32")
    arch = model.arch
    shape = (arch.num_layers, 16, 2, arch.num_kv_heads, PAGE, arch.head_dim)
    plan = StepPlan(1, [SeqChunk(0, list(range(20, 31)), 0, [3, 1, 4], False, True),
                        SeqChunk(1, [40, 41], 0, [7], False, True)], 0)
    got = []
    for rows in (False, True):
        runner = ModelRunner(model, torch.zeros(shape), get_backend("torch", model.device))
        if rows:
            runner.graphs = stand_in = EagerRows(runner)  # type: ignore[assignment]
        _, ctx, _ = runner.execute(plan)
        assert ctx is not None and ctx.shape == (2, arch.hidden_size)
        got.append((ctx, runner.kv[:, [3, 1, 4, 7]].clone()))
    assert stand_in.rows_steps == 1
    torch.testing.assert_close(got[1][0], got[0][0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1][1], got[0][1], rtol=1e-5, atol=1e-5)
