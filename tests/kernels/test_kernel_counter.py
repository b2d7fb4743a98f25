"""The CPU layer counter across two processes: the bumping side creates, the reader attaches."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from disagg.kernels.counter import LayerCounter, _shm_path

ROOT = Path(__file__).resolve().parents[2]

# The "executor": creates the counter, prints its handle, then bumps on each stdin line.
CHILD = textwrap.dedent(
    """
    import sys
    from disagg.kernels.counter import LayerCounter

    counter = LayerCounter.create("cpu")
    print(counter.handle(), flush=True)
    for line in sys.stdin:
        base, value = map(int, line.split())
        counter.set_base(base)
        counter.bump(value)
        print("ok", flush=True)
    counter.close()
    """
)


def test_counter_read_from_another_process() -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert child.stdin is not None and child.stdout is not None
    try:
        handle = child.stdout.readline().strip()
        reader = LayerCounter.attach(handle)
        assert reader.read() == 0
        seen = []
        for layer in range(1, 4):  # step 1 of a 3-layer model: base = step * (layers + 1)
            child.stdin.write(f"4 {layer}\n")
            child.stdin.flush()
            assert child.stdout.readline().strip() == "ok"
            seen.append(reader.read())
        assert seen == [5, 6, 7]
        reader.close()
    finally:
        child.stdin.close()
        assert child.wait(timeout=30) == 0
    assert not os.path.exists(_shm_path(handle)), "the creator removes the counter file on close"


def test_counter_same_process_and_errors() -> None:
    with LayerCounter.create("cpu") as counter:
        counter.set_base(10)
        counter.bump(0)
        assert counter.read() == 10
        counter.bump(3)
        assert counter.read() == 13
        assert int(counter.base[0]) == 10
    with pytest.raises(FileNotFoundError):
        LayerCounter.attach("disagg-layer-counter-does-not-exist")
