"""Start-up objects frozen out of the cyclic collector (in a child: freezing is process-wide)."""

import os
import subprocess
import sys

CODE = """
import gc
from disagg.gc_tuning import freeze_startup_objects
junk = [[i] for i in range(50_000)]
n = freeze_startup_objects("test")
print(n, gc.get_freeze_count())
"""


def run(env_value, code=CODE, name="DISAGG_GC_FREEZE"):
    env = {name: env_value} if env_value is not None else {}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, **env}, timeout=60, check=True)
    return [int(x) for x in out.stdout.split()]


def test_freeze_moves_live_objects_to_the_permanent_generation():
    n, frozen = run(None)
    assert n == frozen and n > 50_000  # the junk list's 50k lists are among them


def test_freeze_can_be_turned_off():
    assert run("0") == [0, 0]


THRESHOLD_CODE = """
import gc
from disagg.gc_tuning import freeze_startup_objects
before = gc.get_threshold()
freeze_startup_objects("test")
print(*before, *gc.get_threshold())
"""


def test_serving_thresholds_are_set_after_the_freeze_and_can_be_given():
    from disagg.gc_tuning import SERVING_THRESHOLDS

    assert run(None, THRESHOLD_CODE) == [700, 10, 10, *SERVING_THRESHOLDS]
    assert run("1000,5,7", THRESHOLD_CODE, "DISAGG_GC_THRESHOLDS")[3:] == [1000, 5, 7]


def test_bad_thresholds_are_refused_by_name():
    import pytest

    with pytest.raises(subprocess.CalledProcessError) as e:
        subprocess.run([sys.executable, "-c", THRESHOLD_CODE], capture_output=True, text=True,
                       env={**os.environ, "DISAGG_GC_THRESHOLDS": "1,2"}, timeout=60,
                       check=True)
    assert "DISAGG_GC_THRESHOLDS='1,2'" in e.value.stderr


SWITCH_CODE = """
import sys
from disagg.gc_tuning import set_switch_interval
before = sys.getswitchinterval()
print(round(before * 1e6), round((set_switch_interval("test") or 0) * 1e6),
      round(sys.getswitchinterval() * 1e6))
"""


def test_switch_interval_is_left_alone_unless_given_and_bad_values_are_refused_by_name():
    import pytest

    assert run(None, SWITCH_CODE) == [5000, 0, 5000]
    assert run("500", SWITCH_CODE, "DISAGG_SWITCH_INTERVAL_US") == [5000, 500, 500]
    for bad in ("0", "1,2", "fast"):
        with pytest.raises(subprocess.CalledProcessError) as e:
            run(bad, SWITCH_CODE, "DISAGG_SWITCH_INTERVAL_US")
        assert "DISAGG_SWITCH_INTERVAL_US" in e.value.stderr, bad


MALLOC_CODE = """
import ctypes, sys
from disagg.gc_tuning import keep_large_buffers
tuned = keep_large_buffers("test")
buf = bytearray(1 << 20)  # over glibc's default mmap threshold (128 KiB)
addr = ctypes.addressof((ctypes.c_char * 1).from_buffer(buf))
heap = [line.split()[0] for line in open("/proc/self/maps") if line.rstrip().endswith("[heap]")]
lo, hi = (int(x, 16) for x in heap[0].split("-"))
print(int(tuned), int(lo <= addr < hi))
"""


def run_malloc(env_value):
    return run(env_value, MALLOC_CODE, "DISAGG_MALLOC_TUNING")


def test_large_buffers_come_from_the_heap():
    """A 1 MiB block is a fresh mapping under glibc's defaults and a heap block once tuned
    (no page faults to fill it, no munmap to free it)."""
    assert run_malloc(None) == [1, 1]
    assert run_malloc("0") == [0, 0]
