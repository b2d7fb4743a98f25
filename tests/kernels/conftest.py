"""Fixtures for kernel tests: the Triton interpreter runs in a subprocess.

An out-of-bounds load segfaults the interpreter, so the CPU kernel cases run in a child process
with ``TRITON_INTERPRET=1``; the parent turns its JSON answer (or its crash) into test results.
All cases run in two workers (one per core) once per session.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
WORKER = HERE / "kernel_cases.py"


def _run_worker(ids: list[str]) -> dict[str, Any]:
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run(
        [sys.executable, str(WORKER)],
        input=json.dumps(ids),
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    if proc.returncode != 0:
        crash = f"worker exited {proc.returncode}: {proc.stderr[-2000:]}"
        return {cid: {"error": crash} for cid in ids}
    return json.loads(proc.stdout)


@pytest.fixture(scope="session")
def interp_results() -> dict[str, Any]:
    pytest.importorskip("triton")
    sys.path.insert(0, str(HERE))
    from kernel_cases import all_cases

    ids = all_cases()
    halves = [ids[0::2], ids[1::2]]
    with ThreadPoolExecutor(2) as pool:
        parts = list(pool.map(_run_worker, halves))
    return {k: v for part in parts for k, v in part.items()}
