"""A decode step's grammar work on the host in one parallel pass (overlapped decoding's late
masks; ``disagg.engine.grammar`` holds the matchers).

When a deferred step's tokens come back, each constrained row's matcher must accept its token
and, where the step launched after it has the row's follow chunk (``SeqChunk.late_mask``),
fill the bitmask of what it admits next: the executor picks that step's tokens only once the
masks arrive, so this is on the critical path of every constrained step (at batch 64, xgrammar
0.2.9, vocabulary 151,936: ~0.3 ms a mask and ~47 us an accept on one core of an H200 host).
``GrammarPass`` does both for every row on a pool of threads: each thread takes an interleaved
share of the rows and makes two xgrammar calls for it (``batch_accept_token``, then
``batch_fill_next_token_bitmask`` on a matcher of one thread), both of which release the GIL,
filling straight into one contiguous buffer that goes to the executors as it is (a ``Masks``
message's own frame). The driver starts it as soon as the tokens are back; once every thread
has accepted its share (``Pass.accepted``) the scheduler's update may apply the tokens, finding
each already accepted and whether it ended the output (``GrammarState.accept`` /
``terminated``, no call into a matcher a thread may still be filling from); the node's driver
sends the masks once filled (``Pass.masks``) and only then applies the tokens and plans the
next step (``disagg.actors.scheduler.stepping``). That is the node's order with
``DISAGG_EXECUTOR_MASKS=0``; by default the executors fill the masks, each on its own
``GrammarPass`` (``disagg.engine.grammar_mirror``), and the scheduler's pass only accepts.

A step that is not overlapped (new prefills joining, a constrained request's first step) has
no token in flight: ``GrammarPass.fill`` fills its constrained rows' masks on the same threads
(fill-only) while ``EngineCore`` builds the plan, each chunk then taking its row.
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from disagg.engine.grammar import bitmask_words

if TYPE_CHECKING:
    from disagg.engine.grammar import GrammarState

PASS_TIMEOUT_S = 60.0  # a pass waited for synchronously (in-process engine) longer: an error


def default_threads() -> int:
    """Half the CPUs this process may run on (xgrammar's own default), at least one."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cpus = os.cpu_count() or 2
    return max(1, cpus // 2)


@dataclass(frozen=True, slots=True)
class Row:
    """One constrained row of a step whose tokens came back."""

    state: GrammarState
    token: int  # the token it sampled (accepted first; -1: none, the mask alone)
    slot: int  # the sequence's slot
    mask: bool  # fill its next mask: its follow chunk in the step launched after waits for it


@dataclass(frozen=True, slots=True)
class Pass:
    """A pass under way: ``accepted`` resolves once every row's token is accepted (the
    update may then apply them: ``GrammarState.terminated`` is known without the matcher),
    ``masks`` once the masks are filled too; both fail with the first error of a thread."""

    accepted: concurrent.futures.Future[None]
    masks: concurrent.futures.Future[MaskBlock]


@dataclass(frozen=True, slots=True)
class MaskBlock:
    """The masks of one pass: row ``i`` of ``words`` (``bitmask_words(vocab)`` little-endian
    int32 words, ``row_bytes`` bytes) is slot ``slots[i]``'s. A row that asked for a mask and
    has none (its grammar ended with the token) is not in it."""

    slots: list[int]
    words: bytearray | memoryview  # len(slots) * row_bytes bytes
    row_bytes: int

    def by_slot(self) -> dict[int, memoryview]:
        """Each slot's mask, a view into ``words`` (no copy)."""
        view, n = memoryview(self.words).cast("B"), self.row_bytes
        return {s: view[i * n:(i + 1) * n] for i, s in enumerate(self.slots)}


class GrammarPass:
    """Accepts a step's tokens and fills the next masks on ``threads`` threads (created on
    first use). Thread-safe only for one pass at a time (the driver's)."""

    def __init__(self, threads: int | None = None):
        self.threads = threads if threads and threads > 0 else default_threads()
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._local = threading.local()  # each thread's one-thread batch matcher

    def submit(self, rows: list[Row], inline: bool = False) -> Pass:
        """Start the pass over ``rows`` (matchers of one vocabulary): each thread accepts its
        share's tokens, then fills their masks. ``inline``: the calling thread takes one of
        the ``threads`` shares (the pool the others) and returns once it is done (``run``;
        more threads at once were slower on a 16-core GPU host, docs/BENCHMARKS.md)."""
        vocab = rows[0].state.vocab_size if rows else 0
        if any(r.state.vocab_size != vocab for r in rows):
            raise ValueError("GrammarPass: matchers of different vocabularies")
        width = bitmask_words(vocab)
        want = [r for r in rows if r.mask]
        words = bytearray(4 * width * len(want))
        buf = np.frombuffer(words, dtype=np.int32).reshape(len(want), width)
        index = {id(r): i for i, r in enumerate(want)}
        filled = [False] * len(want)
        out = Pass(concurrent.futures.Future(), concurrent.futures.Future())
        out.accepted.set_running_or_notify_cancel()
        out.masks.set_running_or_notify_cancel()
        k = min(self.threads, len(rows))
        if k == 0:
            out.accepted.set_result(None)
            out.masks.set_result(MaskBlock([], words, 4 * width))
            return out
        shares = [rows[i::k] for i in range(k)]
        left = [k, k]  # threads still accepting, still running
        lock = threading.Lock()

        def failed(e: BaseException) -> None:
            with lock:
                for f in (out.accepted, out.masks):
                    if not f.done():
                        f.set_exception(e)

        def accepted() -> None:
            """A thread's share accepted."""
            with lock:
                left[0] -= 1
                if left[0] == 0 and not out.accepted.done():
                    out.accepted.set_result(None)

        def ended(f: concurrent.futures.Future[None]) -> None:
            if (e := f.exception()) is not None:
                failed(e)
                return
            with lock:
                left[1] -= 1
                if left[1] or out.masks.done():
                    return
            keep = [i for i, ok in enumerate(filled) if ok]
            block = words if len(keep) == len(want) else bytearray(buf[keep].tobytes())
            out.masks.set_result(MaskBlock([want[i].slot for i in keep], block, 4 * width))

        for share in shares[1:] if inline else shares:
            self._threads().submit(self._work, share, index, buf, filled,
                                   accepted).add_done_callback(ended)
        if inline:  # the first share in this thread, while the pool's run
            mine: concurrent.futures.Future[None] = concurrent.futures.Future()
            mine.set_running_or_notify_cancel()
            try:
                self._work(shares[0], index, buf, filled, accepted)
                mine.set_result(None)
            except Exception as e:  # noqa: BLE001 (the pass fails with it, as a thread's)
                mine.set_exception(e)
            ended(mine)
        return out

    def fill(self, states: Sequence[GrammarState]) -> MaskBlock:
        """Fill-only (a step with no token in flight): row ``i`` of the block (slot ``i``) is
        what ``states[i]`` admits next, as ``GrammarState.mask``; one share of the rows is
        filled in this thread (all of them with one thread), the others on the pool's."""
        vocab = states[0].vocab_size if states else 0
        if any(s.vocab_size != vocab for s in states):
            raise ValueError("GrammarPass: matchers of different vocabularies")
        width = bitmask_words(vocab)
        words = bytearray(4 * width * len(states))
        block = MaskBlock(list(range(len(states))), words, 4 * width)
        if not states:
            return block
        buf = np.frombuffer(words, dtype=np.int32).reshape(len(states), width)
        k = min(self.threads, len(states))
        shares = [list(range(i, len(states), k)) for i in range(k)]
        pool = self._threads() if k > 1 else None
        futures = [pool.submit(self._fill_share, states, at, buf)
                   for at in shares[1:]] if pool is not None else []
        self._fill_share(states, shares[0], buf)
        for f in futures:
            f.result(timeout=PASS_TIMEOUT_S)
        return block

    def _fill_share(self, states: Sequence[GrammarState], at: list[int],
                    buf: np.ndarray) -> None:
        """Rows ``at`` of ``buf``: their states' next masks, in one xgrammar call."""
        self._matcher().batch_fill_next_token_bitmask([states[i]._matcher for i in at], buf, at)

    def _matcher(self) -> Any:
        """This thread's one-thread batch matcher."""
        import xgrammar as xgr

        matcher = getattr(self._local, "matcher", None)
        if matcher is None:
            matcher = self._local.matcher = xgr.BatchGrammarMatcher(1)
        return matcher

    def run(self, rows: list[Row]) -> MaskBlock:
        """``submit`` waited for, this thread taking a share (the in-process engine, an
        executor's own masks)."""
        return self.submit(rows, inline=True).masks.result(timeout=PASS_TIMEOUT_S)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False)
            self._pool = None

    def _threads(self) -> concurrent.futures.ThreadPoolExecutor:
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(
                self.threads, thread_name_prefix="grammar-pass")
        return self._pool

    def _work(self, share: list[Row], index: dict[int, int], buf: np.ndarray, filled: list[bool],
              accepted: Callable[[], None]) -> None:
        """One thread's rows: accept each token (then say so), then fill the masks asked for
        of the rows whose grammar goes on."""
        import xgrammar as xgr

        taking = [r for r in share if r.token >= 0]
        oks = xgr.BatchGrammarMatcher.batch_accept_token(
            [r.state._matcher for r in taking], [r.token for r in taking]) if taking else []
        for r, ok in zip(taking, oks, strict=True):
            r.state.accepted_ahead(r.token, ok)
        fill: list[Any] = []
        at: list[int] = []
        for r in share:
            if r.mask and not r.state.terminated:
                fill.append(r.state._matcher)
                at.append(index[id(r)])
        accepted()
        if not fill:
            return
        self._matcher().batch_fill_next_token_bitmask(fill, buf, at)
        for i in at:
            filled[i] = True
