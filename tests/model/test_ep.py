"""Expert parallelism's pieces: which experts a rank holds, the TP token shares, the layout
refusals, and the all-to-all exchange over two gloo processes against the one-process sum."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from disagg.model.config import ModelArch, MoEArch
from disagg.model.ep import EPError, ExpertParallel, check_layout, token_share
from disagg.model.moe import MoEMLP, experts_loop
from disagg.model.tp import TensorParallel, TPError


def moe_arch(experts: int = 8) -> ModelArch:
    a = ModelArch("Qwen3MoeForCausalLM", 100, 32, 64, 2, 4, 2, 8, 1e-6, 1e4, 64, False, False,
                  False)
    return dataclasses.replace(a, moe=MoEArch(experts, 2, 16, (True, True),
                                              shared_intermediate_size=8))


@pytest.mark.parametrize("size", [1, 2, 4, 8])
def test_every_expert_on_exactly_one_rank(size):
    held = [e for r in range(size) for e in ExpertParallel(r, size).experts(8)]
    assert held == list(range(8))


def test_experts_must_divide():
    with pytest.raises(EPError, match="8 experts do not divide over 3 ranks"):
        ExpertParallel(0, 3).experts(8)
    with pytest.raises(EPError, match="experts do not divide"):
        TensorParallel(0, 1, ep=ExpertParallel(0, 3)).local_arch(moe_arch())


def test_ep_keeps_experts_whole_and_splits_the_shared_one():
    a = moe_arch()
    local = TensorParallel(1, 2, ep=ExpertParallel(1, 4)).local_arch(a)
    assert local.moe is not None and a.moe is not None
    assert local.moe.intermediate_size == a.moe.intermediate_size  # whole experts
    assert local.moe.shared_intermediate_size == a.moe.shared_intermediate_size // 2
    mlp = MoEMLP(a.hidden_size, local.moe, torch.float32, torch.device("cpu"),
                 TensorParallel(1, 2, ep=ExpertParallel(1, 4)))
    assert mlp.gate_up.shape[0] == 2 and mlp.router.shape[0] == 8  # 2 experts; every logit
    one = MoEMLP(a.hidden_size, a.moe, torch.float32, torch.device("cpu"),
                 TensorParallel(ep=ExpertParallel()))
    assert one.ep is None and one.gate_up.shape[0] == 8  # one EP rank: today's path


@pytest.mark.parametrize("rows, size", [(0, 2), (1, 2), (5, 2), (7, 3), (2, 4)])
def test_token_shares_cover_the_rows_once(rows, size):
    shares = [token_share(rows, r, size) for r in range(size)]
    assert shares[0][0] == 0 and shares[-1][1] == rows
    assert all(a[1] == b[0] for a, b in zip(shares, shares[1:], strict=False))


def test_layouts_refused_by_name():
    a = moe_arch()
    ok = TensorParallel(0, 2).check
    check_layout(lambda tp: TensorParallel(0, tp).check(a), 8, 4, 2, True)
    with pytest.raises(EPError, match="--dp 3 does not divide the 4 devices"):
        check_layout(ok, 8, 4, 3, False)
    with pytest.raises(EPError, match="dense"):
        check_layout(lambda tp: None, None, 2, 1, True)
    with pytest.raises(EPError, match="8 experts do not divide over 6 ranks"):
        check_layout(lambda tp: None, 8, 6, 2, True)
    with pytest.raises(TPError, match="attention heads"):
        check_layout(lambda tp: TensorParallel(0, tp).check(a), 8, 6, 2, False)


def _rank(rank: int, size: int, init: str, out: dict) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=size)
    gen = torch.Generator().manual_seed(0)
    e, h, i = 12, 16, 8
    gate_up = torch.randn(e, 2 * i, h, generator=gen)
    down = torch.randn(e, h, i, generator=gen)
    xs = [torch.randn(n, h, generator=gen) for n in (5, 0, 3)[:size]]  # rank 1 has no tokens
    routes = [torch.stack([torch.randperm(e, generator=gen)[:2] for _ in range(len(x))])
              if len(x) else torch.zeros(0, 2, dtype=torch.long) for x in xs]
    weights = [torch.rand(len(x), 2, generator=gen) for x in xs]
    ep = ExpertParallel(rank, size)
    mine = ep.experts(e)

    def local(rows, w, le):
        return experts_loop(rows, w[:, None], le[:, None], gate_up[mine.start:mine.stop],
                            down[mine.start:mine.stop])

    got = ep.exchange(xs[rank], weights[rank], routes[rank], e, local)
    want = experts_loop(xs[rank], weights[rank], routes[rank], gate_up, down)
    out[rank] = (torch.allclose(got, want, atol=1e-5), tuple(got.shape), ep.clock.calls)
    dist.destroy_process_group()


@pytest.mark.procs
@pytest.mark.parametrize("size", [2, 3])
def test_exchange_equals_the_local_sum(size, tmp_path):
    """Tokens routed anywhere come back summed as if every expert were local; a rank with no
    tokens joins with zero rows."""
    import torch.multiprocessing as mp

    out = mp.Manager().dict()
    ctx = mp.spawn(_rank, args=(size, f"file://{tmp_path}/rdv", out), nprocs=size, join=True)
    assert ctx is None
    assert {r: out[r][0] for r in range(size)} == {r: True for r in range(size)}
    assert [out[r][1][0] for r in range(size)] == [5, 0, 3][:size]
    assert all(out[r][2] == 1 for r in range(size))


def test_random_weights_are_the_same_model_under_ep():
    """--random-weights: an EP rank draws exactly its slice of the experts one rank would, and
    everything else the same, so a --dp 2 --expert-parallel node is the --dp 1 node's model."""
    from disagg.model.loader import random_model

    a = moe_arch()
    whole = dict(random_model(a, "float32", seed=4).named_parameters())
    for rank in range(2):
        part = dict(random_model(a, "float32", seed=4, tp=TensorParallel(
            ep=ExpertParallel(rank, 2))).named_parameters())
        assert part.keys() == whole.keys()
        for name, p in part.items():
            if name.endswith((".moe.gate_up", ".moe.down")):
                assert torch.equal(p, whole[name][4 * rank:4 * rank + 4]), name
            else:
                assert torch.equal(p, whole[name]), name
