"""Logprobs, prompt logprobs, penalties and logit_bias in the in-process engine, against
transformers' logits (fp32, CPU) and a plain torch reference of the processors."""

from __future__ import annotations

import math

import pytest
import torch

from disagg.llm import LLM
from disagg.model.loader import load_model
from disagg.protocol import SamplingParams, TokenLogprobs

PAGE = 4
TOL = 1e-4


def prompt(n: int, salt: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(2000 + n + salt)
    return torch.randint(3, 300, (n,), generator=g).tolist()


@pytest.fixture(scope="module")
def hf(tiny_models):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(
        tiny_models["qwen2"], dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def model(tiny_models):
    return load_model(tiny_models["qwen2"], "float32")


@torch.no_grad()
def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    """transformers' float32 logits ``[len(ids), V]`` (row i predicts token i + 1)."""
    return hf(torch.tensor([ids])).logits[0].float()


def reference_process(logits: torch.Tensor, prompt_ids: list[int], output_ids: list[int],
                      p: SamplingParams) -> torch.Tensor:
    """The processors as the README states them, one row, written plainly."""
    out = logits.clone()
    if p.repetition_penalty != 1.0:
        for t in set(prompt_ids) | set(output_ids):
            out[t] = out[t] / p.repetition_penalty if out[t] > 0 else out[t] * p.repetition_penalty
    for t in set(output_ids):
        count = output_ids.count(t)
        out[t] -= p.frequency_penalty * count + p.presence_penalty
    for t, b in p.logit_bias.items():
        out[t] += b
    return out


@torch.no_grad()
def reference_greedy(hf, prompt_ids: list[int], p: SamplingParams) -> list[int]:
    out: list[int] = []
    for _ in range(p.max_tokens):
        row = reference_process(hf_logits(hf, prompt_ids + out)[-1], prompt_ids, out, p)
        out.append(int(row.argmax()))
    return out


def check_entry(entry: TokenLogprobs, lps: torch.Tensor, token: int, k: int) -> None:
    assert entry.token_id == token
    assert abs(entry.logprob - float(lps[token])) < TOL
    top = torch.topk(lps, k)
    assert len(entry.top_ids) == len(entry.top_logprobs) == k
    assert torch.allclose(torch.tensor(entry.top_logprobs), top.values, atol=TOL)
    # ids may swap only between (near-)equal values
    for tid, lp in zip(entry.top_ids, entry.top_logprobs, strict=True):
        assert abs(float(lps[tid]) - lp) < TOL


@pytest.mark.parametrize("budget", [2048, 3])
def test_greedy_logprobs_equal_transformers_log_softmax(hf, model, budget):
    llm = LLM(model, num_pages=64, page_size=PAGE, max_batch_tokens=budget)
    ids = prompt(9)
    other = prompt(5, salt=1)
    params = SamplingParams(max_tokens=6, ignore_eos=True, logprobs=5)
    out, plain = llm.generate([ids, other], [params, SamplingParams(max_tokens=6,
                                                                     ignore_eos=True)])
    assert plain.logprobs is None and plain.prompt_logprobs is None
    assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids) == 6
    seq = list(ids)
    for token, entry in zip(out.token_ids, out.logprobs, strict=True):
        lps = torch.log_softmax(hf_logits(hf, seq)[-1], -1)
        assert token == int(lps.argmax())
        check_entry(entry, lps, token, 5)
        seq.append(token)


def test_sampled_logprobs_are_after_temperature(hf, model):
    llm = LLM(model, num_pages=64, page_size=PAGE)
    ids = prompt(7)
    temp = 0.7
    out = llm.generate([ids], SamplingParams(max_tokens=5, temperature=temp, seed=3,
                                             ignore_eos=True, logprobs=2))[0]
    assert out.logprobs is not None
    seq = list(ids)
    for token, entry in zip(out.token_ids, out.logprobs, strict=True):
        check_entry(entry, torch.log_softmax(hf_logits(hf, seq)[-1] / temp, -1), token, 2)
        seq.append(token)
    again = llm.generate([ids], SamplingParams(max_tokens=5, temperature=temp, seed=3,
                                               ignore_eos=True, logprobs=2))[0]
    assert again.token_ids == out.token_ids  # logprobs leave the seeded draw alone


@pytest.mark.parametrize("budget", [2048, 3])
def test_prompt_logprobs_equal_transformers(hf, model, budget):
    llm = LLM(model, num_pages=64, page_size=PAGE, max_batch_tokens=budget)
    ids = prompt(11)
    params = SamplingParams(max_tokens=2, ignore_eos=True, prompt_logprobs=3)
    first = llm.generate([ids], params)[0]
    lps = torch.log_softmax(hf_logits(hf, ids), -1)
    assert first.prompt_logprobs is not None and len(first.prompt_logprobs) == len(ids) - 1
    for i, entry in enumerate(first.prompt_logprobs):
        check_entry(entry, lps[i], ids[i + 1], 3)
    # the prompt's pages are cached now: a request asking prompt logprobs computes them anyway
    again = llm.generate([ids], params)[0]
    assert again.cached_tokens == 0
    assert again.prompt_logprobs == first.prompt_logprobs
    assert llm.generate([ids], SamplingParams(max_tokens=2))[0].cached_tokens > 0
    assert llm.pool.num_free == llm.pool.num_pages


PENALTIES = [
    SamplingParams(max_tokens=8, ignore_eos=True, repetition_penalty=1.8),
    SamplingParams(max_tokens=8, ignore_eos=True, repetition_penalty=0.6),
    SamplingParams(max_tokens=8, ignore_eos=True, frequency_penalty=1.5),
    SamplingParams(max_tokens=8, ignore_eos=True, presence_penalty=-1.2, frequency_penalty=0.4),
    SamplingParams(max_tokens=8, ignore_eos=True, logit_bias={17: 100.0, 5: -100.0}),
    SamplingParams(max_tokens=8, ignore_eos=True, repetition_penalty=1.3,
                   presence_penalty=0.8, logit_bias={40: 3.0, 41: 2.5}),
]


@pytest.mark.parametrize("overlap", [False, True])
def test_penalties_and_logit_bias_equal_reference(hf, model, overlap):
    llm = LLM(model, num_pages=128, page_size=PAGE, overlap=overlap)
    ids = [prompt(6 + i, salt=7) for i in range(len(PENALTIES))]
    plain = SamplingParams(max_tokens=8, ignore_eos=True)
    outs = llm.generate(ids + [ids[0]], PENALTIES + [plain])  # one batch, one row unprocessed
    for i, p in enumerate(PENALTIES):
        assert outs[i].token_ids == reference_greedy(hf, ids[i], p), p
    assert outs[-1].token_ids == reference_greedy(hf, ids[0], plain)
    unprocessed = llm.generate(ids, plain)
    assert all(o.token_ids != u.token_ids  # each one bites
               for o, u in zip(outs[:-1], unprocessed, strict=True))
    assert llm.pool.num_free == llm.pool.num_pages


def test_logprobs_after_processors(hf, model):
    llm = LLM(model, num_pages=64, page_size=PAGE)
    ids = prompt(8)
    p = SamplingParams(max_tokens=4, ignore_eos=True, frequency_penalty=2.0,
                       logit_bias={9: 4.0}, logprobs=3)
    out = llm.generate([ids], p)[0]
    assert out.logprobs is not None
    seq: list[int] = []
    for token, entry in zip(out.token_ids, out.logprobs, strict=True):
        row = reference_process(hf_logits(hf, ids + seq)[-1], ids, seq, p)
        check_entry(entry, torch.log_softmax(row, -1), token, 3)
        seq.append(token)


def test_logprobs_zero_alternatives_and_sum(model):
    llm = LLM(model, num_pages=64, page_size=PAGE)
    out = llm.generate([prompt(5)], SamplingParams(max_tokens=3, logprobs=0,
                                                   ignore_eos=True))[0]
    assert out.logprobs is not None
    assert all(e.top_ids == [] and e.top_logprobs == [] and e.logprob <= 0 for e in out.logprobs)
    assert all(math.isfinite(e.logprob) for e in out.logprobs)


@pytest.mark.parametrize("field,value,needle", [
    ("presence_penalty", 2.5, "presence_penalty"),
    ("frequency_penalty", float("nan"), "frequency_penalty"),
    ("repetition_penalty", 0.0, "repetition_penalty"),
    ("logit_bias", {3: 101.0}, "logit_bias"),
    ("logit_bias", {-1: 1.0}, "logit_bias"),
    ("logprobs", 21, "logprobs"),
    ("prompt_logprobs", -1, "prompt_logprobs"),
])
def test_bad_processor_params_named(field, value, needle):
    problem = SamplingParams(**{field: value}).validate()
    assert problem is not None and problem.startswith(needle)


def test_logit_bias_outside_vocabulary_refused_by_the_node():
    from disagg.protocol import GenerateRequest
    from disagg.serving.admission import RequestRejected, prepare_prompt

    req = GenerateRequest("r", prompt_token_ids=[1, 2],
                          sampling=SamplingParams(logit_bias={320: 1.0}))
    with pytest.raises(RequestRejected, match="logit_bias"):
        prepare_prompt(req, None, 320, 64)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_processors_and_logprobs_in_cuda_graphs_with_overlap(tiny_models, hf):
    """On CUDA the decode steps replay graphs: the processors run on the graph's logits and
    its argmax is replaced for processed rows; overlapped decoding's follow chunks add the
    in-flight token to the penalties' counts on the device."""
    cuda = load_model(tiny_models["qwen2"], "float32", device="cuda")
    llm = LLM(cuda, num_pages=128, page_size=PAGE, overlap=True)
    llm.runner.enable_cuda_graphs(16, 256)
    assert llm.runner.graphs is not None
    ids = [prompt(6 + i, salt=7) for i in range(len(PENALTIES))]
    plain = SamplingParams(max_tokens=8, ignore_eos=True, logprobs=4)
    outs = llm.generate(ids + [ids[0]], PENALTIES + [plain])
    for i, p in enumerate(PENALTIES):
        assert outs[i].token_ids == reference_greedy(hf, ids[i], p), p
    last = outs[-1]
    assert last.logprobs is not None and llm.core.steps_ahead > 0
    seq = list(ids[0])
    for token, entry in zip(last.token_ids, last.logprobs, strict=True):
        lps = torch.log_softmax(hf_logits(hf, seq)[-1], -1)
        assert token == int(lps.argmax())
        assert abs(entry.logprob - float(lps[token])) < 1e-3
        seq.append(token)


def test_processed_rows_beside_drafted_ones_with_speculation(hf, model):
    """With speculative decoding, rows with processors or logprobs decode one token a step
    while other rows of the same steps carry drafts (verified together)."""
    from disagg.engine.speculative import Speculation

    llm = LLM(model, num_pages=128, page_size=PAGE, speculative=Speculation("ngram", 3))
    loop = [5, 6, 7, 8] * 4  # prompt lookup drafts from the repeats
    p = PENALTIES[5]
    lp = SamplingParams(max_tokens=6, ignore_eos=True, logprobs=2)
    outs = llm.generate([loop, prompt(9, salt=3), loop, prompt(7)],
                        [SamplingParams(max_tokens=12, ignore_eos=True), p, lp,
                         SamplingParams(max_tokens=12, ignore_eos=True)])
    assert llm.scheduler.spec_draft_tokens > 0
    assert outs[1].token_ids == reference_greedy(hf, prompt(9, salt=3), p)
    assert outs[2].logprobs is not None and len(outs[2].logprobs) == 6
    seq = list(loop)
    for token, entry in zip(outs[2].token_ids, outs[2].logprobs, strict=True):
        check_entry(entry, torch.log_softmax(hf_logits(hf, seq)[-1], -1), token, 2)
        seq.append(token)


def test_constrained_rows_logprobs_are_of_the_masked_distribution_and_finite():
    """A grammar mask is part of the distribution a token is picked from: the logprobs of a
    constrained row are the log-softmax over what it admits (after the processors and the
    temperature), alternatives it does not admit are not listed (fewer than asked), and no
    value is -inf or NaN, even for a row whose mask admits nothing (sampled greedily)."""
    from disagg.engine.picking import pick
    from disagg.engine.sampling import LOGPROB_FLOOR
    from disagg.protocol.executor import SeqChunk

    vocab = 64
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(3))

    def mask(ids: list[int]) -> bytes:
        words = [0] * (vocab // 32)
        for t in ids:
            words[t // 32] |= 1 << (t % 32)
        return torch.tensor(words, dtype=torch.int64).to(torch.int32).numpy().tobytes()

    admitted = [5, 40, 41]
    chunks = [SeqChunk(0, [1], 0, [0], True, allowed=mask(admitted), logprobs=5),
              SeqChunk(1, [1], 0, [0], True, temperature=0.7, seed=9, allowed=mask(admitted),
                       logit_bias=[(40, 2.0)], logprobs=5),
              SeqChunk(2, [1], 0, [0], True, allowed=mask([]), logprobs=5),
              SeqChunk(3, [1], 0, [0], True, logprobs=5)]  # unconstrained beside them
    raw = logits.clone()
    tokens, rows = pick(logits, chunks, chunks, None, None)
    assert rows is not None
    got = dict(rows.host())
    for slot, temp, bias in ((0, 1.0, {}), (1, 0.7, {40: 2.0})):
        e = got[slot]
        assert e.token_id in admitted and tokens[slot] == e.token_id
        row = raw[slot].clone()
        for t, b in bias.items():
            row[t] += b
        ref = torch.log_softmax(row[admitted] / temp, -1)  # over what the grammar admits
        want = dict(zip(admitted, ref.tolist(), strict=True))
        assert sorted(e.top_ids) == admitted and len(e.top_logprobs) == 3  # not 5
        assert all(abs(want[t] - lp) < TOL for t, lp in zip(e.top_ids, e.top_logprobs,
                                                            strict=True))
        assert abs(e.logprob - want[e.token_id]) < TOL
        assert abs(sum(math.exp(v) for v in e.top_logprobs) - 1.0) < TOL
    nothing = got[2]  # a mask admitting nothing: nothing to list, a finite logprob
    assert nothing.top_ids == nothing.top_logprobs == [] and nothing.logprob == LOGPROB_FLOOR
    free = got[3]
    assert len(free.top_ids) == 5 and all(math.isfinite(v) for v in free.top_logprobs)
    check_entry(free, torch.log_softmax(raw[3], -1), int(raw[3].argmax()), 5)
