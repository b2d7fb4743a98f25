"""The gateway's small shared pieces: ``parse_listen`` (``--http-listen``) and ``Event``, one
step of a relayed stream (``disagg.actors.http.http`` yields them, ``choices`` consumes them)."""

from __future__ import annotations

import msgspec

from disagg.protocol import TokenLogprobs, Usage


def parse_listen(http_listen: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` too; port 0 picks a free one) -> (host, port)."""
    text = http_listen.removeprefix("http://")
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ValueError(f"--http-listen must be HOST:PORT, got {http_listen!r}")
    return (host.strip("[]") or "127.0.0.1"), int(port)


class Event(msgspec.Struct):
    """One step of a relayed stream: new text, and at the end the reason and usage."""

    text: str
    tokens: int = 0
    finish_reason: str | None = None
    usage: Usage | None = None
    logprobs: list[TokenLogprobs] | None = None  # the tokens' (TokenChunk.logprobs)
    prompt_logprobs: list[TokenLogprobs] | None = None  # the first event's, when asked
