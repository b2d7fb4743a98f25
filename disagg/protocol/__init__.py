"""Every wire message of disagg, as msgspec tagged Structs encoded with msgpack: the client
protocol here; the executor, peer and in-process links in ``disagg.protocol.executor``,
``.peer`` and ``.inproc``.

Messages are grouped by receiver; each receiving socket decodes with one typed decoder over the
union of what it accepts and dispatches with one ``match``. Every struct carries a string tag
(its field ``type`` on the wire) and the protocol version travels in ``GenerateRequest`` and in
every reply from a node as ``v``.

Client protocol (client DEALER -> node ROUTER, one msgpack map per frame):

- ``{"type": "generate", "request_id": str, "prompt": str | null, "prompt_token_ids":
  [int] | null, "sampling": {...}, "cache_salt": str | null}`` -> a stream of ``token``
  chunks then one ``finished`` (or one ``error``);
- ``{"type": "abort", "request_id": str}`` -> ``finished`` with reason ``abort`` (if running);
- ``{"type": "stats"}`` -> one ``stats``;
- ``{"type": "ping"}`` -> one ``pong`` (answered by the node's frontend itself, never queued
  behind a step: the heartbeat a router's liveness comes from; ``draining`` while the node
  drains).

Executor protocol (main process <-> executor process over ``ipc://``): ``StepPlan`` ->
``StepResult``; ``ExecutorReady`` once at start-up; ``Shutdown`` to stop.
"""

from __future__ import annotations

from typing import Literal

import msgspec
import numpy as np

from disagg.protocol.structured import StructuredOutput

PROTOCOL_VERSION = 1

# ------------------------------------------------------------------ client -> node


MAX_TOKENS_LIMIT = 2**31 - 1  # sanity bound on max_tokens (the context limit stops earlier)
MIN_TEMPERATURE = 1e-5  # below this (except 0) float32 logits / temperature overflow
MAX_STOP_TOKEN_IDS = 1024
MAX_CACHE_SALT = 256  # characters of a request's cache_salt
MAX_TENANT = 256  # characters of a request's tenant
MAX_TRACEPARENT = 128  # characters of a request's traceparent (W3C's version 00: 55)
MAX_TOP_LOGPROBS = 20  # alternatives per token (OpenAI's bound for chat top_logprobs)
MAX_LOGIT_BIAS = 1024  # entries of a request's logit_bias
MAX_PENALTY = 2.0  # |presence_penalty|, |frequency_penalty| (OpenAI's range)
MAX_REPETITION_PENALTY = 100.0  # repetition_penalty in (0, MAX_REPETITION_PENALTY]
MAX_BIAS = 100.0  # |logit_bias value| (OpenAI's range)


def as_float32(x: float) -> float:
    """``x`` as the sampling kernels see it (float32): rounds, underflows to 0, overflows to inf."""
    with np.errstate(over="ignore"):
        return float(np.float32(x))


class SamplingParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """How to pick tokens. ``temperature == 0`` is greedy."""

    max_tokens: int = 16  # number of output tokens, in [1, MAX_TOKENS_LIMIT]
    temperature: float = 0.0  # 0 = greedy, else in [MIN_TEMPERATURE, 100]
    top_k: int = 0  # 0 = disabled
    top_p: float = 1.0  # 1 = disabled; > 0 in float32
    # per-request seed; same seed -> same tokens, alone or batched, with or without speculative
    # decoding (where the logits are the same: README, sampling fields)
    seed: int | None = None
    stop_token_ids: list[int] = []  # finish (reason "stop") when one of these is sampled
    ignore_eos: bool = False  # keep going past the model's EOS tokens
    min_tokens: int = 0  # EOS/stop tokens are ignored before this many outputs
    # ---- logits processors and logprobs (README, sampling fields; disagg.engine.sampling)
    # applied in this order to the float32 logits of each sampled row, on the device:
    # repetition_penalty on every token id in the prompt or the output so far (a positive
    # logit divided by it, a negative one multiplied), then logit -= frequency_penalty * count
    # + presence_penalty * (count > 0) over the output tokens so far, then logit_bias added
    presence_penalty: float = 0.0  # in [-2, 2]
    frequency_penalty: float = 0.0  # in [-2, 2]
    repetition_penalty: float = 1.0  # 1 = off; in (0, 100]
    logit_bias: dict[int, float] = {}  # token id (in the vocabulary) -> bias in [-100, 100]
    # None: no logprobs; k in [0, 20]: each output token's logprob and the k most likely
    # alternatives, from the distribution the token was drawn from (after the processors
    # above and the temperature; greedy rows: temperature 1), in TokenChunk.logprobs
    logprobs: int | None = None
    # None: none; k in [0, 20]: the model's raw log-softmax at every prompt token after the
    # first (and k alternatives each), in the request's first TokenChunk.prompt_logprobs;
    # such a request is prefilled where it decodes, without the prefix cache (README)
    prompt_logprobs: int | None = None
    # grammar-constrained decoding: every output token (the first included) obeys this
    # constraint (a JSON schema, regex, grammar or choice); None = unconstrained. Only a node
    # that samples compiles it (disagg.engine.grammar); refused by name where not served
    structured: StructuredOutput | None = None

    @property
    def processed(self) -> bool:
        """Some logits processor is on (the rows' logits change before sampling)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.logit_bias
                    or self.repetition_penalty != 1.0)

    def validate(self) -> str | None:
        """Return a message naming the first bad field, or None.

        Floats are checked as the sampler sees them (float32): a tiny positive temperature
        (1/T overflows) or a top_p that rounds to 0 is refused, not passed on. Token ids are
        checked against the vocabulary by the node (``prepare_prompt``)."""
        if not 1 <= self.max_tokens <= MAX_TOKENS_LIMIT:
            return f"max_tokens must be in [1, {MAX_TOKENS_LIMIT}], got {self.max_tokens}"
        t = self.temperature  # 0 or >= MIN_TEMPERATURE: 1/T and logits/T stay finite in float32
        if not (t == 0.0 or MIN_TEMPERATURE <= t <= 100.0):
            return (f"temperature must be 0 (greedy) or in [{MIN_TEMPERATURE}, 100], "
                    f"got {self.temperature}")
        if self.top_k < 0:
            return f"top_k must be >= 0, got {self.top_k}"
        if not 0.0 < as_float32(self.top_p) <= 1.0 or self.top_p > 1.0:
            return f"top_p must be in (0, 1] (and above 0 in float32), got {self.top_p}"
        if self.min_tokens < 0 or self.min_tokens > self.max_tokens:
            return f"min_tokens must be in [0, max_tokens], got {self.min_tokens}"
        if self.seed is not None and not 0 <= self.seed < 2**63:
            return f"seed must be in [0, 2**63), got {self.seed}"
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            return (f"stop_token_ids must have at most {MAX_STOP_TOKEN_IDS} entries, "
                    f"got {len(self.stop_token_ids)}")
        bad = next((tid for tid in self.stop_token_ids if tid < 0), None)
        if bad is not None:
            return f"stop_token_ids must be token ids >= 0, got {bad}"
        if self.structured is not None and (why := self.structured.validate()) is not None:
            return why
        return self._validate_processors()

    def _validate_processors(self) -> str | None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -MAX_PENALTY <= value <= MAX_PENALTY:  # NaN fails too
                return f"{name} must be in [-{MAX_PENALTY}, {MAX_PENALTY}], got {value}"
        if not 0.0 < self.repetition_penalty <= MAX_REPETITION_PENALTY:
            return (f"repetition_penalty must be in (0, {MAX_REPETITION_PENALTY}], "
                    f"got {self.repetition_penalty}")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            return (f"logit_bias must have at most {MAX_LOGIT_BIAS} entries, "
                    f"got {len(self.logit_bias)}")
        for tid, bias in self.logit_bias.items():
            if tid < 0:
                return f"logit_bias: token id {tid} is outside the vocabulary"
            if not -MAX_BIAS <= bias <= MAX_BIAS:
                return f"logit_bias: the bias of token {tid} must be in [-100, 100], got {bias}"
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and not 0 <= k <= MAX_TOP_LOGPROBS:
                return f"{name} must be in [0, {MAX_TOP_LOGPROBS}] (or null), got {k}"
        return None


class Resume(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A request continued where another node stopped streaming it (the router's migration,
    ``disagg.serving.migration``): the node computes the prompt and these tokens as one
    prefill, then samples output index ``len(output_ids)`` on, under the same ``max_tokens``,
    seed, ``min_tokens`` and penalties, so the stream goes on as it would have; usage counts
    ``output_ids`` as completion tokens; no prompt logprobs are sent again."""

    output_ids: list[int]  # the output tokens streamed so far, in order (1 or more)
    # where the streaming node's incremental detokenizer stood, in output tokens: the text of
    # output_ids[:text_read] has been streamed, and the next delta is decoded from text_prefix
    # on (both 0: no text streamed yet; the window then starts in the prompt, as at the start)
    text_prefix: int = 0
    text_read: int = 0

    def validate(self, max_tokens: int) -> str | None:
        n = len(self.output_ids)
        if not 1 <= n <= max_tokens:
            return f"resume.output_ids must have 1 to max_tokens ({max_tokens}) tokens, got {n}"
        if any(t < 0 for t in self.output_ids):
            return "resume.output_ids must be token ids >= 0"
        if not 0 <= self.text_prefix <= self.text_read <= n or (
                self.text_read > 0 and self.text_prefix == self.text_read):
            return (f"resume: need 0 <= text_prefix < text_read <= {n} (or both 0), got "
                    f"{self.text_prefix}, {self.text_read}")
        return None


