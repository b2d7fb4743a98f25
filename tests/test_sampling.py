from __future__ import annotations

import torch

from disagg.protocol import SeqChunk
from disagg.sampling import draw_seed, filter_logits, sample


def chunk(**kw):
    return SeqChunk(slot=0, token_ids=[1], start_pos=0, block_table=[0], sample=True, **kw)


def test_top_k_keeps_k_largest():
    logits = torch.tensor([1.0, 5.0, 3.0, 4.0, 2.0])
    out = filter_logits(logits, top_k=2, top_p=1.0)
    assert torch.isfinite(out).tolist() == [False, True, False, True, False]


def test_top_p_keeps_smallest_prefix_reaching_p():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log()
    kept = torch.isfinite(filter_logits(logits, 0, 0.8)).tolist()
    assert kept == [True, True, False, False]
    kept = torch.isfinite(filter_logits(logits, 0, 0.81)).tolist()
    assert kept == [True, True, True, False]
    assert torch.isfinite(filter_logits(logits, 0, 0.01)).tolist() == [True, False, False, False]


def test_greedy_is_argmax_and_sampling_respects_filters():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]] * 3)
    chunks = [chunk(), chunk(temperature=1.0, top_k=1, seed=1), chunk(temperature=5.0, seed=2)]
    got = sample(logits, chunks)
    assert got[0] == 1 and got[1] == 1
    assert 0 <= got[2] < 4


def test_seeded_draws_are_reproducible_and_vary_with_index():
    logits = torch.zeros(1, 1000)
    a = [sample(logits, [chunk(temperature=1.0, seed=9, output_index=i)])[0] for i in range(5)]
    b = [sample(logits, [chunk(temperature=1.0, seed=9, output_index=i)])[0] for i in range(5)]
    assert a == b and len(set(a)) > 1
    assert draw_seed(1, 0) != draw_seed(1, 1) != draw_seed(2, 0)
    assert all(0 <= draw_seed(s, i) < 2**63 for s in (0, 2**63 - 1) for i in (0, 10**6))


def test_sampling_distribution_follows_temperature():
    logits = torch.tensor([[0.0, 1.0]])
    draws = [sample(logits, [chunk(temperature=1.0, seed=3, output_index=i)])[0] for i in range(400)]
    frac = sum(draws) / len(draws)
    expected = torch.softmax(torch.tensor([0.0, 1.0]), 0)[1].item()  # ~0.73
    assert abs(frac - expected) < 0.08
