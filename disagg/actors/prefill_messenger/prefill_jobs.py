"""What the prefill messenger (``disagg.actors.prefill_messenger.prefill_messenger``) holds per job (``Job``: the
request and where its writes go), and the object that owns its writes (``JobWrites``: what
was posted of each job, ``Posted``, and which layers of each announced step went out,
``Step``), posting them layer by layer as the layer counter moves, except for a
short step (fewer prompt tokens than ``layerwise_min_tokens``, 0 by default), whose layers go
out together in one write per destination after its last layer: one post instead of one per
layer, where the link is fast enough that the step's whole KV costs little exposed."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from disagg import trace
from disagg.engine.dp import rank_pages
from disagg.protocol.inproc import ChunkInfo, StepAnnounce
from disagg.protocol.peer import KVLayoutDesc, PrefillFailCode, PrefillRequest
from disagg.remote.prefill import PrefillJobs
from disagg.remote.transfer_plan import (
    ChunkPlan,
    Runs,
    context_write,
    job_pages_plan,
    pages_to_send,
    spec_pages_plan,
)

log = logging.getLogger("disagg.actors.prefill_messenger.prefill_messenger")


@dataclass(frozen=True, eq=False)
class Job:
    """What the messenger holds for one job: the request and where its writes go. Its
    lifecycle (state, deadlines, quota) is ``self.life`` (``disagg.remote.prefill``); what was
    posted of it, ``JobWrites``."""

    id: int
    peer: bytes  # decoder's ROUTER identity
    req: PrefillRequest
    dst_kv: list[Any]  # decoded MemoryDescriptor per decoder rank
    dst_ctx: Any


@dataclass
class Posted:
    """What was posted of one job's writes (``JobWrites``), until its answer."""

    job: Job
    futures: list[asyncio.Future[None]] = field(default_factory=list)  # every write posted
    first_post_at: float | None = None
    cached_tokens: int = 0  # prompt tokens this node's prefix cache held (not computed)
    writes: int = 0  # posted so far
    bytes: int = 0
    context_posted: bool = False  # its context write (the decoder counts one) went out
    from_host: set[int] = field(default_factory=set)  # page indices shipped from the host tier


@dataclass
class Step:
    announce: StepAnnounce
    next_layer: int = 0  # layers [0, next_layer) handed to the engine
    plans: dict[int, ChunkPlan | None] = field(default_factory=dict)  # by chunk index, lazily
    bases: dict[int, int] = field(default_factory=dict)  # --dp: its rank's first region, by chunk

    @property
    def tokens(self) -> int:
        return sum(c.count for c in self.announce.chunks)


def layer_spans(next_layer: int, layers_done: int, num_layers: int,
                whole: bool) -> list[tuple[int, int]]:
    """The ``[lo, hi)`` layer spans to post now, each one write per destination: every newly
    finished layer alone, or with ``whole`` (a short step) all layers at once when the last
    one finished, nothing before."""
    if layers_done <= next_layer:
        return []
    if whole:
        return [(next_layer, layers_done)] if layers_done >= num_layers else []
    return [(i, i + 1) for i in range(next_layer, layers_done)]


