"""Start phases (disagg.engine.start_phases): timed and merged over executors, ordered as a
start passes them, and a child's spawn told apart from its imports by the kernel's start time."""

from __future__ import annotations

import subprocess
import sys

import pytest

from disagg.engine.start_phases import (
    PHASES,
    StartPhases,
    boot_clock,
    process_started_at,
    spawn_and_imports,
)


def test_phases_add_up_and_come_in_start_order():
    now = [0.0]
    p = StartPhases(clock=lambda: now[0])
    with p.phase("weights"):
        now[0] += 2.5
    p.add("spawn", 0.04)
    p.add("weights", 0.5)  # a phase timed twice adds up
    p.add("something_else", 1.0)
    assert p.ordered() == {"spawn": 0.04, "weights": 3.0, "something_else": 1.0}
    assert p.line() == "spawn 0.04 s, weights 3.00 s, something_else 1.00 s"


def test_merged_ranks_count_the_slowest_rank_of_each_phase():
    p = StartPhases()
    p.merge([{"weights": 3.0, "kv_alloc": 0.2}, {"weights": 2.0, "kv_alloc": 0.4}, {}])
    assert p.ordered() == {"weights": 3.0, "kv_alloc": 0.4}
    assert PHASES.index("weights") < PHASES.index("kv_alloc")


def test_spawn_and_imports_split_at_the_child_start_time():
    assert spawn_and_imports(10.0, 10.05, 13.0) == pytest.approx({"spawn": 0.05, "imports": 2.95})
    # the kernel floors its start time to a tick: a start just before the spawn is the spawn
    assert spawn_and_imports(10.0, 9.99, 13.0) == {"spawn": 0.0, "imports": 3.0}
    assert spawn_and_imports(10.0, None, 13.0) == {"spawn": 0.0, "imports": 3.0}


def test_a_child_start_time_lies_between_its_spawn_and_now():
    spawned = boot_clock()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(5)"])
    try:
        started = process_started_at(child.pid)
        assert started is not None
        assert spawned - 0.05 <= started <= boot_clock()
        own = process_started_at()
        assert own is not None and own < spawned
    finally:
        child.kill()
        child.wait(10)
