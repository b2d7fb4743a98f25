"""The decode node's scheduler side (DecodeSide) against a fake scheduler port: the machine's
commands turned into messenger messages, pool pages and request outcomes, with no process."""

from __future__ import annotations

import asyncio
import time

import msgspec

from disagg.actors.scheduler.decode_scheduler import DecodeSide
from disagg.engine.cache import PagePool, page_hashes
from disagg.engine.scheduling import BatchScheduler, Sequence, Status
from disagg.protocol import Error, Finished, SamplingParams
from disagg.protocol.inproc import (
    AttemptEvent,
    ForgetPrefill,
    PeersAlive,
    SendPrefill,
    StopPrefill,
    ToMessenger,
)
from disagg.serving.admission import Counters, Limits
from disagg.serving.routing import encoded_prefix_keys

PAGE = 4


class FakePort:
    def __init__(self, pages: int = 16):
        self.pool = PagePool(pages)
        self.sched = BatchScheduler(self.pool, PAGE, 64, 8, 256, prefix_caching=True,
                                    cache_salt=b"m")
        self.page_size = PAGE
        self.limits = Limits(queue_timeout_s=100.0)
        self.counters = Counters()
        self.sent: list[object] = []
        self.tasks: set[asyncio.Task] = set()
        self.ended: list[tuple[Sequence, Finished | Error]] = []
        self._dec = msgspec.msgpack.Decoder(ToMessenger)

    def next_slot(self) -> int:
        return 0

    def spawn(self, coro) -> None:
        self.tasks.add(asyncio.ensure_future(coro))

    async def end(self, seq: Sequence, terminal: Finished | Error) -> None:
        self.ended.append((seq, terminal))

    async def to_messenger(self, frames: list[bytes]) -> None:
        self.sent.append(self._dec.decode(frames[0]))

    def stats(self):  # pragma: no cover - not used by the decode side
        raise NotImplementedError


def side_with(on_failure: str = "error", pages: int = 16) -> tuple[DecodeSide, FakePort]:
    port = FakePort(pages)
    side = DecodeSide(port, local_prefill_max_tokens=4, on_failure=on_failure,  # type: ignore[arg-type]
                      prefill_timeout_s=5.0, peer_timeout_s=1.0)
    return side, port


def long_seq(slot: int = 1, n: int = 17) -> Sequence:
    return Sequence(slot, f"r{slot}", list(range(1, n + 1)), SamplingParams(max_tokens=2), 0,
                    arrival=slot)


def run(coro):
    return asyncio.run(coro)


def test_a_long_prompt_goes_remote_and_runs_its_last_token_once_the_kv_landed():
    side, port = side_with()

    async def go():
        await side.handle_messenger(PeersAlive(1))
        seq = long_seq()
        assert await side.enqueue(seq)
        [send] = port.sent
        assert isinstance(send, SendPrefill) and send.prompt_ids() == seq.prompt_ids[:-1]
        assert seq.prompt_ids == list(range(1, 18))  # its last token back in place
        assert send.num_tokens == 16 and send.route_keys == encoded_prefix_keys(send.prompt)
        assert len(send.dst_pages) == 4 and port.pool.num_free == 16 - 5  # 17 tokens: 5 pages
        assert side.waiting_for_kv() == 1 and seq.status is Status.REMOTE
        await side.handle_messenger(AttemptEvent(send.request_id, "done", timings=(0.1, 0.2, 0.0, 0.0)))
        await side.handle_messenger(AttemptEvent(send.request_id, "landed"))
        assert isinstance(port.sent[-1], ForgetPrefill)
        assert seq.status is Status.RUNNING and seq.num_computed == 16 and len(seq.block_table) == 5
        side.emitting(seq)
        timings = side.timings_of(seq)
        assert timings is not None and timings["prefill_queue"] == 100.0  # the early PrefillDone

    run(go())


class NoIdsEncoder:  # messages yes, id lists no
    def encode(self, obj: object) -> bytes:
        assert not isinstance(obj, list), "the prompt ids were encoded again"
        return msgspec.msgpack.encode(obj)


def test_a_prompt_goes_out_as_its_client_frame_carried_it_less_its_last_id():
    ids = [(i * 7919) % 152000 for i in range(300)]
    sends = []
    for framed in (True, False):  # from a client's ids / tokenized on the node
        side, port = side_with(pages=128)
        seq = Sequence(1, "r1", list(ids), SamplingParams(max_tokens=2), 0, arrival=1,
                       prompt_msgpack=memoryview(msgspec.msgpack.encode(ids)) if framed else None)
        if framed:
            side._menc = NoIdsEncoder()  # type: ignore[assignment]

        async def go(side=side, seq=seq) -> None:
            await side.handle_messenger(PeersAlive(1))
            assert await side.enqueue(seq)

        run(go())
        [send] = port.sent
        assert isinstance(send, SendPrefill) and seq.prompt_ids == ids
        assert bytes(send.prompt) == msgspec.msgpack.encode(ids[:-1]) and send.num_tokens == 299
        sends.append(send)
    assert sends[0].route_keys == sends[1].route_keys == encoded_prefix_keys(sends[0].prompt)
    assert len(sends[0].route_keys) >= 3  # 299 ids of 3-5 bytes: full 256-byte blocks


