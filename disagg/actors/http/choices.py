"""The gateway's choices: echo and logprobs of a choice in OpenAI's shapes (``Shaper``), and a
request of several choices (``n > 1``, batched prompts in ``/v1/completions``) as one client-
protocol request per choice (``serve_many``).

Choice ``k = prompt index * n + j`` is its own ``GenerateRequest`` (id ``<rid>-<k>``), seeded
and started as ``disagg.serving.fanout`` does for both front doors (one prefill per prompt
through the prefix cache). A choice's failure fails the request (its other choices are
aborted). Usage: ``fanout.total_usage``. Chat with tools: each choice's output is
parsed for its own calls (whole: ``message.tool_calls``; streamed: a ``ToolStream`` per choice,
its deltas under the choice's index) and has its own ``finish_reason``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

import msgspec
from aiohttp import web

from disagg.actors.http.http_guard import send
from disagg.protocol import TokenLogprobs, Usage
from disagg.serving.fanout import choice_sampling, merged, total_usage
from disagg.serving.openai_api import (
    SSE_DONE,
    ApiError,
    Prepared,
    chat_chunk,
    chat_response,
    completion_chunk,
    completion_response,
    sse,
    usage_chunk,
)
from disagg.serving.openai_logprobs import TokenText, chat_logprobs, completion_logprobs
from disagg.serving.tool_calls import apply_tool_calls
from disagg.serving.tool_calls import finish_reason as tool_finish_reason
from disagg.serving.tool_stream import ToolStream

if TYPE_CHECKING:
    from disagg.actors.http.http import Event, Gateway


class Reported(ApiError):
    """An error already written into an SSE stream; the handler returns ``resp`` as is."""

    def __init__(self, resp: web.StreamResponse, e: ApiError):
        super().__init__(e.status, e.message, e.type, e.param, e.code)
        self.resp = resp


class Shaper:
    """One choice's echo text and logprobs objects, from its events."""

    def __init__(self, prep: Prepared, chat: bool, text_of: TokenText, tokenizer: Any):
        self.chat, self.text_of = chat, text_of
        self.want = prep.logprobs is not None
        self.echo = prep.echo and not chat
        self.prompt_ids = prep.prompt_token_ids
        text = prep.prompt_texts[0] if prep.prompt_texts else None
        if self.echo and text is None:
            text = tokenizer.decode(self.prompt_ids) if tokenizer is not None else ""
        self.prompt_text = text if self.echo and text is not None else ""
        self.offset = 0
        self.first = True
        self.entries: list[TokenLogprobs] = []
        self.prompt_lps: list[TokenLogprobs] = []

    def text(self, delta: str, first: bool) -> str:
        """The choice's text for an event: the echoed prompt before its first delta."""
        return self.prompt_text + delta if first else delta

    def add(self, ev: Event) -> None:
        """Keep an event's logprobs (a whole response is shaped at its end, ``final``)."""
        self.entries += ev.logprobs or []
        self.prompt_lps += ev.prompt_logprobs or []

    def chunk(self, ev: Event) -> dict[str, Any] | None:
        """The logprobs object of one streamed event's tokens (None: not asked)."""
        if not self.want:
            return None
        first, self.first = self.first, False
        return self._shape(ev.logprobs or [], ev.prompt_logprobs or [], first)

    def final(self) -> dict[str, Any] | None:
        return self._shape(self.entries, self.prompt_lps, True) if self.want else None

    def _shape(self, entries: list[TokenLogprobs], prompt_lps: list[TokenLogprobs],
               first: bool) -> dict[str, Any]:
        if self.chat:
            return chat_logprobs(entries, self.text_of)
        prompt = (self.prompt_ids, prompt_lps) if first and self.echo else None
        out = completion_logprobs(entries, self.text_of, self.offset, prompt)
        if out["tokens"]:
            self.offset = out["text_offset"][-1] + len(out["tokens"][-1])
        return out


def choice_preps(prep: Prepared) -> list[Prepared]:
    """One single-choice ``Prepared`` per choice, in choice order."""
    out = []
    texts = prep.prompt_texts or [None] * len(prep.all_prompts)
    for ids, text in zip(prep.all_prompts, texts, strict=True):
        for j in range(prep.n):
            sampling = choice_sampling(prep.sampling, j)
            out.append(dataclasses.replace(prep, prompt_token_ids=ids, sampling=sampling,
                                           prompts=[], prompt_texts=[text], n=1))
    return out


async def serve_many(gw: Gateway, request: web.Request, prep: Prepared, rid: str, chat: bool,
                     relay: Callable[[Prepared, str], AsyncGenerator[Event, None]]
                     ) -> tuple[web.StreamResponse, str]:
    """Serve a request of several choices: a JSON response or an SSE stream (the first event
    comes before the 200, so a refusal is a proper 4xx)."""
    preps = choice_preps(prep)
    shapers = [Shaper(p, chat, gw.text_of, gw.tokenizer) for p in preps]
    relays = [functools.partial(relay, p, f"{rid}-{k}") for k, p in enumerate(preps)]
    async with contextlib.aclosing(merged(relays, prep.n)) as events:
        if prep.stream:
            return await _stream(gw, request, events, rid, chat, prep, preps, shapers)
        return await _collect(gw, events, rid, chat, shapers, preps, prep.n)


