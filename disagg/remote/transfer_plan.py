"""KV transfer planning: the pure functions both sides of a transfer must agree on.

A prefiller writes each finished layer's pages straight into the decoder's reserved pages.
Both sides import this module: the prefiller to plan writes, the
decoder to know how many units of immediate data to expect. Nothing here touches sockets or
memory.

Memory (``KVLayoutDesc``): each rank has its own buffer ``[layers, pages, kv_parts, kv_heads
of the rank, page_size, head_dim]``, the parts K and V (``kv_parts`` 2, kind gqa) or MLA's
latent (1, kind mla: one "head", replicated on every rank), so page ``p`` of layer ``l`` (every
part) is one contiguous run of ``page_bytes`` at ``(l * num_pages + p) * page_bytes``, and one
part of a range of the rank's heads within one page is one contiguous run (HND).

Sharding. For every destination rank ``d`` and every page, the planner takes the source ranks
of ONE source replica set and, for each source rank whose heads overlap ``d``'s, moves the
overlap (a *piece*) page by page. Which set: ``replica_senders`` deals the source sets, in an
order drawn from the request's key, over the destination sets; a destination set given
several (fewer destination sets than source ones, as MLA's latent on a TP prefiller sent to a
narrower decoder) has each chunk's pages cut into one contiguous share per source set, the
first share to a set drawn per chunk (``page_shares``): every replica holding the KV sends a
share, a different one per transfer, and each page still goes exactly once (SEED.md 29).

- the piece is all heads of both ranks (equal sharding, and always for MLA's one latent): the
  parts are adjacent on both sides, so a page is one run, and runs of pages adjacent on BOTH
  sides coalesce into one write;
- otherwise (prefiller wider: a destination page is rebuilt from several source ranks; decoder
  wider: a source page is split over several destination ranks) each part (K, V) of the piece
  is a separate run per page, and pages never coalesce (the next page's run is not adjacent).

Units. An *elementary run* is one page of one piece on one part: 1 per page for a whole piece
(every part together), ``kv_parts`` per page (K, V; 1 for MLA) for a partial one. A write's
immediate carries the request's key and the elementary runs it moved (``Write.units``), so the
decoder's target depends only on the two layouts and the prompt length, never on chunking,
coalescing, page ids or which replica sends::

    request_units(src, dst, tokens) = num_layers * pages(tokens) * units_per_page(src, dst)
                                      + spec_layers * pages(tokens) + CONTEXT_UNITS

Speculative region (``spec``: a draft model's or the MTP layers' KV, SEED.md 15/25): on the
lead rank of each side after the main region, same page ids, one whole-page run per page of
each of its layers; both sides must have the same one (``incompatibility``).

Context. One write (``CONTEXT_UNITS`` = 1) from the prefiller's context buffer (lead source
rank) to the decoder's context buffer (lead destination rank): the hidden state is identical on
every rank after the all-reduce and the decoder keeps one context buffer per node.
"""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass

import numpy as np

from disagg.engine.cache import pages_needed
from disagg.model.config import shard_kv_heads as shard_kv_heads  # the model's sharding rule
from disagg.protocol.peer import KVLayoutDesc, PrefillRequest

# An immediate (64 bits): slot (low SLOT_BITS of the request's slot, for logs) | generation
# (random per attempt: what makes a key unguessable) | units carried by the write.
UNIT_BITS = 16  # low bits of an immediate: elementary runs carried by the write
MAX_RUN = (1 << UNIT_BITS) - 1
SLOT_BITS = 8
GEN_BITS = 40
CONTEXT_UNITS = 1  # the one context write of a request (lead rank -> lead rank)
LAYOUT_KINDS = {"gqa": (2, "K/V heads"), "mla": (1, "latent")}  # kind: (kv_parts, what it holds)
# KVLayoutDesc.spec_method: speculative decoding whose KV moves with the model's
SPEC_REGIONS = {"": "no speculative KV", "draft": "a draft model's KV",
                "mtp": "the MTP layers' KV"}


