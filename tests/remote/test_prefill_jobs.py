"""The prefill side's job machine (disagg.remote.prefill), with a fake clock: every
transition, failures at every phase, and property tests of its promises."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from disagg.remote.peer_quota import PeerQuota
from disagg.remote.prefill import (
    JobState,
    PrefillJobs,
    Release,
    Reply,
    Schedule,
    Settle,
    Unschedule,
)

IDLE = 4.0
A, B = b"decoder-a", b"decoder-b"


def machine(max_jobs: int = 8, max_pages: int = 10) -> PrefillJobs:
    return PrefillJobs(PeerQuota(max_jobs, max_pages))


def test_a_job_goes_queued_computing_settling_then_done_and_released():
    m = machine()
    assert m.accept(1, A, 3, IDLE, 10.0, 0.0) == [Schedule(1)]
    assert m.state(1) is JobState.QUEUED and m.may_write(1, 0.5)
    m.step_started(1, 1.0)
    assert m.state(1) is JobState.COMPUTING
    assert m.computed(1, 3.0) == [Settle(1)]
    assert m.state(1) is JobState.SETTLING and m.may_write(1, 3.0)  # its context write
    [reply, release] = m.settled(1, None, 3.5)
    assert reply == Reply(1, "done", timings=(1.0, 2.0, 0.5))
    assert release == Release(1, "finished")
    assert m.state(1) is None and m.settled(1, None, 4.0) == []  # answered once


def test_compute_ends_with_the_last_layer_seen_and_the_tail_is_the_transfers():
    """The poller saw the last layer of the job's last chunk at 2.2 (its step's result came
    back at 3.0): compute ends there, the 1.3 s after it are the tail."""
    m = machine()
    m.accept(1, A, 3, IDLE, 10.0, 0.0)
    m.last_layer(1, 0.5)  # not computing yet: no layer of it has run
    m.step_started(1, 1.0)
    m.last_layer(1, 2.2)
    m.last_layer(1, 2.9)  # the first sighting counts
    m.computed(1, 3.0)
    [reply, _] = m.settled(1, None, 3.5)
    assert reply.timings == pytest.approx((1.0, 1.2, 1.3))


def test_a_failed_write_answers_transfer_failed():
    m = machine()
    m.accept(1, A, 3, IDLE, 10.0, 0.0)
    m.computed(1, 1.0)
    assert m.settled(1, "connection refused", 1.5) == [
        Reply(1, "failed", "transfer_failed", "connection refused"), Release(1, "errored")]


def test_jobs_past_their_peers_page_share_wait_without_pages_in_order():
    m = machine(max_pages=5)
    assert m.accept(1, A, 3, IDLE, 10.0, 0.0) == [Schedule(1)]
    assert m.accept(2, A, 3, IDLE, 10.0, 0.0) == []  # 6 > 5: held back
    assert m.accept(3, A, 1, IDLE, 10.0, 0.0) == []  # behind job 2, in order
    assert m.accept(4, B, 3, IDLE, 10.0, 0.0) == [Schedule(4)]  # another peer's share
    assert m.state(2) is JobState.HELD_BACK and not m.may_write(2, 0.0)
    m.computed(1, 1.0)
    out = m.settled(1, None, 1.1)
    assert out[2:] == [Schedule(2), Schedule(3)]


def test_a_peer_over_its_job_share_is_refused():
    m = machine(max_jobs=2)
    m.accept(1, A, 1, IDLE, 10.0, 0.0)
    m.accept(2, A, 1, IDLE, 10.0, 0.0)
    assert m.refusal(A) is not None and m.refusal(B) is None


@pytest.mark.parametrize("phase", ["held_back", "queued", "computing", "settling"])
def test_an_abort_in_every_phase_is_acknowledged_once_its_writes_settle(phase):
    m = machine(max_pages=3)
    m.accept(9, A, 3, IDLE, 10.0, 0.0)  # takes the whole share
    m.accept(1, A, 3, IDLE, 10.0, 0.0)
    if phase != "held_back":
        m.computed(9, 0.5)
        m.settled(9, None, 0.6)  # job 1 is handed over
    if phase in ("computing", "settling"):
        m.step_started(1, 1.0)
    if phase == "settling":
        m.computed(1, 2.0)
    out = m.cancel(1, "acked")
    stop = [Unschedule(1)] if phase in ("queued", "computing") else []
    assert out == stop + [Settle(1)]
    assert m.state(1) is JobState.CANCELLING and not m.may_write(1, 2.0)
    assert m.cancel(1, "failed", "timeout", "late") == []  # the first stop wins
    assert m.settled(1, None, 2.5) == [Reply(1, "acked"), Release(1, "aborted")]
    assert m.settled(1, None, 2.6) == []  # the computed job's own Settle finds it ended


def test_a_deadline_cancels_jobs_still_to_compute_but_not_settling_ones():
    m = machine()
    m.accept(1, A, 1, IDLE, 10.0, 0.0)
    m.accept(2, A, 1, IDLE, 10.0, 0.0)
    m.computed(2, 1.0)
    assert m.overdue(1, IDLE) is not None and not m.may_write(1, IDLE)
    out = m.expire(IDLE)
    assert out == [Unschedule(1), Settle(1)]
    [reply, release] = m.settled(1, None, IDLE + 0.1)
    assert reply.kind == "failed" and reply.code == "timeout" and release.outcome == "errored"
    assert m.state(2) is JobState.SETTLING


def test_progress_pushes_deadlines_and_notifies_decoders_now_and_then():
    m = machine()
    m.accept(1, A, 1, IDLE, 100.0, 0.0)
    assert m.progressed(0.5) == []  # a quarter of the idle timeout has not passed
    assert m.progressed(1.0) == [1]
    assert m.progressed(1.5) == []
    assert m.expire(1.0 + IDLE - 0.01) == []
    m.computed(1, 2.0)
    assert m.progressed(9.0) == []  # settling: nothing left to compute


def test_the_absolute_cap_holds_whatever_the_progress():
    m = machine()
    m.accept(1, A, 1, IDLE, 6.0, 0.0)
    for t in (2.0, 4.0, 5.9):
        m.progressed(t)
    assert m.time_left(1, 5.0) == pytest.approx(1.0)
    assert m.expire(6.0) == [Unschedule(1), Settle(1)]


def test_a_failed_step_cancels_with_its_error():
    m = machine()
    m.accept(1, A, 1, IDLE, 10.0, 0.0)
    m.step_started(1, 0.1)
    assert m.cancel(1, "failed", "internal", "step failed: boom") == [Unschedule(1), Settle(1)]
    assert m.settled(1, None, 0.2)[0] == Reply(1, "failed", "internal", "step failed: boom")


ops = st.lists(st.one_of(
    st.tuples(st.just("accept"), st.sampled_from([A, B]), st.integers(1, 6)),
    st.tuples(st.just("step"), st.integers(0, 15)),
    st.tuples(st.just("computed"), st.integers(0, 15)),
    st.tuples(st.just("cancel"), st.integers(0, 15), st.sampled_from(["acked", "failed"])),
    st.tuples(st.just("settle"), st.integers(0, 15), st.booleans()),
    st.tuples(st.just("tick"), st.floats(0.0, 3.0)),
), max_size=60)


@settings(max_examples=300, deadline=None)
@given(ops)
def test_every_job_is_answered_once_and_released_after_its_answer(script):
    m = machine(max_jobs=6, max_pages=8)
    now = 0.0
    accepted: list[int] = []
    scheduled: set[int] = set()
    pending_settles: list[int] = []
    answers: dict[int, int] = {}
    released: set[int] = set()

    def run(cmds):
        for c in cmds:
            if isinstance(c, Schedule):
                assert c.job not in scheduled
                scheduled.add(c.job)
            elif isinstance(c, Unschedule):
                assert c.job in scheduled
            elif isinstance(c, Settle):
                pending_settles.append(c.job)
            elif isinstance(c, Reply):
                answers[c.job] = answers.get(c.job, 0) + 1
                assert answers[c.job] == 1, "answered twice"
            elif isinstance(c, Release):
                assert answers.get(c.job) == 1, "pages freed before the answer"
                assert c.job not in released
                released.add(c.job)
        held = {p: sum(j.pages for j in m.jobs.values() if j.peer == p and j.handed)
                for p in (A, B)}
        for p, n in held.items():  # a peer may exceed its page share only with a single job
            jobs = [j for j in m.jobs.values() if j.peer == p and j.handed]
            assert n <= 8 or len(jobs) == 1

    for op in script:
        match op:
            case ("accept", peer, pages):
                if m.refusal(peer) is None:
                    job = len(accepted)
                    accepted.append(job)
                    run(m.accept(job, peer, pages, IDLE, 12.0, now))
            case ("step", i):
                m.step_started(i, now)
            case ("computed", i):
                if i in scheduled:
                    run(m.computed(i, now))
            case ("cancel", i, kind):
                run(m.cancel(i, kind, "x", "y"))
            case ("settle", i, ok):
                if i in pending_settles:
                    pending_settles.remove(i)
                    run(m.settled(i, None if ok else "write failed", now))
            case ("tick", dt):
                now += dt
                run(m.expire(now))

    now += 1000
    run(m.expire(now))
    for job in list(m.jobs):  # a computed job's writes settle in the end
        run(m.computed(job, now))
    while pending_settles:
        run(m.settled(pending_settles.pop(), None, now))
    assert not m.jobs and not m.quota.jobs and not m.quota.pages
    assert set(answers) == set(accepted) == released