def test_a_remote_prompts_pages_are_hashed_while_its_prefill_runs():
    """Its lookup hashes one page (nothing cached); the rest are hashed in the background
    before the KV lands, so caching them then hashes nothing on the first token's path."""
    side, port = side_with()

    async def go():
        await side.handle_messenger(PeersAlive(1))
        seq = long_seq(n=1 + 300 * PAGE)  # 300 full pages of prompt to prefill: several slices
        port.pool = port.sched.pool = PagePool(400)
        assert await side.enqueue(seq)
        assert len(seq.known_hashes) == 1
        for _ in range(200):  # bounded: a few ms of slices
            if len(seq.known_hashes) == 300:
                break
            await asyncio.sleep(0.001)
        assert len(seq.known_hashes) == seq.num_tokens // PAGE == 300
        assert seq.known_hashes == page_hashes(seq.prompt_ids, PAGE, port.sched.cache_root, 300)

    run(go())


def test_short_prompts_and_prompts_with_no_prefiller_stay_local():
    side, port = side_with()

    async def go():
        assert not await side.enqueue(long_seq(n=5))  # 4 tokens to prefill: local
        assert not await side.enqueue(long_seq(2))  # no prefiller alive yet
        assert port.sent == []

    run(go())


def test_an_abort_while_waiting_stops_the_prefill_and_frees_pages_only_when_acknowledged():
    side, port = side_with()

    async def go():
        await side.handle_messenger(PeersAlive(1))
        seq = long_seq()
        await side.enqueue(seq)
        send = port.sent[0]
        assert await side.release(seq)
        assert port.sent[-1] == StopPrefill(send.request_id, False)
        assert port.pool.num_free == 11 and side.pages_fenced() == 5
        await side.handle_messenger(AttemptEvent(send.request_id, "acked"))
        assert port.pool.num_free == 16 and side.transfers_in_flight() == 0
        assert port.pool.num_cached == 0  # an aborted attempt's pages never enter the cache

    run(go())


def test_received_pages_enter_the_prefix_cache_only_once_their_kv_landed_and_ran():
    side, port = side_with()

    async def go():
        await side.handle_messenger(PeersAlive(1))
        seq = long_seq()
        await side.enqueue(seq)
        send = port.sent[0]
        await side.handle_messenger(AttemptEvent(send.request_id, "landed"))
        batch = port.sched.schedule()  # the last prompt token, as a decode step
        assert batch is not None and batch.chunks[0].start == 16
        port.sched.update(batch, [5])
        port.sched.remove(seq)
        assert port.pool.num_cached == 4  # the 16 received tokens' pages; the 5th is partial
        again = Sequence(2, "r2", list(range(1, 18)), SamplingParams(max_tokens=1), 0, arrival=2)
        port.sched.add(again)
        batch = port.sched.schedule()
        assert batch is not None and batch.chunks[0].start == 16 and again.cached_tokens == 16

    run(go())


def test_a_refusal_with_retry_resends_on_the_same_pages_then_fails_the_request():
    side, port = side_with("retry")

    async def go():
        await side.handle_messenger(PeersAlive(1))
        seq = long_seq()
        await side.enqueue(seq)
        first = port.sent[0]
        await side.handle_messenger(AttemptEvent(first.request_id, "failed", "overloaded", "busy"))
        retry = port.sent[-1]
        assert isinstance(retry, SendPrefill) and retry.dst_pages == first.dst_pages
        assert retry.request_id != first.request_id
        await side.handle_messenger(AttemptEvent(retry.request_id, "failed", "overloaded", "busy"))
        [(ended, error)] = port.ended
        assert ended is seq and isinstance(error, Error) and error.code == "prefill_failed"
        assert port.pool.num_free == 16

    run(go())


def test_requests_wait_for_pages_and_start_when_pages_come_back():
    side, port = side_with(pages=6)

    async def go():
        await side.handle_messenger(PeersAlive(1))
        a, b = long_seq(1), long_seq(2)
        await side.enqueue(a)
        await side.enqueue(b)  # 5 + 5 pages > 6: b waits
        assert [type(m) for m in port.sent] == [SendPrefill]
        await side.release(a)
        await side.handle_messenger(AttemptEvent(port.sent[0].request_id, "acked"))
        await side.pages_changed()
        assert isinstance(port.sent[-1], SendPrefill) and port.sent[-1].request_id.startswith("2.")

    run(go())


