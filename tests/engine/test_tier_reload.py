"""Host-tier reloads issued layer by layer (``disagg.engine.tier_reload``): the sequence is
scheduled in the step that issues its reload, the step waits on each layer before that
layer's attention (and only such a step), the copy holds its pages until it landed, and the
layer groups bound the copies; on CUDA a host hit reloaded so gives a device hit's tokens."""

from __future__ import annotations

import pytest
import torch

from disagg.engine import tier_copy
from disagg.engine.kv_tiers import Copy
from disagg.engine.scheduling import Status
from disagg.engine.tier_reload import copy_layers, layer_groups
from disagg.llm import LLM
from disagg.model.loader import load_model
from disagg.protocol import SamplingParams
from tinymodels import hf_greedy

from .test_kv_tiers import PAGE, Recorder, flood_with, make_sched, mk, run_all


class Overlapper(Recorder):
    """Issues reloads layer by layer (recorded; they land with ``land``)."""

    def overlap(self, copy: Copy) -> bool:
        self.copies.append(copy)
        return True


def settle(s, mover: Recorder) -> None:
    """Every copy out of the flood landed (no eviction below waits on one)."""
    for _ in range(3):
        s.schedule()
        mover.land()


def prefix_pushed_to_host(mover):
    """A scheduler over ``mover`` whose one prompt ran, then was flooded off the device into
    the host tier: (scheduler, that prompt)."""
    s = make_sched(pages=8, slots=32, mover=mover)
    prompt = list(range(10, 10 + 4 * PAGE + 1))
    run_all(s, [mk(0, prompt)], land=mover)
    flood_with(s, mover)
    settle(s, mover)
    return s, prompt


def test_a_host_hit_is_scheduled_in_the_step_that_issues_its_reload():
    mover = Overlapper()
    s, prompt = prefix_pushed_to_host(mover)
    again = mk(1, prompt)
    s.add(again)
    batch = s.schedule()
    assert batch is not None and again.status is Status.RUNNING  # not loading first
    [chunk] = batch.chunks
    assert chunk.start == 4 * PAGE  # the rest of its prompt, on the reloading pages
    [reload] = mover.copies
    assert reload.kind == "in" and list(reload.pages) == again.block_table[:4]
    assert s.reload_pending()  # the step's plan waits on it per layer
    assert not any(h in s.pool.page_of for h in again.known_hashes[:4])  # not found yet
    s.update(batch, [7])
    mover.land()
    s.schedule()
    assert not s.reload_pending()
    assert all(h in s.pool.page_of for h in again.known_hashes[:4])  # registered now
    run_all(s, [], land=mover)
    assert again.cached_tokens == 4 * PAGE and s.tiers.tiers.counters.hits["host"] == 1
    assert s.pool.num_free == 8 and s.tiers.tiers.host.pinned() == 0 and not s.has_work()


def test_a_sequence_ended_before_its_overlapped_reload_landed_leaves_the_pages_to_the_copy():
    mover = Overlapper()
    s, prompt = prefix_pushed_to_host(mover)
    gone = mk(1, prompt)
    s.add(gone)
    assert s.schedule() is not None
    s.remove(gone)
    assert s.pool.num_free == 4  # its 4 reloading pages: the copy may still write them
    assert all(s.pool.refcount(p) == 1 for p in mover.copies[0].pages)
    mover.land()
    s.schedule()
    assert s.pool.num_free == 8 and not s.has_work() and s.tiers.tiers.host.pinned() == 0


def test_a_step_waits_on_each_layer_after_its_copy_and_plain_steps_never_wait(tiny_models):
    """CPU: the reload is copied layer by layer when issued; the step that uses it waits on
    every layer's event before that layer (fake events record the order), others on none."""
    path = tiny_models["llama"]
    model = load_model(path, "float32")
    llm = LLM(model, num_pages=12, page_size=PAGE, kv_host_cache_mb=1)
    order: list[tuple[str, int]] = []

    class Event:
        def __init__(self, layer: int):
            self.layer = layer

        def wait(self) -> None:
            order.append(("wait", self.layer))

    layers = model.arch.num_layers
    llm.runner.reload_events = [Event(i) for i in range(layers)]
    assert llm.tiers is not None
    llm.tiers.mover.on_layer = lambda i: order.append(("copy", i))  # type: ignore[attr-defined]
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(3, 300, (2 * PAGE + 1,), generator=g).tolist()
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    first = llm.generate([prompt], params)[0]
    assert order == []  # nothing reloads: no step waits
    for _ in range(2):  # every device page taken: the prompt's pages go to the host tier
        llm.generate([torch.randint(3, 300, (11 * PAGE,), generator=g).tolist()], params)
    order.clear()
    again = llm.generate([prompt], params)[0]
    assert again.token_ids == first.token_ids == hf_greedy(path, prompt, 3)
    assert llm.tiers.counters.hit_tokens["host"] == 2 * PAGE
    assert [o for o in order if o[0] == "copy"] == [("copy", i) for i in range(layers)]
    assert [o for o in order if o[0] == "wait"] == [("wait", i) for i in range(layers)]
    assert all(order.index(("copy", i)) < order.index(("wait", i)) for i in range(layers))
    assert llm.pool.num_free == 12 and llm.tiers.host.pinned() == 0


