"""Multi-token-prediction drafting (DeepSeek-V3's MTP layer as the draft): greedy output
token-exact with transformers, and the drafts of the incremental, paged, chunked path equal
the layer run once over the whole sequence."""

from __future__ import annotations

import pytest
import torch

from disagg.engine.speculative import Speculation
from disagg.llm import LLM
from disagg.model.loader import load_model
from disagg.protocol import SamplingParams
from disagg.protocol.executor import SeqChunk, StepPlan
from tinymodels import add_mtp_layer, hf_greedy, make_tiny_model

PAGE = 4
PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7], list(range(10, 10 + 3 * PAGE + 1)), [3, 4]]
NEW = 10


@pytest.fixture(scope="module")
def v3(tmp_path_factory):
    path = add_mtp_layer(make_tiny_model("deepseek_v3", tmp_path_factory.mktemp("mtp") / "v3"))
    return path, load_model(path, "float32", mtp=True)


def reference_draft(model, tokens: list[int]) -> int:
    """The MTP layer's next-token prediction after ``tokens``, computed in one pass over the
    whole sequence on fresh caches: the main model's hidden states at 0 .. n-2, then the layer
    at positions 0 .. n-1."""
    llm = LLM(model, num_pages=64, page_size=PAGE)
    runner = llm.runner
    table = list(range(-(-len(tokens) // PAGE)))
    ids, pos, meta, _, _ = runner.build(StepPlan(0, [SeqChunk(0, tokens[:-1], 0, table, False)],
                                                 0))
    hidden = model(ids, pos, runner.kv, meta, runner.backend)
    ids, pos, meta, _, _ = runner.build(StepPlan(0, [SeqChunk(0, tokens, 0, table, False)], 0))
    previous = torch.cat([hidden.new_zeros(1, hidden.shape[1]), hidden])
    cos, sin = model.rotary.cos_sin(pos, model.dtype)
    cache = torch.zeros_like(runner.kv[:1])
    y = model.mtp(ids, previous, pos, model.embed, cos, sin, cache, meta, runner.backend)
    return int(model.logits(y[-1:]).argmax(dim=-1).item())


@pytest.mark.parametrize("budget", [64, 5])
def test_mtp_drafts_keep_greedy_exact_and_match_one_pass(v3, budget):
    path, model = v3
    llm = LLM(model, num_pages=96, page_size=PAGE, max_batch_tokens=budget,
              speculative=Speculation("mtp", 2))
    seqs = {}
    update = llm.scheduler.update

    def spy(batch, *args):
        for c in batch.chunks:
            seqs[c.seq.request_id] = c.seq
        return update(batch, *args)

    llm.scheduler.update = spy  # type: ignore[method-assign]
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=NEW, ignore_eos=True))
    assert [o.token_ids for o in outs] == [hf_greedy(path, p, NEW) for p in PROMPTS]
    assert llm.scheduler.spec_draft_tokens > 0
    assert llm.pool.num_free == llm.pool.num_pages
    for seq in seqs.values():  # the drafts left after the last step
        assert seq.spec_state and seq.spec_state[0] == reference_draft(
            model, seq.prompt_ids + seq.output_ids)


def test_a_checkpoint_without_an_mtp_layer_is_refused(tmp_path):
    path = make_tiny_model("deepseek_v3", tmp_path / "v3")
    with pytest.raises(ValueError, match="mtp"):
        load_model(path, "float32", mtp=True)
    with pytest.raises(ValueError, match="no multi-token-prediction layer"):
        load_model(make_tiny_model("qwen3_moe", tmp_path / "q"), "float32", mtp=True)


@pytest.mark.parametrize("cut", [None, 2 * PAGE - 1])
def test_across_the_split_the_decoder_has_the_layers_kv_of_one_pass(v3, cut):
    """A prefiller computes the MTP layer over the prompt without its last token (chunked at
    ``cut``; an unfinished chunk carries its next token) and returns its last hidden row; a
    decoder given that KV (copied: what the transfer does) and the row (``prev_hidden``)
    computes the layer at the last prompt token in its first step: its MTP cache then equals
    the layer run once over the whole sequence, and so does its draft."""
    _, model = v3
    prompt = PROMPTS[1]
    n = len(prompt)
    table = list(range(-(-(n + 2) // PAGE)))
    pre = LLM(model, num_pages=64, page_size=PAGE, speculative=Speculation("mtp", 2)).runner
    cuts = [0, *([cut] if cut else []), n - 1]
    ctx = None
    for a, b in zip(cuts, cuts[1:], strict=False):
        last = b == n - 1
        chunk = SeqChunk(0, prompt[a:b], a, table, False, want_hidden=last,
                         next_token=-1 if last else prompt[b])
        _, ctx, _ = pre.execute(StepPlan(0, [chunk], 0))
    assert ctx is not None and pre.mtp_drafter is not None
    dec = LLM(model, num_pages=64, page_size=PAGE, speculative=Speculation("mtp", 2)).runner
    assert dec.mtp_drafter is not None
    dec.kv.copy_(pre.kv)
    dec.mtp_drafter.cache.copy_(pre.mtp_drafter.cache)
    row = ctx[0].contiguous().cpu().numpy().tobytes()
    tokens, _, _ = dec.execute(StepPlan(1, [SeqChunk(0, [prompt[-1]], n - 1, table, True,
                                                      prev_hidden=row)], 1))
    seq = prompt + tokens
    # the one-pass reference: main model over seq[:-1], the layer over every position of seq
    ref = LLM(model, num_pages=64, page_size=PAGE).runner
    ids, pos, meta, _, _ = ref.build(StepPlan(0, [SeqChunk(0, seq[:-1], 0, table, False)], 0))
    hidden = model(ids, pos, ref.kv, meta, ref.backend)
    ids, pos, meta, _, _ = ref.build(StepPlan(0, [SeqChunk(0, seq, 0, table, False)], 0))
    cos, sin = model.rotary.cos_sin(pos, model.dtype)
    cache = torch.zeros_like(dec.mtp_drafter.cache)
    y = model.mtp(ids, torch.cat([hidden.new_zeros(1, hidden.shape[1]), hidden]), pos,
                  model.embed, cos, sin, cache, meta, ref.backend)

    def rows(c: torch.Tensor) -> torch.Tensor:  # positions 0 .. len(seq) - 1 in order
        flat = c[0, table].transpose(1, 3)  # [pages, S, heads, parts, D]
        return flat.reshape(-1, *flat.shape[2:])[:len(seq)]

    torch.testing.assert_close(rows(dec.mtp_drafter.cache), rows(cache))
    assert dec.next_drafts is not None
    assert dec.next_drafts[0][0] == int(model.logits(y[-1:]).argmax(dim=-1).item())


def test_seeded_sampling_is_the_same_with_mtp_drafts(v3):
    """A seeded request draws the same tokens whether or not (and wherever) the MTP layer's
    drafts ride along: each emitted token is the plain draw of its output index."""
    _, model = v3
    params = [SamplingParams(max_tokens=NEW, ignore_eos=True, temperature=t, seed=50 + i)
              for i, t in enumerate((0.02, 1.0))]
    prompts = [p for p in PROMPTS for _ in params]
    params = params * len(PROMPTS)
    alone = [LLM(model, num_pages=64, page_size=PAGE).generate([pr], [p])[0].token_ids
             for pr, p in zip(prompts, params, strict=True)]
    for budget in (64, 5):
        llm = LLM(model, num_pages=96, page_size=PAGE, max_batch_tokens=budget,
                  speculative=Speculation("mtp", 2))
        assert [o.token_ids for o in llm.generate(prompts, params)] == alone, budget
        s = llm.scheduler
        assert s.spec_draft_tokens > 0  # (the tiny random MTP layer's drafts are rejected)
        assert llm.pool.num_free == llm.pool.num_pages