async def _collect(gw: Gateway, events: AsyncIterator[tuple[int, Event]], rid: str, chat: bool,
                   shapers: list[Shaper], preps: list[Prepared], n: int
                   ) -> tuple[web.Response, str]:
    parts: list[list[str]] = [[] for _ in shapers]
    ends: dict[int, tuple[str, Usage]] = {}
    async for k, ev in events:
        parts[k].append(ev.text)
        shapers[k].add(ev)
        if ev.finish_reason is not None:
            assert ev.usage is not None
            ends[k] = (ev.finish_reason, ev.usage)
    if len(ends) != len(shapers):
        raise ApiError(502, "a choice's stream ended without a finish", "server_error")
    build = chat_response if chat else completion_response
    choices = []
    for k, sh in enumerate(shapers):
        reason, usage = ends[k]
        choice = build(rid, gw.model_name, sh.text("".join(parts[k]), True), reason,
                       usage)["choices"][0]
        choice.update(index=k, logprobs=sh.final())
        plan = preps[k].tools
        if chat and plan is not None:  # each choice's own calls
            apply_tool_calls(choice, plan)
        choices.append(choice)
    body = build(rid, gw.model_name, "", None, total_usage([ends[k][1] for k in
                                                             range(len(shapers))], n))
    body["choices"] = choices
    return web.Response(body=msgspec.json.encode(body), content_type="application/json"), \
        ends[0][0]


async def _stream(gw: Gateway, request: web.Request, events: AsyncIterator[tuple[int, Event]],
                  rid: str, chat: bool, prep: Prepared, preps: list[Prepared],
                  shapers: list[Shaper]) -> tuple[web.StreamResponse, str]:
    first = await anext(events)
    created, model, usage_on = int(time.time()), gw.model_name, prep.include_usage
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                       "Cache-Control": "no-cache"})
    await resp.prepare(request)

    async def put(data: bytes | None) -> None:
        await send(request, resp, data, gw.limits.write_timeout_s)

    def chunk(k: int, text: str | None, reason: str | None, lp: dict[str, Any] | None,
              delta: dict[str, Any] | None = None) -> bytes:
        if chat:
            if delta is None:
                delta = {} if text is None else {"content": text}
            out = chat_chunk(rid, model, created, delta, reason, usage_on)
        else:
            out = completion_chunk(rid, model, created, text or "", reason, usage_on)
        out["choices"][0].update(index=k, logprobs=lp)
        return sse(out)

    usages: dict[int, Usage] = {}
    reasons: dict[int, str] = {}
    started: set[int] = set()
    # chat with tools: each choice's output as content and delta.tool_calls of its own
    tools = [ToolStream(p.tools) if chat and p.tools is not None else None for p in preps]

    async def tool_deltas(k: int, deltas: list[dict[str, Any]]) -> None:
        for delta in deltas:
            await put(chunk(k, None, None, None, delta))

    try:
        if chat:
            for k in range(len(shapers)):
                role = chat_chunk(rid, model, created, {"role": "assistant", "content": ""},
                                  None, usage_on)
                role["choices"][0]["index"] = k
                await put(sse(role))
        item: tuple[int, Event] | None = first
        while item is not None:
            k, ev = item
            sh = shapers[k]
            text = sh.text(ev.text, k not in started)
            started.add(k)
            lp = sh.chunk(ev)
            calls = tools[k]
            if calls is not None:
                await tool_deltas(k, calls.push(text))
                text = ""
            if text or lp is not None and ev.tokens:
                await put(chunk(k, text, None, lp))
            if ev.finish_reason is not None:
                assert ev.usage is not None
                usages[k], reasons[k] = ev.usage, ev.finish_reason
                reason = ev.finish_reason
                if calls is not None:
                    await tool_deltas(k, calls.finish())
                    reason = tool_finish_reason(reason, calls.called)
                await put(chunk(k, None, reason, None))
            item = await anext(events, None)
        if len(usages) != len(shapers):
            raise ApiError(502, "a choice's stream ended without a finish", "server_error")
        if usage_on:
            obj = "chat.completion.chunk" if chat else "text_completion"
            await put(sse(usage_chunk(rid, model, created, obj, total_usage(
                [usages[k] for k in range(len(shapers))], prep.n))))
        await put(SSE_DONE)
        await put(None)
        return resp, reasons[0]
    except ApiError as e:  # after the 200: report in-band, then end the stream
        with contextlib.suppress(ConnectionError):
            await put(sse(e.body()))
            await put(SSE_DONE)
        raise Reported(resp, e) from None
    except ConnectionError:
        return resp, "abort"
