"""Stepping the executors for the scheduler actor: one step at a time, or overlapped.

Overlapped decoding (``--overlap-schedule``, as SGLang's overlap scheduler and vLLM's async
scheduling do it): a decode-only batch goes to the executors *deferred* (``StepPlan.defer``).
While it runs, the stepper builds the next step without its tokens
(``BatchScheduler.schedule_ahead``: follow chunks whose token the executor fills in on the
device from the step before) and sends it; the executor launches that one before it answers
the deferred step, so the host work of step N+1 (planning, messages, flattening, copies,
launch) runs while the device computes step N. When the next step cannot be known ahead (new
work arrived, a page is missing) the stepper sends ``Collect`` instead and steps normally
afterwards. A sequence that stops in flight wastes its row of the step after; its pages stay
out of the pool until every deferred step that writes them has landed
(``BatchScheduler.launched`` / ``landed``).
"""

from __future__ import annotations

import itertools
import logging
import time
from typing import Protocol

from disagg.actors.executor_group import ExecutorGroup
from disagg.actors.sides import SchedulerSide
from disagg.engine.scheduling import Batch, BatchScheduler, Sequence, SeqUpdate, Status
from disagg.protocol.executor import StepPlan, StepResult

log = logging.getLogger(__name__)

SLOW_STEP_S = 0.5  # a step slower than this is logged (compiles, stalls)


class StepPort(Protocol):
    """The scheduler actor as the stepper sees it."""

    sched: BatchScheduler
    executors: ExecutorGroup
    side: SchedulerSide

    async def step_failed(self, seq: Sequence, error: str) -> None: ...

    async def emit(self, update: SeqUpdate) -> None: ...

    async def pages_changed(self) -> None: ...


class Stepper:
    def __init__(self, port: StepPort, num_layers: int, overlap: bool):
        self.port = port
        self.num_layers = num_layers
        self.overlap = overlap
        self.in_flight: tuple[StepPlan, Batch, float] | None = None  # the deferred step
        self.steps_ahead = 0  # steps sent before their predecessor's tokens were back
        self._ids = itertools.count()

    def _plan(self, batch: Batch, defer: bool) -> StepPlan:
        step_id = next(self._ids)
        return StepPlan(step_id, [c.to_wire() for c in batch.chunks], batch.num_decodes,
                        counter_base=step_id * (self.num_layers + 1), defer=defer)

    async def _submit(self, batch: Batch) -> None:
        plan = self._plan(batch, defer=True)
        await self.port.side.before_step(plan, batch)
        self.port.sched.launched(batch)
        await self.port.executors.submit(plan)
        self.in_flight = (plan, batch, time.monotonic())

    async def run(self, batch: Batch) -> None:
        """Run a newly scheduled batch: deferred when it may overlap its successor (then
        ``advance`` takes its result), else to the end."""
        if self.overlap and self.port.sched.can_defer(batch):
            await self._submit(batch)
            return
        plan = self._plan(batch, defer=False)
        await self.port.side.before_step(plan, batch)
        started = time.monotonic()
        result, hidden = await self.port.executors.step(plan)
        await self._apply(plan, batch, result, hidden, started)

    async def advance(self) -> None:
        """With a step in flight: send its successor when it is known ahead (else ask for the
        in-flight result alone), then apply the in-flight step's result."""
        assert self.in_flight is not None
        plan, batch, started = self.in_flight
        self.in_flight = None
        ahead = self.port.sched.schedule_ahead(batch)
        if ahead is not None:
            await self._submit(ahead)
            self.steps_ahead += 1
        else:
            await self.port.executors.collect()
        result, hidden = await self.port.executors.result(plan.step_id)
        await self._apply(plan, batch, result, hidden, started)

    def abandon(self) -> None:
        """The executors failed: nothing is in flight any more."""
        if self.in_flight is not None:
            self.port.sched.landed(self.in_flight[1])
            self.in_flight = None

    async def _apply(self, plan: StepPlan, batch: Batch, result: StepResult,
                     hidden: bytes | None, started: float) -> None:
        took = time.monotonic() - started
        if took > SLOW_STEP_S:
            log.warning("slow step %d: %.0f ms for %d tokens (%d decodes, %d chunks)",
                        plan.step_id, 1000 * took, batch.num_tokens, batch.num_decodes,
                        len(batch.chunks) - batch.num_decodes)
        port = self.port
        if plan.defer:
            port.sched.landed(batch)
        await port.side.after_step(plan, batch, result, hidden)
        if result.error is not None:
            for c in batch.chunks:
                if c.seq.status is Status.RUNNING:  # not ended by an earlier failed step
                    await port.step_failed(c.seq, result.error)
            return
        for update in port.sched.update(batch, result.token_ids, result.counts, result.drafts):
            await port.emit(update)
        await port.pages_changed()
