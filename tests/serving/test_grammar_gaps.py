"""``bench/grammar_gaps.py``: a constrained step's parts from the hop marks (its predecessor's
reply, the grammar pass, the masks out and in, its own reply, the next plan in), and the plain
steps' cycle; no nodes."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("grammar_gaps", ROOT / "bench" / "grammar_gaps.py")
assert _spec is not None and _spec.loader is not None
grammar_gaps = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(grammar_gaps)


def mark(t: float, ev: str, sid: int, value: str = "") -> tuple[float, str, str, str, str]:
    return (t, "pid", ev, f"d{sid}", value)


def test_parts_of_constrained_steps_and_the_plain_cycle():
    marks = sorted([
        mark(0.000, "dx.replied", 1), mark(0.006, "dx.replied", 2),  # plain: 6 ms
        mark(0.012, "dx.replied", 3),                                 # plain: 6 ms
        # step 4 follows 3's tokens: back 1, pass 2, out 0.5, hop 0.25, answer 4.25 ms
        mark(0.013, "g.pass", 4, "3 64"), mark(0.015, "g.pass_done", 4),
        mark(0.0155, "g.masks_out", 4), mark(0.01575, "dx.masks_in", 4),
        mark(0.020, "dx.replied", 4),
        mark(0.0175, "dx.plan_in", 5),  # the next plan: 2 ms after step 4's masks went out
        # step 5 lacks its masks_in mark (a run cut off): left out
        mark(0.021, "g.pass", 5, "4"), mark(0.022, "g.pass_done", 5),
        mark(0.023, "g.masks_out", 5),
        (0.0125, "pid", "gc.start", "2", ""),  # other marks are ignored
    ])
    g = grammar_gaps.gaps(marks)
    [row] = g["steps"]
    want = {"back": 1.0, "pass": 2.0, "out": 0.5, "hop": 0.25, "answer": 4.25, "cycle": 8.0,
            "plan": 2.0, "width": 64}
    assert row == pytest.approx(want)
    assert g["plain_cycle"] == pytest.approx([6.0, 6.0])
    assert grammar_gaps.gaps(marks, skip=1)["steps"] == []
    assert grammar_gaps.describe([3.0, 1.0, 2.0]) == {"n": 3, "p50": 2.0, "p90": 3.0}
    assert grammar_gaps.describe([]) == {"n": 0}


def test_parts_of_steps_whose_masks_the_executor_filled():
    """The executors filling the masks (the default): the executor's fill (``dx.fill`` -> ``dx.masks_in``)
    between its predecessor's reply and its own."""
    marks = sorted([
        mark(0.000, "dx.replied", 6),
        mark(0.0002, "dx.fill", 7, "6 64"), mark(0.0032, "dx.masks_in", 7),
        mark(0.0062, "dx.replied", 7),
    ])
    [row] = grammar_gaps.gaps(marks)["steps"]
    assert row == pytest.approx({"x.wait": 0.2, "x.fill": 3.0, "x.answer": 3.0, "x.cycle": 6.2,
                                 "width": 64})
