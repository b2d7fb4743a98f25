"""``ExecutorGroup.result`` over two fake ranks (DEALER sockets in this process): a rank's result
of a later step that comes before another rank's result of the awaited one is kept for its own
turn (an executor filling its late masks itself answers two steps back to back:
``disagg.engine.grammar_mirror``); results of steps already taken are let go."""

from __future__ import annotations

import asyncio

import msgspec
import zmq
import zmq.asyncio

from disagg.actors.executor.executor_group import ExecutorGroup
from disagg.config import ExecutorConfig, NodeConfig
from disagg.protocol.executor import StepResult


def test_results_of_later_steps_wait_for_their_turn(tmp_path):
    cfg = NodeConfig(executor=ExecutorConfig(model="unused"), devices=["cpu", "cpu"],
                     run_dir=str(tmp_path))
    enc = msgspec.msgpack.Encoder()

    async def run() -> None:
        ctx = zmq.asyncio.Context()
        group = ExecutorGroup(cfg, str(tmp_path), ctx)
        ranks = []
        for ident in (b"r0", b"r1"):
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.IDENTITY, ident)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(group.control)
            ranks.append(s)
        group._identities = [b"r0", b"r1"]
        try:
            async def answer(rank: int, step: int, tokens: list[int]) -> None:
                await ranks[rank].send_multipart([enc.encode(StepResult(step, tokens))])

            # rank 0 answers steps 4 and 5 (and a stale 3), read while step 4 is awaited,
            # before rank 1 answers 4
            waiting = asyncio.ensure_future(group.result(4))
            await answer(0, 3, [9])
            await answer(0, 4, [1])
            await answer(0, 5, [2])
            await asyncio.sleep(0.3)
            assert not waiting.done()
            await answer(1, 4, [1])
            first, _ = await asyncio.wait_for(waiting, 5)
            assert (first.step_id, first.token_ids) == (4, [1])
            await answer(1, 5, [2])
            second, _ = await asyncio.wait_for(group.result(5), 5)
            assert (second.step_id, second.token_ids) == (5, [2])
            assert not group._early
        finally:
            for s in ranks:
                s.close()
            group.sock.close()
            group._results.close()
            ctx.destroy(linger=0)

    asyncio.run(run())