class GenerateRequest(msgspec.Struct, tag="generate", frozen=True, forbid_unknown_fields=True):
    """Start a generation. Exactly one of ``prompt`` / ``prompt_token_ids`` is set."""

    request_id: str  # client-chosen, unique among the client's live requests, 1-256 chars
    prompt: str | None = None  # text, tokenized by the node (no chat template applied)
    prompt_token_ids: list[int] | None = None  # token ids, each in [0, vocab_size)
    sampling: SamplingParams = SamplingParams()
    v: int = PROTOCOL_VERSION  # must be PROTOCOL_VERSION
    # only requests of the same salt share cached prompt prefixes (disagg.serving.salting);
    # 1-MAX_CACHE_SALT characters, None = unsalted; a node salting by tenant replaces it
    cache_salt: str | None = None
    # the unit of fairness this request counts under on the node (its fair queue and
    # --max-requests-per-client), set by a router or gateway for its own clients (an API key's
    # id, a header's value); 1-MAX_TENANT characters, None = the sender's own. Ignored from a
    # CURVE client key (its key is its tenant); honoured from node keys and without CURVE
    tenant: str | None = None
    # set: continue a request another node streamed part of (Resume); None: a new request
    resume: Resume | None = None
    # W3C trace context (``00-<trace id>-<span id>-<flags>``) of the caller's span: a node
    # tracing (--otlp-traces-endpoint) makes its spans of this request its children; one that
    # does not parse starts a new trace. At most MAX_TRACEPARENT characters
    traceparent: str | None = None

    def validate(self) -> str | None:
        """The protocol version, the cache salt, the tenant, then the sampling parameters: a
        message naming the first bad field, or None (the prompt is checked by the node, which
        knows the vocabulary)."""
        if self.v != PROTOCOL_VERSION:
            return f"v must be {PROTOCOL_VERSION} (the protocol version of this node), got {self.v}"
        if self.cache_salt is not None and not 1 <= len(self.cache_salt) <= MAX_CACHE_SALT:
            return (f"cache_salt must have 1-{MAX_CACHE_SALT} characters, "
                    f"got {len(self.cache_salt)}")
        if self.tenant is not None and not 1 <= len(self.tenant) <= MAX_TENANT:
            return f"tenant must have 1-{MAX_TENANT} characters, got {len(self.tenant)}"
        if self.traceparent is not None and len(self.traceparent) > MAX_TRACEPARENT:
            return (f"traceparent must have at most {MAX_TRACEPARENT} characters, "
                    f"got {len(self.traceparent)}")
        if self.resume is not None and (why := self.resume.validate(
                self.sampling.max_tokens)) is not None:
            return why
        return self.sampling.validate()


class Abort(msgspec.Struct, tag="abort", frozen=True, forbid_unknown_fields=True):
    """Stop a live request; its pages return to the pool."""

    request_id: str


class StatsRequest(msgspec.Struct, tag="stats", frozen=True, forbid_unknown_fields=True):
    """Ask for one ``Stats`` reply."""


