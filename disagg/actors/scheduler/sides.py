"""What a prefill or decode node adds to the scheduler actor: a *side* it holds (None on a
mixed node), not a subclass. A side gets the scheduler's ``SchedulerPort`` (the few things it
may use) and answers the hooks below; every default does nothing, so a side overrides only
what its role needs. The sides: ``decode_scheduler.DecodeSide`` (holds the remote-prefill
machine ``disagg.remote.decode.DecodeRemote``) and ``prefill_scheduler.PrefillSide``.
"""

from __future__ import annotations

from collections.abc import Coroutine
from typing import Any, Protocol

from disagg.engine.cache import PagePool
from disagg.engine.scheduling import Batch, BatchScheduler, Sequence
from disagg.model.config import ModelArch
from disagg.protocol import Error, Finished, Stats
from disagg.protocol.executor import StepPlan, StepResult
from disagg.protocol.inproc import ToScheduler
from disagg.serving.admission import Counters, Limits


class SchedulerPort(Protocol):
    """The scheduler as a side sees it."""

    sched: BatchScheduler
    pool: PagePool
    page_size: int
    limits: Limits
    counters: Counters
    arch: ModelArch

    def next_slot(self) -> int: ...

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None: ...

    async def end(self, seq: Sequence, terminal: Finished | Error) -> None: ...

    async def to_messenger(self, frames: list[bytes]) -> None: ...

    def stats(self) -> Stats: ...


class SchedulerSide:
    """Hooks the scheduler calls; the defaults are a mixed node's (nothing to add)."""

    def __init__(self, port: SchedulerPort):
        self.port = port

    async def enqueue(self, seq: Sequence) -> bool:
        """An admitted sequence is about to be batched: True if the side took it instead."""
        return False

    def in_flight(self) -> int:
        """Sequences the side holds that count against ``--max-running``."""
        return 0

    async def pages_changed(self) -> None:
        """Pages may have returned to the pool."""

    def next_deadline(self) -> float | None:
        return None

    async def expire(self, now: float) -> None:
        """Apply the side's deadlines passed by ``now``."""

    async def handle_messenger(self, msg: ToScheduler) -> None:
        """A message from the node's messenger (other than its Stats)."""

    async def before_step(self, plan: StepPlan, batch: Batch) -> None:
        """Before the step goes to the executors."""

    async def after_step(self, plan: StepPlan, batch: Batch, result: StepResult,
                         hidden: bytes | None) -> None:
        """When the executors answered, before tokens are applied."""

    async def step_failed(self, seq: Sequence, error: str) -> bool:
        """A step failed for ``seq``: True if the side handles it (else the request ends)."""
        return False

    def emitting(self, seq: Sequence) -> None:
        """Tokens of ``seq`` are about to go to its client."""

    async def hold_finish(self, seq: Sequence, reason: str) -> bool:
        """``seq`` finished (``reason``): True if the side sends its ``Finished`` later
        (through ``port.end``, within a bound), e.g. once what its usage and timings need
        has arrived. Its pages are free already; only the terminal message waits."""
        return False

    def cached_tokens(self, seq: Sequence) -> int:
        """Prompt tokens of ``seq`` not computed for it (taken from a prefix cache)."""
        return seq.cached_tokens

    def timings_of(self, seq: Sequence) -> dict[str, float] | None:
        """The TTFT breakdown of a finishing request, if the side has one."""
        return None

    async def release(self, seq: Sequence) -> bool:
        """An ended sequence: True if the side released it (else its pages are freed)."""
        return False

    def pages_fenced(self) -> int:
        return 0

    def waiting_for_kv(self) -> int:
        return 0

    def transfers_in_flight(self) -> int | None:
        """The side's own count for Stats (None: the messenger's snapshot)."""
        return None
