from __future__ import annotations

import pytest
import torch

from disagg.engine.sampling import (
    draw_seed,
    sample,
    sample_device,
)
from disagg.kernels.sample_race import filter_batch
from disagg.protocol import (
    MAX_STOP_TOKEN_IDS,
    MIN_TEMPERATURE,
    GenerateRequest,
    SamplingParams,
    as_float32,
)
from disagg.protocol.executor import SeqChunk
from disagg.serving.admission import RequestRejected, prepare_prompt


def filter_row(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """The reference: top-k then top-p on one row of float32 logits, as ``filter_batch`` does
    every row of a batch."""
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, stable=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # drop a token when the mass before it already reaches top_p (the top token always stays)
        drop = (torch.cumsum(probs, dim=-1) - probs) >= top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return logits


def filter_logits(logits, top_k, top_p):
    """``filter_batch`` on one row."""
    return filter_batch(logits[None], [top_k], [top_p])[0]


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


MIXED = [dict(temperature=0.7, seed=1), dict(), dict(temperature=1.3, top_k=20, seed=2),
         dict(temperature=1.0, top_p=0.8, seed=3, output_index=5), dict(temperature=0.05, seed=4),
         dict(temperature=2.0, top_k=3, top_p=0.9, seed=1, output_index=1)]


def test_a_rows_draw_does_not_depend_on_the_rest_of_the_batch():
    """Each row draws what it draws alone, in any order and beside any other rows."""
    gen = torch.Generator().manual_seed(3)
    for trial in range(20):
        logits = torch.randn(len(MIXED), 200, generator=gen) * (1 + trial % 5)
        rows = [chunk(**kw) for kw in MIXED]
        alone = [sample(logits[i:i + 1], [c])[0] for i, c in enumerate(rows)]
        assert sample(logits, rows) == alone
        order = torch.randperm(len(rows), generator=gen).tolist()
        assert sample(logits[order], [rows[i] for i in order]) == [alone[i] for i in order]
        assert sample(logits[2:4], rows[2:4]) == alone[2:4]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_sampling_and_verifying_on_cuda_never_wait_for_the_device():
    from disagg.engine.speculative import target_tokens

    logits = torch.randn(len(MIXED), 5000, device="cuda") * 3
    rows = [chunk(**kw) for kw in MIXED]
    drafted = SeqChunk(slot=1, token_ids=[1, 2, 3], start_pos=0, block_table=[0], sample=True,
                       temperature=0.8, seed=5, output_index=2, num_draft=2)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any host sync raises
    try:
        out = sample_device(logits, rows)
        targets = target_tokens(torch.cat([logits, logits[:3]]), rows + [drafted])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    alone = [sample(logits[i:i + 1], [c])[0] for i, c in enumerate(rows)]
    assert out.tolist() == alone == targets[:len(rows)].tolist()
    plain = [sample(logits[j:j + 1], [chunk(temperature=0.8, seed=5, output_index=2 + j)])[0]
             for j in range(3)]
    assert targets[len(rows):].tolist() == plain


POISONS = [  # rows torch.multinomial refuses: probabilities not finite, or nothing kept
    dict(temperature=1e-45, seed=4),  # logits / T overflow to inf
    dict(temperature=1.0, top_p=1e-300, seed=5),  # 0 in float32: top-p drops every token
    dict(temperature=float("nan"), seed=6),
    dict(temperature=1.0, top_p=-1.0, seed=7),
]


def test_poison_rows_fall_back_to_greedy_and_leave_the_other_rows_alone():
    gen = torch.Generator().manual_seed(0)
    normal = [chunk(temperature=0.7, seed=1), chunk(), chunk(temperature=1.3, top_k=20, seed=2),
              chunk(temperature=1.0, top_p=0.8, seed=3, output_index=5)]
    logits = torch.randn(len(normal) + len(POISONS) + 1, 300, generator=gen) * 3
    logits[-1] = float("nan")  # a row whose logits are not finite at all
    rows = normal + [chunk(**p) for p in POISONS] + [chunk(temperature=1.0, seed=8)]
    got = sample(logits, rows)
    assert got[:len(normal)] == sample(logits[:len(normal)], normal)
    poison_rows = logits[len(normal):]
    assert got[len(normal):] == poison_rows.argmax(dim=-1).tolist()
    assert all(0 <= t < 300 for t in got)


def test_poison_rows_in_any_position():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1))
    good = [chunk(temperature=0.9, seed=11), chunk(temperature=0.9, seed=12)]
    alone = sample(logits[[0, 2]], good)
    for p in POISONS:
        got = sample(logits, [good[0], chunk(**p), good[1]])
        assert [got[0], got[2]] == alone and got[1] == int(logits[1].argmax())


