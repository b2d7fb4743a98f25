"""``disagg-bench serve``'s outputs: the printed report and the ``--json`` result."""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
from typing import Any

import msgspec
import numpy as np

from disagg.bench.transport import plain


def format_report(result: dict[str, Any]) -> str:
    s = result["summary"]
    lines = [f"=== disagg-bench serve: {result['label']} ===",
             f"requests: {s['completed']}/{s['num_requests']} completed, {s['failed']} failed"
             + (f" {s['errors']}" if s["errors"] else ""),
             f"duration: {s['duration_s']:.2f} s",
             f"input tokens: {s['total_input_tokens']}  output tokens: {s['total_output_tokens']}",
             f"request throughput: {s['request_throughput']:.2f} req/s",
             f"output throughput: {s['output_throughput']:.1f} tok/s   "
             f"total: {s['total_token_throughput']:.1f} tok/s"]
    if s["goodput"] is not None:
        g = s["goodput"]
        lines.append(f"goodput: {g['request_goodput']:.2f} req/s ({g['good_requests']} good, "
                     f"SLO ttft<={g['slo_ttft_ms']} ms tpot<={g['slo_tpot_ms']} ms)")
    lines.append(f"{'metric':<22}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}")
    for key, name in (("ttft_ms", "TTFT (ms)"), ("tpot_ms", "TPOT (ms)"), ("itl_ms", "ITL (ms)"),
                      ("e2e_ms", "E2E (ms)"), ("tokens_per_s_per_user", "tok/s per user")):
        d = s[key]
        lines.append(f"{name:<22}" + "".join(_fmt(d[k]) for k in ("mean", "p50", "p90", "p99")))
    u = s["tokens_per_s_per_user"]
    if u["count"]:
        lines.append(f"tok/s per user, slowest: p10 {u['p10']:.2f}  p1 {u['p1']:.2f}")
    if s["ttft_breakdown_ms"]:
        lines.append("TTFT breakdown (ms)")
    for phase, d in s["ttft_breakdown_ms"].items():
        lines.append(f"  {phase:<20}" + "".join(_fmt(d[k]) for k in ("mean", "p50", "p90", "p99")))
    if s.get("speculative"):
        sp = s["speculative"]
        lines.append(f"speculative decoding: {sp['accepted_tokens']} of {sp['draft_tokens']} "
                     f"drafted tokens accepted (acceptance rate {sp['acceptance_rate']:.3f})")
    if "multiturn" in s:
        m = s["multiturn"]
        lines.append(f"prefix hit rate: {m['prefix_hit_rate']:.3f} of prompt tokens (node "
                     f"Stats: {m['node_prefix_hit_rate']:.3f}); KV units received per request "
                     f"{m['kv_units_received_per_request']:.1f}")
        tiers = m.get("tier_hit_tokens") or {}
        if any(tiers.values()):
            lines.append("tokens served by tier: " + ", ".join(f"{t} {n}"
                                                               for t, n in tiers.items()))
        later = m.get("later_turns_ttft_ms") or {}
        if later.get("p50") is not None:
            lines.append(f"later turns TTFT p50 {later['p50']:.2f} ms, p90 {later['p90']:.2f} ms")
        lines.append(f"{'turn':<6}{'requests':>9}{'cached':>9}{'TTFT p50':>10}{'vs turn 0':>10}")
        for t, d in m["turns"].items():
            ratio = m["ttft_p50_vs_first_turn"].get(t)
            lines.append(f"{t:<6}{d['requests']:>9}{d['cached_share']:>9.2f}"
                         + _fmt(d["ttft_ms"]["p50"])
                         + (_fmt(ratio) if ratio is not None else f"{'':>10}"))
    return "\n".join(lines)


def _fmt(x: float | None) -> str:
    return f"{'-':>10}" if x is None else f"{x:>10.2f}"


def _json_default(obj: Any) -> Any:
    """What ``json`` can't encode itself: a msgspec Struct (a node's Stats, array_like ones
    included) as an object of its named fields, numpy scalars as numbers."""
    if isinstance(obj, msgspec.Struct):
        return plain(obj)
    if isinstance(obj, np.generic):
        return obj.item()
    return msgspec.to_builtins(obj)  # raises TypeError where it can't either


def result_json(result: dict[str, Any]) -> str:
    """The result as ``--json`` writes it."""
    return json.dumps(result, indent=1, default=_json_default) + "\n"


def write_json(result: dict[str, Any], path: str) -> None:
    """Write the result to ``path`` (``-``: stdout) whole or not at all: it is encoded first,
    then written to a temporary file beside ``path`` and renamed over it."""
    text = result_json(result)
    if path == "-":
        sys.stdout.write(text)
        sys.stdout.flush()
        return
    target = os.path.abspath(path)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(target),
                               prefix=f".{os.path.basename(target)}.", suffix=".tmp")
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.fchmod(fd, 0o666 & ~umask)  # as open() would have made it (mkstemp: 0600)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
