"""Tables and plots of the serving experiment (``bench/experiment_serve.sh`` results).

    python3 bench/experiment_report.py WORK --docs docs [--slo-ttft-ms 1000 --slo-tpot-ms 25]

Prints Markdown tables (one row per system and rate), the goodput table (DistServe's goodput:
the highest request rate at which >= 90% of requests meet both the TTFT and the TPOT SLO, with
the fraction meeting both at every rate) and writes ``serving_vs_rate.png`` (P50 tokens/s per
user, TTFT P50/P99, ITL P99 and the fraction meeting the SLOs against the request rate) and
``serving_cdf_rR.png`` (``disagg-bench plot`` of mixed vs disagg at each common rate) into
``--docs``. Systems are the result names' stems (``mixed``, ``disagg``,
``sharegpt_mixed``, ...); those sharing a workload prefix are plotted together (the prefix is
added to the plot names: ``serving_vs_rate_sharegpt.png``).

The SLOs are the runs' own (``disagg-bench serve --slo-ttft-ms/--slo-tpot-ms``, stored in each
summary's ``goodput``) unless ``--slo-ttft-ms``/``--slo-tpot-ms`` are given: then every run's
fraction is recomputed from its per-request records with the same rule as the bench
(``disagg.bench.metrics_math.meets_slo``; failed requests count as missing the SLOs).
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

TARGET = 0.9  # DistServe's attainment target


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


def slo_fraction(run: dict[str, Any], slo_ttft_ms: float | None = None,
                 slo_tpot_ms: float | None = None) -> float | None:
    """The fraction of a run's requests meeting both SLOs: the run's own (its summary's
    ``goodput``) when no SLO is given, else recomputed from its per-request records. None when
    neither is available."""
    if slo_ttft_ms is None and slo_tpot_ms is None:
        g = run["summary"].get("goodput")
        return None if not g else float(g["fraction"])
    from disagg.bench.metrics_math import RequestRecord, meets_slo

    reqs = run.get("requests")
    if not reqs:
        return None
    fields = set(RequestRecord.__dataclass_fields__)
    good = 0
    for d in reqs:
        r = RequestRecord(**{k: v for k, v in d.items() if k in fields})
        ttft = r.ttft
        if ttft is not None and meets_slo(
                ttft, r.tpot, None if slo_ttft_ms is None else slo_ttft_ms / 1e3,
                None if slo_tpot_ms is None else slo_tpot_ms / 1e3):
            good += 1
    return good / len(reqs)


def goodput_rate(fractions: dict[float, float | None], target: float = TARGET) -> dict[str, Any]:
    """DistServe's goodput from the fraction meeting both SLOs at each measured rate.

    ``rate``: the highest measured rate such that it and every lower rate have a fraction
    >= ``target`` (None when the lowest rate misses already); ``interpolated``: where the
    fraction crosses ``target`` on the line between that rate and the next (failing) one, None
    when no rate fails (the goodput is then at least ``rate``: ``above_range``) or none passes;
    ``first_fail``: the lowest failing rate; ``later_pass``: rates above ``first_fail`` that
    pass again (noise: the curve is not monotone). A rate without a fraction counts as failing."""
    rates = sorted(fractions)
    best: float | None = None
    first_fail: float | None = None
    for r in rates:
        f = fractions[r]
        if f is None or f < target:
            first_fail = r
            break
        best = r
    interp: float | None = None
    if best is not None and first_fail is not None:
        f0, f1 = fractions[best], fractions[first_fail]
        assert f0 is not None
        if f1 is not None and f0 > f1:
            interp = best + (f0 - target) / (f0 - f1) * (first_fail - best)
        else:
            interp = best
    later = [r for r in rates if first_fail is not None and r > first_fail
             and (fractions[r] or 0.0) >= target]
    return {"rate": best, "interpolated": interp, "first_fail": first_fail,
            "above_range": bool(rates) and first_fail is None, "later_pass": later}


def run_slos(runs: dict[str, dict[float, dict[str, Any]]]) -> set[tuple[Any, Any]]:
    """The (TTFT, TPOT) SLO pairs (ms) the runs were scored against."""
    out = set()
    for per_rate in runs.values():
        for r in per_rate.values():
            g = r["summary"].get("goodput")
            out.add((g["slo_ttft_ms"], g["slo_tpot_ms"]) if g else (None, None))
    return out


def goodput_table(runs: dict[str, dict[float, dict[str, Any]]], slo_ttft_ms: float | None = None,
                  slo_tpot_ms: float | None = None, target: float = TARGET) -> str:
    """The goodput of each system (Markdown), its SLOs stated, and per rate the fraction of
    requests meeting both SLOs and the P50 tokens/s per user."""
    if slo_ttft_ms is None and slo_tpot_ms is None:
        slos = run_slos(runs)
        if len(slos) == 1:
            t, p = next(iter(slos))
            slo = ("no SLOs recorded (run disagg-bench serve with --slo-ttft-ms/--slo-tpot-ms, or "
                   "give them here)" if t is None and p is None else
                   f"TTFT <= {t:g} ms and TPOT <= {p:g} ms" if t is not None and p is not None
                   else f"TTFT <= {t} ms, TPOT <= {p} ms")
        else:
            slo = "the runs' own SLOs, which differ: " + ", ".join(
                f"{t}/{p} ms" for t, p in sorted(slos, key=str))
    else:
        slo = " and ".join(f"{k} <= {v:g} ms" for k, v in (("TTFT", slo_ttft_ms),
                                                           ("TPOT", slo_tpot_ms)) if v is not None)
        slo += " (recomputed from the requests)"
    lines = [f"Goodput (DistServe): the highest request rate at which >= {target:.0%} of "
             f"requests meet {slo}; failed requests miss.", "",
             "| system | goodput (req/s) | interpolated | per rate: fraction meeting both SLOs "
             "(tok/s per user p50) |", "|---|---|---|---|"]
    for system in sorted(runs):
        per = runs[system]
        fr = {rate: slo_fraction(r, slo_ttft_ms, slo_tpot_ms) for rate, r in per.items()}
        g = goodput_rate(fr, target)
        if g["rate"] is None:
            rate = f"< {min(fr):g}" if fr else "-"
        else:
            rate = f">= {g['rate']:g}" if g["above_range"] else f"{g['rate']:g}"
        interp = "-" if g["interpolated"] is None else f"{g['interpolated']:.1f}"
        if g["later_pass"]:
            interp += " (passes again at " + ", ".join(f"{r:g}" for r in g["later_pass"]) + ")"
        cells = []
        for r in sorted(per):
            u = per[r]["summary"]["tokens_per_s_per_user"]["p50"]
            f = fr[r]
            cells.append(f"{r:g}: {'-' if f is None else f'{f:.2f}'}"
                         f" ({'-' if u is None else f'{u:.0f}'})")
        lines.append(f"| {system} | {rate} | {interp} | {'; '.join(cells)} |")
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


def groups(runs: dict[str, dict[float, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Systems by workload prefix: ``sharegpt_mixed`` -> ``sharegpt``; ``mixed`` -> ``""``."""
    out: dict[str, dict[str, Any]] = {}
    for system, per in runs.items():
        prefix = system.rsplit("_", 1)[0] if "_" in system else ""
        out.setdefault(prefix, {})[system] = per
    return out


