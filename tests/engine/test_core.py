"""The engine core (disagg.engine.core) on the CPU, through a fake executor: a paged cache of
token ids and a toy model that reads a sequence's whole context from it, so a token comes out
right only if the core put every earlier position in the pages it says. Both production
drivers run on it: ``drive`` (the in-process LLM's) and the node's ``Stepper`` over a fake
executor group. Overlap, preemption, aborts, speculative steps, remote-prefill arrivals and
failed steps."""

from __future__ import annotations

import asyncio

import pytest

from disagg.actors.scheduler.sides import SchedulerSide
from disagg.actors.scheduler.stepping import Stepper
from disagg.engine.cache import PagePool, pages_needed
from disagg.engine.core import Collect, EngineCore, Launch, Run, drive
from disagg.engine.scheduling import BatchScheduler, Sequence, Status
from disagg.protocol import SamplingParams
from disagg.protocol.executor import StepPlan, StepResult

PAGE = 4
STRIDE = 5  # counter values per step


def next_token(ctx: list[int]) -> int:
    """The toy model: a token in 3 .. 42 (never the EOS, 2) that depends on the whole context."""
    h = 0
    for t in ctx:
        h = (h * 31 + t) % 1_000_003
    return 3 + h % 40


def reference(prompt: list[int], max_tokens: int, stop: tuple[int, ...] = ()) -> list[int]:
    out: list[int] = []
    while len(out) < max_tokens:
        out.append(next_token(prompt + out))
        if out[-1] in stop:
            break
    return out


class FakeLaunched:
    def __init__(self, runner: FakeRunner, step_id: int, tokens: list[int],
                 counts: list[int] | None):
        self.runner, self.step_id, self.tokens, self.counts = runner, step_id, tokens, counts

    def wait(self) -> tuple[list[int], None, list[int] | None]:
        self.runner.on_device.pop(self.step_id, None)
        return self.tokens, None, self.counts

    def logprob_maps(self) -> tuple[None, None]:
        return None, None


