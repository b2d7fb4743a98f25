"""Stepping the executors for the scheduler actor: the engine core's commands carried out.

The core (``disagg.engine.core.EngineCore``) decides every step, overlapped decoding included
(a deferred step's successor sent before its result is taken, or ``Collect``), and applies its
results; the stepper is its driver on the node: it sends each command through
``ExecutorGroup`` (``step``; overlapped: ``submit`` a deferred plan, ``collect``, ``result``),
calls the scheduler side's hooks around each step (``before_step``: a prefill node announces
its chunks; ``after_step``), logs slow steps, ends or hands to the side the sequences of a
failed step, and streams every applied step's updates to the scheduler (``emit``). A
deferred step's successor with constrained rows waits for their masks: the core's
``grammar_pass`` starts as soon as the step's tokens are back and runs on its threads while
the step lands. By default the executors fill the late masks themselves
(``disagg.engine.grammar_mirror``): each plan's grammar definitions (``Step.defs``) go out
before it, and the pass only accepts (nothing is sent). With ``DISAGG_EXECUTOR_MASKS=0`` the
pass fills them too and they go out as soon as they are filled, before the tokens are applied
and the next step planned: the executor picks the step and, its forward pass done, answers it
at once (``StepOrder``), so the planning overlaps the masks' trip and the result's rather than
the pass, whose threads need the interpreter back from xgrammar (planning beside the pass was
measured no faster, docs/BENCHMARKS.md, 2026-12-07).
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import Future
from typing import Protocol

from disagg import trace
from disagg.actors.executor.executor_group import ExecutorGroup
from disagg.actors.scheduler.sides import SchedulerSide
from disagg.engine.core import Collect, Command, EngineCore, Launch, Run, Step
from disagg.engine.grammar_pass import PASS_TIMEOUT_S, MaskBlock, Pass
from disagg.engine.scheduling import Sequence, SeqUpdate, Status
from disagg.protocol.executor import StepResult

log = logging.getLogger(__name__)

SLOW_STEP_S = 0.5  # a step slower than this is logged (compiles, stalls)


class StepPort(Protocol):
    """The scheduler actor as the stepper sees it."""

    core: EngineCore
    executors: ExecutorGroup
    side: SchedulerSide

    async def step_failed(self, seq: Sequence, error: str) -> None: ...

    async def emit(self, update: SeqUpdate) -> None: ...

    async def pages_changed(self) -> None: ...


def _trace_pass(masks: Future[MaskBlock], sid: int, after: int, width: int) -> None:
    """Hop marks of a grammar pass (``bench/grammar_gaps.py``): started now, for step
    ``sid`` (``width`` rows) after step ``after``'s tokens, and ended (on its thread)."""
    trace.mark("g.pass", "d", sid, value=f"{after} {width}")
    masks.add_done_callback(lambda _: trace.mark("g.pass_done", "d", sid))


class Stepper:
    def __init__(self, port: StepPort):
        self.port = port
        self._sent: dict[int, float] = {}  # deferred steps sent: step id -> when (monotonic)

    async def run(self, cmd: Command) -> None:
        """Carry out one command of the core: a step run to the end, a deferred one sent
        (then its predecessor's result taken), or a deferred step's result collected."""
        port = self.port
        match cmd:
            case Run(step):
                await port.side.before_step(step.plan, step.batch)
                for grammar in step.defs:
                    await port.executors.define(grammar)
                started = time.monotonic()
                result, hidden = await port.executors.step(step.plan)
                await self._apply(step, result, hidden, started)
            case Launch(step, then):
                await port.side.before_step(step.plan, step.batch)
                for grammar in step.defs:
                    await port.executors.define(grammar)
                await port.executors.submit(step.plan)
                self._sent[step.plan.step_id] = time.monotonic()
                if then is not None:
                    await self._take(then, step)
            case Collect(step):
                await port.executors.collect()
                await self._take(step)

    def abandon(self) -> None:
        """The executors failed: nothing is in flight any more."""
        self.port.core.abandon()
        self._sent.clear()

    async def _take(self, step: Step, ahead: Step | None = None) -> None:
        """Wait for a deferred step's result and apply it; ``ahead``: the step launched after
        it, whose late masks its grammar pass fills (``_apply``)."""
        result, hidden = await self.port.executors.result(step.plan.step_id)
        late, sends = None, None
        if ahead is not None:  # its grammar work starts at once, on the pass's threads
            tokens = result.token_ids if result.error is None else []
            late = self.port.core.grammar_pass(step, ahead, tokens)
            if late is not None and self.port.core.mirror is None:  # (else: accepts only)
                sends = ahead.plan.step_id
                if trace.enabled():
                    _trace_pass(late.masks, ahead.plan.step_id, step.plan.step_id,
                                len(ahead.plan.chunks))
        await self._apply(step, result, hidden, self._sent.pop(step.plan.step_id), late, sends)

    async def _apply(self, step: Step, result: StepResult, hidden: bytes | None,
                     started: float, late: Pass | None = None, sends: int | None = None) -> None:
        """Apply ``step``'s result; ``late``: the grammar pass under way for the step launched
        after it, whose tokens it accepts: they are applied and streamed once it has, and
        (``sends``: that step's id, ``DISAGG_EXECUTOR_MASKS=0``) its masks sent first."""
        plan, batch = step.plan, step.batch
        took = time.monotonic() - started
        if took > SLOW_STEP_S:
            log.warning("slow step %d: %.0f ms for %d tokens (%d decodes, %d chunks)",
                        plan.step_id, 1000 * took, batch.num_tokens, batch.num_decodes,
                        len(batch.chunks) - batch.num_decodes)
        port = self.port
        port.core.land(step)  # before the side's hook: pages it parked are back
        await port.side.after_step(plan, batch, result, hidden)
        if late is not None:
            await asyncio.wait_for(asyncio.wrap_future(late.accepted), PASS_TIMEOUT_S)
            if sends is not None:
                block = await asyncio.wait_for(asyncio.wrap_future(late.masks), PASS_TIMEOUT_S)
                await port.executors.masks(sends, block)
                trace.mark("g.masks_out", "d", sends)
        if result.error is not None:
            for c in batch.chunks:
                if c.seq.status is Status.RUNNING:  # not ended by an earlier failed step
                    await port.step_failed(c.seq, result.error)
            return
        for update in port.core.apply(step, result.token_ids, result.counts, result.drafts,
                                      result.logprobs, result.prompt_logprobs):
            await port.emit(update)
        await port.pages_changed()
