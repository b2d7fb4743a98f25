"""``LoopPoller`` (disagg.actors.sockets): the actors' wait for a message, woken in one loop
turn. It must see a message already queued, one sent while it waits (libzmq's fd signals only
a change), give up at its timeout, and leave pyzmq's own waiting on the same socket intact."""

from __future__ import annotations

import asyncio
import os

import pytest
import zmq
import zmq.asyncio

from disagg.actors.sockets import LoopPoller, pending_frames


@pytest.fixture
def pair():
    ctx = zmq.asyncio.Context()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    a.bind("inproc://loop-poller")
    b.connect("inproc://loop-poller")
    yield a, b
    a.close(linger=0)
    b.close(linger=0)
    ctx.term()


def test_a_queued_message_a_later_one_and_the_timeout(pair):
    a, b = pair

    async def go() -> None:
        p = LoopPoller()
        p.register(b, zmq.POLLIN)
        assert await p.poll(20) == []  # nothing: the timeout
        await a.send(b"1")
        assert await p.poll(1000) == [(b, zmq.POLLIN)]  # queued before the poll
        assert await b.recv(zmq.NOBLOCK) == b"1"
        # the socket was read until empty only after a look at EVENTS: the fd's next signal
        # is the one a later send gives; the poll must wake on it
        asyncio.get_running_loop().call_later(0.05, lambda: a.send(b"2"))
        assert dict(await asyncio.wait_for(p.poll(None), 5)) == {b: zmq.POLLIN}
        assert await b.recv(zmq.NOBLOCK) == b"2"
        p.close()

    asyncio.run(go())


def test_two_sockets_the_one_with_a_message_is_named(pair):
    a, b = pair

    async def go() -> None:
        p = LoopPoller()
        p.register(a, zmq.POLLIN)
        p.register(b, zmq.POLLIN)
        asyncio.get_running_loop().call_later(0.02, lambda: b.send(b"to a"))
        assert await asyncio.wait_for(p.poll(5000), 5) == [(a, zmq.POLLIN)]
        p.close()

    asyncio.run(go())


def test_pyzmq_waits_on_the_same_socket_still_work_and_unregister_closes_the_dup(pair):
    a, b = pair

    async def go() -> None:
        p = LoopPoller()
        p.register(b, zmq.POLLIN)
        dup = p._fds[b]
        waiting = asyncio.ensure_future(b.recv())  # pyzmq's own reader on the socket's fd
        await asyncio.sleep(0.01)
        assert await p.poll(20) == []
        await a.send(b"x")
        assert await asyncio.wait_for(waiting, 5) == b"x"
        p.unregister(b)
        with pytest.raises(OSError):
            os.fstat(dup)
        with pytest.raises(ValueError):
            p.register(b, zmq.POLLOUT)

    asyncio.run(go())


def test_draining_an_empty_socket_leaves_no_cyclic_garbage(pair):
    """``pending`` / ``pending_frames`` look at EVENTS before a receive: a zmq.asyncio receive
    that raises ``Again`` leaves a reference cycle (exception, traceback frames, future) for
    the collector, ~30 objects per empty drain, thousands a second on a busy node."""
    import gc

    from disagg.actors.sockets import pending, pending_frames

    a, b = pair

    async def drains() -> list[bytes]:
        got = []
        for i in range(50):
            await a.send(b"%d" % i)
            got += [x async for x in pending(b)]  # one message, then an empty socket
            async for frames in pending_frames(b):
                got.append(frames[0].bytes)
        return got

    gc.collect()
    gc.disable()
    try:
        got = asyncio.run(drains())
        found = gc.collect()
    finally:
        gc.enable()
    assert got == [b"%d" % i for i in range(50)]
    assert found < 50, f"{found} objects in reference cycles after 100 empty drains"


@pytest.mark.parametrize("every", [0, 8])
def test_a_long_drain_lets_other_callbacks_run_every_few_messages(pair, every):
    """``pending_frames(yield_every=N)``: a drain of 64 queued messages lets a callback that
    became ready meanwhile (a late grammar step's masks done on their thread) run after at
    most N more of them; without it (0), only after the last."""
    a, b = pair

    async def go() -> int | None:
        for i in range(64):
            await a.send_multipart([b"h", str(i).encode()])
        seen: list[int] = []
        ran_at: list[int] = []
        async for frames in pending_frames(b, yield_every=every):
            seen.append(int(frames[1].bytes))
            if len(seen) == 3:  # ready now: runs at the drain's next turn of the loop
                asyncio.get_running_loop().call_soon(lambda: ran_at.append(len(seen)))
        assert seen == list(range(64))  # every message, in order
        await asyncio.sleep(0)
        return ran_at[0]

    ran_at = asyncio.run(go())
    if every:
        assert ran_at <= 3 + every
    else:
        assert ran_at == 64
