"""Several choices of one prompt (``n > 1``) as one client-protocol request each, for both
front doors: the HTTP gateway (``disagg.actors.http.choices``) and the Python clients
(``disagg.client``: ``AsyncClient.choices`` / ``Client.choices``).

Choice ``j`` is seeded ``choice_seed(seed, j)`` when the request has a seed (choice 0 keeps
the seed: n = 1 draws what it always drew). Choice 0 of a prompt starts first; its other
choices start once it has produced its first token (or ended), so its prompt's full pages are
in the node's prefix cache by then and they compute only the last partial page: one prefill
per prompt (without the prefix cache each choice prefills the whole prompt).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Callable, Sequence
from typing import TypeVar

import msgspec

from disagg.protocol import SamplingParams, Usage
from disagg.serving.openai_logprobs import choice_seed

T = TypeVar("T")


def choice_sampling(sampling: SamplingParams, j: int) -> SamplingParams:
    """The sampling parameters of choice ``j`` (its own seed when the request has one)."""
    if sampling.seed is None:
        return sampling
    return msgspec.structs.replace(sampling, seed=choice_seed(sampling.seed, j))


async def merged(relays: Sequence[Callable[[], AsyncGenerator[T, None]]], n: int
                 ) -> AsyncGenerator[tuple[int, T], None]:
    """Every choice's items as they come, tagged by choice index (``relays[k]`` is choice
    ``k % n`` of prompt ``k // n``); choice ``j > 0`` of a prompt starts once choice 0 of it
    has an item (or ended). Closing it closes the choices still running (each relay is closed
    in its task: a client stream then aborts its request); a choice's error is raised here."""
    queue: asyncio.Queue[tuple[int, T | BaseException | None]] = asyncio.Queue()
    leaders = [asyncio.Event() for _ in range(0, len(relays), n)]

    async def pump(k: int) -> None:
        lead = leaders[k // n]
        try:
            if k % n:
                await lead.wait()  # set by the leader's first item or its end, whatever it is
            async with contextlib.aclosing(relays[k]()) as items:
                async for item in items:
                    await queue.put((k, item))
                    if k % n == 0:
                        lead.set()
            await queue.put((k, None))
        except Exception as e:  # noqa: BLE001 - handed to the consumer, which raises it
            await queue.put((k, e))
        finally:
            if k % n == 0:
                lead.set()

    tasks = [asyncio.create_task(pump(k)) for k in range(len(relays))]
    running = len(tasks)
    try:
        while running:
            k, got = await queue.get()
            if got is None:
                running -= 1
            elif isinstance(got, BaseException):
                raise got
            else:
                yield k, got
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def total_usage(usages: list[Usage], n: int) -> Usage:
    """Usage of a request of ``len(usages) // n`` prompts, ``n`` choices each: prompt tokens
    once per prompt, completion tokens of every choice, cached tokens the most any choice of a
    prompt took from the cache, summed over the prompts."""
    groups = [usages[i:i + n] for i in range(0, len(usages), n)]
    return Usage(sum(g[0].prompt_tokens for g in groups),
                 sum(u.completion_tokens for u in usages),
                 sum(max(u.cached_tokens for u in g) for g in groups))
