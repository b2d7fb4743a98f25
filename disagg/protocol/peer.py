"""Decode node <-> prefill node (the prefill node's peer socket): prefill requests, aborts,
pings, the ownership challenge (and its offer ahead of requests), and their answers. KV bytes never ride here."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from disagg.protocol import PROTOCOL_VERSION, Stats, StatsRequest

_ENC = msgspec.msgpack.Encoder()
_IDS = msgspec.msgpack.Decoder(list[int])

# ------------------------------------------------------------------ decode node <-> prefill node
#
# Decode DEALER -> prefill ROUTER (the prefill node's --listen). KV bytes never ride here: only
# page ids and memory descriptors; the pages move through the transfer engine.


MAX_DP_RANKS = 1024  # a Pong's dp_ranks above this is refused (a bad frame)

PrefillFailCode = Literal["bad_request", "incompatible", "overloaded", "transfer_failed",
                          "timeout", "internal"]


class KVLayoutDesc(msgspec.Struct, frozen=True):
    """A node's KV cache as a peer must know it; see transfer_plan.

    Every rank of a node has its own buffer of ``total_bytes`` laid out
    ``[num_layers, num_pages, kv_parts, num_kv_heads, page_size, head_dim]`` (HND), and the same
    page ids on every rank: the third dim is K and V (``kind`` gqa, ``kv_parts`` 2) or MLA's
    latent (``kind`` mla, ``kv_parts`` 1, one "head" of the latent's width).
    Rank ``r`` holds the global kv heads ``rank_heads(r)``: block ``r // kv_replicas`` of
    ``num_kv_heads`` heads, so with ``kv_replicas`` > 1 (kv heads < TP, or MLA's single latent)
    consecutive ranks hold the same heads, and replica set ``j = r % kv_replicas`` (ranks j,
    j + kv_replicas, ...) holds one whole KV cache."""

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
    kind: str = "gqa"  # what a page holds (ModelArch.layout_kind): "gqa" K/V heads, "mla" latent
    kv_parts: int = 2  # the third dim: K and V (2, gqa) or the latent (1, mla)
    # speculative decoding's own KV, moved beside the model's (SEED.md 15, 25): "draft" (a
    # draft model's pages) or "mtp" (the MTP layers' pages); "" = none. ``spec`` lays it out:
    # on the lead rank only (tp_size 1), the same page ids, right after the main region
    spec_method: str = ""
    spec: KVLayoutDesc | None = None
    # FP8 pages (dtype float8_e4m3fn): their scales' identity (kv_quant.scales_identity:
    # "unit" or a digest of every layer's K/V scales); pages are only written between equal ones
    kv_scales: str = ""
    # bytes per element of the context row (the model's hidden state; its dtype, not the
    # pages', with FP8 pages); 0 = element_size
    context_element_size: int = 0
    # the model's MoE (ModelArch.moe_shape: experts, top-k, widths, sparse layers; "" dense).
    # Expert placement never crosses a pair (only pages and hidden rows do), so each side
    # places its experts as it likes, but both must serve the same MoE
    moe: str = ""

    @property
    def page_bytes(self) -> int:
        """Bytes of one page of one layer on one rank: every part (K and V, or the MLA latent)
        of every local kv head."""
        return (self.kv_parts * self.num_kv_heads * self.page_size * self.head_dim
                * self.element_size)

    @property
    def head_bytes(self) -> int:
        """Bytes of one kv head's K (or V, or MLA latent) in one page: one contiguous run."""
        return self.page_size * self.head_dim * self.element_size

    @property
    def total_bytes(self) -> int:
        """Bytes of one rank's KV buffer (the main region; the lead rank's also holds
        ``spec_bytes`` after it)."""
        return self.num_layers * self.num_pages * self.page_bytes

    @property
    def spec_bytes(self) -> int:
        return 0 if self.spec is None else self.spec.total_bytes

    @property
    def total_kv_heads(self) -> int:
        """kv heads of the model (over all ranks, each counted once)."""
        return self.num_kv_heads * self.tp_size // max(1, self.kv_replicas)

    @property
    def context_bytes(self) -> int:
        return self.hidden_size * (self.context_element_size or self.element_size)

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
    # the prompt WITHOUT its last token (a decoder sends them as a bin: PrefillRequestOut)
    prompt_ids: list[int]
    # decoder page ids, in block-table order, for the prompt's pages after the first
    # ``skip_pages`` (which the decoder holds already: never written)
    dst_pages: list[int]
    dst_layout: KVLayoutDesc
    dst_kv: bytes  # encoded MemoryDescriptor of the decoder's (lead rank's) KV region
    dst_ctx: bytes  # encoded MemoryDescriptor of the decoder's context buffer
    ctx_offset: int  # byte offset of this request's context slot in dst_ctx
    timeout_s: float  # idle timeout: the prefiller gives up (and frees its pages) after this
    # long without progress (disagg.remote.deadlines)
    dst_kv_ranks: list[bytes] = []  # one descriptor per decoder rank when its tp_size > 1
    deadline_unix: float = 0.0  # absolute cap, wall clock (time.time()), after which the
    # prefiller posts no write of this request, whenever it received it, progress or not
    # (0 = the rule's cap from reading it: ``prefill_cap_s``); the decoder keeps the pages
    # fenced until then (plus a grace) when it cannot get an acknowledgement
    challenge_slot: int = 0  # the slot of dst_ctx's challenge area this prefiller writes
    # nonces into (disagg.remote.ownership), in [0, CHALLENGE_SLOTS)
    challenge_key: int = 0  # the immediate key the decoder expects a challenge's writes under
    skip_pages: int = 0  # leading prompt pages the decoder has in its prefix cache
    # the client request's cache salt (disagg.serving.salting), for the prefiller's own prefix
    # cache: its pages are shared only with requests of the same salt
    cache_salt: str | None = None
    v: int = PROTOCOL_VERSION
    # W3C trace context of the decoder's remote-prefill span (its tracing on), the parent of
    # the prefiller's spans of this job; at most 128 characters (GenerateRequest.traceparent)
    traceparent: str | None = None

    @property
    def prompt_len(self) -> int:
        """How many prompt ids it carries (``PrefillRequestIn``: read from their header)."""
        return len(self.prompt_ids)

    def prompt_msgpack(self) -> memoryview:
        """The ids' msgpack array (``PrefillRequestIn``: as they came, when they came so)."""
        return memoryview(_ENC.encode(self.prompt_ids))

    def decoded(self) -> PrefillRequest:
        """The request with its ids decoded (``PrefillRequestIn``: from their msgpack)."""
        return self


def _bin_prompt_twin(cls: type[msgspec.Struct]) -> type[msgspec.Struct]:
    """``cls`` with ``prompt_ids`` typed ``memoryview``: the same fields, tag and defaults, its
    ids as one msgpack bin holding their msgpack array."""
    fields: list[tuple[str, Any] | tuple[str, Any, Any]] = []
    for f in msgspec.structs.fields(cls):
        kind = memoryview if f.name == "prompt_ids" else f.type
        if f.default is not msgspec.NODEFAULT:
            fields.append((f.name, kind, f.default))
        elif f.default_factory is not msgspec.NODEFAULT:
            fields.append((f.name, kind, msgspec.field(default_factory=f.default_factory)))
        else:
            fields.append((f.name, kind))
    return msgspec.defstruct(cls.__name__ + "Out", fields, tag=cls.__struct_config__.tag,
                             frozen=True, forbid_unknown_fields=True)


# what a decoder encodes a PrefillRequest with: its prompt ids as the msgpack its scheduler
# made (SendPrefill.prompt), never decoded in between, sent as a bin (a prefiller finds its
# end at once, where an inline array is walked id by id: 0.3 ms at 32k ids); prefillers
# decode PrefillRequestIn
PrefillRequestOut = _bin_prompt_twin(PrefillRequest)


def msgpack_array_len(encoded: bytes | memoryview) -> int | None:
    """The element count in the header of the msgpack array ``encoded``, or None when it
    does not start with an array header (its elements are not looked at)."""
    if len(encoded) < 1:
        return None
    head = encoded[0]
    if head & 0xF0 == 0x90:
        return head & 0x0F
    size = 2 if head == 0xDC else 4 if head == 0xDD else 0
    if not size or len(encoded) < 1 + size:
        return None
    return int.from_bytes(encoded[1:1 + size], "big")


class PrefillRequestIn(PrefillRequest, tag="prefill", frozen=True, forbid_unknown_fields=True):
    """A ``PrefillRequest`` as a prefiller decodes it: ``prompt_ids`` as a decoder sends them
    (``PrefillRequestOut``: a bin holding their msgpack array, kept as a ``memoryview`` into the
    frame, only its header read) or as a plain msgpack array (decoded to a list). The
    prefiller's scheduler decodes the ids once, checking them against the vocabulary
    (``disagg.remote.requests.PromptIds``); the messenger reads their count only."""

    prompt_ids: memoryview | list[int]  # type: ignore[assignment]

    def __post_init__(self) -> None:
        if isinstance(self.prompt_ids, memoryview) and msgpack_array_len(self.prompt_ids) is None:
            raise ValueError("prompt_ids: a bin that is not a msgpack array")

    @property
    def prompt_len(self) -> int:
        ids = self.prompt_ids
        if isinstance(ids, list):
            return len(ids)
        n = msgpack_array_len(ids)
        assert n is not None  # __post_init__
        return n

    def prompt_msgpack(self) -> memoryview:
        ids = self.prompt_ids  # encoded only when they came as a plain array
        return ids if isinstance(ids, memoryview) else memoryview(_ENC.encode(ids))

    def decoded(self) -> PrefillRequest:
        """No vocabulary check; ``msgspec.ValidationError`` or ``DecodeError`` when the ids
        are not integers."""
        ids = self.prompt_ids
        fields = msgspec.structs.asdict(self)
        fields["prompt_ids"] = ids if isinstance(ids, list) else _IDS.decode(ids)
        return PrefillRequest(**fields)


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


class OwnershipOffer(msgspec.Struct, tag="ownership_offer", frozen=True,
                     forbid_unknown_fields=True):
    """Check now that this connection owns the endpoints of ``dst_ctx``, ahead of any request
    (``disagg.remote.ownership``): a decoder sends it when a compatible prefiller answers on a
    new connection, and again every ``REOFFER_S``. The prefiller runs the same check as for a
    ``PrefillRequest`` (its ``Challenge`` names no request) and creates no job. ``dst_kv``:
    the KV descriptors the decoder's requests will name, when they do not change per attempt;
    once the check passed, a prefiller may map them ahead of the first write (cuda-ipc)."""

    dst_ctx: bytes  # encoded MemoryDescriptor of the context buffer (its challenge area)
    challenge_slot: int
    challenge_key: int
    dst_kv: Annotated[list[bytes], msgspec.Meta(max_length=64)] = []
    v: int = PROTOCOL_VERSION


PeerRequest = (PrefillRequest | AbortPrefill | Ping | StatsRequest | ChallengeAnswer
               | OwnershipOffer)


# what a prefiller decodes from its peers (the ids of a request left encoded)
PeerRequestIn = (PrefillRequestIn | AbortPrefill | Ping | StatsRequest | ChallengeAnswer
                 | OwnershipOffer)


class Pong(msgspec.Struct, tag="pong", frozen=True):
    """Liveness and load of a prefiller."""

    seq: int
    queued_tokens: int  # prompt tokens accepted and not yet prefilled
    layout: KVLayoutDesc
    transport: str = ""  # "backend/provider" of its transfer engine; decoders must match it
    v: int = PROTOCOL_VERSION
    # --dp: the DP ranks sharing queued_tokens (the decoder weighs the queue per rank)
    dp_ranks: Annotated[int, msgspec.Meta(ge=1, le=MAX_DP_RANKS)] = 1


class PrefillDone(msgspec.Struct, tag="prefill_done", frozen=True):
    """Every write of the request was posted and completed at the source (not delivery: the
    decoder counts the units that landed itself); the prefiller posts nothing more of it and
    freed its pages."""

    request_id: str
    prefill_s: float  # seconds from acceptance to the last write's completion at the source
    queue_s: float = 0.0  # acceptance -> its first chunk was scheduled
    # first chunk scheduled -> the last layer of its last chunk done on the device (seen by
    # the layer counter's poller; where none was seen, that step's result back)
    compute_s: float = 0.0
    tail_s: float = 0.0  # compute's end -> last write completed at the source
    cached_tokens: int = 0  # prompt tokens the prefiller took from its prefix cache
    # the prefiller's wall clock (unix s) when the last write completed; 0 = not given. On one
    # host (one clock) the decoder splits its wait into the request's trip and the signal
    settled_at: float = 0.0


class PrefillProgress(msgspec.Struct, tag="prefill_progress", frozen=True):
    """The prefiller is making progress with the request or the queue it waits in (a step or
    layer computed): the decoder pushes the attempt's idle deadline forward. Sent at most every
    quarter of ``timeout_s`` per request."""

    request_id: str


class PrefillFailed(msgspec.Struct, tag="prefill_failed", frozen=True):
    """The prefill was refused or failed; no write of it will be posted any more (those
    already posted completed or failed at the source)."""

    request_id: str
    code: str  # a PrefillFailCode
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


