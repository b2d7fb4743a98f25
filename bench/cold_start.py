"""Cold start to ``ready`` (issue 39 item 3): a Qwen3-8B-shaped mixed node (random weights,
config.json only, CUDA graphs) started twice on the same caches, its executor killed once.

1. cold: Triton's cache an empty directory of a fresh temp dir (``TRITON_CACHE_DIR``);
2. restart: the cold node's executor SIGKILLed once ready, timed to the node's next ``ready``;
3. warm: a new node on the same caches.

Each start's wall time (spawn of ``python -m disagg`` -> its ``ready`` line; for the restart:
the kill -> the second ``ready``), the node's own ``start phases`` line and its Stats'
``start_phases_s`` are printed and written to ``OUT_DIR/cold_start.json`` with the node logs.

    python bench/cold_start.py OUT_DIR                     # H200: about 1.5-2 minutes
    python bench/cold_start.py OUT_DIR --tiny --devices cpu  # a dry run of the script
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from experiment_engine import QWEN3_8B  # noqa: E402 - bench/ is not a package

TINY = {**QWEN3_8B, "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16}
PHASES = re.compile(r"start phases: (.*) \(([\d.]+) s in all\)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def parse_phases(line: str) -> dict[str, float]:
    """``node_setup 0.31 s, spawn 0.02 s, ...`` -> {name: seconds}."""
    out = {}
    for part in line.split(", "):
        name, seconds, _ = part.rsplit(" ", 2)
        out[name] = float(seconds)
    return out


def wait_line(log: Path, pattern: str, count: int, proc: subprocess.Popen, timeout: float
              ) -> list[str]:
    """Until ``log`` holds ``count`` lines with ``pattern``; those lines."""
    deadline = time.monotonic() + timeout
    while True:
        lines = [x for x in log.read_text().splitlines() if pattern in x]
        if len(lines) >= count:
            return lines
        if proc.poll() is not None:
            raise RuntimeError(f"the node exited:\n{log.read_text()[-3000:]}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {pattern!r} #{count} in {timeout:.0f} s:\n"
                               f"{log.read_text()[-3000:]}")
        time.sleep(0.05)


def children(pid: int) -> list[int]:
    out = []
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            if f"\nPPid:\t{pid}\n" in status.read_text():
                out.append(int(status.parent.name))
        except OSError:
            continue
    return out


def stats_phases(addr: str) -> dict[str, float]:
    from disagg.client import Client

    client = Client(addr)
    try:
        return dict(client.stats(timeout=30).start_phases_s)
    finally:
        client.close()


def start(args: argparse.Namespace, model: Path, log: Path, env: dict[str, str],
          kill_executor: bool) -> dict:
    addr = f"tcp://127.0.0.1:{free_port()}"
    cmd = [sys.executable, "-m", "disagg", "--role", "mixed", "--model", str(model),
           "--random-weights", "--seed", "0", "--devices", args.devices, "--listen", addr,
           "--startup-timeout", "400", *args.node_args.split()]
    t0 = time.monotonic()
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        wait_line(log, "ready: ", 1, proc, args.timeout)
        res: dict = {"wall_s": round(time.monotonic() - t0, 2)}
        line = [x for x in log.read_text().splitlines() if "start phases: " in x][-1]
        m = PHASES.search(line)
        assert m is not None, line
        res["node_s"], res["phases"] = float(m.group(2)), parse_phases(m.group(1))
        res["stats_phases"] = stats_phases(addr)
        if kill_executor:
            (kid,) = children(proc.pid)
            t1 = time.monotonic()
            os.kill(kid, signal.SIGKILL)
            wait_line(log, "ready: ", 2, proc, args.timeout)
            line = [x for x in log.read_text().splitlines() if "start phases: " in x][-1]
            m = PHASES.search(line)
            assert m is not None, line
            res["restart"] = {"wall_s": round(time.monotonic() - t1, 2),
                              "node_s": float(m.group(2)), "phases": parse_phases(m.group(1)),
                              "stats_phases": stats_phases(addr)}
        return res
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def table(results: dict) -> str:
    runs = {"cold": results["cold"], "restart": results["cold"]["restart"],
            "warm": results["warm"]}
    names: list[str] = []
    for r in runs.values():
        names += [n for n in r["phases"] if n not in names]
    rows = [f"{'phase':<16}" + "".join(f"{k:>10}" for k in runs)]
    rows += [f"{n:<16}" + "".join(f"{r['phases'].get(n, 0.0):>10.2f}" for r in runs.values())
             for n in names]
    rows.append(f"{'node clock':<16}" + "".join(f"{r['node_s']:>10.1f}" for r in runs.values()))
    rows.append(f"{'wall':<16}" + "".join(f"{r['wall_s']:>10.1f}" for r in runs.values()))
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--devices", default="cuda:0")
    ap.add_argument("--tiny", action="store_true", help="a tiny model (dry run)")
    ap.add_argument("--node-args", default="--dtype bfloat16 --page-size 16 "
                    "--max-model-len 4096", help="more disagg-node flags (one string)")
    ap.add_argument("--timeout", type=float, default=300.0, help="per start, seconds")
    args = ap.parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="cold-start-") as tmp:
        model = Path(tmp, "model")
        model.mkdir()
        (model / "config.json").write_text(json.dumps(TINY if args.tiny else QWEN3_8B))
        cache = Path(tmp, "triton")  # empty: a cold start compiles every kernel
        env = {**os.environ, "TRITON_CACHE_DIR": str(cache)}
        results = {"devices": args.devices, "node_args": args.node_args, "tiny": args.tiny}
        results["cold"] = start(args, model, args.out_dir / "cold.log", env, True)
        results["warm"] = start(args, model, args.out_dir / "warm.log", env, False)
        results["triton_cache_files"] = sum(1 for p in cache.rglob("*") if p.is_file())
    print(table(results))
    (args.out_dir / "cold_start.json").write_text(json.dumps(results, indent=1))
    print(f"wrote {args.out_dir / 'cold_start.json'}")


if __name__ == "__main__":
    main()
