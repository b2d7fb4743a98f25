"""Hop marks: when a request passed each point of the remote-prefill path, across processes.

Off (one ``None`` test per mark) unless ``DISAGG_TRACE`` names a directory at import: then every
process appends ``<time> <event> <key> [value]`` lines to ``DIR/<pid>.trace``, one ``os.write`` per mark
on an ``O_APPEND`` descriptor (nothing buffered, so a killed node loses nothing). ``time`` is
``time.monotonic()``, one clock for every process of a host, so the marks of a prefill and a
decode node on one machine line up. ``key`` is the decoder's attempt id (``slot.attempt``)
where the code knows it, else the transfer key (``imm``); ``link`` marks join the two.
``bench/tail_trace.py`` turns the files into per-hop times (the TTFT tail, issue 18).
"""

from __future__ import annotations

import os
import time

_fd: int | None = None


def enable(directory: str) -> None:
    global _fd
    os.makedirs(directory, exist_ok=True)
    _fd = os.open(os.path.join(directory, f"{os.getpid()}.trace"),
                  os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)


def enabled() -> bool:
    return _fd is not None


def mark(event: str, *key: object, value: object = "", at: float | None = None) -> None:
    """Record that the key (its parts joined, so that a caller on a hot path builds no string
    while tracing is off) passed ``event`` now (or at monotonic time ``at``), with an optional
    ``value`` (a no-op unless tracing is on)."""
    if _fd is not None:
        t = time.monotonic() if at is None else at
        os.write(_fd, f"{t:.6f} {event} {''.join(map(str, key))} {value}\n".encode())


if os.environ.get("DISAGG_TRACE"):
    enable(os.environ["DISAGG_TRACE"])
