"""The prefill node's verdict on a PrefillRequest (pure: no sockets, no asyncio, time passed in).

Two phases, the facts gathered in between by the prefill messenger (``_accept``):

1. ``destinations``: the request's own checks (``disagg.remote.requests``), its memory
   descriptors decoded and checked, and the lanes an ownership check writes through; any
   problem refuses it ``bad_request``.
2. ``verdict``, given what the messenger knows of the request (``Facts``: a duplicate id, the
   connection's ownership of those endpoints, the job table's room, the wall clock): refuse
   (``bad_request``, ``overloaded``, ``timeout``), wait for the ownership check (``Park``: no job,
   no page meanwhile), or take it (``Admit``).

The messenger then carries the verdict out: a ``PrefillFailed`` with its code and message, the
ownership gate, or a job.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec

from disagg.protocol.peer import KVLayoutDesc, PrefillFailCode, PrefillRequest
from disagg.remote.deadlines import job_cap_s
from disagg.remote.ownership import endpoints
from disagg.remote.requests import NOT_IDS, descriptor_problem, request_problem

NOT_OWNED = "descriptor not owned by the requester (it failed the ownership check)"
TOO_LATE = "the request's deadline passed before it was read"


@dataclass(frozen=True)
class Destinations:
    """Where a request's writes go, decoded and checked."""

    kv: list[Any]  # decoded MemoryDescriptor per decoder rank
    ctx: Any  # the decoded context descriptor
    lanes: list[Any]  # the context descriptor's lanes an ownership check writes through

    @property
    def addresses(self) -> frozenset[bytes]:
        """The endpoints whose ownership the request's connection must have proven."""
        return frozenset(d.address for d in self.lanes)


@dataclass(frozen=True)
class Refuse:
    """Answer ``PrefillFailed(code, message)``; nothing of the request is kept."""

    code: PrefillFailCode
    message: str


@dataclass(frozen=True)
class Park:
    """Hold the request until its connection proved it owns ``dest`` (the ownership gate)."""

    dest: Destinations


@dataclass(frozen=True)
class Admit:
    """Take the request as a job of ``pages`` pages within ``cap_s`` seconds."""

    dest: Destinations
    pages: int
    cap_s: float


Verdict = Refuse | Park | Admit


@dataclass(frozen=True)
class Facts:
    """What the prefill messenger knows of a request with valid destinations."""

    duplicate: bool  # its peer has a job of the same request id
    owned: str  # its connection's ownership of ``Destinations.addresses``: owned, refused,
    # or unknown (check first: ``disagg.remote.ownership.OwnershipBook.status``)
    busy: str | None  # why the job machine refuses one more job of its peer, or None
    free_slots: int  # job (context) slots free
    now_unix: float  # wall clock: the decoder's deadline is absolute


def destinations(layout: KVLayoutDesc, vocab_size: int, req: PrefillRequest,
                 decode: Callable[[bytes], Any], own_lanes: int,
                 ids_in_vocab: bool = False) -> Destinations | Refuse:
    """Phase 1: the request checked and its descriptors decoded (``decode``: the transfer
    engine's ``decode_descriptor``; ``own_lanes``: the lanes this prefiller writes through),
    or why it is refused. ``ids_in_vocab``: its ids were checked as they were decoded."""
    why = request_problem(layout, vocab_size, req, ids_in_vocab=ids_in_vocab)
    if why is not None:
        return Refuse("bad_request", why)
    try:
        kv = [decode(d) for d in req.dst_kv_ranks or [req.dst_kv]]
        ctx = decode(req.dst_ctx)
        why = descriptor_problem(layout, req, kv, ctx)
        if why is None:
            lanes, why = endpoints(kv, ctx, own_lanes)
    except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as e:
        why = f"bad memory descriptor: {e}"
    if why is not None:
        return Refuse("bad_request", why)
    return Destinations(kv, ctx, lanes)


def refusal_with_ids(layout: KVLayoutDesc, vocab_size: int, req: PrefillRequest,
                     refusal: Refuse) -> Refuse:
    """The refusal of a request checked with its ids left encoded (``ids_in_vocab``: the
    prefiller's scheduler checks them as it decodes them, once, if the request is taken) as
    it reads when every request's ids are decoded and checked first: ``request_problem``'s
    with its ids decoded where it has one (an id outside the vocabulary comes before a
    descriptor's, the ownership's or the job table's problem), else ``refusal``."""
    try:
        why = request_problem(layout, vocab_size, req.decoded())
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        return Refuse("bad_request", f"{NOT_IDS}: {e}")
    return refusal if why is None else Refuse("bad_request", why)


def verdict(layout: KVLayoutDesc, req: PrefillRequest, dest: Destinations,
            facts: Facts) -> Verdict:
    """Phase 2: what becomes of a request with valid destinations, given ``facts``."""
    if facts.duplicate:
        return Refuse("bad_request", f"duplicate request id {req.request_id!r}")
    if facts.owned == "refused":
        return Refuse("bad_request", NOT_OWNED)
    if facts.owned == "unknown":
        return Park(dest)
    busy = facts.busy or (None if facts.free_slots > 0 else "too many jobs")
    if busy:
        return Refuse("overloaded", busy)
    cap_s = job_cap_s(req.timeout_s, req.prompt_len, req.deadline_unix, facts.now_unix)
    if cap_s <= 0:
        return Refuse("timeout", TOO_LATE)
    return Admit(dest, -(-req.prompt_len // layout.page_size), cap_s)
