"""The decode side's remote-prefill machine (disagg.remote.decode), with a fake clock: every
transition, every failure at every phase, and property tests of its two promises."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from disagg.remote.deadlines import DEADLINE_GRACE_S, prefill_cap_s
from disagg.remote.decode import (
    Abort,
    AttemptState,
    DecodeRemote,
    Fail,
    Forget,
    Free,
    Local,
    Policy,
    Ready,
    Send,
)

IDLE, PEER, QUEUE = 4.0, 1.0, 50.0
PAGES = (3, 4, 5)


def machine(on_failure: str = "error", peers: int = 1) -> DecodeRemote:
    gens = itertools.count(7)
    m = DecodeRemote(Policy(on_failure, IDLE, PEER, QUEUE), lambda: next(gens))  # type: ignore[arg-type]
    m.set_peers_alive(peers)
    return m


def sent(m: DecodeRemote, slot: int = 0, now: float = 0.0, tokens: int = 10) -> Send:
    """Admit ``slot`` and give it its pages: its first attempt goes out."""
    m.admit(slot, tokens, len(PAGES), now)
    assert m.head() == (slot, len(PAGES))
    out = m.reserved(slot, list(PAGES), now)
    assert len(out) == 1 and isinstance(out[0], Send)
    return out[0]


def state(m: DecodeRemote, rid: str) -> AttemptState:
    return m.attempts[rid].state


# ---------------------------------------------------------------- the happy path


def test_queued_then_sent_then_landed_hands_the_pages_to_the_sequence():
    m = machine()
    m.admit(0, 10, 3, 0.0)
    assert m.waiting_for_kv() == 1 and m.in_flight() == 0 and m.head() == (0, 3)
    s = m.reserved(0, list(PAGES), 0.5)[0]
    assert isinstance(s, Send) and s.pages == PAGES and s.request_id.startswith("0.")
    assert s.cap_s == prefill_cap_s(IDLE, 10)
    assert m.head() is None and m.in_flight() == 1 and state(m, s.request_id) is AttemptState.WAITING
    assert m.event(s.request_id, "landed", 1.0) == [Forget(s.request_id), Ready(0, PAGES)]
    assert m.waiting_for_kv() == 0 and m.in_flight() == 0 and m.pages_held() == 0


def test_the_queue_gives_pages_in_admission_order():
    m = machine()
    m.admit(0, 10, 3, 0.0)
    m.admit(1, 10, 2, 0.0)
    assert m.head() == (0, 3)
    with pytest.raises(AssertionError):
        m.reserved(1, [1, 2], 0.0)
    m.reserved(0, [1, 2, 3], 0.0)
    assert m.head() == (1, 2)


def test_a_request_queued_past_the_queue_timeout_fails_with_timeout():
    m = machine()
    m.admit(0, 10, 3, 0.0)
    assert m.next_deadline() == QUEUE
    assert m.expire(QUEUE - 0.1) == []
    [fail] = m.expire(QUEUE)
    assert isinstance(fail, Fail) and fail.code == "timeout" and "--queue-timeout" in fail.message
    assert m.waiting_for_kv() == 0


def test_progress_pushes_the_idle_deadline_but_never_past_the_cap():
    m = machine()
    s = sent(m, tokens=2048)  # cap: 3 x IDLE
    for t in (3.0, 6.0, 9.0, 11.5):
        assert m.expire(t) == []
        m.event(s.request_id, "progress", t)
    assert m.next_deadline() == pytest.approx(3 * IDLE)
    assert m.expire(3 * IDLE) == [Abort(s.request_id, True)]


# ---------------------------------------------------------------- refusals (acknowledged)


@pytest.mark.parametrize("policy", ["error", "retry", "local"])
def test_a_refusal_settles_the_attempt_and_applies_the_policy(policy):
    m = machine(policy)
    s = sent(m)
    out = m.event(s.request_id, "failed", 1.0, "overloaded", "busy")
    assert out[0] == Forget(s.request_id)
    if policy == "error":
        assert out[1:] == [Free(PAGES), Fail(0, "prefill_failed", "overloaded: busy")]
    elif policy == "local":
        assert out[1:] == [Free(PAGES), Local(0, "overloaded: busy")]
    else:  # settled: the retry reuses the same pages at once
        [retry] = out[1:]
        assert isinstance(retry, Send) and retry.pages == PAGES
        assert retry.request_id != s.request_id and retry.key != s.key
        # the second refusal is final: at most MAX_ATTEMPTS attempts
        out = m.event(retry.request_id, "failed", 2.0, "overloaded", "busy")
        assert out == [Forget(retry.request_id), Free(PAGES),
                       Fail(0, "prefill_failed", "overloaded: busy")]
    assert m.pages_held() == 0 and m.waiting_for_kv() == 0


def test_no_prefiller_at_send_time_prefills_locally_whatever_the_policy():
    m = machine("error")
    s = sent(m)
    out = m.event(s.request_id, "failed", 0.1, "no_prefiller", "no prefiller is alive")
    assert out == [Forget(s.request_id), Free(PAGES), Local(0, "no_prefiller: no prefiller is alive")]


def test_retry_needs_a_live_prefiller():
    m = machine("retry")
    s = sent(m)
    m.set_peers_alive(0)
    out = m.event(s.request_id, "failed", 1.0, "internal", "step failed")
    assert out == [Forget(s.request_id), Free(PAGES), Fail(0, "prefill_failed", "internal: step failed")]


def test_with_no_prefiller_alive_queued_requests_are_prefilled_here():
    m = machine()
    m.admit(0, 10, 3, 0.0)
    m.admit(1, 10, 3, 0.0)
    assert m.set_peers_alive(0) == [Local(0, "no prefiller is alive"), Local(1, "no prefiller is alive")]
    assert m.waiting_for_kv() == 0 and m.head() is None


# ---------------------------------------------------------------- timeouts: drain, then fence


@pytest.mark.parametrize("settle", ["acked", "done", "failed", "conn_down"])
def test_a_timeout_drains_and_an_acknowledgement_settles_it(settle):
    m = machine("error")
    s = sent(m)
    assert m.expire(IDLE) == [Abort(s.request_id, True)]
    assert state(m, s.request_id) is AttemptState.DRAINING and m.pages_fenced() == 0
    assert m.event(s.request_id, "landed", IDLE + 0.1) == []  # not wanted any more
    out = m.event(s.request_id, settle, IDLE + 0.5, "timeout", "late")
    assert out[:2] == [Forget(s.request_id), Free(PAGES)]
    assert isinstance(out[2], Fail) and out[2].code == "timeout"


def test_a_timeout_acknowledged_is_retried_on_the_same_pages():
    m = machine("retry")
    s = sent(m)
    m.expire(IDLE)
    out = m.event(s.request_id, "acked", IDLE + 0.2)
    assert out[0] == Forget(s.request_id)
    assert isinstance(out[1], Send) and out[1].pages == PAGES and len(out) == 2


def test_no_acknowledgement_fences_the_pages_and_the_request_moves_on():
    m = machine("error")
    s = sent(m)
    m.expire(IDLE)
    [fail] = m.expire(IDLE + PEER)
    assert isinstance(fail, Fail) and fail.code == "timeout"
    assert state(m, s.request_id) is AttemptState.FENCED
    assert m.pages_fenced() == len(PAGES) and m.waiting_for_kv() == 0 and m.in_flight() == 1
    # the fence lifts on an acknowledgement ...
    assert m.event(s.request_id, "acked", IDLE + 9) == [Forget(s.request_id), Free(PAGES)]
    assert m.pages_fenced() == 0 and m.in_flight() == 0


def test_a_fence_lifts_after_the_absolute_deadline_and_its_grace():
    m = machine("error")
    s = sent(m)
    m.expire(IDLE)
    m.expire(IDLE + PEER)
    end = s.cap_s + DEADLINE_GRACE_S
    assert m.next_deadline() == pytest.approx(end)
    assert m.expire(end - 0.01) == []
    assert m.expire(end) == [Forget(s.request_id), Free(PAGES)]


def test_a_fenced_attempt_is_retried_on_new_pages_and_its_old_pages_stay_fenced():
    m = machine("retry")
    s = sent(m)
    m.expire(IDLE)
    assert m.expire(IDLE + PEER) == []  # requeued at the head: it needs new pages
    assert m.head() == (0, 3) and m.pages_fenced() == 3
    [retry] = m.reserved(0, [7, 8, 9], IDLE + PEER)
    assert isinstance(retry, Send) and retry.pages == (7, 8, 9)
    # a late write of the old attempt completes nothing; its pages free only when settled
    assert m.event(s.request_id, "landed", IDLE + 2) == []
    assert m.event(retry.request_id, "landed", IDLE + 3) == [Forget(retry.request_id),
                                                              Ready(0, (7, 8, 9))]
    assert m.event(s.request_id, "conn_down", IDLE + 4) == [Forget(s.request_id), Free(PAGES)]


def test_a_fenced_request_that_was_already_retried_fails_at_once():
    m = machine("retry")
    s = sent(m, tokens=4096)  # its fence lasts past the retry's failure
    m.expire(IDLE)
    m.expire(IDLE + PEER)
    retry = m.reserved(0, [7, 8, 9], 10.0)[0]
    assert isinstance(retry, Send)
    m.expire(10.0 + IDLE)
    [fail] = m.expire(10.0 + IDLE + PEER)
    assert isinstance(fail, Fail) and m.pages_fenced() == 6 and s.request_id in m.attempts


# ---------------------------------------------------------------- peer death


def test_a_dead_prefiller_aborts_and_fences_at_once():
    m = machine("local")
    s = sent(m)
    out = m.event(s.request_id, "peer_dead", 1.0, "prefiller_dead", "gone")
    assert out == [Abort(s.request_id, True), Local(0, "prefiller_dead: gone")]
    assert state(m, s.request_id) is AttemptState.FENCED and m.pages_fenced() == 3
    assert m.event(s.request_id, "peer_dead", 1.5) == []
    assert m.event(s.request_id, "conn_down", 2.0) == [Forget(s.request_id), Free(PAGES)]


def test_a_draining_attempt_whose_prefiller_dies_is_fenced():
    m = machine("error")
    s = sent(m)
    m.expire(IDLE)
    [fail] = m.event(s.request_id, "peer_dead", IDLE + 0.1)
    assert isinstance(fail, Fail) and state(m, s.request_id) is AttemptState.FENCED


def test_a_connection_drop_while_waiting_changes_nothing():
    m = machine()
    s = sent(m)
    assert m.event(s.request_id, "conn_down", 1.0) == []
    assert state(m, s.request_id) is AttemptState.WAITING


# ---------------------------------------------------------------- aborts in every phase


def test_abort_while_queued_takes_it_out_of_the_queue():
    m = machine()
    m.admit(0, 10, 3, 0.0)
    assert m.cancel(0, 1.0) == [] and m.head() is None and m.waiting_for_kv() == 0


def test_abort_while_waiting_drains_then_frees_on_the_acknowledgement():
    m = machine("retry")
    s = sent(m)
    assert m.cancel(0, 1.0) == [Abort(s.request_id, False)]
    assert m.waiting_for_kv() == 0 and m.pages_fenced() == 3
    assert m.event(s.request_id, "acked", 1.2) == [Forget(s.request_id), Free(PAGES)]


def test_abort_while_waiting_with_no_acknowledgement_keeps_the_fence_until_the_deadline():
    m = machine()
    s = sent(m)
    m.cancel(0, 1.0)
    assert m.expire(1.0 + PEER) == []  # fenced; no outcome: the request is gone already
    assert state(m, s.request_id) is AttemptState.FENCED
    assert m.expire(s.cap_s + DEADLINE_GRACE_S) == [Forget(s.request_id), Free(PAGES)]


def test_abort_while_draining_after_a_timeout():
    m = machine("retry")
    s = sent(m)
    m.expire(IDLE)
    assert m.cancel(0, IDLE + 0.1) == []
    assert m.event(s.request_id, "acked", IDLE + 0.2) == [Forget(s.request_id), Free(PAGES)]


def test_abort_after_a_fence_while_the_retry_waits_for_pages():
    m = machine("retry")
    s = sent(m)
    m.expire(IDLE)
    m.expire(IDLE + PEER)
    assert m.cancel(0, 6.0) == [] and m.head() is None and m.pages_fenced() == 3
    assert m.event(s.request_id, "done", 7.0) == [Forget(s.request_id), Free(PAGES)]


def test_abort_after_the_kv_landed_is_not_the_machines_business():
    m = machine()
    s = sent(m)
    m.event(s.request_id, "landed", 1.0)
    assert m.cancel(0, 2.0) == []
    assert m.event(s.request_id, "done", 2.0) == []  # late news of a finished attempt


def test_done_before_the_kv_arrived_waits_for_the_kv():
    m = machine()
    s = sent(m)
    assert m.event(s.request_id, "done", 1.0) == []
    assert m.event(s.request_id, "landed", 1.1) == [Forget(s.request_id), Ready(0, PAGES)]


def test_events_of_unknown_attempts_are_ignored():
    m = machine()
    sent(m)
    for kind in ("landed", "progress", "failed", "done", "acked", "peer_dead", "conn_down"):
        assert m.event("0.999", kind, 1.0) == []  # type: ignore[arg-type]


# ---------------------------------------------------------------- properties


KINDS = ["landed", "progress", "failed", "done", "acked", "peer_dead", "conn_down"]
ops = st.lists(st.one_of(
    st.tuples(st.just("admit"), st.integers(1, 3000)),
    st.tuples(st.just("pump"), st.just(0)),
    st.tuples(st.just("event"), st.integers(0, 40), st.sampled_from(KINDS)),
    st.tuples(st.just("cancel"), st.integers(0, 12)),
    st.tuples(st.just("tick"), st.floats(0.0, 8.0)),
    st.tuples(st.just("peers"), st.integers(0, 2)),
    st.tuples(st.just("finish"), st.integers(0, 12)),
), max_size=80)


@settings(max_examples=300, deadline=None)
@given(ops, st.sampled_from(["error", "retry", "local"]))
def test_no_page_is_both_free_and_writable_and_every_request_ends_once(script, policy):
    total = 24
    m = machine(policy)
    free = set(range(total))  # the pool
    owned: dict[int, set[int]] = {}  # slot -> pages its sequence holds (after Ready)
    writable: dict[str, tuple[set[int], float]] = {}  # sent attempts a prefiller may write
    sends: list[str] = []
    outcome: dict[int, str] = {}
    admitted: list[int] = []
    cancelled: set[int] = set()
    now = 0.0

    def run(cmds):
        for c in cmds:
            if isinstance(c, Send):
                assert c.request_id not in writable
                writable[c.request_id] = (set(c.pages), now + c.cap_s + DEADLINE_GRACE_S)
                sends.append(c.request_id)
            elif isinstance(c, Free):
                assert not set(c.pages) & free, "a page freed twice"
                free.update(c.pages)
            elif isinstance(c, Ready):
                assert c.slot not in outcome and c.slot not in cancelled
                outcome[c.slot] = "ready"
                owned[c.slot] = set(c.pages)
            elif isinstance(c, Local | Fail):
                assert c.slot not in outcome and c.slot not in cancelled
                outcome[c.slot] = type(c).__name__
        for rid, (pages, _) in writable.items():
            assert not pages & free, f"pages of {rid} are free while it may write them"
        held = sum(map(len, owned.values())) + len(free) + m.pages_held()
        assert held == total, "a page leaked or was counted twice"

    for op in script:
        match op:
            case ("admit", tokens):
                slot = len(admitted)
                admitted.append(slot)
                m.admit(slot, tokens, 1 + tokens % 5, now)
            case ("pump", _):
                while (head := m.head()) is not None and len(free) >= head[1]:
                    pages = sorted(free)[: head[1]]
                    free.difference_update(pages)
                    run(m.reserved(head[0], pages, now))
            case ("event", i, kind):
                if i < len(sends):
                    rid = sends[i]
                    if kind in ("failed", "done", "acked", "conn_down", "landed"):
                        writable.pop(rid, None)  # the world says: nothing more of it lands
                    run(m.event(rid, kind, now, "overloaded", "x"))
            case ("cancel", i):
                if i < len(admitted) and admitted[i] not in outcome and admitted[i] not in cancelled:
                    cancelled.add(admitted[i])
                    run(m.cancel(admitted[i], now))
            case ("finish", i):
                if i < len(admitted) and admitted[i] in owned:
                    free.update(owned.pop(admitted[i]))
            case ("tick", dt):
                now += dt
                for rid in [r for r, (_, end) in writable.items() if now > end]:
                    del writable[rid]  # past the absolute deadline the prefiller posts nothing
                run(m.expire(now))
            case ("peers", n):
                run(m.set_peers_alive(n))

    # time passes far beyond every deadline: everything ends, every page comes back
    run(m.set_peers_alive(0))
    now += 10_000
    writable.clear()
    run(m.expire(now))
    for slot in list(owned):
        free.update(owned.pop(slot))
    assert m.waiting_for_kv() == 0 and m.in_flight() == 0 and m.pages_held() == 0
    assert len(free) == total
    for slot in admitted:
        assert (slot in outcome) != (slot in cancelled), f"slot {slot}: no single end"
