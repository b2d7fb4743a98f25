"""Hop marks (``disagg.trace``) and their analysis (``bench/tail_trace.py``): marks land in a
per-process file only when ``DISAGG_TRACE`` is set; repeated attempt ids, transfer keys and
step ids group into the right requests; no nodes, no GPU."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

from disagg.remote.transfer_plan import UNIT_BITS

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("tail_trace", ROOT / "bench" / "tail_trace.py")
assert _spec is not None and _spec.loader is not None
tail_trace = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tail_trace)

CODE = """
import gc
from disagg import trace
print(trace.enabled())
trace.mark("d.send", "0.", 1, value=17)  # key parts joined: 0.1
trace.mark("dm.kv", "0.1", at=12.5)
gc.collect()
"""


def run_marks(tmp_path: Path, on: bool) -> str:
    env = {k: v for k, v in os.environ.items() if k != "DISAGG_TRACE"}
    if on:
        env["DISAGG_TRACE"] = str(tmp_path / "t")
    out = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, env=env,
                         timeout=60, check=True)
    return out.stdout.strip()


def test_marks_are_written_only_when_tracing_is_on(tmp_path):
    assert run_marks(tmp_path, False) == "False" and not (tmp_path / "t").exists()
    assert run_marks(tmp_path, True) == "True"
    [f] = (tmp_path / "t").glob("*.trace")
    every = [ln.split(" ") for ln in f.read_text().splitlines()]
    lines = [ln for ln in every if not ln[1].startswith("gc.")]
    assert [ln[1:] for ln in lines] == [["d.send", "0.1", "17"], ["dm.kv", "0.1", ""]]
    assert float(lines[1][0]) == 12.5
    # the collector's runs are marked too: gc.collect() is a generation-2 start, then its stop
    # with the objects it collected
    at = [ln[1:3] for ln in every].index(["dm.kv", "0.1"])
    after = [ln[1:] for ln in every[at + 1:]]
    assert after[0] == ["gc.start", "2", ""] and after[1][:2] == ["gc.stop", "2"], after
    assert after[1][2].isdigit()


def write(path: Path, rows: list[tuple[float, str, str, str]]) -> None:
    path.write_text("".join(f"{t:.6f} {ev} {key} {value}\n" for t, ev, key, value in rows))


def test_requests_group_by_send_link_and_key(tmp_path):
    """Two requests reuse attempt id 0.0; each has its own transfer key (cuda-ipc marks name
    the immediate, key and units) and prefill step, whose executor mark precedes its link."""
    k1, k2 = 5, 9
    write(tmp_path / "1.trace", [
        (1.000, "d.send", "0.0", "1024"), (1.001, "link", f"0.0=k{k1}", ""),
        (1.030, "d.ready", "0.0", ""),
        (2.000, "d.send", "0.0", "1024"), (2.001, "link", f"0.0=k{k2}", ""),
        (2.050, "d.ready", "0.0", ""),
        (3.000, "d.send", "1.0", "32768"),  # no other mark
    ])
    write(tmp_path / "2.trace", [
        (1.0019, "x.plan_in", "s7", ""), (1.002, "link", "0.0=s7", ""),
        (1.020, "c.note_out", f"k{(k1 << UNIT_BITS) | 3}", ""),
        (2.002, "link", "0.0=s8", ""), (2.040, "x.replied", "s8", ""),
        (2.041, "c.note_out", f"k{(k2 << UNIT_BITS) | 1}", ""),
    ])
    reqs = tail_trace.requests(tail_trace.read(str(tmp_path)))
    assert [r["tokens"] for r in reqs] == [1024, 1024, 32768]
    a, b, c = (r["marks"] for r in reqs)
    assert a == {"d.send": 1.0, "x.plan_in": 1.0019, "c.note_out": 1.02, "d.ready": 1.03}
    assert b == {"d.send": 2.0, "x.replied": 2.04, "c.note_out": 2.041, "d.ready": 2.05}
    assert c == {"d.send": 3.0}
    table = tail_trace.summarize(reqs, skip=0)
    rows = {r["mark"]: r for r in table[1024]}
    assert [r["mark"] for r in table[1024]][0] == "d.send"
    assert abs(rows["d.ready"]["at_ms"] - 40.0) < 1e-6  # median of 30 and 50 ms
    assert rows["d.ready"]["n"] == 2