class FakeRunner:
    """Steps as ``ModelRunner`` does: a follow chunk takes its slot's token from the step
    before (refused without one), drafts are verified against the toy model, and a deferred
    step stays on the device until waited for; no page it writes may show up in another
    sequence's chunk meanwhile."""

    next_drafts = None

    def __init__(self, num_pages: int):
        self.kv: list[list[int | None]] = [[None] * PAGE for _ in range(num_pages)]
        self.prev: dict[int, int] = {}  # slot -> the token the last step sampled for it
        self.on_device: dict[int, dict[int, set[int]]] = {}  # step -> slot -> pages written
        self.plans: list[StepPlan] = []

    def execute(self, plan: StepPlan) -> tuple[list[int], None, list[int] | None]:
        return self.launch(plan).wait()

    def _at(self, table: list[int], pos: int) -> int | None:
        return self.kv[table[pos // PAGE]][pos % PAGE]

    def launch(self, plan: StepPlan) -> FakeLaunched:
        self.plans.append(plan)
        for c in plan.chunks:
            for sid, writes in self.on_device.items():
                for slot, pages in writes.items():
                    assert slot == c.slot or not pages & set(c.block_table), (
                        f"step {plan.step_id} gives slot {c.slot} pages that step {sid} "
                        f"still writes for slot {slot}")
        prev, self.prev = self.prev, {}
        tokens: list[int] = []
        counts: list[int] = []
        writes: dict[int, set[int]] = {}
        for c in plan.chunks:
            ids = list(c.token_ids)
            if c.follow:
                if c.slot not in prev:
                    raise ValueError(f"slot {c.slot}: follows a step that sampled no token")
                ids = [prev[c.slot]]
            for p, t in enumerate(ids, c.start_pos):
                self.kv[c.block_table[p // PAGE]][p % PAGE] = t
            writes[c.slot] = {c.block_table[p // PAGE]
                              for p in range(c.start_pos, c.start_pos + len(ids))}
            if not c.sample:
                continue
            first = c.start_pos + len(ids) - c.num_draft  # the position the first token takes
            emitted: list[int] = []
            for j in range(c.num_draft + 1):
                ctx = [self._at(c.block_table, p) for p in range(first + j)]
                assert None not in ctx, f"slot {c.slot} reads a position never written"
                emitted.append(next_token(ctx))  # type: ignore[arg-type]
                if j == c.num_draft or ids[len(ids) - c.num_draft + j] != emitted[-1]:
                    break
            tokens += emitted
            counts.append(len(emitted))
            self.prev[c.slot] = emitted[-1]
        if plan.defer:
            self.on_device[plan.step_id] = writes
        spec = any(c.num_draft for c in plan.chunks)
        return FakeLaunched(self, plan.step_id, tokens, counts if spec else None)


def settle(core: EngineCore, runner: FakeRunner, pending: dict[int, FakeLaunched]) -> None:
    """Carry the core's commands out, as ``drive`` does, until no deferred step is in flight
    (``pending``: the launched ones, by step id)."""
    while core.in_flight is not None:
        match core.next():
            case Launch(step, then) if then is not None:
                pending[step.plan.step_id] = runner.launch(step.plan)
                core.apply(then, *pending.pop(then.plan.step_id).wait()[::2])
            case Collect(step):
                core.apply(step, *pending.pop(step.plan.step_id).wait()[::2])
            case cmd:
                raise AssertionError(f"{cmd} with a step in flight")


def make(pages: int = 64, overlap: bool = True, budget: int = 16, **kw) -> EngineCore:
    sched = BatchScheduler(PagePool(pages), PAGE, budget, 8, 256, (2,), **kw)
    return EngineCore(sched, overlap, counter_stride=STRIDE)


def seq(slot: int, prompt: list[int], max_tokens: int, stop: tuple[int, ...] = ()) -> Sequence:
    params = SamplingParams(max_tokens=max_tokens, stop_token_ids=list(stop))
    return Sequence(slot, f"r{slot}", prompt, params, seed=slot, arrival=slot)


PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [9] * 12, list(range(10, 23)), [3, 4]]


def wave(core: EngineCore, first: int = 0) -> list[tuple[Sequence, list[int]]]:
    """Add four sequences (different lengths, one ending at a stop token); with their
    reference outputs."""
    out = []
    for i, (prompt, n) in enumerate(zip(PROMPTS, [12, 5, 12, 9], strict=True)):
        stop = (reference(prompt, 12)[6],) if i == 2 else ()
        s = seq(first + i, prompt, n, stop)
        core.sched.add(s)
        out.append((s, reference(prompt, n, stop)))
    return out


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("budget", [64, 5])
def test_drive_overlapped_or_not_gives_the_model_s_tokens(overlap, budget):
    core, runner = make(overlap=overlap, budget=budget), FakeRunner(64)
    for _ in range(2):  # a second wave once the first is done
        seqs = wave(core, len(runner.plans))
        drive(core, runner)
        assert [s.output_ids for s, _ in seqs] == [ref for _, ref in seqs]
        assert [s.finish_reason for s, _ in seqs] == ["length", "length", "stop", "length"]
        assert core.sched.pool.num_free == core.sched.pool.num_pages and not core.has_work()
    assert [p.step_id for p in runner.plans] == list(range(len(runner.plans)))
    assert all(p.counter_base == p.step_id * STRIDE for p in runner.plans)
    deferred = sum(p.defer for p in runner.plans)
    follows = sum(c.follow for p in runner.plans for c in p.chunks)
    if overlap:
        assert core.steps_ahead >= 4 and deferred > core.steps_ahead // 2 and follows > 0
    else:
        assert core.steps_ahead == deferred == follows == 0


def test_the_commands_of_an_overlapped_decode():
    core, runner = make(), FakeRunner(64)
    a, b = seq(0, [5, 6, 7], 6), seq(1, [8, 9, 10, 11, 12], 6)
    core.sched.add(a)
    core.sched.add(b)
    cmd = core.next()
    assert isinstance(cmd, Run) and not cmd.step.plan.defer  # the prefills run to the end
    core.apply(cmd.step, *runner.execute(cmd.step.plan)[::2])
    cmd = core.next()
    assert isinstance(cmd, Launch) and cmd.then is None and cmd.step.plan.defer
    first = cmd.step
    assert core.in_flight is first and core.has_work()
    pending = runner.launch(first.plan)
    cmd = core.next()  # its successor, built without its tokens
    assert isinstance(cmd, Launch) and cmd.then is first and core.steps_ahead == 1
    ahead = cmd.step
    assert [(c.slot, c.follow, c.start_pos) for c in ahead.plan.chunks] == [
        (0, True, 4), (1, True, 6)]
    ahead_pending = runner.launch(ahead.plan)
    updates = core.apply(first, *pending.wait()[::2])
    assert [len(u.new_token_ids) for u in updates] == [1, 1]
    late = seq(2, [4, 4, 4], 3)
    core.sched.add(late)  # new work: the next step cannot be known ahead
    cmd = core.next()
    assert isinstance(cmd, Collect) and cmd.step is ahead and core.in_flight is None
    core.apply(ahead, *ahead_pending.wait()[::2])
    cmd = core.next()
    assert isinstance(cmd, Run) and [c.slot for c in cmd.step.plan.chunks] == [0, 1, 2]
    core.apply(cmd.step, *runner.execute(cmd.step.plan)[::2])
    drive(core, runner)
    assert a.output_ids == reference([5, 6, 7], 6) and b.output_ids == reference(b.prompt_ids, 6)
    assert late.output_ids == reference([4, 4, 4], 3)


def test_an_abort_in_flight_parks_the_pages_until_the_step_lands():
    core, runner = make(), FakeRunner(64)
    a, b = seq(0, [5] * 7, 20), seq(1, [6] * 3, 20)
    core.sched.add(a)
    core.sched.add(b)
    while not isinstance(cmd := core.next(), Launch):  # until decoding goes deferred
        assert isinstance(cmd, Run)
        core.apply(cmd.step, *runner.execute(cmd.step.plan)[::2])
    first, pending = cmd.step, runner.launch(cmd.step.plan)
    cmd = core.next()
    assert isinstance(cmd, Launch) and cmd.then is first
    ahead, ahead_pending = cmd.step, runner.launch(cmd.step.plan)
    core.apply(first, *pending.wait()[::2])
    free, held = core.sched.pool.num_free, len(a.block_table)
    core.sched.remove(a)  # aborted while the follow step still writes its pages
    assert core.sched.pool.num_free == free
    core.sched.add(c := seq(2, [7] * 9, 4))  # a newcomer must not get them meanwhile
    cmd = core.next()
    assert isinstance(cmd, Collect) and cmd.step is ahead
    updates = core.apply(ahead, *ahead_pending.wait()[::2])
    assert [u.seq for u in updates] == [b]  # a's token is dropped
    assert core.sched.pool.num_free == free + held  # a's pages came back as the step landed
    drive(core, runner)
    assert c.output_ids == reference([7] * 9, 4) and b.output_ids == reference([6] * 3, 20)
    assert core.sched.pool.num_free == core.sched.pool.num_pages


def test_a_remote_prefill_arriving_in_flight_decodes_after_a_collect():
    core, runner = make(), FakeRunner(64)
    a = seq(0, [5, 6, 7], 8)
    core.sched.add(a)
    while not isinstance(cmd := core.next(), Launch):
        core.apply(cmd.step, *runner.execute(cmd.step.plan)[::2])
    first, pending = cmd.step, runner.launch(cmd.step.plan)
    # a prefiller wrote all but the last prompt token into pages the decoder reserved
    far = seq(1, list(range(20, 31)), 5)
    pages = core.sched.pool.allocate(pages_needed(far.num_tokens, PAGE))
    assert pages is not None
    for p, t in enumerate(far.prompt_ids[:-1]):
        runner.kv[pages[p // PAGE]][p % PAGE] = t
    core.sched.kv_arrived(far, pages)
    cmd = core.next()
    assert isinstance(cmd, Collect) and cmd.step is first
    core.apply(first, *pending.wait()[::2])
    cmd = core.next()
    assert isinstance(cmd, Launch) and cmd.then is None
    assert [(c.slot, c.start_pos, c.token_ids) for c in cmd.step.plan.chunks] == [
        (0, 4, [a.output_ids[-1]]), (1, 10, [30])]  # its last prompt token runs as a decode
    settle(core, runner, {cmd.step.plan.step_id: runner.launch(cmd.step.plan)})
    drive(core, runner)
    assert a.output_ids == reference([5, 6, 7], 8)
    assert far.output_ids == reference(far.prompt_ids, 5)


@pytest.mark.parametrize("overlap", [True, False])
def test_preempted_sequences_recompute_and_give_the_same_tokens(overlap):
    core, runner = make(pages=10, overlap=overlap), FakeRunner(10)
    seqs = [seq(i, [3 + i] * 6, 14) for i in range(3)]  # 60 tokens in all, 40 fit
    for s in seqs:
        core.sched.add(s)
    drive(core, runner)
    assert core.sched.num_preemptions > 0
    assert [s.output_ids for s in seqs] == [reference(s.prompt_ids, 14) for s in seqs]
    assert core.sched.pool.num_free == core.sched.pool.num_pages


def test_speculative_steps_keep_the_accepted_drafts_and_never_defer():
    def propose(s: Sequence, k: int) -> list[int]:
        right = reference(s.prompt_ids + s.output_ids, k)
        return right if s.slot % 2 == 0 else [1] * k  # odd slots draft wrong

    core, runner = make(spec_tokens=3, propose=propose), FakeRunner(64)
    seqs = [seq(i, [4 + i] * 5, 10) for i in range(4)]
    for s in seqs:
        core.sched.add(s)
    drive(core, runner)
    assert [s.output_ids for s in seqs] == [reference(s.prompt_ids, 10) for s in seqs]
    sched = core.sched
    assert 0 < sched.spec_accepted_tokens < sched.spec_draft_tokens
    assert not any(p.defer for p in runner.plans) and core.steps_ahead == 0
    assert any(c.num_draft for p in runner.plans for c in p.chunks)
    assert sched.pool.num_free == sched.pool.num_pages


def test_abandon_lands_every_step_on_the_device():
    core, runner = make(), FakeRunner(64)
    seqs = [seq(0, [5] * 3, 20), seq(1, [6] * 4, 20)]
    for s in seqs:
        core.sched.add(s)
    while not isinstance(cmd := core.next(), Launch):
        core.apply(cmd.step, *runner.execute(cmd.step.plan)[::2])
    cmd = core.next()
    assert isinstance(cmd, Launch) and cmd.then is not None  # two deferred steps out
    for s in seqs:  # the executors died: every request ends
        core.sched.remove(s)
    assert core.sched.pool.num_free < core.sched.pool.num_pages  # parked for the device
    core.abandon()
    assert core.sched.pool.num_free == core.sched.pool.num_pages and not core.has_work()


# ---------------------------------------------------------------------- the node's driver


class FakeExecutors:
    """``ExecutorGroup``'s stepping over a ``FakeRunner``; steps in ``fail`` answer an error."""

    def __init__(self, runner: FakeRunner, fail: set[int] = frozenset()):  # type: ignore[assignment]
        self.runner, self.fail = runner, fail
        self.pending: dict[int, FakeLaunched] = {}
        self.calls: list[tuple[str, int]] = []

    async def step(self, plan: StepPlan) -> tuple[StepResult, bytes | None]:
        await self.submit(plan)
        return await self.result(plan.step_id)

    async def submit(self, plan: StepPlan) -> None:
        self.calls.append(("submit", plan.step_id))
        self.pending[plan.step_id] = self.runner.launch(plan)

    async def collect(self) -> None:
        self.calls.append(("collect", -1))

    async def result(self, step_id: int) -> tuple[StepResult, bytes | None]:
        self.calls.append(("result", step_id))
        tokens, _, counts = self.pending.pop(step_id).wait()
        if step_id in self.fail:
            return StepResult(step_id, [], error="boom"), None
        return StepResult(step_id, tokens, counts=counts), None


class RecordingSide(SchedulerSide):
    async def before_step(self, plan, batch):
        self.port.executors.calls.append(("before", plan.step_id))

    async def after_step(self, plan, batch, result, hidden):
        self.port.executors.calls.append(("after", plan.step_id))


class Port:
    def __init__(self, core: EngineCore, executors: FakeExecutors):
        self.core, self.executors = core, executors
        self.side = RecordingSide(self)  # type: ignore[arg-type]
        self.emitted: dict[int, list[int]] = {}
        self.failed: list[int] = []

    async def step_failed(self, seq: Sequence, error: str) -> None:
        assert error == "boom"
        self.failed.append(seq.slot)
        self.core.sched.remove(seq)

    async def emit(self, update) -> None:
        self.emitted.setdefault(update.seq.slot, []).extend(update.new_token_ids)

    async def pages_changed(self) -> None:
        pass


def step_all(core: EngineCore, executors: FakeExecutors) -> Port:
    port = Port(core, executors)
    stepper = Stepper(port)  # type: ignore[arg-type]

    async def loop() -> None:
        while core.has_work():
            cmd = core.next()
            assert cmd is not None
            await stepper.run(cmd)

    asyncio.run(loop())
    return port


def test_the_stepper_streams_what_the_core_applies():
    core, runner = make(), FakeRunner(64)
    seqs = wave(core)
    port = step_all(core, FakeExecutors(runner))
    assert [port.emitted[s.slot] for s, _ in seqs] == [ref for _, ref in seqs]
    calls = port.executors.calls
    assert ("collect", -1) in calls and core.steps_ahead > 0
    for p in runner.plans:  # each step: the side's hooks around it, sent before its result
        i = calls.index(("submit", p.step_id))
        assert calls[i - 1] == ("before", p.step_id)
        assert calls.index(("result", p.step_id)) + 1 == calls.index(("after", p.step_id))
    assert core.sched.pool.num_free == core.sched.pool.num_pages


def test_a_failed_deferred_step_ends_its_sequences_and_frees_their_pages():
    core, runner = make(), FakeRunner(64)
    a, b = seq(0, [5] * 3, 20), seq(1, [6] * 4, 20)
    core.sched.add(a)
    core.sched.add(b)
    runner_plans = runner.plans
    port = step_all(core, FakeExecutors(runner, fail={2}))  # the second decode step
    assert runner_plans[2].defer and port.failed == [0, 1]
    assert a.status is b.status is Status.FINISHED and len(port.emitted[0]) == 2
    assert core.sched.pool.num_free == core.sched.pool.num_pages and not core.has_work()


class _CopiesOnly:
    """A core whose only work is tier copies landing after ``polls`` looks (a CUDA reload's
    events not done yet), or none in flight at all (``polls`` None)."""

    def __init__(self, polls: int | None):
        self.polls = polls
        self.looks = 0

    def has_work(self) -> bool:
        return self.polls is None or self.looks < self.polls

    def next(self) -> None:
        self.looks += 1
        return None

    def copies_in_flight(self) -> bool:
        return self.polls is not None


def test_drive_waits_for_tier_copies_that_are_its_only_work() -> None:
    from disagg.engine.core import drive

    core = _CopiesOnly(polls=5)
    assert drive(core, None) == []  # type: ignore[arg-type]
    assert core.looks == 5
    with pytest.raises(RuntimeError, match="cannot schedule"):
        drive(_CopiesOnly(polls=None), None)  # type: ignore[arg-type]