def layout_problem(layout: KVLayoutDesc) -> str | None:
    """Why ``layout`` is not a valid sharded layout, or None."""
    for field in ("num_layers", "num_kv_heads", "page_size", "head_dim", "element_size",
                  "tp_size", "kv_replicas"):
        if getattr(layout, field) < 1:
            return f"invalid layout: {field}={getattr(layout, field)} (must be >= 1)"
    if layout.num_pages < 0 or layout.hidden_size < 0:
        return f"invalid layout: num_pages={layout.num_pages}, hidden_size={layout.hidden_size}"
    if layout.kind not in LAYOUT_KINDS:
        return f"invalid layout: unknown kind {layout.kind!r} (known: {', '.join(LAYOUT_KINDS)})"
    if layout.kv_parts != LAYOUT_KINDS[layout.kind][0]:
        return (f"invalid layout: kv_parts={layout.kv_parts} for kind {layout.kind} (must be "
                f"{LAYOUT_KINDS[layout.kind][0]})")
    if layout.tp_size % layout.kv_replicas:
        return (f"invalid layout: kv_replicas={layout.kv_replicas} does not divide "
                f"tp_size={layout.tp_size}")
    return spec_problem(layout)


def spec_problem(layout: KVLayoutDesc) -> str | None:
    """Why ``layout``'s speculative region (``spec``) is not valid, or None: it is present
    exactly when ``spec_method`` names one, lies on the lead rank (tp_size 1) over the same
    pages, and holds no region of its own."""
    method, spec = layout.spec_method, layout.spec
    if method not in SPEC_REGIONS:
        return (f"invalid layout: unknown spec_method {method!r} (known: "
                f"{', '.join(m for m in SPEC_REGIONS if m)})")
    if (spec is None) != (method == ""):
        return f"invalid layout: spec_method {method!r} with{'out' if spec is None else ''} a spec region"
    if spec is None:
        return None
    if spec.spec is not None or spec.spec_method:
        return "invalid layout: a spec region holds a spec region"
    if (spec.tp_size, spec.kv_replicas, spec.num_pages, spec.page_size) != (
            1, 1, layout.num_pages, layout.page_size):
        return ("invalid layout: the spec region must be one rank's (tp_size 1) over the same "
                "pages and page size")
    why = layout_problem(spec)
    return None if why is None else f"spec region: {why}"


def incompatibility(src: KVLayoutDesc, dst: KVLayoutDesc) -> str | None:
    """Why pages of ``src`` (the prefiller) cannot be written into ``dst`` (the decoder), or
    None. Sharding (tp_size, kv heads per rank, kv_replicas) and expert placement may differ;
    the model may not (its KV shape, its MoE: ``moe``), nor what a page holds (``kind``:
    GQA's K/V heads or MLA's latent)."""
    for side, lay in (("prefiller", src), ("decoder", dst)):
        why = layout_problem(lay)
        if why:
            return f"{side} {why}"
    if src.kind != dst.kind:
        return (f"KV layout mismatch: the prefiller's pages hold {src.kind} "
                f"({LAYOUT_KINDS[src.kind][1]}) and the decoder's {dst.kind} "
                f"({LAYOUT_KINDS[dst.kind][1]})")
    why = kv_dtype_mismatch(src, dst)
    if why:
        return why
    for field in ("kv_parts", "num_layers", "total_kv_heads", "page_size", "head_dim",
                  "element_size", "hidden_size", "context_element_size"):
        a, b = getattr(src, field), getattr(dst, field)
        if a != b:
            return f"layout mismatch: prefiller {field}={a}, decoder {field}={b}"
    if src.moe != dst.moe:  # the pages' shape agrees, the models that made them may not
        return (f"MoE mismatch: the prefiller serves {src.moe or 'a dense model'} and the "
                f"decoder {dst.moe or 'a dense model'} (only KV pages and hidden rows cross the "
                "pair, never experts: both sides must serve the same model)")
    if src.spec_method != dst.spec_method:
        return (f"speculative set-up mismatch: the decoder ({dst.spec_method or 'none'}) needs "
                f"{SPEC_REGIONS[dst.spec_method]} and the prefiller "
                f"({src.spec_method or 'none'}) makes {SPEC_REGIONS[src.spec_method]}")
    if src.spec is not None and dst.spec is not None:
        for field in ("kind", "num_layers", "num_kv_heads", "head_dim", "dtype"):
            a, b = getattr(src.spec, field), getattr(dst.spec, field)
            if a != b:
                return (f"speculative set-up mismatch: the prefiller's {src.spec_method} KV has "
                        f"{field}={a}, the decoder's {field}={b}")
    return None


