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


def run(env_value):
    env = {"DISAGG_GC_FREEZE": env_value} if env_value is not None else {}
    out = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True,
                         env={**os.environ, **env}, timeout=60, check=True)
    return [int(x) for x in out.stdout.split()]


def test_freeze_moves_live_objects_to_the_permanent_generation():
    n, frozen = run(None)
    assert n == frozen and n > 50_000  # the junk list's 50k lists are among them


def test_freeze_can_be_turned_off():
    assert run("0") == [0, 0]