class JobWrites:
    """The prefill messenger's job writes: owns what was posted of each job (``add`` to
    ``finish``) and each announced step (``announce`` to ``step_done``), and posts them to the
    transfer engine: each step's layers as the layer counter reports them (``on_layers``), a
    job's cached pages at once, the speculative region, the context write. Whether a job may
    still be written is asked of the job machine ``life``; a refused or overdue job is told
    to the messenger (``fail``), and so is progress (``progressed``)."""

    def __init__(self, layout: KVLayoutDesc, life: PrefillJobs, transfer: Any,
                 kv_regions: list[Any], ctx_region: Any, zero_slot: int,
                 fail: Callable[[int, PrefillFailCode, str], None],
                 progressed: Callable[[float], None], metrics: Any = None,
                 layerwise_min_tokens: int = 0, dp: int = 1) -> None:
        self.layout = layout
        # --dp: kv_regions are every rank's executors in rank order; a job's pages (global
        # ids) lie on one rank, whose regions and local page ids its writes name (``_source``)
        self.dp, self.rank_width = dp, len(kv_regions) // dp
        self.life = life
        self.transfer = transfer  # disagg.transfer.TransferEngine
        self.kv_regions = kv_regions
        self.ctx_region = ctx_region
        self.zero_slot = zero_slot  # a context row never written: the source of markers
        self.jobs: dict[int, Posted] = {}  # by job id
        self.steps: dict[int, Step] = {}  # by step id, announced until done
        self._fail = fail
        self._progressed = progressed
        self.metrics = metrics  # disagg.serving.metrics.Metrics | None
        self.layerwise_min_tokens = layerwise_min_tokens  # shorter steps: all layers at once
        self.layerwise_steps = 0  # steps that began shipping before their last layer
        # the host KV tier's registrations (one per rank) and the layout its offsets follow
        # (``ship_host``), when this backend ships from host memory; None: no host shipping
        self.host: tuple[list[Any], KVLayoutDesc] | None = None
        self.host_pages_sent = 0  # pages shipped straight from the host tier
        self.units_by_rank = [0] * len(kv_regions)  # KV units posted from each executor's pages
        # job -> its spans (the messenger's, shared; empty while traces are off): a step's
        # first and last layer posted become events of its prefill_compute phase
        self.traces: dict[int, trace.Phases] = {}

    # ------------------------------------------------------------------ what it owns

    def add(self, job: Job) -> None:
        """A job accepted: nothing of it posted yet."""
        self.jobs[job.id] = Posted(job)

    def finish(self, job_id: int) -> Posted:
        """The job was answered: what was posted of it, forgotten here."""
        return self.jobs.pop(job_id)

    def futures(self, job_id: int) -> list[asyncio.Future[None]]:
        """The job's writes posted so far (the list grows as more are posted)."""
        return self.jobs[job_id].futures

    def announce(self, a: StepAnnounce) -> None:
        """A step is about to run: its layers go out as the layer counter reports them."""
        self.steps[a.step_id] = Step(a)

    def step_done(self, step_id: int, ok: bool) -> StepAnnounce | None:
        """The step ended (``ok``: computed): whatever layers the poller missed go out, and
        with MTP the speculative region computed after the last layer; the step is forgotten.
        Its announcement, or None when it is not known."""
        step = self.steps.get(step_id)
        if step is None:
            return None
        if ok:
            self.on_layers(step_id, self.layout.num_layers)
            if self.layout.spec_method == "mtp":  # computed after the model's last layer
                for c in step.announce.chunks:
                    if (w := self.jobs.get(c.job)) and self.life.may_write(c.job,
                                                                          time.monotonic()):
                        self.ship_spec(w, self.spec_plan(w, c))
        del self.steps[step_id]
        return step.announce

    def in_flight(self) -> int:
        """Jobs with writes posted."""
        return sum(1 for w in self.jobs.values() if w.futures)

    def layer_lag(self, counter: int) -> int:
        """The most layers of a step computed (the layer counter at ``counter``) but not yet
        handed to the engine."""
        lag = 0
        for s in self.steps.values():
            done = max(0, min(self.layout.num_layers, counter - s.announce.counter_base))
            lag = max(lag, done - s.next_layer)
        return lag

    # ------------------------------------------------------------------ posting

    def post_context(self, job_id: int, slot: int | None = None) -> None:
        """The job's context write, once: its hidden row at ``slot`` (MTP reads it), else a
        zero-row marker, posted with the last layer's KV so the decoder's count ends there."""
        w = self.jobs.get(job_id)
        if w is None or w.context_posted or (slot is None and self.layout.spec_method == "mtp") \
                or not self.life.may_write(job_id, time.monotonic()):
            return
        w.context_posted, n = True, self.layout.context_bytes
        self.post(w, self.ctx_region, w.job.dst_ctx, Runs.of([context_write(
            (self.zero_slot if slot is None else slot) * n, w.job.req.ctx_offset, n)]))

    def post(self, w: Posted, src: Any, dst: Any, runs: Runs, rank: int | None = None) -> None:
        """Hand ``runs`` to the transfer engine (the caller checked ``may_write``); no write
        may still be queued or posted past the job's absolute deadline. ``rank``: the executor
        whose pages they are (KV, counted in ``units_by_rank``; None: the context write)."""
        now = time.monotonic()
        if w.first_post_at is None:
            w.first_post_at = now
        w.writes += len(runs)
        w.bytes += int(runs.length.sum())
        left = self.life.time_left(w.job.id, now)
        try:
            w.futures.extend(self.transfer.write(src, dst, runs, w.job.req.key,
                                                 timeout=min(left, self.transfer.timeout_s)))
            if rank is not None:
                self.units_by_rank[rank] += int(runs.units.sum())
        except Exception as e:  # out of range: refuse, never write outside
            log.error("job %d: refused writes: %s", w.job.id, e)
            self._fail(w.job.id, "transfer_failed", str(e))

    def on_layers(self, step_id: int, layers_done: int, seen_at: float | None = None) -> None:
        """Called in the loop by the poller: ship the step's newly finished layers
        (``layer_spans``). ``seen_at``: when the poller saw the counter reach ``layers_done`` (for the lag metric)."""
        step = self.steps.get(step_id)
        if step is None:
            return
        num_layers = self.layout.num_layers
        if layers_done >= num_layers > step.next_layer:
            trace.mark("p.last_layer_in", "s", step_id)
            for chunk in step.announce.chunks:  # a job's compute ends with its last layer
                if chunk.start + chunk.count >= chunk.total:
                    self.life.last_layer(chunk.job, seen_at or time.monotonic())
        whole = self.layerwise_min_tokens > 0 and step.tokens < self.layerwise_min_tokens
        spans = layer_spans(step.next_layer, layers_done, num_layers, whole)
        if not spans:
            return
        if seen_at is not None and self.metrics is not None:
            self.metrics.observe_layer_lag(time.monotonic() - seen_at)
        if step.next_layer == 0 and layers_done < num_layers and step.announce.chunks:
            self.layerwise_steps += 1  # shipping starts while later layers still compute
        now = time.monotonic()
        self._progressed(now)
        for lo, hi in spans:
            for i, chunk in enumerate(step.announce.chunks):
                w = self.jobs.get(chunk.job)
                if w is None or not self.life.may_write(chunk.job, now):
                    if w is not None and (why := self.life.overdue(chunk.job, now)):
                        self._fail(chunk.job, "timeout", why)  # the decoder may reuse the pages
                    continue
                plan = self._plan(step, i, w.job)
                if plan is None:
                    continue
                base = step.bases.get(i, 0)
                for sr, dr in plan.by_pair:  # every source rank sends in parallel
                    self.post(w, self.kv_regions[base + sr], w.job.dst_kv[dr],
                              plan.layers((sr, dr), lo, hi), base + sr)
                if self.traces and (lo == 0 or hi == num_layers):
                    self._layer_events(step_id, chunk, w, lo, hi)
                if lo == 0 and self.layout.spec_method == "draft":  # computed before it
                    self.ship_spec(w, self.spec_plan(w, chunk))
        if step.next_layer < num_layers <= layers_done:  # last layer out: markers
            trace.mark("p.last_layer_posted", "s", step_id)
            for c in step.announce.chunks:
                if c.start + c.count == c.total:
                    self.post_context(c.job)
        step.next_layer = max(step.next_layer, layers_done)

    def _layer_events(self, step_id: int, chunk: ChunkInfo, w: Posted, lo: int, hi: int) -> None:
        """The layers pushed, as events of the job's ``prefill_compute`` span: one when a
        step's first layer's writes are posted (``layers``: how many went with it, all of them
        for a short step), one when its last layer's are (``writes`` and ``bytes``: the job's
        so far); two per step and job, none per layer."""
        phases = self.traces.get(chunk.job)
        if phases is None or phases.name != "prefill_compute":
            return
        n = self.layout.num_layers
        if lo == 0:
            trace.event(phases.phase, "kv_first_layer_posted", step=step_id, tokens=chunk.count,
                        layers=hi, num_layers=n)
        if hi == n:
            trace.event(phases.phase, "kv_last_layer_posted", step=step_id, tokens=chunk.count,
                        layers=n, writes=w.writes, bytes=w.bytes)

    def ship_spec(self, w: Posted, plan: ChunkPlan | None) -> None:
        """Every layer of a chunk's pages in the speculative region (a draft model's KV,
        computed before the step's first layer; the MTP layers', after its last)."""
        if plan is None:
            return
        self.post(w, self.kv_regions[0], w.job.dst_kv[0], plan.layers((0, 0), 0,
                                                                      plan.num_layers), 0)

    def ship_cached(self, chunk: ChunkInfo, now: float) -> None:
        """A job's first chunk starts after pages this node had in its prefix cache: they are
        complete for every layer, so they go out at once (those the decoder does not hold)."""
        w = self.jobs.get(chunk.job)
        if w is None or not self.life.may_write(chunk.job, now):
            return
        w.cached_tokens = chunk.start
        base, pages = self._source(chunk.pages)
        plan = job_pages_plan(self.layout, w.job.req, pages,
                              [i for i in range(chunk.start // self.layout.page_size)
                               if i not in w.from_host])
        if plan is None:
            return
        for sr, dr in plan.by_pair:  # every layer in one write per destination
            self.post(w, self.kv_regions[base + sr], w.job.dst_kv[dr],
                      plan.layers((sr, dr), 0, self.layout.num_layers), base + sr)
        self.ship_spec(w, spec_pages_plan(self.layout, w.job.req, chunk.pages,
                                          range(chunk.start // self.layout.page_size)))

    def ship_host(self, job_id: int, pages: list[tuple[int, int]], now: float) -> None:
        """Pages of a job the host KV tier holds (page index, slot), as it starts reloading
        them: every layer of each goes out now from host memory, not from device pages
        (nor a staged copy of them); the job's later writes leave them out."""
        w = self.jobs.get(job_id)
        if self.host is None or w is None or not self.life.may_write(job_id, now):
            return
        regions, layout = self.host
        src = dict(pages)
        indices = sorted(i for i in src if i >= w.job.req.skip_pages and i not in w.from_host)
        if not indices:
            return
        # the host pool is slot-major: slot s's layer l lies l + s * layers pages in
        # (``layout``: one page a layer; disagg.engine.tier_copy.host_layout_pages)
        table = [src.get(i, 0) * self.layout.num_layers for i in range(indices[-1] + 1)]
        plan = job_pages_plan(layout, w.job.req, table, indices)
        if plan is None:
            return
        w.from_host.update(indices)
        self.host_pages_sent += len(indices)
        for sr, dr in plan.by_pair:
            self.post(w, regions[sr], w.job.dst_kv[dr], plan.layers((sr, dr), 0,
                                                                    self.layout.num_layers), sr)

    def _source(self, pages: list[int]) -> tuple[int, list[int]]:
        """The first source region of the rank holding ``pages`` and their ids there."""
        if self.dp == 1:
            return 0, pages
        rank, local = rank_pages(pages, self.layout.num_pages)
        return rank * self.rank_width, local

    def spec_plan(self, w: Posted, c: ChunkInfo) -> ChunkPlan | None:
        return spec_pages_plan(self.layout, w.job.req, c.pages, pages_to_send(
            c.start, c.start + c.count, c.total, self.layout.page_size))

    def _plan(self, step: Step, i: int, job: Job) -> ChunkPlan | None:
        """The writes of chunk ``i`` of ``step`` for every layer (planned at its first layer;
        None when the chunk completes no page)."""
        if i not in step.plans:
            c = step.announce.chunks[i]
            sent = self.jobs[job.id].from_host  # a failed reload recomputes them: sent already
            step.bases[i], pages = self._source(c.pages)
            step.plans[i] = job_pages_plan(self.layout, job.req, pages, [
                j for j in pages_to_send(c.start, c.start + c.count, c.total,
                                         self.layout.page_size) if j not in sent])
        return step.plans[i]