def kv_dtype_mismatch(src: KVLayoutDesc, dst: KVLayoutDesc) -> str | None:
    """Why the prefiller's pages (``src``) are not what the decoder's (``dst``) hold: another
    dtype (pages are never converted in flight), or FP8 pages under other scales."""
    if src.dtype != dst.dtype:
        return (f"KV dtype mismatch: the prefiller's pages are {src.dtype} and the decoder's "
                f"{dst.dtype} (pages are moved as they are, never converted: give both the "
                "same --kv-cache-dtype and --dtype)")
    if src.kv_scales != dst.kv_scales:
        return (f"KV dtype mismatch: the prefiller's {src.dtype} pages have scales "
                f"{src.kv_scales or 'none'} and the decoder's {dst.kv_scales or 'none'} (the "
                "same checkpoint's k_scale / v_scale on both sides)")
    return None


def rank_heads(layout: KVLayoutDesc, rank: int) -> range:
    """Global kv heads held by ``rank`` of ``layout`` (``KVLayoutDesc.rank_heads``)."""
    return layout.rank_heads(rank)


def replica_ranks(layout: KVLayoutDesc, replica: int) -> list[int]:
    """Ranks of replica set ``replica`` (together one whole KV cache), in head order."""
    return list(range(replica, layout.tp_size, layout.kv_replicas))


def replica_assignment(src: KVLayoutDesc, dst: KVLayoutDesc, seed: int) -> list[int]:
    """Source replica set of each destination replica set: a seeded random order of the source
    sets, dealt round-robin, so with as many destination sets as source sets every source
    device sends, and with fewer the senders vary from request to request.
    Deterministic in ``seed`` (the prefiller passes the request key) and platform-independent.
    The decoder's count does not depend on it."""
    return [senders[0] for senders in replica_senders(src, dst, seed)]


def _draw(seed: int, salt: object) -> bytes:
    return hashlib.blake2b(f"{seed}:{salt}".encode(), digest_size=8).digest()


def replica_senders(src: KVLayoutDesc, dst: KVLayoutDesc, seed: int) -> list[list[int]]:
    """The source replica sets that send to each destination replica set: a seeded random
    order of the source sets dealt round-robin, one per destination set when there are as many
    destination sets or more, else several per destination set (every source set sends, each
    a share of the pages: ``page_shares``). The first of each is ``replica_assignment``'s."""
    order = sorted(range(src.kv_replicas), key=lambda i: _draw(seed, i))
    if dst.kv_replicas >= len(order):
        return [[order[j % len(order)]] for j in range(dst.kv_replicas)]
    return [order[j::dst.kv_replicas] for j in range(dst.kv_replicas)]