class Ping(msgspec.Struct, tag="ping", frozen=True, forbid_unknown_fields=True):
    """Ask for one ``Pong`` (a heartbeat: the frontend answers it at once, however busy the
    scheduler is)."""


ClientMessage = GenerateRequest | Abort | StatsRequest | Ping

# ------------------------------------------------------------------ node -> client


class TokenLogprobs(msgspec.Struct, array_like=True, gc=False, frozen=True):
    """One token's log-probability (natural log) and the most likely alternatives at its
    position, most likely first (``SamplingParams.logprobs`` / ``prompt_logprobs`` of them)."""

    token_id: int
    logprob: float
    top_ids: list[int] = []
    top_logprobs: list[float] = []  # top_logprobs[i] is top_ids[i]'s


class TokenChunk(msgspec.Struct, tag="token", frozen=True):
    """New output tokens of one request, in order."""

    request_id: str
    token_ids: list[int]
    text: str  # detokenized text delta ("" when the node has no tokenizer)
    v: int = PROTOCOL_VERSION
    # SamplingParams.logprobs set: one entry per token_ids, in order; else None
    logprobs: list[TokenLogprobs] | None = None
    # SamplingParams.prompt_logprobs set: in the request's first chunk, one entry per prompt
    # token after the first (the first has no context to be predicted from); else None
    prompt_logprobs: list[TokenLogprobs] | None = None


class Usage(msgspec.Struct, frozen=True):
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # prompt tokens taken from the prefix cache, not computed


FinishReason = Literal["stop", "length", "abort"]
# Error.code and PrefillFailed.code. The wire fields are plain ``str`` so that a client decodes
# a code a newer node adds; the node's own code builds errors through these types (mypy).
ErrorCode = Literal["bad_frame", "bad_request", "duplicate_request", "unknown_request",
                    "overloaded", "timeout", "prefill_failed", "unavailable", "shutting_down",
                    "internal"]


class Finished(msgspec.Struct, tag="finished", frozen=True):
    """Terminal message of a request; no more messages follow for this id.

    ``stop``: EOS or a stop token; ``length``: max_tokens or the context limit;
    ``abort``: the client aborted."""

    request_id: str
    reason: str  # FinishReason (plain str on the wire, see ErrorCode)
    usage: Usage
    v: int = PROTOCOL_VERSION
    # Where the time to first token went (milliseconds), for requests prefilled remotely
    # (disagg.actors.scheduler.decode_scheduler DecodeSide.timings_of): decode_queue
    # (admitted -> sent to a prefiller), kv_wait (sent -> every unit landed), prefill_queue,
    # prefill_compute (to the last layer of the prompt done on the prefiller's device) and
    # transfer_tail (-> its last write completed), the prefiller's; request_trip and
    # completion_signal (where both nodes share a clock; else trip_and_signal), wake_up (KV
    # landed -> the step computing the first token launched), first_step (that step: launched
    # -> token out); exposed_transfer: the node's time to first token less prefill_compute and
    # first_step (what disaggregation added; never clipped). None for local prefills.
    timings: dict[str, float] | None = None


class Error(msgspec.Struct, tag="error", frozen=True):
    """A request (or a frame) was refused or failed. Terminal for ``request_id`` if set."""

    code: str  # machine-readable: an ErrorCode

    message: str  # human-readable reason naming the field
    request_id: str | None = None
    v: int = PROTOCOL_VERSION


