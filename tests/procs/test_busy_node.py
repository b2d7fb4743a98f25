"""A decode node busy in long steps behind a router (issue 36, item 5): every step of the
node takes longer than the router's ``dead_after`` (``DISAGG_TEST_STEP_DELAY_S``), so it
answers Stats only long after they were asked; its frontend answers the router's Pings at
once, so the router keeps it live: the request finishes there, never re-sent (it used to be
marked dead after 3 s without a Stats answer and its requests re-sent)."""

from __future__ import annotations

import pytest

from disagg.actors.router.router import start_router
from disagg.protocol import Finished, SamplingParams, TokenChunk
from nodes import LoopThread, node, running, stats
from tinymodels import free_port

pytestmark = pytest.mark.procs

STEP_S = 1.5  # every step of the node
DEAD_AFTER_S = 0.8  # the router's: shorter than a step


def test_a_node_busy_in_steps_longer_than_dead_after_stays_live(chat_llama, tmp_path, caplog):
    addr, proc = node("mixed", chat_llama, tmp_path, "--num-pages", "32", "--max-model-len",
                      "128", env={"DISAGG_TEST_STEP_DELAY_S": str(STEP_S)})
    with running([proc]):
        lt = LoopThread()
        r, _ = lt.run(start_router(f"tcp://127.0.0.1:{free_port()}", [addr], poll_interval=0.2,
                                   dead_after=DEAD_AFTER_S, wait_for_peer=30))

        async def request() -> tuple[list[int], str]:
            tokens: list[int] = []
            async for msg in r.generate(prompt_token_ids=[5, 6, 7], timeout=60,
                                        sampling=SamplingParams(max_tokens=4, ignore_eos=True)):
                if isinstance(msg, TokenChunk):
                    tokens += msg.token_ids
                elif isinstance(msg, Finished):
                    return tokens, msg.reason
            return tokens, "no finish"

        try:
            with caplog.at_level("INFO", logger="disagg.actors.router.router"):
                tokens, reason = lt.run(request())
            assert (len(tokens), reason) == (4, "length")
            assert "marked dead" not in caplog.text
            assert r.balancer.alive() == [addr]
            assert stats(addr, timeout=30).started == 1  # sent once, never re-sent
        finally:
            lt.run(r.stop())
            lt.close()