class LateLanding:
    """A layered reload as CUDA runs it, on the CPU: the copy is issued at once but reported
    landed only at the second look (a step runs on its pages meanwhile)."""

    def __init__(self, kv, host) -> None:
        self.kv, self.host, self.pending, self.issued = kv, host, [], 0

    def issue(self, copy: Copy) -> None:
        copy_layers(copy, self.kv, self.host)
        self.pending.append([copy.op, 2])
        self.issued += 1

    def landed(self) -> list[int]:
        for p in self.pending:
            p[1] -= 1
        out = [op for op, looks in self.pending if looks <= 0]
        self.pending = [p for p in self.pending if p[1] > 0]
        return out

    def busy(self) -> bool:
        return bool(self.pending)


def test_a_reload_landing_after_its_step_gives_a_device_hits_tokens_and_frees_its_pages(
        tiny_models, monkeypatch):
    """The CUDA test's sequence on the CPU with the reload landing late: the host hit's
    sequence runs before its copy is reported landed, its pages cached once it is, and the
    pool is whole at the end (the copy's reference returned)."""
    late: list[LateLanding] = []

    def make(kv, host, events):
        late.append(LateLanding(kv, host.tensors))
        return late[-1]

    monkeypatch.setattr(tier_copy, "layered", make)
    path = tiny_models["qwen3"]
    llm = LLM(load_model(path, "float32"), num_pages=24, page_size=PAGE, kv_host_cache_mb=4)
    g = torch.Generator().manual_seed(9)
    prompt = torch.randint(3, 300, (4 * PAGE + 1,), generator=g).tolist()
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    device_hit = llm.generate([prompt + [5]], params)[0]
    for _ in range(3):
        llm.generate([torch.randint(3, 300, (22 * PAGE,), generator=g).tolist()], params)
    host_hit = llm.generate([prompt + [5]], params)[0]
    assert llm.tiers is not None and late[0].issued == 1
    assert llm.tiers.counters.hit_tokens["host"] == 4 * PAGE
    assert host_hit.token_ids == device_hit.token_ids == hf_greedy(path, prompt + [5], 6)
    assert llm.pool.num_free == 24 and llm.tiers.host.pinned() == 0 and not llm.tiers.busy()


def test_layer_groups_are_per_layer_when_the_copies_allow_it_and_cover_every_layer():
    assert layer_groups(32, 1) == [(i, i + 1) for i in range(32)]
    groups = layer_groups(32, 256)  # 256 scattered slots: 4 groups of 8 layers
    assert groups == [(0, 8), (8, 16), (16, 24), (24, 32)]
    assert layer_groups(5, 10_000) == [(0, 5)]  # at least one
    for layers, runs in [(7, 300), (61, 5), (1, 1)]:
        g = layer_groups(layers, runs)
        assert g[0][0] == 0 and g[-1][1] == layers
        assert all(a[1] == b[0] for a, b in zip(g, g[1:], strict=False))
        assert len(g) * runs <= max(1024, runs)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_host_hit_reloaded_layer_by_layer_gives_a_device_hits_greedy_tokens(tiny_models,
                                                                             monkeypatch):
    """CUDA: the same prompt as a device hit and, after the device cache was flooded, as a
    host hit whose reload is issued layer by layer on a side stream while the step runs;
    equal greedy tokens (and transformers')."""
    monkeypatch.setenv("DISAGG_LAYERED_RELOAD", "1")
    path = tiny_models["qwen3"]
    llm = LLM(load_model(path, "float32", device="cuda"), num_pages=24, page_size=PAGE,
              kv_host_cache_mb=4)
    assert llm.tiers is not None and llm.tiers.mover._layered is not None  # type: ignore
    g = torch.Generator().manual_seed(9)
    prompt = torch.randint(3, 300, (4 * PAGE + 1,), generator=g).tolist()
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    cold = llm.generate([prompt], params)[0]
    device_hit = llm.generate([prompt + [5]], params)[0]
    assert device_hit.cached_tokens == 4 * PAGE
    host_before = llm.tiers.counters.hit_tokens["host"]
    for _ in range(3):  # 22 pages of prompt + 6 tokens: every page of the pool, none spare
        llm.generate([torch.randint(3, 300, (22 * PAGE,), generator=g).tolist()], params)
    host_hit = llm.generate([prompt + [5]], params)[0]
    assert llm.tiers.counters.hit_tokens["host"] - host_before == 4 * PAGE
    assert host_hit.token_ids == device_hit.token_ids == hf_greedy(path, prompt + [5], 6)
    assert cold.token_ids == hf_greedy(path, prompt, 6)
    assert llm.pool.num_free == 24 and llm.tiers.host.pinned() == 0 and not llm.tiers.busy()
