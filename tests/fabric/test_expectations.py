"""The expectation table both transfer backends share (pure: no engine, no threads)."""

import asyncio

import pytest

from disagg.fabric.expectations import ExpectationTable, TransferTimeout


def settle(events):
    for fut, exc in events:
        if exc is None:
            fut.set_result(None)
        else:
            fut.set_exception(exc)


@pytest.fixture
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def test_met_by_arrivals_in_any_order(loop):
    t = ExpectationTable()
    e = t.expect(7, 3, loop.create_future(), deadline=10.0)
    events = []
    t.arrive([7, 9], events)
    assert events == [] and len(t) == 1
    t.arrive({7: 2}, events)
    assert [f for f, _ in events] == [e.future] and len(t) == 0
    settle(events)
    assert e.future.result() is None


def test_arrivals_before_expect_are_junk_and_never_count(loop):
    t = ExpectationTable()
    t.arrive([5, 5], [])  # nobody expects 5 yet: a forgery or a stray write
    assert t.junk == 2
    e = t.expect(5, 2, loop.create_future(), deadline=10.0)  # does not raise, not met
    assert not e.future.done() and e.landed() == 0
    events = []
    t.arrive([5, 5], events)
    assert [f for f, _ in events] == [e.future]


def test_junk_cannot_complete_early_or_raise(loop):
    t = ExpectationTable(weight_bits=4)
    e = t.expect(3, 5, loop.create_future(), deadline=10.0)
    events = []
    t.arrive([(3 << 4) | 0, (3 << 4) | 9, (4 << 4) | 5], events)  # zero weight, overflow, other
    assert not events and e.landed() == 0 and t.junk == 3
    t.arrive([(3 << 4) | 2] * 3, events)  # 6 units of 5: two arrivals fit, one is junk
    assert not events and e.landed() == 4 and t.junk == 4
    t.arrive([(3 << 4) | 1], events)
    assert [f for f, _ in events] == [e.future]
    t.arrive([(3 << 4) | 1], events)  # finished: junk, no second event
    assert len(events) == 1 and t.junk == 5


def test_junk_report_is_rate_limited(loop):
    t = ExpectationTable()
    assert t.junk_report(0.0) is None
    t.arrive([0xAB] * 3, [])
    first = t.junk_report(100.0)
    assert first is not None and first.startswith("3 ") and "0xab" in first
    t.arrive([0xCD], [])
    assert t.junk_report(101.0) is None  # within the period
    later = t.junk_report(200.0)
    assert later is not None and later.startswith("1 ") and "0xcd" in later


def test_weighted_immediates_count_units(loop):
    t = ExpectationTable(weight_bits=4)
    e = t.expect(3, 5, loop.create_future(), deadline=10.0)
    events = []
    t.arrive([(3 << 4) | 2], events)
    assert not events
    t.arrive([(3 << 4) | 3], events)
    assert [f for f, _ in events] == [e.future]


def test_cancel_frees_the_immediate(loop):
    t = ExpectationTable()
    e = t.expect(1, 2, loop.create_future(), deadline=10.0)
    t.arrive([1], [])
    assert e.cancel() and e.future.cancelled() and len(t) == 0
    assert not e.cancel()
    # a new expectation on the same value starts from zero
    e2 = t.expect(1, 2, loop.create_future(), deadline=10.0)
    events = []
    t.arrive([1], events)
    assert not events
    t.arrive([1], events)
    assert [f for f, _ in events] == [e2.future]


def test_expire_and_fail_all(loop):
    t = ExpectationTable()
    late = t.expect(1, 4, loop.create_future(), deadline=1.0)
    t.arrive([1], [])
    live = t.expect(2, 1, loop.create_future(), deadline=5.0)
    events = []
    t.expire(2.0, events)
    assert len(events) == 1 and events[0][0] is late.future
    assert isinstance(events[0][1], TransferTimeout) and "1 of 4" in str(events[0][1])
    assert not late.cancel() and len(t) == 1
    err = RuntimeError("closed")
    assert t.fail_all(err) == [(live.future, err)] and len(t) == 0


def test_only_non_standing_expectations_are_urgent(loop):
    """A standing expectation (a challenge key armed for an hour) does not count as writes
    due soon: a receiver polling for completions (shm: no completion fd) may nap long."""
    t = ExpectationTable()
    assert not t.urgent()
    armed = t.expect(1, 16, loop.create_future(), deadline=3600.0, standing=True)
    assert len(t) == 1 and not t.urgent()
    due = t.expect(2, 4, loop.create_future(), deadline=5.0)
    assert t.urgent()
    t.arrive({2: 4}, [])
    assert not t.urgent() and len(t) == 1
    assert armed.cancel() and len(t) == 0 and not t.urgent()
    assert due.future is not None
