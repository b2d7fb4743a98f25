"""Checks of a PrefillRequest before a prefiller takes it: pure, every bound checked before
any write is planned (the prefiller answers ``bad_request`` with the reason)."""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

from disagg.protocol import MAX_CACHE_SALT, MAX_TRACEPARENT
from disagg.protocol.peer import KVLayoutDesc, PrefillRequest
from disagg.remote.ownership import CHALLENGE_AREA_BYTES, CHALLENGE_SLOTS
from disagg.remote.transfer_plan import incompatibility

OUT_OF_VOCAB = "token id outside the vocabulary"  # a request's refusal, its code bad_request
NOT_IDS = "prompt_ids are not token ids"  # the same, for ids that are no integers


def request_problem(layout: KVLayoutDesc, vocab_size: int, req: PrefillRequest,
                    ids_in_vocab: bool = False) -> str | None:
    """Why a PrefillRequest cannot be served, or None (bounds-checks before any write).
    ``ids_in_vocab``: its ids are checked elsewhere, as they are decoded (a prefiller's
    scheduler: ``PromptIds``); without it they must be decoded (a list)."""
    why = incompatibility(layout, req.dst_layout)
    if why:
        return why
    n = req.prompt_len
    if n == 0:
        return "empty prompt"
    if not ids_in_vocab and (min(req.prompt_ids) < 0 or max(req.prompt_ids) >= vocab_size):
        return OUT_OF_VOCAB
    d = req.dst_layout
    if not 0 <= req.skip_pages <= n // d.page_size:
        return f"skip_pages {req.skip_pages} outside the {n // d.page_size} full pages"
    if len(req.dst_pages) != -(-n // d.page_size) - req.skip_pages:
        return (f"{len(req.dst_pages)} destination pages for {n} tokens of page size "
                f"{d.page_size} less {req.skip_pages} held")
    if len(set(req.dst_pages)) != len(req.dst_pages):
        return "destination pages repeat"
    if req.dst_pages and (min(req.dst_pages) < 0 or max(req.dst_pages) >= d.num_pages):
        return "destination page id out of range"
    if n > layout.num_pages * layout.page_size:
        return "prompt larger than this prefiller's KV pool"
    if not 0 < req.timeout_s <= 3600:
        return f"timeout_s out of range: {req.timeout_s}"
    if req.traceparent is not None and len(req.traceparent) > MAX_TRACEPARENT:
        return f"traceparent longer than {MAX_TRACEPARENT} characters"
    if req.cache_salt is not None and not 1 <= len(req.cache_salt) <= MAX_CACHE_SALT:
        return f"cache_salt must have 1-{MAX_CACHE_SALT} characters"
    return None


def descriptor_problem(layout: KVLayoutDesc, req: PrefillRequest, dst_kv: list[Any],
                       dst_ctx: Any) -> str | None:
    """Why the decoded memory descriptors of ``req`` cannot take its writes, or None."""
    if len(dst_kv) != req.dst_layout.tp_size:
        return f"{len(dst_kv)} KV descriptors for tp_size {req.dst_layout.tp_size}"
    if any(d.length < req.dst_layout.total_bytes for d in dst_kv):
        return "KV descriptor smaller than the advertised layout"
    if dst_kv[0].length < req.dst_layout.total_bytes + req.dst_layout.spec_bytes:
        return "lead KV descriptor smaller than the advertised layout and its spec region"
    if not 0 <= req.ctx_offset <= dst_ctx.length - CHALLENGE_AREA_BYTES - layout.context_bytes:
        return "context offset outside the context buffer's slots"
    if not 0 <= req.challenge_slot < CHALLENGE_SLOTS:
        return f"challenge slot {req.challenge_slot} out of range"
    return None


class PromptIds:
    """A prefill job's prompt ids (a msgpack array, as the request carried them) decoded once,
    each checked against the vocabulary as it is decoded (a constrained msgspec decoder: a
    32k-id scan afterwards costs ~0.9 ms on the 2-core box). ``decode`` gives the ids or the
    reason they are refused (``OUT_OF_VOCAB``, as the request's own checks name it)."""

    def __init__(self, vocab_size: int):
        ids = list[Annotated[int, msgspec.Meta(ge=0, lt=vocab_size)]]
        self._checked = msgspec.msgpack.Decoder(ids)
        self._plain = msgspec.msgpack.Decoder(list[int])

    def decode(self, encoded: bytes | memoryview) -> list[int] | str:
        try:
            return self._checked.decode(encoded)
        except (msgspec.ValidationError, msgspec.DecodeError):
            pass
        try:  # refused: by name, after a plain decode
            self._plain.decode(encoded)
        except (msgspec.ValidationError, msgspec.DecodeError) as e:
            return f"{NOT_IDS}: {e}"
        return OUT_OF_VOCAB
