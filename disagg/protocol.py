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

from typing import Annotated, Literal

import msgspec
import numpy as np

PROTOCOL_VERSION = 1

# ------------------------------------------------------------------ client -> node


MAX_TOKENS_LIMIT = 2**31 - 1  # sanity bound on max_tokens (the context limit stops earlier)
MIN_TEMPERATURE = 1e-5  # below this (except 0) float32 logits / temperature overflow
MAX_STOP_TOKEN_IDS = 1024


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
    seed: int | None = None  # per-request seed; same seed -> same tokens, alone or batched
    stop_token_ids: list[int] = []  # finish (reason "stop") when one of these is sampled
    ignore_eos: bool = False  # keep going past the model's EOS tokens
    min_tokens: int = 0  # EOS/stop tokens are ignored before this many outputs

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
        return None


class GenerateRequest(msgspec.Struct, tag="generate", frozen=True, forbid_unknown_fields=True):
    """Start a generation. Exactly one of ``prompt`` / ``prompt_token_ids`` is set."""

    request_id: str  # client-chosen, unique among the client's live requests, 1-256 chars
    prompt: str | None = None  # text, tokenized by the node (no chat template applied)
    prompt_token_ids: list[int] | None = None  # token ids, each in [0, vocab_size)
    sampling: SamplingParams = SamplingParams()
    v: int = PROTOCOL_VERSION  # must be PROTOCOL_VERSION

    def validate(self) -> str | None:
        """The protocol version, then the sampling parameters: a message naming the first bad
        field, or None (the prompt is checked by the node, which knows the vocabulary)."""
        if self.v != PROTOCOL_VERSION:
            return f"v must be {PROTOCOL_VERSION} (the protocol version of this node), got {self.v}"
        return self.sampling.validate()


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
    # Where the time to first token went (milliseconds), for requests prefilled remotely:
    # decode_queue (admitted -> sent to a prefiller), prefill_queue, prefill_compute (the
    # prefiller's view), kv_wait (sent -> every unit landed), exposed_transfer (kv_wait minus
    # the prefiller's queue and compute: what the transfer added), first_step (KV landed ->
    # first token). None for requests prefilled locally.
    timings: dict[str, float] | None = None


class Error(msgspec.Struct, tag="error", frozen=True):
    """A request (or a frame) was refused or failed. Terminal for ``request_id`` if set."""

    # machine-readable: bad_frame, bad_request, duplicate_request, unknown_request, overloaded,
    # timeout, prefill_failed, unavailable, shutting_down, internal
    code: str
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
    want_hidden: bool = False  # return the last position's hidden state (prefill context)
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
    """Sampled tokens, one per chunk with ``sample=True``, in chunk order.

    When ``hidden_rows > 0`` a second zmq frame follows: the final hidden states of the chunks
    with ``want_hidden``, in chunk order, ``[hidden_rows, hidden_size]`` in the model dtype."""

    step_id: int
    token_ids: list[int]
    error: str | None = None  # set when the step failed; the executor keeps serving
    hidden_rows: int = 0


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
    counter: str | None = None  # LayerCounter handle (lead rank only), for the main process


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
    """A reply for the frontend to route to ``identity`` (None: nothing to send), and how many
    of that client's frames the scheduler finished handling with it (the frontend's count of
    the client's frames in flight)."""

    identity: bytes
    msg: NodeReply | None
    frames: int = 0


class ClientGone(msgspec.Struct, tag="client_gone", array_like=True, frozen=True):
    """The frontend's word that a client disconnected or stopped reading its replies: end
    its live requests (``reason`` says which, for the log)."""

    identity: bytes
    reason: str


SchedulerInbox = FromClient | ClientGone  # what the scheduler reads from the frontend


# ------------------------------------------------------------------ decode node <-> prefill node
#
# Decode DEALER -> prefill ROUTER (the prefill node's --listen). KV bytes never ride here: only
# page ids and memory descriptors; the pages move through the transfer engine.


