"""Running kernel cases under the Triton interpreter in child processes.

An out-of-bounds load segfaults the interpreter, so CPU kernel cases run in a child process
with ``TRITON_INTERPRET=1``: a case module's ``main`` is ``serve(run_case)`` (case ids in as
JSON on stdin, ``{id: {"err": float} | {"error": str}}`` out), and ``run_cases`` runs one in two
workers (one per core), turning a crash into an error for each of the worker's cases.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def _run_worker(worker: Path, ids: list[str], timeout: float) -> dict[str, Any]:
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, str(worker)], input=json.dumps(ids),
                          capture_output=True, text=True, env=env, timeout=timeout)
    if proc.returncode != 0:
        crash = f"worker exited {proc.returncode}: {proc.stderr[-2000:]}"
        return {cid: {"error": crash} for cid in ids}
    return dict(json.loads(proc.stdout))


def run_cases(worker: Path, ids: list[str], timeout: float = 600) -> dict[str, Any]:
    """Every case of ``worker`` (a case module) over two interpreter processes."""
    with ThreadPoolExecutor(2) as pool:
        parts = list(pool.map(lambda half: _run_worker(worker, half, timeout),
                              [ids[0::2], ids[1::2]]))
    return {k: v for part in parts for k, v in part.items()}


def serve(run_case: Callable[[str], float]) -> None:
    """A case module's ``main``: run the case ids read from stdin, print the results."""
    ids = json.load(sys.stdin)
    results: dict[str, dict[str, Any]] = {}
    for cid in ids:
        try:
            results[cid] = {"err": run_case(cid)}
        except Exception as e:  # report per case; a segfault still kills the whole worker
            results[cid] = {"error": f"{type(e).__name__}: {e}"}
    json.dump(results, sys.stdout)
