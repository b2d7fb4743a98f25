"""``disagg-bench plot a.json b.json -o out.png``: compare ``disagg-bench serve`` runs.

Three panels, one line (or point cloud) per run: the CDF of TTFT, the CDF of TPOT, and every
inter-token gap against the time it was observed (seconds since the run started). Uses
matplotlib's Agg backend (``pip install disagg[bench]``); nothing here needs a display.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from itertools import pairwise
from pathlib import Path
from typing import Any

from disagg.bench.metrics_math import request_tpot


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("results", nargs="+", help="JSON files written by disagg-bench serve --json")
    ap.add_argument("-o", "--output", required=True, help="PNG to write")
    ap.add_argument("--labels", default=None,
                    help="comma-separated names for the runs (default: each run's label)")


def _request_series(result: dict[str, Any]) -> tuple[list[float], list[float],
                                                      list[tuple[float, float]]]:
    """(TTFTs ms, TPOTs ms, (time s, ITL ms) points) of the completed requests of one run."""
    ttfts: list[float] = []
    tpots: list[float] = []
    itl_pts: list[tuple[float, float]] = []
    for r in result["requests"]:
        if r["error"] is not None or r["send_time"] is None or not r["chunk_times"]:
            continue
        times, choices = r["chunk_times"], r.get("chunk_choices") or []
        ttfts.append((times[0] - r["send_time"]) * 1e3)
        if r["finish_time"] is not None and (x := request_tpot(
                r["send_time"], r["finish_time"], times, r["chunk_tokens"], choices)) is not None:
            tpots.append(x * 1e3)
        for c in dict.fromkeys(choices or [0]):
            own = [t for i, t in enumerate(times) if not choices or choices[i] == c]
            itl_pts.extend((b, (b - a) * 1e3) for a, b in pairwise(own))
    return ttfts, tpots, itl_pts


def _cdf(ax: Any, values: list[float], label: str) -> None:
    xs = sorted(values)
    if xs:
        ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=label)


def plot_runs(results: Sequence[dict[str, Any]], path: str | Path,
              labels: Sequence[str] | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a_ttft, a_tpot, a_itl) = plt.subplots(1, 3, figsize=(16, 4.5))
    for i, res in enumerate(results):
        label = labels[i] if labels else str(res.get("label") or f"run {i}")
        ttfts, tpots, itl_pts = _request_series(res)
        _cdf(a_ttft, ttfts, label)
        _cdf(a_tpot, tpots, label)
        if itl_pts:
            a_itl.scatter([t for t, _ in itl_pts], [g for _, g in itl_pts], s=2, alpha=0.5,
                          label=label)
    a_ttft.set(title="TTFT", xlabel="ms", ylabel="fraction of requests")
    a_tpot.set(title="TPOT", xlabel="ms", ylabel="fraction of requests")
    a_itl.set(title="ITL over time", xlabel="s since start", ylabel="ms")
    for ax in (a_ttft, a_tpot, a_itl):
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(args: argparse.Namespace) -> int:
    results = []
    for p in args.results:
        with open(p) as f:
            results.append(json.load(f))
    labels = args.labels.split(",") if args.labels else None
    if labels is not None and len(labels) != len(results):
        sys.stderr.write(f"disagg-bench plot: {len(labels)} labels for {len(results)} runs\n")
        return 2
    plot_runs(results, args.output, labels)
    return 0
