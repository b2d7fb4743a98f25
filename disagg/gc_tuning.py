"""Keep Python's cyclic garbage collector out of the serving loop's way.

After start-up a node and its executors hold hundreds of thousands of long-lived objects
(torch, the model, tokenizer tables). A full (generation 2) collection walks all of them, a
pause of several to tens of milliseconds, right inside a decode step or a token send: it shows
up as inter-token-latency spikes. ``freeze_startup_objects`` moves everything alive at the end
of start-up to the permanent generation (``gc.freeze``), so later collections only walk what
serving allocates. Set ``DISAGG_GC_FREEZE=0`` to leave the collector as it is.

The same goes for glibc's allocator: it serves every block over its mmap threshold (128 KiB
at first) from a fresh ``mmap`` and returns it with ``munmap``, so each copy of a long
prompt's message (the scheduler's encoding, the socket's copy, the peer request) pays page
faults on the way in and a TLB shootdown on the way out: 89 us to allocate, fill and free
140 KB where reused heap memory takes 7 us (32k-token prompts). ``keep_large_buffers``
raises the mmap threshold to its ceiling (32 MiB) and the trim threshold to 128 MiB, so such
buffers come from, and go back to, the heap. Set ``DISAGG_MALLOC_TUNING=0`` to leave glibc's
defaults.

And the interpreter's thread switch: a thread that wants the GIL waits up to
``sys.getswitchinterval()`` (5 ms) while another runs Python, so a grammar pass's threads
(``disagg.engine.grammar_pass``), back from an xgrammar call while the event loop is busy, can
stall a constrained step by that much. ``set_switch_interval`` applies
``DISAGG_SWITCH_INTERVAL_US`` (microseconds) to the node process; unset leaves Python's
default (500 us did not shorten the JSON-schema TPOT on an H200: docs/NOTES.md).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import logging
import sys
import time

from disagg.config import env, env_ints

log = logging.getLogger(__name__)


def freeze_startup_objects(who: str) -> int:
    """Collect once, freeze what survives and set the serving thresholds
    (``serving_thresholds``); returns the objects frozen (0 when disabled: the collector is
    then left as it is)."""
    if env("GC_FREEZE", "1") == "0":
        return 0
    t0 = time.perf_counter()
    gc.collect()
    gc.freeze()
    gc.set_threshold(*serving_thresholds())
    n = gc.get_freeze_count()
    log.info("%s: froze %d start-up objects out of the collector's way (%.0f ms)", who, n,
             1e3 * (time.perf_counter() - t0))
    return n


# the collector's thresholds while serving (``gc.set_threshold``): a generation-0 run every
# 50,000 net allocations of tracked objects rather than 700 (CPython's default), so a request's
# objects are mostly freed by their reference counts before a collection promotes them: each
# promotion counts toward the next full collection
SERVING_THRESHOLDS = (50_000, 20, 100)


def serving_thresholds() -> tuple[int, int, int]:
    """``SERVING_THRESHOLDS``, or ``DISAGG_GC_THRESHOLDS=g0,g1,g2``."""
    given = env_ints("GC_THRESHOLDS", 3, "three integers g0,g1,g2, each >= 0")
    if given is None:
        return SERVING_THRESHOLDS
    if min(given) < 0:
        raise ValueError(f"DISAGG_GC_THRESHOLDS={env('GC_THRESHOLDS')!r}: thresholds are >= 0")
    g0, g1, g2 = given
    return g0, g1, g2


M_TRIM_THRESHOLD = -1  # glibc mallopt parameters (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # glibc's ceiling on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX)
TRIM_THRESHOLD = 128 << 20


def keep_large_buffers(who: str) -> bool:
    """Serve large blocks (up to 32 MiB) from the heap and keep up to 128 MiB of free heap
    (glibc ``mallopt``); False where it does not apply (another libc, or disabled)."""
    if env("MALLOC_TUNING", "1") == "0":
        return False
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):  # no glibc (musl, macOS)
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    ok = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) and mallopt(M_TRIM_THRESHOLD,
                                                                     TRIM_THRESHOLD))
    log.info("%s: large buffers %s", who, "kept on the heap" if ok else "left to glibc (mallopt failed)")
    return ok


def set_switch_interval(who: str) -> float | None:
    """Set the interpreter's thread switch interval from ``DISAGG_SWITCH_INTERVAL_US``
    (an integer, 50 to 100000 microseconds); returns it in seconds, None when unset."""
    given = env_ints("SWITCH_INTERVAL_US", 1, "an integer number of microseconds")
    if given is None:
        return None
    (us,) = given
    if not 50 <= us <= 100_000:
        raise ValueError(f"DISAGG_SWITCH_INTERVAL_US={us}: want 50 to 100000 (Python's "
                         "default is 5000)")
    sys.setswitchinterval(us / 1e6)
    log.info("%s: thread switch interval %d us", who, us)
    return us / 1e6
