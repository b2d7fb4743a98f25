"""Fixtures for kernel tests: the Triton interpreter runs in a subprocess.

An out-of-bounds load segfaults the interpreter, so the CPU kernel cases run in a child process
with ``TRITON_INTERPRET=1``; the parent turns its JSON answer (or its crash) into test results.
All cases run in two workers (one per core) once per session.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent
WORKER = HERE / "kernel_cases.py"


@pytest.fixture(scope="session")
def interp_results() -> dict[str, Any]:
    pytest.importorskip("triton")
    sys.path.insert(0, str(HERE))
    from interp import run_cases
    from kernel_cases import all_cases

    return run_cases(WORKER, all_cases())
