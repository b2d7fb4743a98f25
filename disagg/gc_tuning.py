"""Keep Python's cyclic garbage collector out of the serving loop's way.

After start-up a node and its executors hold hundreds of thousands of long-lived objects
(torch, the model, tokenizer tables). A full (generation 2) collection walks all of them, a
pause of several to tens of milliseconds, right inside a decode step or a token send: it shows
up as inter-token-latency spikes. ``freeze_startup_objects`` moves everything alive at the end
of start-up to the permanent generation (``gc.freeze``), so later collections only walk what
serving allocates. Set ``DISAGG_GC_FREEZE=0`` to leave the collector as it is.
"""

from __future__ import annotations

import gc
import logging
import os
import time

log = logging.getLogger(__name__)


def freeze_startup_objects(who: str) -> int:
    """Collect once, then freeze what survives; returns the objects frozen (0 when disabled)."""
    if os.environ.get("DISAGG_GC_FREEZE", "1") == "0":
        return 0
    t0 = time.perf_counter()
    gc.collect()
    gc.freeze()
    n = gc.get_freeze_count()
    log.info("%s: froze %d start-up objects out of the collector's way (%.0f ms)", who, n,
             1e3 * (time.perf_counter() - t0))
    return n
