"""How long a decode attempt's window stays open (disagg.remote.attempt_windows), alone and
driven by the remote-prefill machine (disagg.remote.decode) as the decode messenger drives it:
a write its prefiller may still send never meets a revoked key (libfabric 1.17 tcp would drop
the whole connection), a kept key never covers a page anyone else holds, and every window is
revoked by its attempt's fence deadline at the latest."""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from disagg.remote.attempt_windows import AttemptWindows
from disagg.remote.deadlines import DEADLINE_GRACE_S
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


class FakeWindow:
    def __init__(self) -> None:
        self.closes = 0

    def close(self) -> None:
        self.closes += 1


def test_a_stopped_attempts_window_stays_open_until_it_settles():
    ws, w = AttemptWindows(), FakeWindow()
    ws.open("0.7", w, revoke_by=10.0)
    ws.stop("0.7")  # the client aborted: its prefiller may still have writes on their way
    assert ws.is_open("0.7") and ws.kept() == 1 and w.closes == 0
    assert ws.settled("0.7")  # AbortAck: nothing more of it will be written
    assert not ws.is_open("0.7") and ws.kept() == 0 and w.closes == 1
    assert not ws.settled("0.7") and not ws.revoke("0.7") and w.closes == 1  # once


def test_done_at_the_source_keeps_a_wanted_window_but_not_a_stopped_one():
    ws, wanted, stopped = AttemptWindows(), FakeWindow(), FakeWindow()
    ws.open("0.1", wanted, 10.0)
    ws.open("1.1", stopped, 10.0)
    ws.stop("1.1")
    assert not ws.settled("0.1", done=True)  # its writes may still be on their way here
    assert ws.settled("1.1", done=True)
    assert (wanted.closes, stopped.closes) == (0, 1)
    assert ws.settled("0.1")  # failed: nothing more of it lands
    assert wanted.closes == 1 and len(ws) == 0


def test_every_window_is_revoked_by_its_deadline_whatever_else_happened():
    ws = AttemptWindows()
    wins = {rid: FakeWindow() for rid in ("0.1", "1.1", "2.1")}
    for i, (rid, w) in enumerate(wins.items()):
        ws.open(rid, w, revoke_by=5.0 + i)
    ws.stop("1.1")
    assert ws.expire(4.9) == []
    assert ws.expire(6.0) == ["0.1", "1.1"]
    assert [w.closes for w in wins.values()] == [1, 1, 0] and len(ws) == 1
    ws.revoke("2.1")  # forgotten
    assert ws.expire(100.0) == [] and wins["2.1"].closes == 1


# ---------------------------------------------------------------- with the machine

PEER_TIMEOUT = 1.0
KINDS = ["landed", "progress", "failed", "done", "acked", "peer_dead", "conn_down"]
SETTLING = ("failed", "done", "acked", "conn_down")  # the messenger revokes before passing on
ops = st.lists(st.one_of(
    st.tuples(st.just("admit"), st.integers(1, 3000)),
    st.tuples(st.just("pump"), st.just(0)),
    st.tuples(st.just("event"), st.integers(0, 40), st.sampled_from(KINDS)),
    st.tuples(st.just("write"), st.integers(0, 40)),
    st.tuples(st.just("cancel"), st.integers(0, 12)),
    st.tuples(st.just("tick"), st.floats(0.0, 8.0)),
    st.tuples(st.just("peers"), st.integers(0, 2)),
    st.tuples(st.just("finish"), st.integers(0, 12)),
), max_size=80)