# ---- validation: values as the sampler sees them (float32)


@pytest.mark.parametrize("kw, field", [
    (dict(temperature=1e-45), "temperature"),  # a float32 denormal: logits / T overflow
    (dict(temperature=1e-6), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(temperature=float("inf")), "temperature"),
    (dict(temperature=-0.5), "temperature"),
    (dict(top_p=1e-300), "top_p"),  # > 0 as a double, 0 in float32
    (dict(top_p=float("nan")), "top_p"),
    (dict(top_p=1.0000001), "top_p"),
    (dict(max_tokens=2**31), "max_tokens"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(stop_token_ids=[7] * (MAX_STOP_TOKEN_IDS + 1)), "stop_token_ids"),
    (dict(stop_token_ids=[3, -1]), "stop_token_ids"),
])
def test_sampling_params_refusals_name_the_field(kw, field):
    problem = SamplingParams(**kw).validate()
    assert problem is not None and problem.startswith(field), problem


@pytest.mark.parametrize("kw", [
    dict(), dict(temperature=0.0), dict(temperature=MIN_TEMPERATURE), dict(temperature=100.0),
    dict(top_p=1e-40),  # tiny but above 0 in float32: keeps the top token
    dict(max_tokens=2**31 - 1), dict(stop_token_ids=list(range(MAX_STOP_TOKEN_IDS))),
])
def test_sampling_params_accepted(kw):
    assert SamplingParams(**kw).validate() is None


def test_accepted_extremes_sample_without_failing():
    logits = torch.randn(2, 100, generator=torch.Generator().manual_seed(2)) * 30
    rows = [chunk(temperature=MIN_TEMPERATURE, seed=1), chunk(temperature=1.0, top_p=1e-40,
                                                              seed=2)]
    assert sample(logits, rows) == logits.argmax(dim=-1).tolist()


def test_as_float32():
    assert as_float32(1e-300) == 0.0 and as_float32(1e39) == float("inf")
    assert as_float32(0.5) == 0.5 and 0 < as_float32(1e-40) < 1e-39


def test_prepare_prompt_checks_version_and_stop_token_ids():
    def req(**kw):
        return GenerateRequest("r", prompt_token_ids=[1, 2], **kw)

    assert prepare_prompt(req(), None, 100, 64) == [1, 2]
    assert prepare_prompt(req(sampling=SamplingParams(stop_token_ids=[0, 99])), None, 100,
                          64) == [1, 2]
    with pytest.raises(RequestRejected, match=r"^v must be 1.*got 99") as e:
        prepare_prompt(req(v=99), None, 100, 64)
    assert e.value.code == "bad_request"
    with pytest.raises(RequestRejected, match="stop_token_ids.*100.*outside the vocabulary"):
        prepare_prompt(req(sampling=SamplingParams(stop_token_ids=[5, 100])), None, 100, 64)
    with pytest.raises(RequestRejected, match="temperature"):
        prepare_prompt(req(sampling=SamplingParams(temperature=1e-45)), None, 100, 64)
    with pytest.raises(RequestRejected, match="token id 100 is outside the vocabulary"):
        prepare_prompt(GenerateRequest("r", prompt_token_ids=[1, 100]), None, 100, 64)
    decoded = [1, 2]  # checked against the vocabulary as it was decoded: taken as it is
    assert prepare_prompt(GenerateRequest("r", prompt_token_ids=decoded), None, 100, 64,
                          ids_in_vocab=True) is decoded


