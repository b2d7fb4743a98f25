"""The HTTP gateway's bounds, as pure values and functions (no sockets, no asyncio).

``HttpLimits`` holds the gateway's flags: how many connections it keeps open, how long a client
may take to send a request head (also the idle keep-alive time) and its body, how long a
response may wait for a client that reads nothing, how large a body may be and how many body
bytes all connections may buffer together.

``connection_cap`` derives the number of HTTP connections from the process's file-descriptor
limit so that, whatever HTTP clients do, descriptors remain for the client protocol's ZeroMQ
socket, peers and executor restarts (``fd_reserve`` of them). ``raise_nofile_limit`` lifts the
soft limit to the hard one at start (the only side effect here). ``pick_victim`` chooses which
connection to close when the cap is reached; ``BodyBudget`` counts the body bytes buffered.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence

import msgspec

log = logging.getLogger(__name__)

MIN_CONNECTIONS = 8  # however small the fd table, the gateway keeps this many


class HttpLimits(msgspec.Struct, frozen=True):
    """``--http-max-connections``, ``--http-header-timeout``, ``--http-body-timeout``,
    ``--http-write-timeout``, ``--http-body-buffer-mb`` (bytes here), ``--max-n``,
    ``--default-max-tokens``, ``--tenant-header``, and the body limit."""

    max_connections: int = 1024
    header_timeout_s: float = 15.0  # connection open / previous response -> complete head
    body_timeout_s: float = 30.0  # complete head -> complete body
    write_timeout_s: float = 30.0  # a write (SSE chunk, response) the client does not take
    max_body_bytes: int = 8 << 20
    body_buffer_bytes: int = 256 << 20  # all bodies being read, together
    max_n: int = 16  # --max-n: choices per request (n) at most, times its prompts
    # --default-max-tokens: a chat request's output cap when it names none (0: up to the context
    # limit, as OpenAI's API does); a request's own max_tokens is never lowered by it
    default_max_tokens: int = 1024
    # --tenant-header: the header naming a request's tenant (disagg.serving.tenants); empty:
    # the API key's id (Authorization: Bearer), if any
    tenant_header: str = ""

    def validate(self) -> HttpLimits:
        if self.max_connections < 1:
            raise ValueError("--http-max-connections must be >= 1")
        for name, v in (("--http-header-timeout", self.header_timeout_s),
                        ("--http-body-timeout", self.body_timeout_s),
                        ("--http-write-timeout", self.write_timeout_s)):
            if not v > 0 or v != v or v == float("inf"):
                raise ValueError(f"{name} must be a finite number of seconds > 0")
        if self.max_n < 1:
            raise ValueError("--max-n must be >= 1")
        if self.default_max_tokens < 0:
            raise ValueError("--default-max-tokens must be >= 0 (0: up to the context limit)")
        if self.max_body_bytes < 1:
            raise ValueError("the body limit must be >= 1 byte")
        if self.body_buffer_bytes < self.max_body_bytes:
            raise ValueError(f"--http-body-buffer-mb must hold at least one body "
                             f"({self.max_body_bytes} bytes)")
        return self


def fd_reserve(soft_limit: int) -> int:
    """Descriptors HTTP never takes: half the table, at least 256 (ZeroMQ clients, peers, an
    executor restart's pipes and sockets, the model's files)."""
    return max(256, soft_limit // 2)


def connection_cap(wanted: int, soft_limit: int, fds_open: int) -> int:
    """At most ``wanted`` connections, and no more than leaves ``fd_reserve`` descriptors free
    beyond the ``fds_open`` ones already in use (never fewer than ``MIN_CONNECTIONS``)."""
    room = soft_limit - fds_open - fd_reserve(soft_limit)
    return max(MIN_CONNECTIONS, min(wanted, room))


def pick_victim(idle: Sequence[bool], cap: int) -> tuple[bool, int | None]:
    """A new connection arrives while connections are open, oldest first, ``idle[i]`` telling
    whether the i-th has no request in progress (it waits for, or is in the middle of, a
    request head): (admit the newcomer?, the index of the one to close first). Under the cap:
    admit, close nothing. At the cap: close the oldest idle one and admit; with none idle,
    refuse the newcomer."""
    if len(idle) < cap:
        return True, None
    for i, free in enumerate(idle):
        if free:
            return True, i
    return False, None


class BodyBudget:
    """Body bytes buffered by every connection together, at most ``total``."""

    def __init__(self, total: int):
        self.total = total
        self.used = 0

    def take(self, n: int) -> bool:
        if n < 0 or self.used + n > self.total:
            return False
        self.used += n
        return True

    def give(self, n: int) -> None:
        self.used -= n
        assert self.used >= 0, "gave back more body bytes than taken"


def open_fds() -> int:
    """Descriptors this process has open now (Linux ``/proc``; 0 where unknown)."""
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return 0


def nofile_limit() -> int:
    import resource

    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def raise_nofile_limit() -> tuple[int, int]:
    """Lift RLIMIT_NOFILE's soft limit to the hard one where allowed; returns (soft, hard)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError) as e:  # e.g. macOS's OPEN_MAX: keep the soft one
            log.debug("could not raise the fd limit %d -> %d: %s", soft, hard, e)
    return soft, hard
