"""The order an executor launches steps and answers them in, as its commands arrive (pure
logic; the executor process supplies the launches and the replies).

A plan is launched at once and answered at once, unless it is deferred (``StepPlan.defer``,
overlapped decoding): then its answer waits for the next command, so that the next step is
already queued on the device when the host turns to its tokens. A deferred step with late
grammar masks (``late_mask`` chunks) cannot pick its tokens before its ``Masks`` arrive, and
the step after it reads those tokens on the device, so a plan that arrives before the masks
of the deferred step it follows is held and launched right after they pick that step (the
scheduler sends a step's masks before the next plan, and an executor filling its own
(``late_masks.OwnMasks``) fills them as soon as the step before is answered, so this is the
guard of an order no sender is meant to make). Masks that arrive first are applied at once and the
step waits for its successor's plan as any deferred step does; except when ``settled`` says
the device had finished the step's forward pass when they came: the host's chain (tokens back,
grammar pass, masks out) is then what bounds the step, and its tokens are answered at once,
before a held plan is launched (that launch's host time is not added to the chain; the device
has nothing queued to overlap with it anyway).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

from disagg.protocol.executor import StepPlan

L = TypeVar("L")  # a launched step (``Launched``), or the exception that failed it


class StepOrder(Generic[L]):
    """``launch`` queues a plan's step, ``answer`` sends a step's result (waiting for its
    tokens), ``awaits_masks`` says whether a launched step still waits for late masks."""

    def __init__(self, launch: Callable[[StepPlan], L], answer: Callable[[int, L], None],
                 awaits_masks: Callable[[L], bool],
                 settled: Callable[[L], bool] = lambda _: False):
        self._launch, self._answer, self._awaits = launch, answer, awaits_masks
        self._settled = settled  # a picked step whose forward pass was done (answered first)
        self.deferred: tuple[int, L] | None = None  # answered on the next command
        self.held: StepPlan | None = None  # came before the masks of the deferred step
        self._answered: int | None = None  # the last step answered

    def plan(self, plan: StepPlan) -> None:
        # a plan still held: the masks it waited for are not coming (the deferred step's
        # answer then says so)
        self._release_held()
        if self.deferred is not None and self._awaits(self.deferred[1]):
            self.held = plan
        else:
            self._run(plan)

    def masks(self, step_id: int, pick: Callable[[L], L]) -> bool:
        """The deferred step ``step_id``'s late masks: ``pick`` picks its tokens with them;
        then a plan held for them is launched. False: no such step in flight. Masks of the
        step answered last are let go: under ``--dp`` every rank gets the masks, and a rank
        whose share of the step waited for none has answered it on the next plan already."""
        if self.deferred is None or self.deferred[0] != step_id:
            return step_id == self._answered
        self.deferred = (step_id, pick(self.deferred[1]))
        if self._settled(self.deferred[1]):
            self._answer_deferred()
        self._release_held()
        return True

    def collect(self) -> None:
        """Answer the deferred step now (its successor cannot be known ahead)."""
        self._release_held()
        self._answer_deferred()

    def _release_held(self) -> None:
        if self.held is not None:
            plan, self.held = self.held, None
            self._run(plan)

    def _answer_deferred(self) -> None:
        if self.deferred is not None:
            (sid, launched), self.deferred = self.deferred, None
            self._reply(sid, launched)

    def _reply(self, step_id: int, launched: L) -> None:
        self._answered = step_id
        self._answer(step_id, launched)

    def _run(self, plan: StepPlan) -> None:
        """Launch ``plan``, then answer the deferred step before it (its host work overlaps
        this one's device work); a deferred plan is answered on the next command."""
        launched = self._launch(plan)
        self._answer_deferred()
        if plan.defer:
            self.deferred = (plan.step_id, launched)
        else:
            self._reply(plan.step_id, launched)