def page_shares(pages: int, senders: list[int], seed: int, salt: int) -> list[tuple[int, range]]:
    """``pages`` pages of one chunk cut into contiguous near-equal shares, one per sender
    (empty ones left out), in order from a sender drawn from ``seed`` and ``salt`` (the
    chunk's first destination page: each chunk of a request draws anew). Together the shares
    cover every page once."""
    k = len(senders)
    first = int.from_bytes(_draw(seed, f"p{salt}"), "little") % k if k > 1 else 0
    cuts = [i * pages // k for i in range(k + 1)]
    return [(senders[(i + first) % k], range(cuts[i], cuts[i + 1])) for i in range(k)
            if cuts[i + 1] > cuts[i]]


@dataclass(frozen=True)
class Piece:
    """Global kv heads ``[head, head + count)`` that source rank ``src_rank`` gives destination
    rank ``dst_rank``; ``whole`` when they are all heads of both ranks (every part of a page,
    K+V or the MLA latent, is then one run; otherwise one run per part)."""

    src_rank: int
    dst_rank: int
    head: int
    count: int
    whole: bool
    kv_parts: int = 2

    @property
    def units_per_page(self) -> int:
        return 1 if self.whole else self.kv_parts


def pieces(src: KVLayoutDesc, dst: KVLayoutDesc, seed: int = 0) -> list[Piece]:
    """Every (source rank, destination rank, head range) a page is moved by, from each
    destination set's first sender (any sender's pieces move a page in as many units)."""
    assign = replica_assignment(src, dst, seed)
    return [pc for d in range(dst.tp_size) for pc in rank_pieces(src, dst, d,
                                                                 assign[d % dst.kv_replicas])]


def rank_pieces(src: KVLayoutDesc, dst: KVLayoutDesc, d: int, replica: int) -> list[Piece]:
    """The pieces destination rank ``d`` takes from the ranks of source replica set
    ``replica``."""
    dh = dst.rank_heads(d)
    out: list[Piece] = []
    for s in replica_ranks(src, replica):
        sh = src.rank_heads(s)
        lo, hi = max(dh.start, sh.start), min(dh.stop, sh.stop)
        if lo < hi:
            out.append(Piece(s, d, lo, hi - lo, dh == sh, src.kv_parts))
    return out


def units_per_page(src: KVLayoutDesc, dst: KVLayoutDesc) -> int:
    """Elementary runs moving one page of one layer to every destination rank."""
    return sum(p.units_per_page for p in pieces(src, dst))


@dataclass(frozen=True)
class Write:
    src_offset: int
    dst_offset: int
    length: int
    units: int  # elementary runs moved (the immediate's weight): pages, or parts (K/V) of pages
    src_rank: int = 0  # offsets are into this rank's KV buffer on the prefiller
    dst_rank: int = 0  # ... and this rank's KV buffer on the decoder


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
    src: KVLayoutDesc, dst: KVLayoutDesc, src_pages: list[int], dst_pages: list[int], layer: int,
    seed: int = 0,
) -> list[Write]:
    """Writes that copy ``src_pages`` of ``layer`` (on every source rank) into ``dst_pages``
    (on every destination rank), grouped by destination rank, share and piece (see the module
    docstring). ``seed`` picks the source replica sets (``replica_senders``, ``page_shares``):
    pass the request key, so every layer of a chunk uses the same senders and the decoder
    could tell nothing from the count."""
    if len(src_pages) != len(dst_pages):
        raise ValueError(f"{len(src_pages)} source pages for {len(dst_pages)} destination pages")
    writes: list[Write] = []
    senders = replica_senders(src, dst, seed)
    salt = dst_pages[0] if dst_pages else 0
    for d in range(dst.tp_size):
        for replica, share in page_shares(len(src_pages), senders[d % dst.kv_replicas], seed,
                                          salt):
            sp, dp = src_pages[share.start:share.stop], dst_pages[share.start:share.stop]
            for pc in rank_pieces(src, dst, d, replica):
                writes.extend(piece_writes(src, dst, pc, sp, dp, layer))
    return writes


def piece_writes(src: KVLayoutDesc, dst: KVLayoutDesc, pc: Piece, src_pages: list[int],
                 dst_pages: list[int], layer: int) -> list[Write]:
    """The writes of piece ``pc`` of these pages of ``layer``: runs of pages adjacent on both
    sides for a whole piece, else one write per part (K, V) of each page."""
    if pc.whole:
        pb = src.page_bytes
        return [Write(src.page_offset(layer, s), dst.page_offset(layer, d), n * pb, n,
                      pc.src_rank, pc.dst_rank)
                for s, d, n in page_runs(src_pages, dst_pages)]
    length = pc.count * src.head_bytes
    s_head = pc.head - src.rank_heads(pc.src_rank).start
    d_head = pc.head - dst.rank_heads(pc.dst_rank).start
    writes: list[Write] = []
    for kv in range(pc.kv_parts):
        s_in = (kv * src.num_kv_heads + s_head) * src.head_bytes
        d_in = (kv * dst.num_kv_heads + d_head) * dst.head_bytes
        writes.extend(
            Write(src.page_offset(layer, s) + s_in, dst.page_offset(layer, d) + d_in, length,
                  1, pc.src_rank, pc.dst_rank)
            for s, d in zip(src_pages, dst_pages, strict=True))
    return writes


