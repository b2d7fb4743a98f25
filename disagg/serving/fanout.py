"""Several choices of one prompt (``n > 1``) as one client-protocol request each, for both
front doors: the HTTP gateway (``disagg.actors.http.choices``) and the Python clients
(``disagg.client``: ``AsyncClient.choices`` / ``Client.choices``).

Choice ``j`` is seeded ``choice_seed(seed, j)`` when the request has a seed (choice 0 keeps
the seed: n = 1 draws what it always drew). Choice 0 of a prompt starts first; its other
choices start once it has produced its first token (or ended), so its prompt's full pages are
in the node's prefix cache by then and they compute only the last partial page: one prefill
per prompt (without the prefix cache each choice prefills the whole prompt).

Prompt logprobs (``SamplingParams.prompt_logprobs``, HTTP ``echo`` with ``logprobs``) are the
same for every choice of a prompt, and a request asking them computes its whole prompt (it
takes nothing from the prefix cache): only choice 0 asks them, and the others get a copy of
its on their first item that carries them (``SharedPromptLogprobs``), so they still take the
prompt from the cache.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Callable, Sequence
from typing import Any, TypeVar

import msgspec

from disagg.protocol import SamplingParams, TokenLogprobs, Usage
from disagg.serving.openai_logprobs import choice_seed

T = TypeVar("T")
_NO_FIELD = object()


def choice_sampling(sampling: SamplingParams, j: int) -> SamplingParams:
    """The sampling parameters of choice ``j`` (its own seed when the request has one; no
    prompt logprobs for ``j > 0``: choice 0's are copied, ``SharedPromptLogprobs``)."""
    changes: dict[str, Any] = {}
    if sampling.seed is not None:
        changes["seed"] = choice_seed(sampling.seed, j)
    if j and sampling.prompt_logprobs is not None:
        changes["prompt_logprobs"] = None
    return msgspec.structs.replace(sampling, **changes) if changes else sampling


class SharedPromptLogprobs:
    """Choice 0's prompt logprobs given to the other choices of its prompt, which do not ask
    for them (``choice_sampling``). Items are a choice's replies, e.g. ``TokenChunk`` or the
    gateway's ``Event``: structs whose ``prompt_logprobs`` field the node sets in a request's
    first chunk. Choice 0's first item comes before any other choice's (they start after it),
    so each other choice gets the copy on its own first item that carries the field."""

    def __init__(self, n: int):
        self.n = n
        self.lead: dict[int, list[TokenLogprobs]] = {}  # prompt index -> choice 0's
        self.given: set[int] = set()  # choices k > 0 whose first such item went by

    def share(self, k: int, item: T) -> T:
        """Item ``item`` of choice ``k`` (``k % n`` of prompt ``k // n``), with the prompt
        logprobs of its prompt's choice 0 when it is another choice's first that carries
        them."""
        lps: Any = getattr(item, "prompt_logprobs", _NO_FIELD)
        if lps is _NO_FIELD:  # a Finished, say
            return item
        prompt, j = divmod(k, self.n)
        if j == 0:
            if lps is not None:
                self.lead[prompt] = lps
            return item
        if k in self.given:
            return item
        self.given.add(k)
        lead = self.lead.get(prompt)
        if lps is not None or lead is None:
            return item
        out: Any = item
        return msgspec.structs.replace(out, prompt_logprobs=lead)


async def merged(relays: Sequence[Callable[[], AsyncGenerator[T, None]]], n: int
                 ) -> AsyncGenerator[tuple[int, T], None]:
    """Every choice's items as they come, tagged by choice index (``relays[k]`` is choice
    ``k % n`` of prompt ``k // n``); choice ``j > 0`` of a prompt starts once choice 0 of it
    has an item (or ended), and gets its prompt logprobs (``SharedPromptLogprobs``). Closing it closes the choices still running (each relay is closed
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
    shared = SharedPromptLogprobs(n)
    try:
        while running:
            k, got = await queue.get()
            if got is None:
                running -= 1
            elif isinstance(got, BaseException):
                raise got
            else:
                yield k, shared.share(k, got)
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
