"""Report Triton compilations after a process said it was ready (nothing should compile then:
a compile stalls the step that needs it by 0.5-2 s on an H200).

``arm(where)`` installs Triton's post-compile hook (``triton.knobs.runtime``); every kernel
compiled or loaded into the in-memory cache from then on is logged as a warning naming the
kernel and its specialization, and counted (``compiled_after_ready``). Serving code warms every
variant it can need before arming (``ModelRunner.warm_prefill``, the decode graphs,
``gather_copy.warm``); the GPU tests read the logs.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)

compiled_after_ready = 0


def arm(where: str) -> bool:
    """Start reporting compilations in this process; False when Triton has no hook here."""
    try:
        from triton import knobs
    except ImportError:
        return False
    runtime = getattr(knobs, "runtime", None)
    if runtime is None or not hasattr(runtime, "jit_post_compile_hook"):
        return False

    def hook(*args: Any, **kwargs: Any) -> None:
        global compiled_after_ready
        compiled_after_ready += 1
        log.warning("Triton compiled %s after %s was ready", kwargs.get("repr") or
                    kwargs.get("fn"), where)

    runtime.jit_post_compile_hook = hook
    return True
