"""KV transfer planning: the pure functions both sides of a transfer must agree on.

A prefiller writes each finished layer's pages straight into the decoder's reserved pages
(SEED.md 11, 17). Both sides import this module: the prefiller to plan writes, the decoder to
know how many units of immediate data to expect. Nothing here touches sockets or memory.

Memory layout (``disagg.kv_memory``): ``[layers, pages, 2, kv_heads, page_size, head_dim]``, so
page ``p`` of layer ``l`` (K and V together) is one contiguous run of ``page_bytes`` at
``(l * num_pages + p) * page_bytes``. Runs of pages adjacent on BOTH sides coalesce into one
write. Each write's immediate carries the request's key and the number of pages it moved, so
the decoder's target (``expected_units``) does not depend on chunking or coalescing.
"""

from __future__ import annotations

from dataclasses import dataclass

from disagg.cache import pages_needed
from disagg.protocol import KVLayoutDesc

UNIT_BITS = 16  # low bits of an immediate: pages carried by the write (context write: 1)
MAX_RUN = (1 << UNIT_BITS) - 1
SLOT_BITS = 24
GEN_BITS = 24


def incompatibility(src: KVLayoutDesc, dst: KVLayoutDesc) -> str | None:
    """Why pages of ``src`` cannot be written into ``dst`` as they are, or None."""
    for field in ("num_layers", "num_kv_heads", "page_size", "head_dim", "dtype", "hidden_size",
                  "tp_size"):
        a, b = getattr(src, field), getattr(dst, field)
        if a != b:
            return f"layout mismatch: prefiller {field}={a}, decoder {field}={b}"
    return None


@dataclass(frozen=True)
class Write:
    src_offset: int
    dst_offset: int
    length: int
    units: int  # pages moved (the immediate's weight)
    src_rank: int = 0
    dst_rank: int = 0


def page_runs(src_pages: list[int], dst_pages: list[int]) -> list[tuple[int, int, int]]:
    """(src start, dst start, length) of runs adjacent on both sides, in order."""
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src_pages, dst_pages, strict=True):
        if runs:
            rs, rd, n = runs[-1]
            if s == rs + n and d == rd + n and n < MAX_RUN:
                runs[-1] = (rs, rd, n + 1)
                continue
        runs.append((s, d, 1))
    return runs


def plan_layer_writes(
    src: KVLayoutDesc, dst: KVLayoutDesc, src_pages: list[int], dst_pages: list[int], layer: int
) -> list[Write]:
    """Writes that copy ``src_pages`` of ``layer`` into ``dst_pages`` (equal TP)."""
    if len(src_pages) != len(dst_pages):
        raise ValueError(f"{len(src_pages)} source pages for {len(dst_pages)} destination pages")
    pb = src.page_bytes
    return [
        Write(src.page_offset(layer, s), dst.page_offset(layer, d), n * pb, n)
        for s, d, n in page_runs(src_pages, dst_pages)
    ]


def pages_to_send(start: int, end: int, total: int, page_size: int) -> range:
    """Page indices (into the request's block table) a chunk covering positions
    ``[start, end)`` of a ``total``-token prefill completes: full pages, plus the partial last
    page when the chunk is the last one. A page a chunk fills only partly goes with the chunk
    that completes it."""
    first = start // page_size
    last = pages_needed(total, page_size) if end >= total else end // page_size
    return range(first, max(first, last))


def expected_units(num_layers: int, prefill_tokens: int, page_size: int) -> int:
    """Units the decoder waits for: every page of every layer, plus one context write."""
    return num_layers * pages_needed(prefill_tokens, page_size) + 1


def make_key(slot: int, generation: int) -> int:
    """The immediate key of one transfer attempt. A new attempt (retry) of the same slot gets
    a new generation, so a late write of an old attempt can never count for a new one."""
    return ((slot & ((1 << SLOT_BITS) - 1)) << GEN_BITS) | (generation & ((1 << GEN_BITS) - 1))


def make_imm(key: int, units: int) -> int:
    if not 0 < units <= MAX_RUN:
        raise ValueError(f"a write carries 1..{MAX_RUN} units, got {units}")
    return (key << UNIT_BITS) | units
