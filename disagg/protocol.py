"""Every wire message of disagg, as msgspec tagged Structs encoded with msgpack.

Messages are grouped by receiver; each receiving socket decodes with one typed decoder over the
union of what it accepts and dispatches with one ``match``. Every struct carries a string tag
(its field ``type`` on the wire) and the protocol version travels in ``GenerateRequest`` and in
every reply from a node as ``v``.

Client protocol (client DEALER -> node ROUTER, one msgpack map per frame):

- ``{"type": "generate", "request_id": str, "prompt": str | null, "prompt_token_ids":
  [int] | null, "sampling": {...}}`` -> a stream of ``token`` chunks then one ``finished``
  (or one ``error``);
- ``{"type": "abort", "request_id": str}`` -> ``finished`` with reason ``abort`` (if running);
- ``{"type": "stats"}`` -> one ``stats``.

Executor protocol (main process <-> executor process over ``ipc://``): ``StepPlan`` ->
``StepResult``; ``ExecutorReady`` once at start-up; ``Shutdown`` to stop.
"""

from __future__ import annotations

from typing import Literal

import msgspec

PROTOCOL_VERSION = 1

# ------------------------------------------------------------------ client -> node


class SamplingParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """How to pick tokens. ``temperature == 0`` is greedy."""

    max_tokens: int = 16  # number of output tokens, >= 1
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = disabled
    top_p: float = 1.0  # 1 = disabled
    seed: int | None = None  # per-request seed; same seed -> same tokens, alone or batched
    stop_token_ids: list[int] = []  # finish (reason "stop") when one of these is sampled
    ignore_eos: bool = False  # keep going past the model's EOS tokens
    min_tokens: int = 0  # EOS/stop tokens are ignored before this many outputs

    def validate(self) -> str | None:
        """Return a message naming the first bad field, or None."""
        if self.max_tokens <= 0:
            return f"max_tokens must be >= 1, got {self.max_tokens}"
        if not 0.0 <= self.temperature <= 100.0:
            return f"temperature must be in [0, 100], got {self.temperature}"
        if self.top_k < 0:
            return f"top_k must be >= 0, got {self.top_k}"
        if not 0.0 < self.top_p <= 1.0:
            return f"top_p must be in (0, 1], got {self.top_p}"
        if self.min_tokens < 0 or self.min_tokens > self.max_tokens:
            return f"min_tokens must be in [0, max_tokens], got {self.min_tokens}"
        if self.seed is not None and not 0 <= self.seed < 2**63:
            return f"seed must be in [0, 2**63), got {self.seed}"
        return None


class GenerateRequest(msgspec.Struct, tag="generate", frozen=True, forbid_unknown_fields=True):
    """Start a generation. Exactly one of ``prompt`` / ``prompt_token_ids`` is set."""

    request_id: str  # client-chosen, unique among the client's live requests, 1-256 chars
    prompt: str | None = None  # text, tokenized by the node (no chat template applied)
    prompt_token_ids: list[int] | None = None  # token ids, each in [0, vocab_size)
    sampling: SamplingParams = SamplingParams()
    v: int = PROTOCOL_VERSION


class Abort(msgspec.Struct, tag="abort", frozen=True, forbid_unknown_fields=True):
    """Stop a live request; its pages return to the pool."""

    request_id: str


class StatsRequest(msgspec.Struct, tag="stats", frozen=True, forbid_unknown_fields=True):
    """Ask for one ``Stats`` reply."""


ClientMessage = GenerateRequest | Abort | StatsRequest

# ------------------------------------------------------------------ node -> client


class TokenChunk(msgspec.Struct, tag="token", frozen=True):
    """New output tokens of one request, in order."""

    request_id: str
    token_ids: list[int]
    text: str  # detokenized text delta ("" when the node has no tokenizer)
    v: int = PROTOCOL_VERSION


class Usage(msgspec.Struct, frozen=True):
    prompt_tokens: int
    completion_tokens: int


FinishReason = Literal["stop", "length", "abort"]