def test_cached_leading_pages_are_held_not_written_and_complete_the_block_table():
    side, port = side_with()

    async def go():
        await side.handle_messenger(PeersAlive(1))
        first = long_seq(1)
        await side.enqueue(first)
        send = port.sent[0]
        await side.handle_messenger(AttemptEvent(send.request_id, "landed"))
        batch = port.sched.schedule()
        port.sched.update(batch, [5])
        port.sched.remove(first)  # its 4 full prompt pages are cached now
        # a longer prompt starting with the same 16 tokens (22 in all): 4 pages held, 2 reserved
        seq = Sequence(2, "r2", list(range(1, 18)) + [70, 71, 72, 73, 74], SamplingParams(
            max_tokens=2), 0, arrival=2)
        assert await side.enqueue(seq)
        send = port.sent[-1]
        assert isinstance(send, SendPrefill) and send.skip_pages == 4
        assert len(send.dst_pages) == 2 and not set(send.dst_pages) & set(seq.block_table)
        assert seq.cached_tokens == 16 and len(seq.block_table) == 4
        held = list(seq.block_table)
        await side.handle_messenger(AttemptEvent(send.request_id, "landed"))
        assert seq.block_table[:4] == held and len(seq.block_table) == 6
        assert seq.num_computed == len(seq.prompt_ids) - 1

    run(go())


def test_an_abort_frees_held_cached_pages_at_once():
    side, port = side_with()

    async def go():
        await side.handle_messenger(PeersAlive(1))
        first = long_seq(1)
        await side.enqueue(first)
        await side.handle_messenger(AttemptEvent(port.sent[0].request_id, "landed"))
        port.sched.update(port.sched.schedule(), [5])
        port.sched.remove(first)
        seq = Sequence(2, "r2", list(range(1, 18)) + [70, 71, 72, 73, 74], SamplingParams(
            max_tokens=2), 0, arrival=2)
        await side.enqueue(seq)
        assert port.pool.num_cached == 0  # held by seq
        await side.release(seq)
        assert port.pool.num_cached == 4  # back to the cache at once; the 2 reserved fenced
        assert side.pages_fenced() == 2

    run(go())


def test_a_prompt_mostly_cached_is_prefilled_locally():
    side, port = side_with()

    async def go():
        await side.handle_messenger(PeersAlive(1))
        first = long_seq(1)
        await side.enqueue(first)
        await side.handle_messenger(AttemptEvent(port.sent[0].request_id, "landed"))
        port.sched.update(port.sched.schedule(), [5])
        port.sched.remove(first)
        # 16 of 17 prompt tokens cached: 0 left to prefill remotely (threshold 4)
        assert not await side.enqueue(long_seq(2))

    run(go())


def test_pages_of_a_failed_or_fenced_attempt_never_enter_the_cache():
    """A refused attempt's pages go back uncached; a cancelled one's reserved pages stay fenced
    until the prefiller acknowledges, then come back free and uncached too."""
    side, port = side_with()

    async def go():
        await side.handle_messenger(PeersAlive(1))
        failed = long_seq(1)
        await side.enqueue(failed)
        await side.handle_messenger(AttemptEvent(port.sent[0].request_id, "failed",
                                                 "transfer_failed", "broken write"))
        assert isinstance(port.ended[-1][1], Error)
        assert port.pool.num_cached == 0 and port.pool.num_free == 16
        cut = long_seq(2)
        await side.enqueue(cut)
        await side.release(cut)  # ended while its writes may still land: fenced
        assert side.pages_fenced() == 5 and port.pool.num_cached == 0
        await side.handle_messenger(AttemptEvent(port.sent[-2].request_id, "acked"))
        assert side.pages_fenced() == 0
        assert port.pool.num_cached == 0 and port.pool.num_free == 16

    run(go())


def test_a_finish_before_prefilldone_waits_for_its_timings_and_hit():
    """The KV landed, the request finished, and only then the prefiller's PrefillDone came:
    the Finished carries the prefiller's timings and prefix-cache hit anyway, whatever the
    order; without any PrefillDone it goes out after the hold bound, without them."""
    from disagg.actors.scheduler.decode_scheduler import HOLD_FINISH_S

    async def go(done_first: bool, done: bool):
        side, port = side_with()
        await side.handle_messenger(PeersAlive(1))
        seq = long_seq()
        await side.enqueue(seq)
        rid = port.sent[0].request_id
        event = AttemptEvent(rid, "done", timings=(0.01, 0.02, 0.0, 0.0), cached_tokens=8)
        if done_first:
            await side.handle_messenger(event)
        await side.handle_messenger(AttemptEvent(rid, "landed"))
        side.emitting(seq)
        held = await side.hold_finish(seq, "length")
        assert held is not done_first
        if done and not done_first:
            assert port.ended == []
            await side.handle_messenger(event)
        elif not done:
            await side.expire(time.monotonic() + HOLD_FINISH_S + 0.1)
        if held:
            [(ended, fin)] = port.ended
            assert ended is seq and isinstance(fin, Finished) and fin.reason == "length"
            assert fin.timings is not None
            assert ("prefill_queue" in fin.timings) is done
            assert fin.usage.cached_tokens == (8 if done else 0)
        else:  # nothing held: the scheduler sends it at once, with everything
            assert side.timings_of(seq) is not None and "prefill_queue" in side.timings_of(seq)
            assert side.cached_tokens(seq) == 8

    for done_first, done in ((True, True), (False, True), (False, False)):
        run(go(done_first, done))
