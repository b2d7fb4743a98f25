"""bench/experiment_report.py: DistServe goodput (the highest request rate at which >= 90% of
requests meet both SLOs) on synthetic serve results; no nodes, no GPU."""

from __future__ import annotations

import importlib.util
import json
from dataclasses import asdict
from pathlib import Path

import pytest

from disagg.bench.metrics_math import RequestRecord, aggregate

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("experiment_report",
                                               ROOT / "bench" / "experiment_report.py")
assert _spec is not None and _spec.loader is not None
report = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(report)


def test_goodput_rate_is_the_last_rate_of_the_passing_run_from_the_lowest():
    g = report.goodput_rate({2: 1.0, 4: 0.95, 8: 0.7, 12: 0.1})
    assert g["rate"] == 4 and g["first_fail"] == 8 and not g["above_range"]
    # 0.95 -> 0.7 crosses 0.9 a fifth of the way from 4 to 8
    assert g["interpolated"] == pytest.approx(4.8)
    assert g["later_pass"] == []
    # exactly 90% passes
    assert report.goodput_rate({1: 0.9, 2: 0.89})["rate"] == 1


def test_goodput_rate_edges():
    none = report.goodput_rate({2: 0.5, 4: 0.2})
    assert none["rate"] is None and none["interpolated"] is None and none["first_fail"] == 2
    every = report.goodput_rate({2: 1.0, 4: 0.99})
    assert every["rate"] == 4 and every["above_range"] and every["interpolated"] is None
    # a rate that passes again above a failing one does not raise the goodput; it is flagged
    bumpy = report.goodput_rate({2: 1.0, 4: 0.8, 8: 0.95})
    assert bumpy["rate"] == 2 and bumpy["later_pass"] == [8]
    # a rate without a fraction (no SLOs recorded) counts as failing
    assert report.goodput_rate({2: 0.95, 4: None})["rate"] == 2
    assert report.goodput_rate({2: 0.95, 4: None})["interpolated"] == 2
    assert report.goodput_rate({})["rate"] is None
    assert report.goodput_rate({2: 0.8, 4: 0.85}, target=0.8)["rate"] == 4


def _record(i: int, ttft: float, tpot: float, n: int = 5, failed: bool = False) -> RequestRecord:
    chunks = [ttft + k * tpot for k in range(n)]
    return RequestRecord(index=i, node="n", input_len=8, output_len=n, scheduled_time=0.0,
                         send_time=0.0, chunk_times=chunks, chunk_tokens=[1] * n,
                         finish_time=None if failed else chunks[-1], finish_reason="length",
                         error="timeout: no answer" if failed else None)


def _run(records: list[RequestRecord], slo_ttft_ms: float = 1000, slo_tpot_ms: float = 25):
    summary = aggregate(records, 10.0, slo_ttft_ms / 1e3, slo_tpot_ms / 1e3)
    return {"summary": summary, "requests": [asdict(r) for r in records]}


def test_fraction_from_the_summary_and_recomputed_from_the_records():
    recs = ([_record(i, 0.2, 0.010) for i in range(7)]  # good
            + [_record(7, 1.5, 0.010), _record(8, 0.2, 0.030)]  # TTFT miss, TPOT miss
            + [_record(9, 0.2, 0.010, failed=True)])  # failed: misses
    run = _run(recs)
    assert report.slo_fraction(run) == pytest.approx(0.7)
    assert report.slo_fraction(run, 1000, 25) == pytest.approx(0.7)
    assert report.slo_fraction(run, 2000, 25) == pytest.approx(0.8)
    assert report.slo_fraction(run, 2000, 40) == pytest.approx(0.9)
    assert report.slo_fraction({"summary": {"goodput": None}}) is None


def test_goodput_table_and_load(tmp_path, capsys):
    good = [_record(i, 0.1, 0.01) for i in range(10)]
    slow = [_record(i, 0.1, 0.05 if i % 2 else 0.01) for i in range(10)]
    for name, recs in {"mixed_r2": good, "mixed_r4": slow, "disagg_r2": good,
                       "disagg_r4": good, "sharegpt_mixed_r8": good}.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(_run(recs)))
    (tmp_path / "disagg_probe.json").write_text("{}")  # the probe is not a rate
    runs = report.load(tmp_path)
    assert set(runs) == {"mixed", "disagg", "sharegpt_mixed"}
    assert set(runs["mixed"]) == {2.0, 4.0}
    text = report.goodput_table(runs)
    assert "TTFT <= 1000 ms and TPOT <= 25 ms" in text
    rows = {line.split("|")[1].strip(): line for line in text.splitlines()
            if line.startswith("| ") and "system" not in line}
    assert rows["mixed"].split("|")[2].strip() == "2"  # 4 req/s: half miss the TPOT SLO
    assert "4: 0.50" in rows["mixed"]
    assert rows["disagg"].split("|")[2].strip() == ">= 4"
    # other SLOs: recomputed from the records
    assert "| mixed | >= 4 |" in report.goodput_table(runs, 1000, 60)
    assert set(report.groups(runs)) == {"", "sharegpt"}
    # the earlier tables still render
    assert report.table(runs).count("\n") == 1 + 5
