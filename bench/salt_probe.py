"""The prefix-cache oracle as an attacker sees it (docs/SECURITY.md, "Prefix-cache isolation"):
time to first token and ``cached_tokens`` of tenant B probing the prompt tenant A just had
cached (another ``cache_salt``), of B's fresh prompt of the same length, and of A's repeat.
A mixed node with the tiny test model on CPU; with salts the probe costs what a fresh prompt
costs and finds 0 cached tokens.

    .venv/bin/python bench/salt_probe.py [--tokens 2048] [--rounds 12]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from disagg.client import Client  # noqa: E402
from disagg.protocol import Finished  # noqa: E402
from nodes import greedy, node, prompt, running  # noqa: E402
from tinymodels import make_tiny_model  # noqa: E402


def ttft(c: Client, ids: list[int], salt: str) -> tuple[float, int]:
    """(ms to the first reply, cached_tokens) of a one-token request."""
    t0 = time.perf_counter()
    first = None
    for msg in c.generate(prompt_token_ids=ids, sampling=greedy(1), cache_salt=salt,
                          timeout=120):
        first = first if first is not None else time.perf_counter() - t0
        if isinstance(msg, Finished):
            return 1000 * first, msg.usage.cached_tokens
    raise RuntimeError("no Finished")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=12, help="the first two are warm-up")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="salt_probe"))
    model = make_tiny_model("llama", tmp / "llama", max_position_embeddings=4096)
    addr, proc = node("mixed", model, tmp, "--num-pages", "4096", "--max-model-len", "4096",
                      "--max-batch-tokens", "4096")
    rows: dict[str, list[tuple[float, int]]] = {"A's repeat": [], "B probes A's prompt": [],
                                                "B's fresh prompt": []}
    with running([proc]):
        c = Client(addr)
        try:
            for i in range(args.rounds):
                secret = prompt(args.tokens, salt=1000 + i)
                ttft(c, secret, "tenant-a")  # cached for A
                rows["A's repeat"].append(ttft(c, secret, "tenant-a"))
                rows["B probes A's prompt"].append(ttft(c, secret, f"tenant-b{i}"))
                rows["B's fresh prompt"].append(ttft(c, prompt(args.tokens, salt=5000 + i),
                                                     f"tenant-b{i}"))
        finally:
            c.close()
    for name, got in rows.items():
        ms = [t for t, _ in got[2:]]
        print(f"{name:20s} TTFT median {statistics.median(ms):7.1f} ms (min {min(ms):.1f}, "
              f"max {max(ms):.1f}), cached_tokens {sorted({n for _, n in got})}")


if __name__ == "__main__":
    main()