class DPRankStats(msgspec.Struct, array_like=True, frozen=True):
    """One data-parallel attention rank of a ``--dp`` node (``Stats.dp_ranks``)."""

    rank: int
    running: int  # sequences running on the rank now
    pages_total: int  # the rank's own KV pool
    pages_free: int
    started: int  # sequences that took their first pages on the rank (cumulative)
    # --expert-parallel: seconds the rank's lead executor spent in the MoE layers' all-to-alls
    # (dispatch and combine, waits for the other ranks included; cumulative)
    all_to_all_s: float = 0.0


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
    waiting_for_kv: int = 0  # decode: requests whose pages wait for a prefiller's KV
    transfers_in_flight: int = 0
    kv_writes_sent: int = 0
    kv_bytes_sent: int = 0
    kv_units_received: int = 0  # pages (per layer) + contexts landed on this node
    kv_junk_immediates: int = 0  # decode: immediates refused (unknown/finished key, overflow)
    layer_lag: int = 0  # prefill: layers computed but not yet handed to the engine
    prefill_peers_alive: int = 0
    layerwise_steps: int = 0  # prefill: steps whose first layer shipped before the last finished
    pages_fenced: int = 0  # decode: pages a write of a failed attempt may still reach (not free)
    max_model_len: int = 0  # the context limit enforced here: prompt + output tokens
    replies_dropped: int = 0  # replies to clients that vanished or stopped reading
    dp_ranks: list[DPRankStats] = []  # --dp > 1: each rank's load, in rank order
    pages_cached: int = 0  # free pages holding a cached prefix (evictable; in pages_free)
    prefix_query_tokens: int = 0  # prompt tokens of requests that looked the prefix cache up
    prefix_hit_tokens: int = 0  # ... of which served from this node's prefix cache
    # (both prefix counters read 0 for a client key salted by tenant: disagg.serving.salting)
    spec_draft_tokens: int = 0  # speculative decoding: drafted tokens verified (cumulative)
    spec_accepted_tokens: int = 0  # ... of which accepted (emitted without their own step)
    steps_overlapped: int = 0  # decode steps sent before their predecessor's tokens were back
    draining: int = 0  # 1 while the node drains (admits nothing new; a router: nodes draining)
    # KV tiers behind the prefix cache (--kv-host-cache-mb, --kv-disk-cache-dir;
    # disagg.engine.kv_tiers): lookups that found pages in each tier, and their tokens (a
    # lookup spanning tiers counts in each; tokens add up to prefix_hit_tokens; read 0 for a
    # client key salted by tenant, as the prefix counters)
    tier_hits_device: int = 0
    tier_hits_host: int = 0
    tier_hits_disk: int = 0
    tier_hit_tokens_device: int = 0
    tier_hit_tokens_host: int = 0
    tier_hit_tokens_disk: int = 0
    kv_bytes_to_host: int = 0  # device -> host tier (cumulative)
    kv_bytes_from_host: int = 0  # host tier -> device
    kv_bytes_to_disk: int = 0  # host -> disk tier
    kv_bytes_from_disk: int = 0  # disk tier -> host
    host_cache_pages_total: int = 0  # the host tier's slots (0: no host tier)
    host_cache_pages_used: int = 0  # ... holding a page (or a copy on its way)
    disk_cache_bytes_total: int = 0  # the disk tier's bound (0: no disk tier)
    disk_cache_bytes_used: int = 0  # its page files' bytes
    kv_pages_from_host: int = 0  # prefill: pages shipped to decoders from the host tier
    # evictions of a page whose copy to the host tier was still on its way: waited for it (the
    # scheduler blocked), copied it at once (not started yet), voided it (the wait's bound
    # passed: the host entry dropped); and pages the host tier never got (evicted before
    # their copy was sent, or no slot free of pins)
    tier_copies_waited: int = 0
    tier_copies_expedited: int = 0
    tier_copies_voided: int = 0
    tier_copies_skipped: int = 0
    # prefill: KV units (a page's run of one layer, as kv_units_received counts them; context
    # writes not included) posted from each executor's pages, in executor order (--dp ranks
    # rank-major, each its --tp ranks): every source replica sends a share of an MLA transfer
    kv_units_sent_by_rank: list[int] = []
    # seconds per phase of this node's last start (disagg.engine.start_phases.PHASES: spawn,
    # imports, weights, triton_warmup, kv_profile, kv_alloc, graph_capture, ...; a restart's
    # replace the first start's)
    start_phases_s: dict[str, float] = {}
    v: int = PROTOCOL_VERSION


class Pong(msgspec.Struct, tag="pong", frozen=True):
    """The answer to ``Ping``: the node's event loop runs. ``draining``: it drains (SIGTERM,
    ``POST /drain`` on ``--metrics-listen``, ``disagg-node drain``): it admits no new request
    (they get ``unavailable``) and finishes its streams, then exits."""

    draining: bool = False
    v: int = PROTOCOL_VERSION


NodeReply = TokenChunk | Finished | Error | Stats | Pong

