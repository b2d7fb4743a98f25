"""Request migration (pure: no sockets, no asyncio): what the router keeps of each request it
streams so that, when its decode node dies or restarts mid-stream, it goes on on another one
from the exact token (``Progress``), and the bounds on it (``MigrationPolicy``).

A request's resumable state is its original ``GenerateRequest`` (prompt, sampling, seed) and
what it streamed: the output ids and where the node's incremental detokenizer stood (the
output positions its text was decoded from and up to, which only the chunks carrying text
move). ``Progress.resume`` turns them into the request another decoder continues
(``protocol.Resume``): prompt + streamed tokens prefilled as one, output index, ``max_tokens``
(what remains of it), ``min_tokens`` and penalties counted on from the streamed tokens, the same
seed (``with_seed`` gives a sampled request without one a seed of its own before its first
node), so that greedy and seeded streams continue exactly. Usage then counts the original
prompt and every generated token; prompt logprobs, already sent in the first chunk, are not
asked again; stop strings and several choices (``n``) are the gateway's, above the router,
which sees one unbroken stream per choice.

Bounds: at most ``limit`` migrations per request, and only while it has streamed at most
``max_tokens`` tokens (the router keeps them in memory, and the next decoder computes them
again); past either the request ends ``unavailable`` with the reason, as it does when no
decode node takes it within ``MIGRATION_WAIT_S`` (the router tries again at every poll: the
only other node may be restarting).
"""

from __future__ import annotations

import random
from array import array
from dataclasses import dataclass

import msgspec

from disagg.protocol import GenerateRequest, Resume

MIGRATION_LIMIT = 3  # --migration-limit: migrations per request
MIGRATION_MAX_TOKENS = 16384  # --migration-max-tokens: streamed tokens a migration carries
MIGRATION_WAIT_S = 10.0  # a moving request waits this long for a node that takes it


@dataclass(frozen=True)
class MigrationPolicy:
    limit: int = MIGRATION_LIMIT  # 0: never migrate (a mid-stream death ends the request)
    max_tokens: int = MIGRATION_MAX_TOKENS

    def validate(self) -> str | None:
        if self.limit < 0:
            return f"--migration-limit must be >= 0, got {self.limit}"
        if self.max_tokens < 1:
            return f"--migration-max-tokens must be >= 1, got {self.max_tokens}"
        return None

    @property
    def enabled(self) -> bool:
        return self.limit > 0


def with_seed(req: GenerateRequest, policy: MigrationPolicy,
              draw: random.Random | None = None) -> GenerateRequest:
    """``req`` with a seed of its own when it samples without one and may migrate: the node
    that continues it must draw the same noise (greedy and seeded requests as they are)."""
    s = req.sampling
    if not policy.enabled or s.temperature == 0.0 or s.seed is not None:
        return req
    seed = (draw or random).getrandbits(63)
    return msgspec.structs.replace(req, sampling=msgspec.structs.replace(s, seed=seed))


class Progress:
    """What one request streamed so far, and how often it moved."""

    __slots__ = ("policy", "tokens", "text_prefix", "text_read", "migrations", "over_cap")

    def __init__(self, policy: MigrationPolicy, start: Resume | None = None):
        """``start``: the request came resumed already (its streamed part counts)."""
        self.policy = policy
        self.tokens = array("q", start.output_ids if start else [])  # streamed (none past the cap)
        self.text_prefix = start.text_prefix if start else 0  # detokenizer window (Resume)
        self.text_read = start.text_read if start else 0  # tokens whose text was streamed
        self.migrations = 0
        self.over_cap = False

    @property
    def streamed(self) -> int:
        return len(self.tokens)

    def on_chunk(self, token_ids: list[int], text: str) -> None:
        """A chunk went to the client: its tokens are part of the stream now. A chunk with
        text moved the node's detokenizer (its window starts where the last text ended)."""
        if self.over_cap or not self.policy.enabled:
            return
        if len(self.tokens) + len(token_ids) > self.policy.max_tokens:
            self.over_cap = True  # past the cap: not resumable, nothing more kept
            self.tokens = array("q")
            return
        self.tokens.extend(token_ids)
        if text:
            self.text_prefix, self.text_read = self.text_read, len(self.tokens)

    def resume(self, req: GenerateRequest, request_id: str) -> GenerateRequest | str:
        """The request that continues ``req`` (as first sent) on another node under
        ``request_id``, counted as a migration; or why it cannot move (the client's error
        message)."""
        p = self.policy
        if not p.enabled:
            return "migration is off (--migration-limit 0)"
        if self.over_cap:
            return (f"it streamed more than {p.max_tokens} tokens, past which it is not "
                    "moved (--migration-max-tokens)")
        if self.migrations >= p.limit:
            return f"it moved {self.migrations} times already (--migration-limit {p.limit})"
        self.migrations += 1
        if not self.tokens:  # nothing streamed: the request as it was
            return msgspec.structs.replace(req, request_id=request_id)
        sampling = msgspec.structs.replace(req.sampling, prompt_logprobs=None)  # sent already
        return msgspec.structs.replace(
            req, request_id=request_id, sampling=sampling,
            resume=Resume(self.tokens.tolist(), self.text_prefix, self.text_read))
