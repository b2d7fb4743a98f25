"""A node drained by SIGTERM whose streams outlive ``--drain-timeout`` (issue 36, item 3: the
node "finishes or migrates its streams"): its steps are slow (``DISAGG_TEST_STEP_DELAY_S``),
so at the timeout its live requests end ``unavailable`` and the router migrates them to the
other node from the exact token; every stream completes, greedy-equal to a run on the other
node alone, and the drained node exits 0 shortly after its timeout."""

from __future__ import annotations

import asyncio
import signal
import time

import pytest

from disagg.actors.router.router import start_router
from disagg.protocol import Finished, SamplingParams, TokenChunk
from nodes import LoopThread, node, running, wait_for
from tinymodels import free_port

pytestmark = pytest.mark.procs

DRAIN_TIMEOUT_S = 2.0
NEW = 40  # tokens per request: at 0.3 s a step the slow node needs 12 s for them


def test_streams_past_the_drain_timeout_migrate_and_complete(chat_llama, tmp_path, caplog):
    slow_addr, slow = node("mixed", chat_llama, tmp_path, "--num-pages", "64",
                           "--max-model-len", "128", "--drain-timeout", str(DRAIN_TIMEOUT_S),
                           env={"DISAGG_TEST_STEP_DELAY_S": "0.3"})
    fast_addr, fast = node("mixed", chat_llama, tmp_path, "--num-pages", "64",
                           "--max-model-len", "128")
    with running([slow, fast]):
        lt = LoopThread()
        r, _ = lt.run(start_router(f"tcp://127.0.0.1:{free_port()}", [slow_addr, fast_addr],
                                   poll_interval=0.2, dead_after=3.0, wait_for_peer=30))
        wait_for(lambda: len(r.balancer.serving()) == 2, what="both nodes live")

        async def one(ids: list[int]) -> tuple[list[int], str]:
            tokens: list[int] = []
            async for msg in r.generate(prompt_token_ids=ids, timeout=120, tenant=f"t{ids[0]}",
                                        sampling=SamplingParams(max_tokens=NEW,
                                                                ignore_eos=True)):
                if isinstance(msg, TokenChunk):
                    tokens += msg.token_ids
                elif isinstance(msg, Finished):
                    return tokens, msg.reason
            return tokens, "no finish"

        prompts = [[20 + i, 4, 5, 6] for i in range(6)]

        async def all_of() -> list[tuple[list[int], str]]:
            return list(await asyncio.gather(*(one(p) for p in prompts)))
        try:
            with caplog.at_level("INFO", logger="disagg.actors.router.router"):
                fut = asyncio.run_coroutine_threadsafe(all_of(), lt.loop)
                wait_for(lambda: any(f.streamed and f.peer == slow_addr
                                     for f in list(r.flights.values())), what="slow streams")
                t0 = time.monotonic()
                slow.proc.send_signal(signal.SIGTERM)
                code = slow.proc.wait(timeout=DRAIN_TIMEOUT_S + 20)
                exited_after = time.monotonic() - t0
                results = fut.result(timeout=120)
            assert code == 0
            assert [(len(t), why) for t, why in results] == [(NEW, "length")] * len(prompts)
            assert "moved to" in caplog.text  # the slow node's streams went on elsewhere
            log = slow.log_path.read_text()
            assert "drain timeout:" in log and "end unavailable" in log
            reference = lt.run(all_of())  # on the fast node alone
            assert results == reference  # no token lost or repeated across the move
            print(f"drain timeout: exit 0 after {exited_after:.1f} s (--drain-timeout "
                  f"{DRAIN_TIMEOUT_S:g}), {len(prompts)}/{len(prompts)} streams complete")
        finally:
            lt.run(r.stop())
            lt.close()
