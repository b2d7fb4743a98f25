"""The engine core: what to run next and what a step's result does, for both drivers.

Synchronous and socket-free, like the remote-prefill machines (``disagg.remote``): a driver
asks ``EngineCore.next()`` for a command, carries it out on its executor and hands the result
back (``apply``; ``land`` alone for a failed step). The core owns the batch scheduler
(``disagg.engine.scheduling``: batches, preemption, speculative bookkeeping, prefix caching),
the step ids and overlapped decoding with the page parking it needs. Two drivers carry the
commands out, and nothing else steps: the in-process ``disagg.llm.LLM`` (``drive`` below, over
a ``ModelRunner``) and the node's stepper (``disagg.actors.scheduler.stepping``, over the executor
processes; it adds the side hooks, slow-step logs and failed steps). Sequences join and leave
through ``sched`` as before (admission, aborts, a remote prefill's landed KV); the next command
takes them into account.

The commands (``next()`` answers one, or None when nothing can run now):

- ``Run(step)``: run ``step`` to the end, then ``apply`` its result.
- ``Launch(step, then)``: send ``step`` deferred (``StepPlan.defer``: the executor answers it
  only once the next command arrives, after launching that one); ``then``, when not None, is
  the deferred step before it: take its result now and ``apply`` it.
- ``Collect(step)``: the in-flight deferred ``step``'s successor cannot be known ahead: ask for
  its result alone and ``apply`` it; the next command is planned normally.

Overlapped decoding (``overlap``, as SGLang's overlap scheduler and vLLM's async scheduling do
it): a decode-only batch that may overlap its successor (``BatchScheduler.can_defer``) goes out
deferred. While it runs, the next step is built without its tokens
(``BatchScheduler.schedule_ahead``: follow chunks whose token the executor fills in on the
device from the step before) and sent before the deferred result is taken, so the host work of
step N+1 (planning, messages, flattening, copies, launch) runs while the device computes step
N. A constrained row's mask needs the token in flight: its follow chunk goes ``late_mask``.
With a ``MirrorBook`` (a node's default) every constrained row goes ``late_mask`` and the
executors fill the masks from their own copies of the matchers
(``disagg.engine.grammar_mirror``); once the step before is back the driver starts
``grammar_pass``, which then only accepts its tokens, and applies that step once it has.
Without one, the pass also fills the masks on its threads (``disagg.engine.grammar_pass``),
the driver sends them when filled and only then applies the step
(``disagg.actors.scheduler.stepping``); the executor runs the forward pass meanwhile and
picks when the masks come, and a step that is not overlapped fills its constrained rows'
masks with the plan,
together on the same pass's threads (``GrammarPass.fill``; one such row fills its own). When
the next step cannot be known ahead (new work arrived, a page is missing) the core
answers ``Collect`` and plans normally afterwards. A sequence that stops in flight wastes its
row of the step after; its pages stay out of the pool until every deferred step that writes
them has landed (``BatchScheduler.launched`` / ``landed``, called here).

Plans carry ``counter_base = step_id * counter_stride``: a node's executors bump the layer
counter from there (stride: layers + 1); the in-process engine has no counter (stride 0).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from disagg.engine.grammar_pass import PASS_TIMEOUT_S, GrammarPass, Pass
from disagg.engine.scheduling import Batch, BatchScheduler, SeqUpdate
from disagg.protocol import TokenLogprobs
from disagg.protocol.executor import GrammarDef, StepPlan

if TYPE_CHECKING:
    from disagg.engine.grammar_mirror import MirrorBook

COPY_WAIT_S = 60.0  # the in-process loop waits this long at most for tier copies alone


@dataclass(frozen=True, eq=False)
class Step:
    """One step sent to the executor: its wire plan and the batch it was built from."""

    plan: StepPlan
    batch: Batch
    # grammars the executors get before the plan (``MirrorBook``; none with DISAGG_EXECUTOR_MASKS=0)
    defs: tuple[GrammarDef, ...] = ()


@dataclass(frozen=True)
class Run:
    step: Step


@dataclass(frozen=True)
class Launch:
    step: Step
    then: Step | None = None  # the deferred step before ``step``: take its result after sending


@dataclass(frozen=True)
class Collect:
    step: Step


Command = Run | Launch | Collect


class EngineCore:
    def __init__(self, sched: BatchScheduler, overlap: bool = False, counter_stride: int = 0,
                 grammar: GrammarPass | None = None, mirror: MirrorBook | None = None):
        """``overlap``: defer decode-only steps (overlapped decoding); ``counter_stride``: the
        layer-counter values a step spans (``counter_base``); ``grammar``: the late masks'
        pass (default: half the machine's threads, started on first use); ``mirror``: the
        executors fill the late masks themselves (``disagg.engine.grammar_mirror``), the
        pass only accepts."""
        self.sched = sched
        self.grammar = grammar if grammar is not None else GrammarPass()
        self.mirror = mirror
        self.overlap = overlap
        self.counter_stride = counter_stride
        self.in_flight: Step | None = None  # the newest deferred step, its result not asked for
        self.steps_ahead = 0  # steps sent before their predecessor's tokens were back
        self._on_device: list[Step] = []  # deferred steps sent and not landed (at most two)
        self._ids = itertools.count()

    def has_work(self) -> bool:
        """Something to compute now, or a deferred step's result still to take."""
        return self.sched.has_work() or self.in_flight is not None

    def copies_in_flight(self) -> bool:
        """KV tier copies not landed yet (what ``has_work`` may be waiting for alone)."""
        tiers = getattr(self.sched, "tiers", None)
        return tiers is not None and tiers.busy()

    def next(self) -> Command | None:
        """The next command: with a deferred step in flight, its successor (built ahead) or
        ``Collect``; else the next scheduled batch, deferred when it may overlap its successor.
        None: nothing can be scheduled now."""
        prev, self.in_flight = self.in_flight, None
        if prev is not None:
            ahead = self.sched.schedule_ahead(prev.batch)
            if ahead is None:
                return Collect(prev)
            self.steps_ahead += 1
            return Launch(self._defer(ahead), prev)
        batch = self.sched.schedule()
        if batch is None:
            return None
        if self.overlap and self.sched.can_defer(batch):
            return Launch(self._defer(batch))
        return Run(self._step(batch, defer=False))

    def _step(self, batch: Batch, defer: bool) -> Step:
        step_id = next(self._ids)
        own = self.mirror is not None  # the executors fill every constrained row's mask
        masks = {} if own else self._masks(batch)
        wires = [c.to_wire(masks.get(i), late=own) for i, c in enumerate(batch.chunks)]
        defs: list[GrammarDef] = []
        gone: list[int] = []
        if self.mirror is not None:
            wires = self.mirror.mark(batch.chunks, wires)
            defs, gone = self.mirror.take()
        return Step(StepPlan(step_id, wires, batch.num_decodes,
                             counter_base=step_id * self.counter_stride, defer=defer,
                             reload_wait=self.sched.reload_pending(), grammar_gone=gone),
                    batch, tuple(defs))

    def _masks(self, batch: Batch) -> dict[int, bytes]:
        """The masks of ``batch``'s constrained chunks that fill theirs with the plan, by chunk
        index, filled together on the grammar pass's threads; none for one such chunk (it
        fills its own, no hand-off)."""
        at = [i for i, c in enumerate(batch.chunks) if c.needs_mask]
        if len(at) < 2:
            return {}
        block = self.grammar.fill([batch.chunks[i].seq.grammar for i in at])
        rows = block.by_slot()  # slot j: chunk at[j]
        return {i: bytes(rows[j]) for j, i in enumerate(at)}

    def _defer(self, batch: Batch) -> Step:
        step = self._step(batch, defer=True)
        self.sched.launched(batch)
        self._on_device.append(step)
        self.in_flight = step
        return step

    def land(self, step: Step) -> None:
        """``step`` is done on the device (its result came back, or it failed): pages its
        sequences released meanwhile go back to the pool. Only a deferred step's first call
        does anything."""
        if step in self._on_device:
            self._on_device.remove(step)
            self.sched.landed(step.batch)

    def apply(self, step: Step, tokens: list[int], counts: list[int] | None = None,
              drafts: list[list[int]] | None = None,
              logprobs: dict[int, TokenLogprobs] | None = None,
              prompt_logprobs: dict[int, list[TokenLogprobs]] | None = None
              ) -> list[SeqUpdate]:
        """Apply ``step``'s sampled tokens (``BatchScheduler.update``: ``counts`` per sampling
        chunk with speculative decoding, ``drafts`` for MTP, the logprobs by slot) once it has
        landed."""
        self.land(step)
        return self.sched.update(step.batch, tokens, counts, drafts, logprobs, prompt_logprobs)

    def grammar_pass(self, then: Step, step: Step, tokens: list[int]) -> Pass | None:
        """Start the grammar work of the deferred ``then``, whose ``tokens`` just came back
        ([]: it failed), before they are applied: its constrained rows accept them and the
        masks ``step``'s follow chunks wait for (``SeqChunk.late_mask``) are filled, on the
        pass's threads; ``apply`` may run once ``Pass.accepted`` is done. None when ``step``
        has no late chunk."""
        # (with a mirror the executors fill the masks: the rows only accept)
        rows = self.sched.grammar_rows(then.batch, step.batch, tokens, self.mirror is None)
        return None if rows is None else self.grammar.submit(rows)

    def abandon(self) -> None:
        """The executors failed: no step is on the device any more."""
        for step in self._on_device:
            self.sched.landed(step.batch)
        self._on_device.clear()
        self.in_flight = None


class Pending(Protocol):
    def wait(self) -> tuple[list[int], Any, list[int] | None]: ...

    def logprob_maps(self) -> tuple[dict[int, TokenLogprobs] | None,
                                    dict[int, list[TokenLogprobs]] | None]: ...

    def with_masks(self, masks: Mapping[int, bytes | memoryview]) -> Pending: ...


class Runner(Protocol):
    """What ``drive`` needs of an in-process runner (``disagg.engine.runner.ModelRunner``)."""

    next_drafts: list[list[int]] | None  # mtp: the drafts the last step made

    def launch(self, plan: StepPlan) -> Pending: ...


def drive(core: EngineCore, runner: Runner) -> list[SeqUpdate]:
    """Run ``core``'s commands on ``runner`` in this thread until it has no work left (the
    in-process engine's loop); returns every update, in order. Raises RuntimeError when work
    cannot be scheduled."""
    launched: dict[int, Pending] = {}
    updates: list[SeqUpdate] = []
    idle_until: float | None = None
    while core.has_work():
        match core.next():
            case None:
                if not core.copies_in_flight():
                    raise RuntimeError("scheduler has work but cannot schedule (pool too small?)")
                # only tier copies left to land (a CUDA reload's events not done yet)
                idle_until = idle_until or time.monotonic() + COPY_WAIT_S
                if time.monotonic() > idle_until:
                    raise RuntimeError(f"KV tier copies did not land in {COPY_WAIT_S:.0f} s")
                time.sleep(0.0005)
                continue
            case Run(step):
                done = runner.launch(step.plan)
                tokens, _, counts = done.wait()
                updates += core.apply(step, tokens, counts, runner.next_drafts,
                                      *done.logprob_maps())
            case Launch(step, then):
                launched[step.plan.step_id] = runner.launch(step.plan)
                if then is not None:
                    done = launched.pop(then.plan.step_id)
                    tokens, _, counts = done.wait()
                    if (late := core.grammar_pass(then, step, tokens)) is not None:
                        block = late.masks.result(timeout=PASS_TIMEOUT_S)
                        sid = step.plan.step_id
                        launched[sid] = launched[sid].with_masks(block.by_slot())
                    updates += core.apply(then, tokens, counts, None, *done.logprob_maps())
            case Collect(step):
                done = launched.pop(step.plan.step_id)
                tokens, _, counts = done.wait()
                updates += core.apply(step, tokens, counts, None, *done.logprob_maps())
    return updates
