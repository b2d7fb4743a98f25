"""Who may start an ownership check (issue 41, item 2): bounds in all, per identity and per
address; failures back the identity off exponentially; waiting checks in arrival order with
deadlines; a nonce slot comes back once its write is known dead."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from disagg.actors.prefill_messenger.ownership_gate import known_dead
from disagg.fabric.expectations import NotPosted, TransferTimeout
from disagg.fabric.lib import FabricError
from disagg.remote.check_quotas import CheckQuotas, CheckWaits


def test_checks_are_bounded_in_all_per_identity_and_per_address():
    q = CheckQuotas(max_checks=4, per_identity=2, per_address=3)
    for _ in range(2):
        assert q.refusal(b"a", "h1", 0.0) is None
        q.started(b"a", "h1")
    assert "of this decoder" in (q.refusal(b"a", "h1", 0.0) or "")
    assert q.refusal(b"b", "h1", 0.0) is None
    q.started(b"b", "h1")
    assert "from this address" in (q.refusal(b"c", "h1", 0.0) or "")
    assert q.refusal(b"c", "h2", 0.0) is None
    q.started(b"c", "h2")
    assert "too many ownership checks under way" == q.refusal(b"d", "h3", 0.0)
    q.ended(b"a", "h1", "inconclusive", 0.0)
    assert q.refusal(b"d", "h3", 0.0) is None and q.refusal(b"a", "h1", 0.0) is None


def test_failures_back_the_identity_off_exponentially_and_a_pass_forgets_them():
    q = CheckQuotas(backoff_s=0.5, backoff_max_s=4.0)
    now = 0.0
    waits = []
    for _ in range(6):
        q.started(b"a", "h")
        q.ended(b"a", "h", "failed", now)
        waits.append(q.backed_off_until(b"a") - now)
        assert "ownership checks failed" in (q.refusal(b"a", "h", now) or "")
        assert q.refusal(b"b", "h", now) is None  # another identity of the same host is not
        now = q.backed_off_until(b"a")
        assert q.refusal(b"a", "h", now) is None
    assert waits == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]
    q.started(b"a", "h")
    q.ended(b"a", "h", "inconclusive", now)  # an abstention costs nothing
    assert q.backed_off_until(b"a") == now  # unchanged
    q.started(b"a", "h")
    q.ended(b"a", "h", "passed", now)
    assert q.backed_off_until(b"a") == 0.0


def test_the_failures_remembered_are_bounded():
    q = CheckQuotas(max_tracked=3)
    for i in range(10):
        q.started(i, "h")
        q.ended(i, "h", "failed", 0.0)
    assert list(q.failures) == [7, 8, 9]


def test_waiting_checks_keep_their_order_and_expire_at_their_deadline():
    w: CheckWaits[str, int] = CheckWaits()
    w.add("c1", 1, deadline=5.0)
    w.add("c2", 2, deadline=3.0)
    w.add("c1", 9, deadline=1.0)  # one per connection: the first stays
    assert w.in_order() == [("c1", 1), ("c2", 2)] and "c1" in w and len(w) == 2
    assert w.expired(2.9) == [] and w.expired(3.0) == [("c2", 2)]
    assert w.remove("c1") == 1 and w.remove("c1") is None and len(w) == 0


def test_a_nonce_slot_comes_back_once_no_write_can_still_read_it():
    assert known_dead([]) and known_dead([None, None])
    assert known_dead([NotPosted("queued at the deadline, not posted")])
    assert known_dead([None, FabricError("write completion", -5)])
    assert not known_dead([TransferTimeout("unfinished at the deadline")])
    assert not known_dead([None, TransferTimeout("unfinished at the deadline")])


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["start", "end"]), st.integers(0, 5),
                          st.integers(0, 2), st.sampled_from(["passed", "failed",
                                                               "inconclusive"])),
                max_size=150))
def test_the_bounds_hold_whatever_the_order(ops):
    """Checks start only when ``refusal`` says so and end in any order: no bound is ever
    passed, the counts return to zero, and an identity in back-off never starts one."""
    q = CheckQuotas(max_checks=5, per_identity=2, per_address=3)
    running: list[tuple[int, str]] = []
    now = 0.0
    for op, ident, host, outcome in ops:
        now += 0.3
        address = f"h{host}"
        if op == "start":
            if q.refusal(ident, address, now) is None:
                assert q.backed_off_until(ident) <= now
                q.started(ident, address)
                running.append((ident, address))
        elif running:
            i, a = running.pop(ident % len(running))
            q.ended(i, a, outcome, now)  # type: ignore[arg-type]
        assert q.under_way == len(running) <= 5
        assert all(n <= 2 for n in q.by_identity.values())
        assert all(n <= 3 for n in q.by_address.values())
    for i, a in running:
        q.ended(i, a, "passed", now)
    assert q.under_way == 0 and not q.by_identity and not q.by_address
