"""TTFT of a prefix hit by tier (issue 38, "a 4k-token host hit costs <= 1.3x a device hit"):
on a node with a host tier (--kv-host-cache-mb), a PREFIX-token prompt is computed once, then
resent with NEW fresh tokens while its pages are on the device (a device hit), then again
after prompts of FLOOD_TOKENS in total pushed them out of the device cache (a host hit). Each
hit is checked in the node's Stats (tier_hit_tokens_*). Prints the medians and their ratio;
--json writes every sample.

    python bench/kv_tiers_hit.py --connect tcp://127.0.0.1:7777 --prefix 4096 --flood 65536
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time

from disagg.client import AsyncClient
from disagg.protocol import SamplingParams, TokenChunk

MIN_ID = 10


async def ttft(client: AsyncClient, ids: list[int], max_tokens: int = 2) -> float:
    """Seconds from sending ``ids`` to the first token."""
    t0 = time.perf_counter()
    first = None
    async for msg in client.generate(prompt_token_ids=ids, sampling=SamplingParams(
            max_tokens=max_tokens, ignore_eos=True), timeout=300):
        if first is None and isinstance(msg, TokenChunk) and msg.token_ids:
            first = time.perf_counter() - t0
    assert first is not None
    return first


async def tier_tokens(client: AsyncClient) -> dict[str, int]:
    s = await client.stats()
    return {t: getattr(s, f"tier_hit_tokens_{t}") for t in ("device", "host", "disk")}


async def run(args: argparse.Namespace) -> dict[str, object]:
    rng = random.Random(args.seed)
    client = AsyncClient(args.connect)
    samples: dict[str, list[float]] = {"device": [], "host": []}
    try:
        for _ in range(args.warmup):  # compiles, graphs
            await ttft(client, [rng.randrange(MIN_ID, args.vocab) for _ in range(args.prefix)])
        for _ in range(args.repeats):
            prefix = [rng.randrange(MIN_ID, args.vocab) for _ in range(args.prefix)]
            await ttft(client, prefix + [rng.randrange(MIN_ID, args.vocab)])  # computed once
            for tier in ("device", "host"):
                if tier == "host":  # push the prefix out of the device cache
                    for _ in range(max(1, args.flood // args.prefix)):
                        await ttft(client, [rng.randrange(MIN_ID, args.vocab)
                                            for _ in range(args.prefix)], max_tokens=1)
                before = await tier_tokens(client)
                fresh = [rng.randrange(MIN_ID, args.vocab) for _ in range(args.new)]
                samples[tier].append(await ttft(client, prefix + fresh))
                after = await tier_tokens(client)
                got = {t: after[t] - before[t] for t in after}
                if got[tier] < args.prefix * 9 // 10:
                    print(f"warning: the {tier} hit found {got} tokens by tier "
                          f"(--flood too small or the host tier off?)")
    finally:
        await client.close()
    med = {t: 1e3 * statistics.median(v) for t, v in samples.items() if v}
    return {"prefix": args.prefix, "new": args.new, "ttft_ms_p50": med,
            "host_over_device": med["host"] / med["device"] if med.get("device") else None,
            "samples_ms": {t: [1e3 * x for x in v] for t, v in samples.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--connect", default="tcp://127.0.0.1:7777")
    ap.add_argument("--prefix", type=int, default=4096, help="cached prefix tokens")
    ap.add_argument("--new", type=int, default=16, help="fresh tokens after the prefix")
    ap.add_argument("--flood", type=int, default=65536,
                    help="tokens of other prompts that push the prefix out of the device cache "
                         "(more than it holds)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=150000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="write the result here")
    args = ap.parse_args()
    res = asyncio.run(run(args))
    med = res["ttft_ms_p50"]
    assert isinstance(med, dict)
    print(f"{args.prefix}-token prefix hit, TTFT p50: device {med.get('device', 0):.2f} ms, "
          f"host {med.get('host', 0):.2f} ms (host/device {res['host_over_device']:.2f}x)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
