"""A process whose pid a killed process had once can still open shm endpoints: the killed
one's leftover region of the same name (``/dev/shm/<pid>:0:0``) made ``fi_enable`` fail with
EBUSY (seen as a node that could not start on a busy host)."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.fabric

SCRIPT = r"""
import os
from disagg.fabric import lib

stale = f"/dev/shm/{os.getpid()}:0:0"
open(stale, "wb").close()  # what a killed process with this pid left behind
info = lib.discover("shm", None)
fabric = lib.Fabric(info)
domain = lib.Domain(fabric)
ep = lib.Endpoint(domain, lib.CompletionQueue(domain), lib.AddressVector(domain))
second = lib.Endpoint(domain, lib.CompletionQueue(domain), lib.AddressVector(domain))
assert ep.name() != second.name()  # the first one's region is not removed by the second
assert os.path.exists(f"/dev/shm/{os.getpid()}:0:0")
print("opened", ep.name())
"""


def test_an_shm_endpoint_opens_over_a_dead_processs_region() -> None:
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "opened" in proc.stdout