class KVLayoutDesc(msgspec.Struct, frozen=True):
    """A node's KV cache as a peer must know it; see transfer_plan.

    Every rank of a node has its own buffer of ``total_bytes`` laid out
    ``[num_layers, num_pages, 2 (K, V), num_kv_heads, page_size, head_dim]`` (HND), and the same
    page ids on every rank. Rank ``r`` holds the global kv heads ``rank_heads(r)``: block
    ``r // kv_replicas`` of ``num_kv_heads`` heads, so with ``kv_replicas`` > 1 (kv heads < TP,
    or MLA's single latent) consecutive ranks hold the same heads, and replica set
    ``j = r % kv_replicas`` (ranks j, j + kv_replicas, ...) holds one whole KV cache."""

    num_layers: int
    num_pages: int  # pages per rank (page ids are node-local, the same on every rank)
    num_kv_heads: int  # kv heads held by each rank
    page_size: int  # tokens per page
    head_dim: int
    dtype: str  # torch dtype name
    element_size: int  # bytes per element
    hidden_size: int  # context (hidden state) elements per request
    tp_size: int = 1  # ranks (one KV buffer each, all in one node's transfer engine)
    kv_replicas: int = 1  # ranks holding each kv head (divides tp_size); 1 = no replication

    @property
    def page_bytes(self) -> int:
        """Bytes of one page of one layer on one rank: K and V of every local kv head."""
        return 2 * self.num_kv_heads * self.page_size * self.head_dim * self.element_size

    @property
    def head_bytes(self) -> int:
        """Bytes of one kv head's K (or V) in one page: one contiguous run (HND)."""
        return self.page_size * self.head_dim * self.element_size

    @property
    def total_bytes(self) -> int:
        """Bytes of one rank's KV buffer."""
        return self.num_layers * self.num_pages * self.page_bytes

    @property
    def total_kv_heads(self) -> int:
        """kv heads of the model (over all ranks, each counted once)."""
        return self.num_kv_heads * self.tp_size // max(1, self.kv_replicas)

    @property
    def context_bytes(self) -> int:
        return self.hidden_size * self.element_size

    def page_offset(self, layer: int, page: int) -> int:
        """Byte offset of page ``page`` of ``layer`` in a rank's buffer."""
        return (layer * self.num_pages + page) * self.page_bytes

    def rank_heads(self, rank: int) -> range:
        """Global kv heads held by ``rank`` (in local order)."""
        block = rank // self.kv_replicas
        return range(block * self.num_kv_heads, (block + 1) * self.num_kv_heads)


class PrefillRequest(msgspec.Struct, tag="prefill", frozen=True, forbid_unknown_fields=True):
    """Prefill ``prompt_ids`` and write their KV into the decoder's ``dst_pages``.

    The decoder owns ``dst_pages`` and the context slot until it gets ``PrefillDone``,
    ``PrefillFailed`` or ``AbortAck`` (or declares the prefiller dead): only then may it reuse
    them, since a write may land until then."""

    request_id: str  # the decoder's id for this attempt (unique per decoder)
    key: int  # immediate key (slot, generation) every write carries
    prompt_ids: list[int]  # the prompt WITHOUT its last token (SEED.md 26)
    dst_pages: list[int]  # decoder page ids, in block-table order; len = pages for prompt_ids
    dst_layout: KVLayoutDesc
    dst_kv: bytes  # encoded MemoryDescriptor of the decoder's (lead rank's) KV region
    dst_ctx: bytes  # encoded MemoryDescriptor of the decoder's context buffer
    ctx_offset: int  # byte offset of this request's context slot in dst_ctx
    timeout_s: float  # idle timeout: the prefiller gives up (and frees its pages) after this
    # long without progress (disagg.deadlines)
    dst_kv_ranks: list[bytes] = []  # one descriptor per decoder rank when its tp_size > 1
    deadline_unix: float = 0.0  # absolute cap, wall clock (time.time()), after which the
    # prefiller posts no write of this request, whenever it received it, progress or not
    # (0 = the rule's cap from reading it: ``prefill_cap_s``); the decoder keeps the pages
    # fenced until then (plus a grace) when it cannot get an acknowledgement
    challenge_slot: int = 0  # the slot of dst_ctx's challenge area this prefiller writes
    # nonces into (disagg.ownership), in [0, CHALLENGE_SLOTS)
    challenge_key: int = 0  # the immediate key the decoder expects a challenge's writes under
    v: int = PROTOCOL_VERSION