class Finished(msgspec.Struct, tag="finished", frozen=True):
    """Terminal message of a request; no more messages follow for this id.

    ``stop``: EOS or a stop token; ``length``: max_tokens or the context limit;
    ``abort``: the client aborted."""

    request_id: str
    reason: str
    usage: Usage
    v: int = PROTOCOL_VERSION


class Error(msgspec.Struct, tag="error", frozen=True):
    """A request (or a frame) was refused or failed. Terminal for ``request_id`` if set."""

    code: str  # machine-readable: bad_frame, bad_request, duplicate_request, unknown_request, internal
    message: str  # human-readable reason naming the field
    request_id: str | None = None
    v: int = PROTOCOL_VERSION


class Stats(msgspec.Struct, tag="stats", frozen=True):
    """A snapshot of the node."""

    role: str
    pages_total: int
    pages_free: int
    page_size: int
    running: int
    waiting: int
    started: int  # requests accepted since start
    finished: int  # reached Finished with stop/length
    aborted: int  # ended by the client's Abort
    errored: int  # ended with Error after acceptance
    rejected: int  # refused before acceptance (bad input, duplicates)
    bad_frames: int  # frames that did not decode
    preemptions: int
    v: int = PROTOCOL_VERSION


NodeReply = TokenChunk | Finished | Error | Stats

# ------------------------------------------------------------------ main <-> executor


class SeqChunk(msgspec.Struct, array_like=True, gc=False, frozen=True):
    """One sequence's slice of a step: ``token_ids`` at positions ``start_pos...``.

    Pages are owned by the main process's page pool; the executor only reads/writes them."""

    slot: int  # scheduler-local sequence id (stable while the request lives)
    token_ids: list[int]
    start_pos: int  # position of token_ids[0]; tokens before it are already in the cache
    block_table: list[int]  # the sequence's page ids covering positions [0, start_pos + len)
    sample: bool  # sample a token after the last position of this chunk
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0  # sampling seed of the request
    output_index: int = 0  # index of the output token being sampled (seeds its draw)


class StepPlan(msgspec.Struct, tag="step", array_like=True, gc=False, frozen=True):
    """One forward pass. Decode chunks (one token, no prefix beyond the cache) come first."""

    step_id: int
    chunks: list[SeqChunk]
    num_decodes: int
    counter_base: int = 0  # layer counter value before this step (lead rank bumps base+layer+1)


class StepResult(msgspec.Struct, tag="result", array_like=True, gc=False, frozen=True):
    """Sampled tokens, one per chunk with ``sample=True``, in chunk order."""

    step_id: int
    token_ids: list[int]
    error: str | None = None  # set when the step failed; the executor keeps serving


class KVMemoryInfo(msgspec.Struct, frozen=True):
    """Where an executor's KV cache lives, so the main process can map it.

    kind ``memfd``: the file descriptor arrives out of band (SCM_RIGHTS) on the executor's
    handshake socket; ``cuda``: ``handle`` is the cuMem POSIX fd, also passed by SCM_RIGHTS."""

    kind: str  # "memfd" | "cuda" | "none"
    nbytes: int
    dtype: str  # torch dtype name, e.g. "bfloat16"
    shape: list[int]  # [num_layers, num_pages, 2, num_kv_heads_local, page_size, head_dim]
    device: str


class ExecutorReady(msgspec.Struct, tag="ready", array_like=True, frozen=True):
    rank: int
    num_pages: int
    kv: KVMemoryInfo


class Shutdown(msgspec.Struct, tag="shutdown", array_like=True, frozen=True):
    pass


ExecutorCommand = StepPlan | Shutdown
ExecutorReply = StepResult | ExecutorReady


# ------------------------------------------------------------------ frontend <-> scheduler (inproc)


class FromClient(msgspec.Struct, tag="from_client", array_like=True, frozen=True):
    """A decoded client message and the ROUTER identity it came from."""

    identity: bytes
    msg: ClientMessage


class ToClient(msgspec.Struct, tag="to_client", array_like=True, frozen=True):
    """A reply for the frontend to route to ``identity``."""

    identity: bytes
    msg: NodeReply
