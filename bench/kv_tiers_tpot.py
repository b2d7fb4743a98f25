"""Decode TPOT of other requests while the KV tiers copy (issue 38: "decode TPOT of other
requests unchanged (<= 1.05x) while tiers copy").

STEADY requests decode long outputs (short prompts, ``ignore_eos``) while a background client
sends prompts one after another; the steady streams' time per output token is taken over the
background's span only (tokens that arrived between its first send and its last answer).
Windows, in the order given (``--windows``), on one node:

- ``device``: PREFIXES cached prefixes resent with fresh tokens, each a device hit (no copy);
- ``host``: the same prefixes after FLOOD tokens of other prompts pushed them out of the
  device cache (before the window): each a host hit, reloaded while the steady rows decode;
- ``fresh``: as many prompts of the same lengths never seen (computed whole; on a node with a
  host tier their pages are copied out when they end).

The prompt tokens computed are the same in ``device`` and ``host`` (the fresh tail only), so
their TPOT ratio is what the reloads cost the other requests; ``fresh`` on a node with a host
tier against ``fresh`` on one without (run this twice) is what the copies out cost. Each
hit is checked in the node's Stats (tier_hit_tokens_*).

    python bench/kv_tiers_tpot.py --connect tcp://127.0.0.1:7777 --windows device,host,fresh
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time

from kv_tiers_hit import MIN_ID, tier_tokens  # this directory (run as a script)

from disagg.client import AsyncClient
from disagg.protocol import SamplingParams, TokenChunk

TIERS = ("device", "host", "disk")


async def stream(client: AsyncClient, ids: list[int], max_tokens: int,
                 stamps: list[tuple[float, int]] | None = None) -> float:
    """Send ``ids``; the seconds to the first token. ``stamps``: each chunk's (arrival,
    tokens) appended as it comes."""
    t0 = time.perf_counter()
    first = None
    async for msg in client.generate(prompt_token_ids=ids, sampling=SamplingParams(
            max_tokens=max_tokens, ignore_eos=True), timeout=900):
        if isinstance(msg, TokenChunk) and msg.token_ids:
            now = time.perf_counter()
            if first is None:
                first = now - t0
            if stamps is not None:
                stamps.append((now, len(msg.token_ids)))
    assert first is not None
    return first


def tpot_within(stamps: list[tuple[float, int]], lo: float, hi: float) -> float | None:
    """Seconds per token of one stream over its chunks that arrived within [lo, hi]."""
    inside = [(t, n) for t, n in stamps if lo <= t <= hi]
    if len(inside) < 2:
        return None
    return (inside[-1][0] - inside[0][0]) / sum(n for _, n in inside[1:])


class Bench:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.rng = random.Random(args.seed)
        self.client = AsyncClient(args.connect)
        self.prefixes: list[list[int]] = []

    def tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(MIN_ID, self.args.vocab) for _ in range(n)]

    async def window(self, name: str) -> dict[str, object]:
        a = self.args
        if name == "host":  # push the prefixes out of the device cache first
            for _ in range(max(1, a.flood // a.prefix)):
                await stream(self.client, self.tokens(a.prefix), 1)
        prompts = ([p + self.tokens(a.new) for p in self.prefixes] if name != "fresh"
                   else [self.tokens(a.prefix + a.new) for _ in self.prefixes])
        stamps: list[list[tuple[float, int]]] = [[] for _ in range(a.steady)]
        steady = [asyncio.ensure_future(stream(self.client, self.tokens(a.steady_len),
                                               a.steady_out, s)) for s in stamps]
        while sum(len(s) for s in stamps) < 4 * a.steady:  # every steady row decoding
            await asyncio.sleep(0.01)
        before = await tier_tokens(self.client)
        lo = time.perf_counter()
        ttfts = [await stream(self.client, p, 1) for p in prompts]
        hi = time.perf_counter()
        after = await tier_tokens(self.client)
        await asyncio.gather(*steady)
        done = [s for s in stamps if s and s[-1][0] >= hi]
        if len(done) < a.steady:
            print(f"warning: {name}: {a.steady - len(done)} steady rows ended before the "
                  "background did (raise --steady-out)")
        per_row = [x for s in stamps if (x := tpot_within(s, lo, hi)) is not None]
        got = {t: after[t] - before[t] for t in TIERS}
        if name in ("device", "host") and got[name] < len(prompts) * a.prefix * 9 // 10:
            print(f"warning: the {name} window found {got} tokens by tier")
        return {"tpot_ms_p50": 1e3 * statistics.median(per_row) if per_row else None,
                "tpot_ms_rows": [1e3 * x for x in per_row],
                "background_ttft_ms_p50": 1e3 * statistics.median(ttfts),
                "background_s": hi - lo, "tier_hit_tokens": got}

    async def run(self) -> dict[str, object]:
        a = self.args
        try:
            for _ in range(a.warmup):  # compiles, graphs
                await stream(self.client, self.tokens(a.prefix), 2)
            self.prefixes = [self.tokens(a.prefix) for _ in range(a.prefixes)]
            for p in self.prefixes:  # computed once: cached on the device
                await stream(self.client, p + self.tokens(1), 1)
            out: dict[str, object] = {}
            for name in a.windows.split(","):
                out[name] = await self.window(name)
            return out
        finally:
            await self.client.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--connect", default="tcp://127.0.0.1:7777")
    ap.add_argument("--windows", default="device,host,fresh",
                    help="comma-separated, in order: device, host, fresh")
    ap.add_argument("--steady", type=int, default=16, help="decoding rows measured")
    ap.add_argument("--steady-len", type=int, default=64, help="their prompt tokens")
    ap.add_argument("--steady-out", type=int, default=2048,
                    help="their output tokens (enough to outlast each window's background)")
    ap.add_argument("--prefix", type=int, default=4096, help="tokens of each cached prefix")
    ap.add_argument("--prefixes", type=int, default=8, help="background prompts per window")
    ap.add_argument("--new", type=int, default=16, help="fresh tokens after each prefix")
    ap.add_argument("--flood", type=int, default=65536,
                    help="tokens of other prompts that push the prefixes out of the device "
                         "cache before the host window (more than it holds)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=150000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="write the result here")
    args = ap.parse_args()
    res = asyncio.run(Bench(args).run())
    for name, r in res.items():
        assert isinstance(r, dict)
        tpot = r["tpot_ms_p50"]
        print(f"{name:>6}: steady TPOT p50 {tpot if tpot is None else f'{tpot:.2f}'} ms over "
              f"{r['background_s']:.2f} s of background (its TTFT p50 "
              f"{r['background_ttft_ms_p50']:.1f} ms), tokens by tier {r['tier_hit_tokens']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