class AbortPrefill(msgspec.Struct, tag="abort_prefill", frozen=True, forbid_unknown_fields=True):
    """Stop a prefill; answered by ``AbortAck`` once no write of it can land any more."""

    request_id: str


class Ping(msgspec.Struct, tag="ping", frozen=True, forbid_unknown_fields=True):
    seq: int


class ChallengeAnswer(msgspec.Struct, tag="challenge_answer", frozen=True,
                      forbid_unknown_fields=True):
    """The bytes the decoder read from its challenge slot after a ``Challenge``; empty: the
    decoder abstains, the request named no longer wants KV (aborted: its registration may
    have closed before the nonce landed)."""

    id: int
    nonce: Annotated[bytes, msgspec.Meta(max_length=4096)]


PeerRequest = PrefillRequest | AbortPrefill | Ping | StatsRequest | ChallengeAnswer


class Pong(msgspec.Struct, tag="pong", frozen=True):
    """Liveness and load of a prefiller."""

    seq: int
    queued_tokens: int  # prompt tokens accepted and not yet prefilled
    layout: KVLayoutDesc
    transport: str = ""  # "backend/provider" of its transfer engine; decoders must match it
    v: int = PROTOCOL_VERSION


class PrefillDone(msgspec.Struct, tag="prefill_done", frozen=True):
    """Every write of the request was posted and completed at the source (not delivery: the
    decoder counts the units that landed itself); the prefiller posts nothing more of it and
    freed its pages."""

    request_id: str
    prefill_s: float  # seconds from acceptance to the last write's completion at the source
    queue_s: float = 0.0  # acceptance -> its first chunk was scheduled
    compute_s: float = 0.0  # first chunk scheduled -> last step done
    tail_s: float = 0.0  # last step done -> last write completed at the source


class PrefillProgress(msgspec.Struct, tag="prefill_progress", frozen=True):
    """The prefiller is making progress with the request or the queue it waits in (a step or
    layer computed): the decoder pushes the attempt's idle deadline forward. Sent at most every
    quarter of ``timeout_s`` per request."""

    request_id: str


class PrefillFailed(msgspec.Struct, tag="prefill_failed", frozen=True):
    """The prefill was refused or failed; no write of it will be posted any more (those
    already posted completed or failed at the source)."""

    request_id: str
    code: str  # bad_request | incompatible | overloaded | transfer_failed | timeout | internal
    message: str


class AbortAck(msgspec.Struct, tag="abort_ack", frozen=True):
    """No write of the request will land any more."""

    request_id: str


class Challenge(msgspec.Struct, tag="challenge", frozen=True):
    """Prove you own the endpoint your request named: a nonce was just written through
    ``lanes`` lanes into your challenge slot; answer with what you read (``ChallengeAnswer``)."""

    id: int
    lanes: int
    request_id: str = ""  # the request whose descriptors the nonce went through


PeerReply = Pong | PrefillDone | PrefillFailed | AbortAck | PrefillProgress | Stats | Challenge


# ------------------------------------------------------------------ scheduler <-> messenger (inproc)
#
# Prefill node: the messenger hands accepted PrefillRequests to the scheduler as jobs; before
# every step the scheduler announces which chunks it holds (SEED.md 12) and after it reports
# the step done (with the context rows as a second frame). Pages stay with the scheduler's
# pool; the messenger says when a job's pages may be freed (all its writes completed).
# Decode node: the scheduler asks for remote prefills of requests whose pages it reserved; the
# messenger reports KV arrival, or failure once no write can land any more.


class ChunkInfo(msgspec.Struct, array_like=True, frozen=True):
    job: int  # the messenger's job id
    start: int  # first position computed by this chunk
    count: int  # positions computed by this chunk
    total: int  # the job's prefill length (positions)
    pages: list[int]  # the job's source pages so far (block table)


class StepAnnounce(msgspec.Struct, tag="announce", array_like=True, frozen=True):
    """Sent BEFORE the step runs: the prefill chunks it holds and its layer-counter base."""

    step_id: int
    counter_base: int
    chunks: list[ChunkInfo]