def plot(runs: dict[str, dict[float, dict[str, Any]]], docs: Path,
         slo_ttft_ms: float | None = None, slo_tpot_ms: float | None = None) -> list[Path]:
    out = []
    for prefix, group in sorted(groups(runs).items()):
        out += _plot_group(group, docs, prefix, slo_ttft_ms, slo_tpot_ms)
    return out


def _plot_group(runs: dict[str, dict[float, dict[str, Any]]], docs: Path, prefix: str,
                slo_ttft_ms: float | None, slo_tpot_ms: float | None) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from disagg.bench.plot import plot_runs

    fig, axes = plt.subplots(1, 4, figsize=(19, 4.2))
    for system in sorted(runs):
        rates = sorted(runs[system])
        s = [runs[system][r]["summary"] for r in rates]
        axes[0].plot(rates, [x["tokens_per_s_per_user"]["p50"] for x in s], "o-", label=system)
        axes[1].plot(rates, [x["ttft_ms"]["p50"] for x in s], "o-", label=f"{system} p50")
        axes[1].plot(rates, [x["ttft_ms"]["p99"] for x in s], "x--", label=f"{system} p99")
        axes[2].plot(rates, [x["itl_ms"]["p99"] for x in s], "o-", label=f"{system} p99")
        axes[2].plot(rates, [x["itl_ms"]["p50"] for x in s], "x--", label=f"{system} p50")
        fr = [slo_fraction(runs[system][r], slo_ttft_ms, slo_tpot_ms) for r in rates]
        axes[3].plot(rates, [float("nan") if f is None else f for f in fr], "o-", label=system)
    axes[0].set(title="tokens/s per user (P50)", xlabel="request rate (req/s)")
    axes[1].set(title="TTFT (ms)", xlabel="request rate (req/s)", yscale="log")
    axes[2].set(title="ITL (ms)", xlabel="request rate (req/s)", yscale="log")
    axes[3].axhline(TARGET, color="grey", ls=":")
    axes[3].set(title="fraction meeting both SLOs", xlabel="request rate (req/s)", ylim=(0, 1.05))
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    shape = (f"{prefix} workload" if prefix else "input 4096 / output 256")
    fig.suptitle(f"Qwen3-8B shape, 2x H200, {shape}: 2 mixed replicas vs 1P1D")
    fig.tight_layout()
    stem = f"_{prefix}" if prefix else ""
    out = [docs / f"serving_vs_rate{stem}.png"]
    fig.savefig(out[0], dpi=90)
    plt.close(fig)
    common = sorted(set.intersection(*(set(v) for v in runs.values()))) if runs else []
    for rate in common:
        path = docs / f"serving_cdf{stem}_r{rate:g}.png"
        plot_runs([runs[s][rate] for s in sorted(runs)], path)
        out.append(path)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("work")
    ap.add_argument("--docs", default=None)
    ap.add_argument("--slo-ttft-ms", type=float, default=None,
                    help="score every run against this TTFT SLO (default: the runs' own)")
    ap.add_argument("--slo-tpot-ms", type=float, default=None,
                    help="score every run against this TPOT SLO (default: the runs' own)")
    args = ap.parse_args()
    runs = load(Path(args.work))
    print(table(runs))
    print()
    print(goodput_table(runs, args.slo_ttft_ms, args.slo_tpot_ms))
    print()
    print(breakdown(runs))
    if args.docs:
        for p in plot(runs, Path(args.docs), args.slo_ttft_ms, args.slo_tpot_ms):
            print("wrote", p)


if __name__ == "__main__":
    main()
