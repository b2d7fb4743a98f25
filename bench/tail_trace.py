"""Per-hop times of remote prefills from hop marks (``disagg.trace``; issue 18, the tail).

Run the nodes of one host with ``DISAGG_TRACE=DIR`` (``bench/ttft_tail.sh`` does with
``TRACE=1``), then:
    python bench/tail_trace.py DIR [--json OUT]
Each request is one ``d.send`` (the decoder's scheduler sends it to a prefiller) and everything
linked to it: its attempt id until the next ``d.send`` of that id, its transfer key and the
prefill steps that ran it (``link`` marks). Per prompt length it prints, in time order, every
mark's median offset from ``d.send`` and the median gap from the mark before (the last
occurrence of each mark: a long prompt's last chunk).
"""

from __future__ import annotations

import argparse
import collections
import json
import pathlib
import statistics
from typing import Any

from disagg.remote.transfer_plan import UNIT_BITS


def marks(directory: str | pathlib.Path) -> list[tuple[float, str, str, str, str]]:
    """Every mark of every process's file, in time order: (time, pid, event, key, value)."""
    out = []
    for f in pathlib.Path(directory).glob("*.trace"):
        for line in f.read_text().splitlines():
            parts = line.split(" ", 3)
            if len(parts) >= 3:
                out.append((float(parts[0]), f.stem, parts[1], parts[2],
                            parts[3] if len(parts) > 3 else ""))
    return sorted(out)


def read(directory: str) -> list[tuple[float, str, str, str]]:
    """The hop marks (``marks`` less the collector's, and the pid): (time, event, key, value)."""
    events = []
    for t, _, ev, key, value in marks(directory):
        if ev.startswith("gc."):  # the collector's runs: no hop
            continue
        if ev.startswith("c."):  # cuda-ipc marks name the immediate: key and units
            key = f"k{int(key[1:]) >> UNIT_BITS}"
        events.append((t, ev, key, value))
    return events


def requests(events: list[tuple[float, str, str, str]]) -> list[dict[str, Any]]:
    """Group marks into requests: ``{"tokens": n, "marks": {event: last time}}``. Attempt
    ids repeat (slot.attempt): a mark with one belongs to its latest ``d.send``; transfer keys
    and step ids are unique, and belong where their ``link`` put them, even marks made before
    the link (an executor can start a step before the messenger reads its announcement)."""
    reqs: list[dict[str, Any]] = []
    sent: list[int] = []  # the request of each d.send, in time order
    current: dict[str, int] = {}  # attempt id -> its latest request
    linked: dict[str, int] = {}
    for _, ev, key, value in events:  # 1: requests and links
        if ev == "d.send":
            current[key] = len(reqs)
            sent.append(len(reqs))
            reqs.append({"tokens": int(value or 0), "marks": {}})
        elif ev == "link" and key.partition("=")[0] in current:
            a, _, b = key.partition("=")
            linked[b] = current[a]
    current.clear()
    sends = iter(sent)
    for t, ev, key, _ in events:  # 2: every mark to its request
        if ev == "d.send":
            current[key] = next(sends)
        if ev != "link" and (i := linked.get(key, current.get(key))) is not None:
            reqs[i]["marks"][ev] = t
    return reqs


def summarize(reqs: list[dict[str, Any]], skip: int = 1) -> dict[int, list[dict[str, Any]]]:
    """Per prompt length (its first ``skip`` requests dropped: start-up): marks in median
    time order with their median offset and gap."""
    by_len: dict[int, list[dict[str, float]]] = collections.defaultdict(list)
    for r in reqs:
        by_len[r["tokens"]].append(r["marks"])
    out = {}
    for n, runs in sorted(by_len.items()):
        runs = runs[skip:] if len(runs) > skip else runs
        names = {e for m in runs for e in m}
        offs = {e: statistics.median(m[e] - m["d.send"] for m in runs if e in m) for e in names}
        order = sorted(names, key=lambda e: offs[e])
        rows, prev = [], None
        for e in order:
            gaps = [m[e] - m[prev] for m in runs if prev is not None and e in m and prev in m]
            rows.append({"mark": e, "at_ms": round(1000 * offs[e], 3), "n": sum(e in m for m in runs),
                         "gap_ms": round(1000 * statistics.median(gaps), 3) if gaps else None})
            prev = e
        out[n] = rows
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("dir")
    ap.add_argument("--skip", type=int, default=1, help="first requests per length to drop")
    ap.add_argument("--json")
    args = ap.parse_args()
    table = summarize(requests(read(args.dir)), args.skip)
    for n, rows in table.items():
        print(f"--- {n} prompt tokens")
        for r in rows:
            gap = "" if r["gap_ms"] is None else f"+{r['gap_ms']:8.3f}"
            print(f"  {r['mark']:<22} {r['at_ms']:10.3f} ms {gap:>10}  (n={r['n']})")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(table, indent=1))


if __name__ == "__main__":
    main()