@dataclass(frozen=True)
class Runs:
    """Writes as arrays (int64): what the transfer engine posts."""

    src_offset: np.ndarray
    dst_offset: np.ndarray
    length: np.ndarray
    units: np.ndarray

    @staticmethod
    def of(writes: list[Write]) -> Runs:
        a = np.array([(w.src_offset, w.dst_offset, w.length, w.units) for w in writes],
                     dtype=np.int64).reshape(-1, 4)
        return Runs(a[:, 0], a[:, 1], a[:, 2], a[:, 3])

    def __len__(self) -> int:
        return int(self.length.shape[0])

    def split(self, max_bytes: int) -> Runs:
        """Cut runs longer than ``max_bytes`` at unit boundaries (the units of a run are the
        same size), weights following the bytes, so that several lanes can share a long run.
        The units of all pieces add up to the run's: what the receiver counts does not change."""
        unit = self.length // self.units
        step = np.maximum(1, max_bytes // unit)
        pieces = -(-self.units // step)
        if int(pieces.max(initial=1)) <= 1:
            return self
        run = np.repeat(np.arange(len(self)), pieces)
        first = np.repeat(np.cumsum(pieces) - pieces, pieces)
        k = np.arange(run.shape[0]) - first  # piece index within its run
        u0 = k * step[run]
        u = np.minimum(step[run], self.units[run] - u0)
        shift = u0 * unit[run]
        return Runs(self.src_offset[run] + shift, self.dst_offset[run] + shift, u * unit[run], u)


@dataclass(frozen=True)
class ChunkPlan:
    """The writes of one chunk's pages for every layer, planned once: offsets are linear in
    the layer (``page_offset``), so layer ``l``'s writes are layer 0's shifted by ``l`` times
    each side's layer stride. ``by_pair`` holds them per (source rank, destination rank)."""

    by_pair: dict[tuple[int, int], Runs]
    src_stride: int
    dst_stride: int
    num_layers: int = 0  # layers of the region planned (ChunkPlan.all_layers)

    def layer(self, pair: tuple[int, int], layer: int) -> Runs:
        r = self.by_pair[pair]
        return Runs(r.src_offset + layer * self.src_stride, r.dst_offset + layer * self.dst_stride,
                    r.length, r.units)

    def layers(self, pair: tuple[int, int], lo: int, hi: int) -> Runs:
        """The writes of layers ``[lo, hi)`` as one ``Runs`` (layer by layer)."""
        if hi - lo == 1:
            return self.layer(pair, lo)
        r = self.by_pair[pair]
        k = np.arange(lo, hi, dtype=np.int64)[:, None]
        return Runs((r.src_offset[None, :] + k * self.src_stride).ravel(),
                    (r.dst_offset[None, :] + k * self.dst_stride).ravel(),
                    np.tile(r.length, hi - lo), np.tile(r.units, hi - lo))

    def shifted(self, src_base: int, dst_base: int) -> ChunkPlan:
        """The same writes into regions starting ``src_base`` / ``dst_base`` bytes further."""
        return ChunkPlan({k: Runs(r.src_offset + src_base, r.dst_offset + dst_base, r.length,
                                  r.units) for k, r in self.by_pair.items()},
                         self.src_stride, self.dst_stride, self.num_layers)


def plan_chunk(src: KVLayoutDesc, dst: KVLayoutDesc, src_pages: list[int], dst_pages: list[int],
               seed: int = 0) -> ChunkPlan:
    """``plan_layer_writes`` for every layer at the cost of one."""
    by_pair: dict[tuple[int, int], list[Write]] = {}
    for w in plan_layer_writes(src, dst, src_pages, dst_pages, 0, seed):
        by_pair.setdefault((w.src_rank, w.dst_rank), []).append(w)
    return ChunkPlan({k: Runs.of(v) for k, v in by_pair.items()},
                     src.num_pages * src.page_bytes, dst.num_pages * dst.page_bytes, dst.num_layers)


def pages_to_send(start: int, end: int, total: int, page_size: int) -> range:
    """Page indices (into the request's block table) a chunk covering positions
    ``[start, end)`` of a ``total``-token prefill completes: full pages, plus the partial last
    page when the chunk is the last one. A page a chunk fills only partly goes with the chunk
    that completes it."""
    first = start // page_size
    last = pages_needed(total, page_size) if end >= total else end // page_size
    return range(first, max(first, last))


def request_units(src: KVLayoutDesc, dst: KVLayoutDesc, prefill_tokens: int,
                  skip_pages: int = 0) -> int:
    """Units the decoder (layout ``dst``) waits for from a prefiller advertising ``src``:
    every elementary run of every page written (all but the ``skip_pages`` leading ones the
    decoder holds) of every layer on every destination rank, plus the context write. Equals
    the units of all ``plan_layer_writes`` of the request, whatever the chunking, page ids or
    seed."""
    pages = pages_needed(prefill_tokens, dst.page_size) - skip_pages
    spec = 0 if dst.spec is None else dst.spec.num_layers * pages  # whole pages, lead ranks
    return dst.num_layers * pages * units_per_page(src, dst) + spec + CONTEXT_UNITS


def context_write(src_offset: int, dst_offset: int, length: int) -> Write:
    """The request's context write: lead source rank -> lead destination rank."""
    return Write(src_offset, dst_offset, length, CONTEXT_UNITS)


def make_key(slot: int, generation: int) -> int:
    """The immediate key of one transfer attempt. A new attempt (retry) of the same slot gets
    a new generation, so a late write of an old attempt can never count for a new one."""
    return ((slot & ((1 << SLOT_BITS) - 1)) << GEN_BITS) | (generation & ((1 << GEN_BITS) - 1))


def new_generation() -> int:
    """A random nonzero generation of ``GEN_BITS`` bits (``secrets``): a peer that was not sent
    an attempt cannot guess its key, and a retry's key differs from its predecessor's."""
    return secrets.randbits(GEN_BITS) or 1


def make_imm(key: int, units: int) -> int:
    if not 0 < units <= MAX_RUN:
        raise ValueError(f"a write carries 1..{MAX_RUN} units, got {units}")
    return (key << UNIT_BITS) | units


def job_pages_plan(src: KVLayoutDesc, req: PrefillRequest, src_pages: list[int],
                   indices: range | list[int]) -> ChunkPlan | None:
    """The writes of the request's prompt pages ``indices`` (block-table positions; those
    ``src_pages`` has on the prefiller) for every layer, leaving out the ``skip_pages`` the
    decoder holds; None when nothing is left."""
    skip = req.skip_pages
    idx = [j for j in indices if j >= skip]
    if not idx:
        return None
    return plan_chunk(src, req.dst_layout, [src_pages[j] for j in idx],
                      [req.dst_pages[j - skip] for j in idx], seed=req.key)


def spec_pages_plan(src: KVLayoutDesc, req: PrefillRequest, src_pages: list[int],
                    indices: range | list[int]) -> ChunkPlan | None:
    """``job_pages_plan`` for the speculative region (a draft model's or the MTP layers'
    pages, lead rank to lead rank, after each side's main region); None when there is none
    or nothing is left."""
    dst = req.dst_layout
    if src.spec is None or dst.spec is None:
        return None
    skip = req.skip_pages
    idx = [j for j in indices if j >= skip]
    if not idx:
        return None
    return plan_chunk(src.spec, dst.spec, [src_pages[j] for j in idx],
                      [req.dst_pages[j - skip] for j in idx]).shifted(src.total_bytes,
                                                                     dst.total_bytes)
