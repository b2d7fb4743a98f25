"""In-process links between the actors of one node (``inproc://``): frontend <-> scheduler
and scheduler <-> messenger (prefill and decode sides)."""

from __future__ import annotations

from typing import Literal

import msgspec

from disagg.protocol import ClientMessage, GenerateRequest, Stats

_ENC = msgspec.msgpack.Encoder()
_IDS = msgspec.msgpack.Decoder(list[int])


def msgpack_array_header(n: int) -> bytes:
    """The header msgpack (and msgspec) puts before an array of ``n`` elements."""
    if n < 16:
        return bytes((0x90 | n,))
    if n < 1 << 16:
        return b"\xdc" + n.to_bytes(2, "big")
    return b"\xdd" + n.to_bytes(4, "big")


def drop_last_id(encoded: bytes | memoryview, n: int, last: int) -> bytes | None:
    """The msgpack array ``encoded`` of ``n`` token ids ending in ``last``, without that
    last id: one copy of the bytes, no id converted (a 32k-id prompt: ~10 us, where encoding
    the list takes 0.3-0.6 ms). None when ``encoded`` does not have that header and that
    last element (the caller then encodes the ids)."""
    head, tail = msgpack_array_header(n), _ENC.encode(last)
    end = len(encoded) - len(tail)
    if n < 1 or end < len(head) or encoded[:len(head)] != head or encoded[end:] != tail:
        return None
    return msgpack_array_header(n - 1) + encoded[len(head):end]

# ------------------------------------------------------------------ frontend <-> scheduler (inproc)


class FromClient(msgspec.Struct, tag="from_client", array_like=True, frozen=True):
    """A decoded client message and the ROUTER identity it came from.

    A ``GenerateRequest``'s prompt ids travel beside it, encoded (``prompt``, a msgpack array;
    ``FromClient.of`` moves them there): the scheduler decodes them and keeps those bytes, so
    that a decoder's remote-prefill request sends them on as they are (``drop_last_id``)
    instead of encoding a long prompt again on its way to a prefiller."""

    identity: bytes
    msg: ClientMessage
    prompt: memoryview | None = None  # msgpack of the request's prompt_token_ids, taken out
    # the client's unit of fairness (its CURVE client key); None: the connection, identity
    tenant: bytes | None = None

    @classmethod
    def of(cls, identity: bytes, msg: ClientMessage, tenant: bytes | None = None) -> FromClient:
        if isinstance(msg, GenerateRequest) and msg.prompt_token_ids is not None:
            return cls(identity, msgspec.structs.replace(msg, prompt_token_ids=None),
                       memoryview(_ENC.encode(msg.prompt_token_ids)), tenant)
        return cls(identity, msg, None, tenant)

    def generate_request(self, ids: msgspec.msgpack.Decoder[list[int]] = _IDS
                         ) -> GenerateRequest:
        """``msg`` (a GenerateRequest) with its prompt ids back in, decoded by ``ids`` (one
        with constraints raises ``msgspec.ValidationError`` for an id outside them)."""
        assert isinstance(self.msg, GenerateRequest)
        if self.prompt is None:
            return self.msg
        return msgspec.structs.replace(self.msg, prompt_token_ids=ids.decode(self.prompt))


class ToClient(msgspec.Struct, tag="to_client", array_like=True, frozen=True):
    """The header of a reply for the frontend to route to ``identity``; the reply itself, an
    encoded ``NodeReply``, follows as a second frame (``reply`` not "none") and is forwarded
    as it is. ``frames``: how many of that client's frames the scheduler finished handling with
    it (the frontend's count of the client's frames in flight). ``reply``: ``terminal`` ends a
    request (kept for a slow reader past its backlog), ``stats`` gets the frontend's counters."""

    identity: bytes
    frames: int = 0
    reply: Literal["none", "reply", "terminal", "stats"] = "none"


class ClientGone(msgspec.Struct, tag="client_gone", array_like=True, frozen=True):
    """The frontend's word that a client disconnected or stopped reading its replies: end
    its live requests (``reason`` says which, for the log)."""

    identity: bytes
    reason: str


SchedulerInbox = FromClient | ClientGone  # what the scheduler reads from the frontend



# ------------------------------------------------------------------ scheduler <-> messenger (inproc)
#
# Prefill node: the messenger hands accepted PrefillRequests to the scheduler as jobs; before
# every step the scheduler announces which chunks it holds and after it reports
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
    # when the scheduler sent the step to its executors (monotonic, this process's clock):
    # a job's compute starts there (the messenger may read this after the step ran)
    sent_at: float = 0.0


class JobHostPages(msgspec.Struct, tag="job_host_pages", array_like=True, frozen=True):
    """Pages of ``job``'s prompt the host KV tier holds (``disagg.engine.prefix_tiers``):
    the messenger may ship them from there at once, while they are reloaded for the job's
    compute; the slots stay the job's until ``ReleaseJob``."""

    job: int
    pages: list[tuple[int, int]]  # (page index in the job's block table, host tier slot)