def test_the_batched_filter_equals_filtering_each_row_alone():
    gen = torch.Generator().manual_seed(5)
    logits = (torch.randn(12, 300, generator=gen) * 3).round()  # rounded: ties at the cuts
    ks = [0, 1, 5, 300, 0, 17, 2, 0, 40, 299, 3, 0]
    ps = [0.9, 1.0, 0.5, 0.3, 1.0, 0.95, 0.0, 0.01, 1.0, 0.7, -1.0, 0.999]
    got = filter_batch(logits, ks, ps)
    for i in range(len(ks)):
        alone = filter_row(logits[i], ks[i], ps[i])
        assert torch.equal(torch.isfinite(got[i]), torch.isfinite(alone)), i
        assert torch.equal(got[i][torch.isfinite(got[i])], alone[torch.isfinite(alone)])


def test_the_race_draws_tokens_with_their_probabilities():
    """Over many keys, each token is drawn about as often as its softmax probability."""
    from disagg.kernels.sample_race import race

    x = torch.tensor([[0.0, 1.0, 2.0, float("-inf")]] * 6000)
    keys = torch.tensor([draw_seed(42, i) for i in range(6000)], dtype=torch.int64)
    tok = race(x, keys)
    freq = torch.bincount(tok, minlength=4).float() / len(tok)
    want = torch.softmax(x[0], dim=0)
    assert freq[3] == 0 and (freq - want).abs().max() < 0.025, (freq, want)


def interpreted(code: str) -> object:
    """What ``code`` prints (JSON) when run under Triton's interpreter in a child process."""
    import json
    import os
    import subprocess
    import sys

    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout)


def test_the_triton_race_draws_what_the_torch_race_draws():
    """The CUDA kernel (run by Triton's interpreter here) and the CPU path agree token for
    token, rows that cannot be drawn from included."""
    code = (
        "import json, torch\n"
        "from disagg.kernels.sample_race import race, race_torch\n"
        "g = torch.Generator().manual_seed(1)\n"
        "x = torch.randn(7, 5000, generator=g) * 4\n"
        "x[1, :4000] = float('-inf')\n"
        "x[2] = float('-inf')\n"
        "x[3, 17] = float('nan')\n"
        "x[4, 99] = float('inf')\n"
        "keys = torch.randint(0, 2**62, (7,), generator=g)\n"
        "print(json.dumps([race(x, keys).tolist(), race_torch(x, keys).tolist()]))\n")
    kernel, torch_path = interpreted(code)
    assert kernel == torch_path
    assert kernel[2] == kernel[3] == kernel[4] == -1 and kernel[1] >= 4000


CUT_CASE = (  # rows of every kind of cut: peaked, flat, ties at the cut, masked, poisoned
    "import json, torch\n"
    "from disagg.kernels.sample_race import filter_batch, race, race_torch\n"
    "def case(n, V, seed):\n"
    "    g = torch.Generator().manual_seed(seed)\n"
    "    scale = torch.tensor([4.0, 0.05, 1.0, 2.0, 8.0, 0.5])[torch.arange(n) % 6]\n"
    "    x = torch.randn(n, V, generator=g) * scale[:, None]\n"
    "    x[1::7] = x[1::7].round()\n"
    "    x[2::9, : V // 2] = float('-inf')\n"
    "    x[3, 5] = float('nan')\n"
    "    keys = torch.randint(0, 2**62, (n,), generator=g)\n"
    "    ks = torch.randint(1, 60, (n,), generator=g) * (torch.arange(n) % 3 != 1)\n"
    "    ps = torch.rand(n, generator=g) * (torch.arange(n) % 3 != 0) + (torch.arange(n) % 3 == 0)\n"
    "    ps[5], ps[8] = 0.0, 1e-300\n"
    "    temps = 0.3 + torch.rand(n, generator=g) * 1.5\n"
    "    return x, keys, ks.tolist(), ps.float(), temps\n"
    "def floor(x, ks):\n"
    "    kth = torch.topk(x, max(ks), dim=-1).values.gather(1, torch.tensor([max(k, 1) - 1 for k in ks])[:, None])[:, 0]\n"
    "    return torch.where(torch.tensor(ks) > 0, kth, float('-inf'))\n"
    "def reference(x, keys, ks, ps, temps):\n"
    "    return race_torch(filter_batch(x / temps[:, None], ks, ps.tolist()), keys)\n")


