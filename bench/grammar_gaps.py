"""Where a constrained step's time goes on a node (#34's host-bound JSON-schema TPOT), from
the hop marks of a traced run (``DISAGG_TRACE=DIR``; ``bench/gpu_round.sh``'s surface parts
trace). A step launched before its predecessor's tokens were back waits for its rows' grammar
masks (``late_mask``); for each such step S, with P the predecessor whose tokens its masks
follow:

  back    P's reply sent by the executor (``dx.replied``) -> its grammar pass started on the
          scheduler (``g.pass``): the result's trip and the scheduler's wake-up
  pass    the pass on its threads: tokens accepted, masks filled (``g.pass_done``)
  out     the pass done -> the masks sent (``g.masks_out``): the step landing, the scheduler's
          hooks, the event loop noticing the pass
  hop     masks sent -> in the executor (``dx.masks_in``)
  answer  masks in -> S's reply sent (``dx.replied``): the masks applied and S's tokens
          picked, the tokens' copy to the host, and the next plan launched first unless S's
          forward pass was done when the masks came (``StepOrder``) or, masks first, the wait
          for that plan when it was not
  cycle   P's reply -> S's reply: the TPOT the batch sees
  plan    S's masks sent -> the next plan in the executor (``dx.plan_in`` of S + 1): P's
          tokens applied and streamed, the next step planned and sent; negative where that
          plan went out first, planned while the pass filled the masks (the executor holds
          it until the masks have picked S)

With the executor filling the masks itself (the default since 2026-12-08, marks ``dx.fill``)
the parts of such a step are instead:

  wait    P's reply sent -> the fill started (``dx.fill``)
  fill    the executor's copies accept P's tokens and fill S's masks (-> ``dx.masks_in``)
  answer, cycle  as above

and, for comparison, the cycle between consecutive replies of steps without masks. Medians
and p90 in ms over the steps after the first ``--skip`` whose batch is at least
``--min-width`` rows wide (default: half the widest seen, so that the warm-up's batch-1
steps do not mix with a batch-64 run's).

    python3 bench/grammar_gaps.py DIR [--skip 20] [--min-width N] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from itertools import pairwise
from pathlib import Path
from typing import Any

sys.path.append(str(Path(__file__).resolve().parent))  # (last: bench/kernels.py is no package)
import tail_trace  # noqa: E402  (this directory)

PARTS = ("back", "pass", "out", "hop", "answer", "cycle", "plan")
EXEC_PARTS = ("wait", "fill", "answer", "cycle")  # (keys "x.<part>": the executor's fill)


def gaps(marks: list[tuple[float, str, str, str, str]], skip: int = 0) -> dict[str, Any]:
    """The parts above, per constrained step, from ``tail_trace.marks`` output."""
    at: dict[tuple[str, int], float] = {}
    pred: dict[int, int] = {}
    width: dict[int, int] = {}  # rows in the step (marks of older runs: 0)
    for t, _, ev, key, value in marks:
        if not (key.startswith("d") and key[1:].isdigit()):
            continue
        sid = int(key[1:])
        at.setdefault((ev, sid), t)
        if ev in ("g.pass", "dx.fill") and (v := value.split()) and all(x.isdigit() for x in v):
            pred[sid] = int(v[0])
            width[sid] = int(v[1]) if len(v) > 1 else 0
    rows = []
    for s in sorted(pred)[skip:]:
        p = pred[s]
        mine = ("dx.fill", s) in at
        need = ([("dx.replied", p), ("dx.fill", s), ("dx.masks_in", s), ("dx.replied", s)]
                if mine else
                [("dx.replied", p), ("g.pass", s), ("g.pass_done", s), ("g.masks_out", s),
                 ("dx.masks_in", s), ("dx.replied", s)])
        if any(k not in at for k in need):
            continue
        t = [at[k] for k in need]
        names = [f"x.{n}" for n in EXEC_PARTS] if mine else PARTS[:-1]
        row = dict(zip(names, [1e3 * (b - a) for a, b in pairwise(t)]
                       + [1e3 * (t[-1] - t[0])], strict=True))
        if not mine and ("dx.plan_in", s + 1) in at:
            row["plan"] = 1e3 * (at["dx.plan_in", s + 1] - at["g.masks_out", s])
        row["width"] = width[s]
        rows.append(row)
    replied = sorted((sid, t) for (ev, sid), t in at.items() if ev == "dx.replied")
    plain = [1e3 * (t1 - t0) for (s0, t0), (s1, t1) in pairwise(replied)
             if s1 == s0 + 1 and s1 not in pred]
    return {"steps": rows, "plain_cycle": plain[skip:]}


def describe(values: list[float]) -> dict[str, float]:
    if not values:
        return {"n": 0}
    q = sorted(values)
    return {"n": len(q), "p50": statistics.median(q), "p90": q[min(len(q) - 1, int(0.9 * len(q)))]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dir", type=Path)
    ap.add_argument("--skip", type=int, default=20, help="first constrained steps left out")
    ap.add_argument("--min-width", type=int, help="rows a step has at least (default: half "
                    "the widest)")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    g = gaps(tail_trace.marks(a.dir), a.skip)
    widest = max((r["width"] for r in g["steps"]), default=0)
    least = a.min_width if a.min_width is not None else (widest + 1) // 2
    steps = [r for r in g["steps"] if r["width"] >= least]
    print(f"steps {least}-{widest} rows wide: {len(steps)} of {len(g['steps'])}")
    out: dict[str, Any] = {part: describe([r[part] for r in steps if part in r])
                           for part in (*PARTS, *(f"x.{n}" for n in EXEC_PARTS))}
    out["plain_cycle"] = describe(g["plain_cycle"])
    own = any(out[f"x.{n}"]["n"] for n in EXEC_PARTS)  # the executors filled the masks
    for name, d in out.items():
        if d["n"]:
            print(f"{name:12s} p50 {d['p50']:7.3f} ms  p90 {d['p90']:7.3f} ms  ({d['n']} steps)")
        elif name != "plain_cycle" and name.startswith("x.") == own:  # (the other way's: none)
            print(f"{name:12s} no steps")
    if a.json:
        a.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
