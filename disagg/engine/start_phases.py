"""Where a node's start goes: named phases and their seconds, logged before ``ready`` and kept in
``Stats.start_phases_s``.

The executor process times its own phases (``PHASES``: its spawn and imports from the kernel's
record of when it started, then each step of ``serve``) and hands them over in
``ExecutorReady.phases``; the node adds its own (``node_setup``, ``executor_wait``,
``node_actors``) and, with several executors, the slowest rank's value of each phase.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator

# every phase a start may report, in the order a start passes them (README: Stats.start_phases_s)
PHASES = (
    "node_setup",  # main process: model directory, config, sockets, before any executor spawns
    "spawn",  # the executor's fork + exec (main's Popen -> the kernel's start time of the child)
    "imports",  # the executor's interpreter start and module imports (torch, triton, disagg)
    "cuda_init",  # device selection, CUDA context, tensor-parallel rendezvous
    "weights",  # weights loaded or drawn (random), draft model included
    "triton_warmup",  # CUDA: Triton kernels compiled several at a time (scratch KV; engine/warmup)
    "kv_profile",  # CUDA: the profiling step that sizes the KV pool (--num-pages 0)
    "kv_alloc",  # the KV pool allocated (and its fd handed to the main process)
    "graph_capture",  # CUDA: decode CUDA graphs captured (their eager warm-up steps included)
    "warm_eager",  # CUDA: eager decode launch shapes and prefill steps warmed (compiles left over)
    "executor_wait",  # main: the executors spawned -> every handshake in (contains the above)
    "node_actors",  # main: scheduler, messenger, frontend, the KV tiers started
)


class StartPhases:
    """Seconds per named phase; a phase timed twice adds up."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        t0 = self.clock()
        try:
            yield
        finally:
            self.add(name, self.clock() - t0)

    def add(self, name: str, seconds: float) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + max(0.0, seconds)

    def merge(self, ranks: list[dict[str, float]]) -> None:
        """Add every rank's phases, each the slowest rank's value (the start waits for it)."""
        names = {n for r in ranks for n in r}
        for name in names:
            self.add(name, max(r.get(name, 0.0) for r in ranks))

    def ordered(self) -> dict[str, float]:
        """The phases in ``PHASES`` order (others after, by name), rounded to milliseconds."""
        rank = {n: i for i, n in enumerate(PHASES)}
        names = sorted(self.seconds, key=lambda n: (rank.get(n, len(PHASES)), n))
        return {n: round(self.seconds[n], 3) for n in names}

    def line(self) -> str:
        """``node_setup 0.31 s, spawn 0.02 s, ...``: the log line's text."""
        return ", ".join(f"{n} {s:.2f} s" for n, s in self.ordered().items())


def boot_clock() -> float:
    """Seconds on the clock the kernel's process start times count on (CLOCK_BOOTTIME, Linux;
    elsewhere the monotonic clock, which then never matches ``process_started_at``)."""
    clock = getattr(time, "CLOCK_BOOTTIME", None)
    return time.clock_gettime(clock) if clock is not None else time.monotonic()


def process_started_at(pid: int | None = None) -> float | None:
    """When process ``pid`` (this one by default) started, on ``boot_clock``'s clock (the
    kernel's record, to its clock tick: 10 ms); None where ``/proc`` does not tell."""
    try:
        stat = open(f"/proc/{pid or os.getpid()}/stat").read()  # noqa: SIM115
        ticks = int(stat[stat.rindex(")") + 2:].split()[19])  # field 22: starttime
        return ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def spawn_and_imports(spawned_at: float, started: float | None, now: float) -> dict[str, float]:
    """A child's ``spawn`` (its parent's ``spawned_at`` -> ``started``, the kernel's start time)
    and ``imports`` (-> ``now``), all on ``boot_clock``; without ``started`` all of it counts
    as imports."""
    if started is not None and spawned_at - 0.05 <= started < spawned_at:
        started = spawned_at  # the kernel's start time is floored to a clock tick
    if started is None or not spawned_at <= started <= now:
        return {"spawn": 0.0, "imports": max(0.0, now - spawned_at)}
    return {"spawn": started - spawned_at, "imports": now - started}