def test_the_triton_race_cuts_top_k_and_top_p_as_the_sort_does():
    """The kernel's top-k (a floor) and top-p (a race, then a check of its winner, no sort;
    run by Triton's interpreter here) draw what the sort's mask then the race draw, row by
    row, rows with both included."""
    code = CUT_CASE + ("x, keys, ks, ps, t = case(48, 2500, 3)\n"
                       "f = floor(x / t[:, None], ks)\n"
                       "print(json.dumps(race(x, keys, f, ps, t).tolist()))\n")
    kernel = interpreted(code)
    scope: dict = {}
    exec(CUT_CASE, scope)
    x, keys, ks, ps, t = scope["case"](48, 2500, 3)
    want = scope["reference"](x, keys, ks, ps, t).tolist()
    assert kernel == want
    f = scope["floor"](x / t[:, None], ks)
    assert scope["race"](x, keys, f, ps, t).tolist() == want  # the CPU path
    # the division keeps the order: the k-th logit over T is the k-th of the logits over T
    assert torch.equal(scope["floor"](x, ks) / t, f)
    assert want[3] == want[5] == want[8] == -1  # a NaN; top-p 0 and one that rounds to it
    assert len({t for t in want if t >= 0}) > 30


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_compiled_race_cuts_as_the_cpu_does():
    scope: dict = {}
    exec(CUT_CASE, scope)
    x, keys, ks, ps, t = scope["case"](64, 151936, 4)
    f = scope["floor"](x / t[:, None], ks)
    got = scope["race"](x.cuda(), keys.cuda(), f.cuda(), ps.cuda(), t.cuda()).cpu().tolist()
    assert got == scope["reference"](x, keys, ks, ps, t).tolist()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_compiled_race_draws_what_the_cpu_draws():
    """The compiled kernel's integer hash (products past 2**63 wrap) and the CPU's torch ops
    give the same tokens for the same keys."""
    from disagg.kernels.sample_race import race, race_torch

    g = torch.Generator().manual_seed(2)
    x = torch.randn(16, 151936, generator=g) * 2
    keys = torch.randint(0, 2**62, (16,), generator=g)
    assert race(x.cuda(), keys.cuda()).cpu().tolist() == race_torch(x, keys).tolist()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_race_warm_up_leaves_sampled_steps_nothing_to_compile():
    """``warm_race`` compiles both of the race's variants (with and without top-p), so a
    sampled step of any kind compiles nothing after it."""
    from triton import knobs

    from disagg.engine.sampling import draw
    from disagg.engine.warmup import warm_race
    from disagg.kernels import compile_watch

    warm_race(1000, torch.device("cuda"))
    if not compile_watch.arm("test"):
        pytest.skip("no Triton post-compile hook")
    before = compile_watch.compiled_after_ready
    try:
        logits = torch.randn(3, 1000, device="cuda")
        for rows in ([(0.7, 0, 0.9, 1, 0)], [(1.0, 5, 1.0, 2, 0)], [(0.5, 0, 1.0, 2, 3)],
                     [(0.7, 0, 0.9, 1, 0), (1.0, 5, 1.0, 2, 0), (1.2, 3, 0.5, 3, 1)]):
            draw(logits[:len(rows)], rows)
        torch.cuda.synchronize()
    finally:
        knobs.runtime.jit_post_compile_hook = None
    assert compile_watch.compiled_after_ready == before