@settings(max_examples=300, deadline=None)
@given(ops, st.sampled_from(["error", "retry", "local"]))
def test_a_kept_key_meets_every_late_write_and_no_page_of_another(script, policy):
    total = 24
    gens = itertools.count(7)
    m = DecodeRemote(Policy(policy, 4.0, PEER_TIMEOUT, 50.0), lambda: next(gens))  # type: ignore[arg-type]
    m.set_peers_alive(1)
    ws = AttemptWindows()
    free = set(range(total))  # the pool
    owned: dict[int, set[int]] = {}  # slot -> pages its sequence holds (after Ready)
    pages_of: dict[str, set[int]] = {}  # attempt -> the pages it asked its prefiller to fill
    writable: dict[str, float] = {}  # attempts their prefiller may still write -> deadline
    revoke_by: dict[str, float] = {}  # attempt -> its window's deadline
    sends: list[str] = []
    admitted: list[int] = []
    done: set[int] = set()
    now = 0.0

    def run(cmds):
        for c in cmds:  # what the scheduler and the messenger do, in the machine's order
            if isinstance(c, Send):
                pages_of[c.request_id] = set(c.pages)
                writable[c.request_id] = revoke_by[c.request_id] = (
                    now + c.cap_s + DEADLINE_GRACE_S)
                ws.open(c.request_id, FakeWindow(), revoke_by[c.request_id])
                sends.append(c.request_id)
            elif isinstance(c, Abort):
                ws.stop(c.request_id)
            elif isinstance(c, Forget):
                ws.revoke(c.request_id)
            elif isinstance(c, Free):
                free.update(c.pages)
            elif isinstance(c, Ready):
                owned[c.slot] = set(c.pages)
                done.add(c.slot)
            elif isinstance(c, Local | Fail):
                done.add(c.slot)
        open_rids = {rid for rid in sends if ws.is_open(rid)}
        # a key is kept exactly while its attempt's pages are fenced: never past the machine's
        # attempt (bounded, no leak), never on a page that is free or another's
        assert open_rids == set(m.attempts), "a window outlived its attempt, or never opened"
        for rid in open_rids:
            mine = pages_of[rid]
            assert not mine & free, f"{rid}'s key is kept on pages back in the pool"
            for slot, pages in owned.items():
                assert not mine & pages, f"{rid}'s key is kept on pages of sequence {slot}"
        # every write the prefiller may still send meets an open window: none drops the
        # connection the other jobs' writes share
        for rid in writable:
            assert ws.is_open(rid), f"a late write of {rid} would meet a revoked key"
        # the machine's fence revokes every key by its deadline: the messenger's own expiry
        # (ws.expire) is never needed here
        assert all(revoke_by[rid] > now for rid in open_rids), "a key kept past its deadline"

    for op in script:
        match op:
            case ("admit", tokens):
                admitted.append(len(admitted))
                m.admit(admitted[-1], tokens, 1 + tokens % 5, now)
            case ("pump", _):
                while (head := m.head()) is not None and len(free) >= head[1]:
                    pages = sorted(free)[: head[1]]
                    free.difference_update(pages)
                    run(m.reserved(head[0], pages, now))
            case ("event", i, kind) if i < len(sends):
                rid = sends[i]
                a = m.attempts.get(rid)
                if kind == "conn_down" and a is not None and a.state is AttemptState.WAITING:
                    continue  # the messenger reports a connection down only for attempts
                    # no longer wanted; for a wanted one the peer's liveness decides
                if kind in SETTLING or kind == "landed":
                    writable.pop(rid, None)  # the world says: nothing more of it lands
                if kind in SETTLING:
                    ws.settled(rid, done=kind == "done")
                run(m.event(rid, kind, now, "overloaded", "x"))
            case ("write", i) if i < len(sends) and sends[i] in writable:
                assert ws.is_open(sends[i])  # a late write lands (in fenced pages)
            case ("cancel", i) if i < len(admitted) and admitted[i] not in done:
                done.add(admitted[i])
                run(m.cancel(admitted[i], now))
            case ("finish", i) if i < len(admitted) and admitted[i] in owned:
                free.update(owned.pop(admitted[i]))
            case ("tick", dt):
                now += dt
                for rid in [r for r, end in writable.items() if now >= end]:
                    del writable[rid]  # past the deadline + grace nothing of it lands
                run(m.expire(now))
            case ("peers", n):
                run(m.set_peers_alive(n))

    run(m.set_peers_alive(0))
    now += 10_000
    writable.clear()
    run(m.expire(now))
    assert len(ws) == 0 and ws.expire(now) == []  # every window revoked
