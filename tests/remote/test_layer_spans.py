"""Which layers a prefill step posts when (``disagg.actors.prefill_messenger.prefill_jobs.layer_spans``), and a
span of layers as one ``Runs`` (``ChunkPlan.layers``): the same writes as its layers one by
one."""

from __future__ import annotations

import numpy as np

from disagg.actors.prefill_messenger.prefill_jobs import layer_spans
from disagg.remote.transfer_plan import ChunkPlan, Runs


def test_layer_by_layer_posts_each_new_layer_alone():
    assert layer_spans(0, 3, 8, whole=False) == [(0, 1), (1, 2), (2, 3)]
    assert layer_spans(3, 3, 8, whole=False) == []
    assert layer_spans(7, 8, 8, whole=False) == [(7, 8)]


def test_a_whole_step_posts_nothing_until_its_last_layer_then_all():
    assert layer_spans(0, 5, 8, whole=True) == []
    assert layer_spans(0, 8, 8, whole=True) == [(0, 8)]
    assert layer_spans(8, 8, 8, whole=True) == []


def test_a_span_of_layers_is_its_layers_in_order():
    runs = Runs(np.array([0, 100]), np.array([5, 205]), np.array([16, 32]), np.array([1, 2]))
    plan = ChunkPlan({(0, 0): runs}, src_stride=1000, dst_stride=3000, num_layers=4)
    span = plan.layers((0, 0), 1, 4)
    parts = [plan.layer((0, 0), i) for i in range(1, 4)]
    for field in ("src_offset", "dst_offset", "length", "units"):
        assert getattr(span, field).tolist() == sum((getattr(p, field).tolist() for p in parts),
                                                    [])
    one = plan.layers((0, 0), 2, 3)
    assert one.src_offset.tolist() == [2000, 2100] and one.dst_offset.tolist() == [6005, 6205]