class StepDone(msgspec.Struct, tag="step_done", array_like=True, frozen=True):
    """The step finished. ``context_jobs[i]`` owns row i of the hidden-state frame that follows
    (when ``ok``); a failed step writes nothing more for its jobs."""

    step_id: int
    ok: bool
    context_jobs: list[int]
    error: str | None = None


class PrefillJob(msgspec.Struct, tag="job", array_like=True, frozen=True):
    """Schedule a prefill-only sequence (never sampled) for messenger job ``job``."""

    job: int
    prompt_ids: list[int]


class CancelJob(msgspec.Struct, tag="cancel_job", array_like=True, frozen=True):
    """Stop scheduling ``job``; keep its pages until ``ReleaseJob``."""

    job: int


class ReleaseJob(msgspec.Struct, tag="release_job", array_like=True, frozen=True):
    """No write reads ``job``'s pages any more: free them. ``outcome``: finished (every write
    completed), aborted (the decoder's AbortPrefill) or errored (writes failed, deadline)."""

    job: int
    outcome: str = "finished"


AttemptEventKind = Literal["landed", "progress", "failed", "done", "acked", "peer_dead",
                          "conn_down"]


class SendPrefill(msgspec.Struct, tag="send_prefill", array_like=True, frozen=True):
    """Decode side (``disagg.remote.decode.Send``): ask a prefiller for the KV of
    ``prompt_ids`` under ``request_id`` / ``key``, written into ``dst_pages``."""

    request_id: str
    key: int
    prompt_ids: list[int]  # without the last prompt token
    dst_pages: list[int]  # pages covering prompt_ids, block-table order
    cap_s: float  # the attempt's absolute budget (sent as deadline_unix)


class StopPrefill(msgspec.Struct, tag="stop_prefill", array_like=True, frozen=True):
    """Decode side (``disagg.remote.decode.Abort``): no KV of ``request_id`` is wanted any
    more; ``blame``: count it against its prefiller's health."""

    request_id: str
    blame: bool = False


class ForgetPrefill(msgspec.Struct, tag="forget_prefill", array_like=True, frozen=True):
    """Decode side (``disagg.remote.decode.Forget``): nothing of ``request_id`` can land any
    more; drop its registrations and context slot."""

    request_id: str


class AttemptEvent(msgspec.Struct, tag="attempt_event", array_like=True, frozen=True):
    """Decode side: what the messenger saw of an attempt, fed to the scheduler's
    ``DecodeRemote.event`` (``kind``: landed, progress, failed, done, acked, peer_dead,
    conn_down). ``timings``: with ``done``, the prefiller's queue / compute / tail seconds."""

    request_id: str
    kind: AttemptEventKind
    code: str = ""
    message: str = ""
    timings: tuple[float, float, float] | None = None


class PeersAlive(msgspec.Struct, tag="peers_alive", array_like=True, frozen=True):
    count: int


class MessengerStats(msgspec.Struct, tag="messenger_stats", array_like=True, frozen=True):
    transfers_in_flight: int = 0  # requests with writes outstanding (prefill) or awaited (decode)
    kv_writes_sent: int = 0
    kv_bytes_sent: int = 0
    kv_units_received: int = 0  # pages + contexts landed here
    layer_lag: int = 0  # prefill: layers computed but not yet handed to the engine, last step
    prefill_peers_alive: int = 0
    layerwise_steps: int = 0  # prefill: steps whose first layer shipped before the last finished
    kv_junk_immediates: int = 0  # decode: immediates refused (unknown/finished key, overflow)


class StatsQuery(msgspec.Struct, tag="stats_query", array_like=True, frozen=True):
    """Prefill node: a peer asked for Stats; the scheduler answers with ``StatsReply``."""

    peer: bytes


class StatsReply(msgspec.Struct, tag="stats_reply", array_like=True, frozen=True):
    peer: bytes
    stats: Stats


ToScheduler = (PrefillJob | CancelJob | ReleaseJob | AttemptEvent | PeersAlive | MessengerStats
               | StatsQuery)
ToMessenger = StepAnnounce | StepDone | SendPrefill | StopPrefill | ForgetPrefill | StatsReply
