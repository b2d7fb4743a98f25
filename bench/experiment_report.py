"""Tables and plots of the serving experiment (``bench/experiment_serve.sh`` results).

    python3 bench/experiment_report.py WORK --docs docs

Prints Markdown tables (one row per system and rate) and writes ``serving_vs_rate.png``
(P50 tokens/s per user, TTFT P50/P99 and ITL P99 against the request rate) and
``serving_cdf_rR.png`` (``disagg-bench plot`` of mixed vs disagg at each common rate) into
``--docs``.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any


def load(work: Path) -> dict[str, dict[float, dict[str, Any]]]:
    runs: dict[str, dict[float, dict[str, Any]]] = {}
    for f in sorted(work.glob("*_r*.json")):
        m = re.fullmatch(r"(\w+)_r([\d.]+)\.json", f.name)
        if m:
            runs.setdefault(m.group(1), {})[float(m.group(2))] = json.loads(f.read_text())
    return runs


def table(runs: dict[str, dict[float, dict[str, Any]]]) -> str:
    head = ("| system | rate (req/s) | done | out tok/s | TTFT p50 / p99 (ms) | TPOT p50 / p99 (ms) "
            "| ITL p50 / p99 (ms) | tok/s per user p50 | exposed transfer p50 (ms) |")
    lines = [head, "|" + "---|" * 9]
    for system in sorted(runs):
        for rate, r in sorted(runs[system].items()):
            s = r["summary"]
            tail = s["ttft_breakdown_ms"].get("exposed_transfer")

            def pp(d: dict[str, Any]) -> str:
                return "-" if d["p50"] is None else f"{d['p50']:.1f} / {d['p99']:.1f}"

            u = s["tokens_per_s_per_user"]["p50"]
            t50 = "-" if not tail else f"{tail['p50']:.2f}"
            lines.append(
                f"| {system} | {rate:g} | {s['completed']}/{s['num_requests']} | "
                f"{s['output_throughput']:.0f} | {pp(s['ttft_ms'])} | {pp(s['tpot_ms'])} | "
                f"{pp(s['itl_ms'])} | {'-' if u is None else f'{u:.1f}'} | "
                f"{t50} |")
    return "\n".join(lines)


def breakdown(runs: dict[str, dict[float, dict[str, Any]]]) -> str:
    lines = []
    for system in sorted(runs):
        for rate, r in sorted(runs[system].items()):
            b = r["summary"]["ttft_breakdown_ms"]
            if b:
                parts = ", ".join(f"{k} {v['p50']:.1f}" for k, v in b.items()
                                  if v.get("p50") is not None)
                lines.append(f"- {system} @{rate:g} req/s, P50 ms: {parts}")
    return "\n".join(lines)


def plot(runs: dict[str, dict[float, dict[str, Any]]], docs: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from disagg.bench.plot import plot_runs

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for system in sorted(runs):
        rates = sorted(runs[system])
        s = [runs[system][r]["summary"] for r in rates]
        axes[0].plot(rates, [x["tokens_per_s_per_user"]["p50"] for x in s], "o-", label=system)
        axes[1].plot(rates, [x["ttft_ms"]["p50"] for x in s], "o-", label=f"{system} p50")
        axes[1].plot(rates, [x["ttft_ms"]["p99"] for x in s], "x--", label=f"{system} p99")
        axes[2].plot(rates, [x["itl_ms"]["p99"] for x in s], "o-", label=f"{system} p99")
        axes[2].plot(rates, [x["itl_ms"]["p50"] for x in s], "x--", label=f"{system} p50")
    axes[0].set(title="tokens/s per user (P50)", xlabel="request rate (req/s)")
    axes[1].set(title="TTFT (ms)", xlabel="request rate (req/s)", yscale="log")
    axes[2].set(title="ITL (ms)", xlabel="request rate (req/s)", yscale="log")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("Qwen3-8B shape, 2x H200, input 4096 / output 256: 2 mixed replicas vs 1P1D")
    fig.tight_layout()
    out = [docs / "serving_vs_rate.png"]
    fig.savefig(out[0], dpi=90)
    plt.close(fig)
    common = sorted(set.intersection(*(set(v) for v in runs.values()))) if runs else []
    for rate in common:
        path = docs / f"serving_cdf_r{rate:g}.png"
        plot_runs([runs[s][rate] for s in sorted(runs)], path)
        out.append(path)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("work")
    ap.add_argument("--docs", default=None)
    args = ap.parse_args()
    runs = load(Path(args.work))
    print(table(runs))
    print()
    print(breakdown(runs))
    if args.docs:
        for p in plot(runs, Path(args.docs)):
            print("wrote", p)


if __name__ == "__main__":
    main()