class StepDone(msgspec.Struct, tag="step_done", array_like=True, frozen=True):
    """The step finished. ``context_jobs[i]`` owns row i of the hidden-state frame that follows
    (when ``ok``); a failed step writes nothing more for its jobs."""

    step_id: int
    ok: bool
    context_jobs: list[int]
    error: str | None = None


class PrefillJob(msgspec.Struct, tag="job", array_like=True, frozen=True):
    """Schedule a prefill-only sequence (never sampled) for messenger job ``job``.

    Its ids travel as the request carried them (``prompt``, a msgpack array in a bin: the
    messenger read only their count), decoded once, by the scheduler, each checked against the
    vocabulary as it is (``disagg.remote.requests.PromptIds``; refused: ``JobRefused``)."""

    job: int
    prompt: memoryview  # msgpack of the prompt ids (PrefillRequest.prompt_ids)
    cache_salt: str | None = None  # its PrefillRequest's: the root of its page hashes

    @property
    def prompt_ids(self) -> list[int]:
        """The ids, decoded (tests and tools; the scheduler decodes them with its checks)."""
        return _IDS.decode(self.prompt)


class JobRefused(msgspec.Struct, tag="job_refused", array_like=True, frozen=True):
    """The scheduler did not take ``job``: its ids are not this model's token ids
    (``message`` names why, as the request's own checks would); the messenger refuses the
    request ``bad_request`` with it."""

    job: int
    message: str


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
    """Decode side (``disagg.remote.decode.Send``): ask a prefiller for the KV of the prompt
    under ``request_id`` / ``key``, written into ``dst_pages``.

    The prompt ids travel encoded once (``prompt``, a msgpack array): the messenger puts
    those bytes into the ``PrefillRequest`` as they are (``PrefillRequestOut``, a bin) and
    reads only ``num_tokens`` and ``route_keys``, so a long prompt is not decoded and encoded
    again on its way out (nor on the prefiller before its scheduler: ``PrefillJob``). The decode side builds one from the client's encoded ids
    (``DecodeSide._send_prefill``); ``SendPrefill.of`` encodes a list (tests and tools). They
    go as a msgpack bin, not as ``msgspec.Raw`` (a Raw array is walked element by element to
    find its end: 0.36 ms at 32k ids), decoded as a ``memoryview`` into the received frame (no
    copy)."""

    request_id: str
    key: int
    prompt: memoryview  # msgpack of the prompt ids without the last prompt token
    num_tokens: int  # how many ids ``prompt`` holds
    route_keys: list[bytes]  # disagg.serving.routing.encoded_prefix_keys of ``prompt``
    dst_pages: list[int]  # pages covering the prompt after the first skip_pages
    cap_s: float  # the attempt's absolute budget (sent as deadline_unix)
    skip_pages: int = 0  # leading prompt pages the decoder holds (prefix cache): not written
    cache_salt: str | None = None  # the request's (``PrefillRequest.cache_salt``)
    traceparent: str | None = None  # its remote-prefill span's (``PrefillRequest.traceparent``)

    @classmethod
    def of(cls, request_id: str, key: int, prompt_ids: list[int], dst_pages: list[int],
           cap_s: float, skip_pages: int = 0, route_keys: list[bytes] | None = None,
           cache_salt: str | None = None) -> SendPrefill:
        return cls(request_id, key, memoryview(_ENC.encode(prompt_ids)), len(prompt_ids),
                   route_keys or [], dst_pages, cap_s, skip_pages, cache_salt)

    def prompt_ids(self) -> list[int]:
        """The ids, decoded (tests and tools; the messenger never needs them)."""
        return msgspec.msgpack.decode(self.prompt, type=list[int])


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
    conn_down). ``timings``: with ``done``, the prefiller's queue / compute / tail seconds
    and its wall clock when it accepted the request (0: unknown);
    ``cached_tokens``: with ``done``, the prompt tokens it took from its prefix cache;
    ``context``: with ``landed`` when the decoder drafts with MTP, the context row the
    prefiller wrote (its last hidden state)."""

    request_id: str
    kind: AttemptEventKind
    code: str = ""
    message: str = ""
    timings: tuple[float, float, float, float] | None = None
    cached_tokens: int = 0
    context: bytes = b""


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
    kv_pages_from_host: int = 0  # prefill: pages shipped straight from the host KV tier
    kv_units_sent_by_rank: list[int] = []  # prefill: KV units posted from each executor's pages


class StatsQuery(msgspec.Struct, tag="stats_query", array_like=True, frozen=True):
    """Prefill node: a peer asked for Stats; the scheduler answers with ``StatsReply``."""

    peer: bytes


class StatsReply(msgspec.Struct, tag="stats_reply", array_like=True, frozen=True):
    peer: bytes
    stats: Stats


ToScheduler = (PrefillJob | CancelJob | ReleaseJob | AttemptEvent | PeersAlive | MessengerStats
               | StatsQuery)
ToMessenger = (StepAnnounce | StepDone | SendPrefill | StopPrefill | ForgetPrefill | StatsReply
               | JobHostPages | JobRefused)
