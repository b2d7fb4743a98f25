"""The order an executor launches and answers steps in (``StepOrder``): deferred steps
answered after their successor is launched, and a plan that arrives before the late grammar
masks of the step it follows held until they have picked that step."""

from __future__ import annotations

from disagg.actors.executor.step_order import StepOrder
from disagg.protocol.executor import StepPlan


class Device:
    """Launches as strings (``"masks"``: waits for late masks until picked), the events in
    order."""

    def __init__(self, late: set[int] = frozenset()):  # type: ignore[assignment]
        self.late, self.log = late, []

    def launch(self, plan: StepPlan) -> str:
        self.log.append(f"launch {plan.step_id}")
        return "masks" if plan.step_id in self.late else "ready"

    def answer(self, step_id: int, launched: str) -> None:
        self.log.append(f"answer {step_id} {launched}")

    def order(self) -> StepOrder[str]:
        return StepOrder(self.launch, self.answer, lambda ld: ld == "masks")

    def pick(self, launched: str) -> str:
        self.log.append("pick")
        return "picked"


def plan(step_id: int, defer: bool = True) -> StepPlan:
    return StepPlan(step_id, [], 0, defer=defer)


def test_a_deferred_step_is_answered_after_its_successor_is_launched():
    d = Device()
    o = d.order()
    o.plan(plan(1))
    o.plan(plan(2))
    assert d.log == ["launch 1", "launch 2", "answer 1 ready"]
    o.plan(plan(3, defer=False))
    o.collect()  # nothing deferred: nothing to answer
    assert d.log[3:] == ["launch 3", "answer 2 ready", "answer 3 ready"]
    o.plan(plan(4))
    o.collect()
    assert d.log[6:] == ["launch 4", "answer 4 ready"] and o.deferred is None


def test_a_plan_before_the_masks_it_follows_is_held_until_they_pick_that_step():
    d = Device(late={2, 3})
    o = d.order()
    o.plan(plan(1))
    o.plan(plan(2))  # step 2's tokens wait for masks (from step 1's tokens)
    o.plan(plan(3))  # planned while they were filled: must not run before step 2 is picked
    assert d.log == ["launch 1", "launch 2", "answer 1 ready"] and o.held is not None
    assert o.masks(2, d.pick)
    assert d.log[3:] == ["pick", "launch 3", "answer 2 picked"] and o.held is None
    # masks first (a short pass): picked at once, answered once the next plan is launched
    assert o.masks(3, d.pick)
    assert d.log[6:] == ["pick"]
    o.plan(plan(4))
    assert d.log[7:] == ["launch 4", "answer 3 picked"]


def test_masks_of_no_step_in_flight_are_refused_but_those_of_the_last_answer_let_go():
    d = Device()
    o = d.order()
    assert not o.masks(7, d.pick)  # nothing in flight
    o.plan(plan(1))
    o.plan(plan(2))  # step 1 waited for no masks here (a --dp rank without its late rows)
    assert o.masks(1, d.pick)  # the broadcast masks of a step answered already: let go
    assert not o.masks(5, d.pick)
    assert "pick" not in d.log


def test_collect_or_a_second_plan_never_leaves_a_held_plan_behind():
    d = Device(late={2})
    o = d.order()
    o.plan(plan(1))
    o.plan(plan(2))
    o.plan(plan(3))  # held for step 2's masks
    o.collect()  # no masks came: the held plan runs, then both steps are answered
    assert d.log[3:] == ["launch 3", "answer 2 masks", "answer 3 ready"]
    assert o.held is None and o.deferred is None
    d2 = Device(late={2})
    o = d2.order()
    for sid in (1, 2, 3, 4):  # a second plan while one is held: the held one goes first
        o.plan(plan(sid))
    assert d2.log == ["launch 1", "launch 2", "answer 1 ready", "launch 3", "answer 2 masks",
                      "launch 4", "answer 3 ready"]


def test_a_step_whose_forward_was_done_when_its_masks_came_is_answered_before_the_next_launch():
    """``settled``: the device had finished the step's forward pass (the host's chain bounds
    the step): its tokens go back at once, before a held plan's launch; masks that come first
    get the step answered without waiting for the next plan. A step still in its forward pass
    keeps the launch-first order (its successor queued behind it)."""
    d = Device(late={2, 3, 5})
    o = StepOrder(d.launch, d.answer, lambda ld: ld == "masks", lambda ld: ld == "picked")
    o.plan(plan(1))
    o.plan(plan(2))
    o.plan(plan(3))  # held for step 2's masks
    assert o.masks(2, d.pick)
    assert d.log[3:] == ["pick", "answer 2 picked", "launch 3"] and o.held is None
    assert o.deferred is not None and o.deferred[0] == 3
    assert o.masks(3, d.pick)  # masks first: answered at once, nothing deferred
    assert d.log[6:] == ["pick", "answer 3 picked"] and o.deferred is None
    o.plan(plan(4))
    assert d.log[8:] == ["launch 4"]
    busy = StepOrder(d.launch, d.answer, lambda ld: ld == "masks", lambda ld: False)
    busy.deferred, busy.held = (5, "masks"), plan(6)  # its forward still running
    assert busy.masks(5, d.pick)
    assert d.log[-3:] == ["pick", "launch 6", "answer 5 picked"]
