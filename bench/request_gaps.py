"""Where a request's time to first token went on a node, from its hop marks (``DISAGG_TRACE``,
``disagg.trace``): for each request whose id matches ``--match``, the time from its arrival
at the scheduler (``r.in``) to it being live (``r.live``, admitted) and to its first token out
(``r.first``), and what else happened in that window in every process of the node: the cyclic
collector's pauses (``gc.start`` / ``gc.stop``, by generation) and the executor's steps
(``dx.plan_in`` to ``dx.replied``: their count and the longest).

    DISAGG_TRACE=DIR disagg-node ...;  python3 bench/request_gaps.py DIR [--match -0$]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tail_trace  # noqa: E402  (this directory)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dir", type=Path)
    ap.add_argument("--match", default="", help="a regex over request ids")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    marks = tail_trace.marks(a.dir)
    pauses = []  # (start, end, pid, generation)
    open_gc: dict[str, tuple[float, str]] = {}
    steps = []  # (plan_in, replied, pid)
    open_step: dict[tuple[str, str], float] = {}
    req: dict[str, dict[str, float]] = defaultdict(dict)
    for t, pid, ev, key, _ in marks:
        if ev == "gc.start":
            open_gc[pid] = (t, key)
        elif ev == "gc.stop" and pid in open_gc:
            t0, gen = open_gc.pop(pid)
            pauses.append((t0, t, pid, gen))
        elif ev.endswith(".plan_in"):  # the executor's steps (dx.*, or sx.* on a prefill node)
            open_step[(pid, key)] = t
        elif ev.endswith(".replied") and (pid, key) in open_step:
            steps.append((open_step.pop((pid, key)), t, pid))
        elif ev in ("r.in", "r.live", "r.first") and re.search(a.match, key):
            req[key].setdefault(ev[2:], t)
    rows = []
    for rid, r in sorted(req.items(), key=lambda kv: kv[1].get("in", 0.0)):
        if "in" not in r or "first" not in r:
            continue
        t0, t1 = r["in"], r["first"]
        inside = [p for p in pauses if p[1] > t0 and p[0] < t1]
        st = [s for s in steps if s[1] > t0 and s[0] < t1]
        rows.append({
            "request": rid, "ttft_ms": 1e3 * (t1 - t0),
            "admit_ms": 1e3 * (r.get("live", t0) - t0),
            "gc_ms": round(1e3 * sum(min(p[1], t1) - max(p[0], t0) for p in inside), 2),
            "gc": [f"pid {p[2]} gen {p[3]} {1e3 * (p[1] - p[0]):.1f} ms" for p in inside
                   if p[1] - p[0] > 5e-4],
            "steps": len(st), "longest_step_ms": round(1e3 * max((s[1] - s[0] for s in st),
                                                                  default=0.0), 2),
        })
        x = rows[-1]
        print(f"{rid:>28s} ttft {x['ttft_ms']:7.1f} admit {x['admit_ms']:5.1f} gc {x['gc_ms']:6.1f}"
              f" steps {x['steps']:3d} longest {x['longest_step_ms']:6.1f}  {' '.join(x['gc'])}")
    by_gen: dict[str, list[float]] = defaultdict(list)
    for p in pauses:
        by_gen[f"{p[2]} gen {p[3]}"].append(1e3 * (p[1] - p[0]))
    for k, v in sorted(by_gen.items()):
        print(f"gc pid {k}: {len(v)} runs, {sum(v):.1f} ms in all, longest {max(v):.1f} ms")
    if a.json:
        a.json.write_text(json.dumps({"requests": rows, "gc": {k: sorted(v)[-5:]
                                                              for k, v in by_gen.items()}}))


if __name__ == "__main__":
    main()
