"""Grammar masks on the executor's side: picking a launched step's tokens once its masks are
there (``finish``), filled here from the executor's own copies of the requests' matchers
(``OwnMasks``, ``disagg.engine.grammar_mirror``; the default) or, with
``DISAGG_EXECUTOR_MASKS=0``, from a ``Masks`` message."""

from __future__ import annotations

import concurrent.futures
import functools
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from disagg import trace
from disagg.actors.executor.step_order import StepOrder
from disagg.engine.grammar_mirror import GrammarMirror
from disagg.engine.grammar_pass import default_threads
from disagg.protocol.executor import GrammarDef, StepPlan

if TYPE_CHECKING:
    from disagg.config import NodeConfig
    from disagg.engine.launched import Launched

log = logging.getLogger(__name__)


def mask_threads(cfg: NodeConfig) -> int:
    """Threads of one executor's mask fills: ``--grammar-threads`` as given, or by default
    the node's share (half the CPUs, xgrammar's own default) split among its executors, which
    all fill at once under ``--tp`` (each rank the whole batch's masks)."""
    return cfg.scheduler.grammar_threads or max(1, default_threads() // len(cfg.devices))


def awaits_masks(launched: Launched | Exception) -> bool:
    """A launched step whose tokens wait for late grammar masks (``Launched.with_masks``)."""
    return not isinstance(launched, Exception) and launched.picker is not None


def finish(launched: Launched | Exception, slots: list[int], row_bytes: int,
           rows: memoryview) -> Launched | Exception:
    """Pick a launched step's tokens with its late grammar masks (``Launched.with_masks``):
    ``rows``, a ``Masks`` message's frame, holds slot ``slots[i]``'s at row ``i``."""
    if isinstance(launched, Exception):
        return launched
    try:
        if len(rows) != len(slots) * row_bytes:
            raise ValueError(f"grammar masks of {len(rows)} bytes for {len(slots)} rows of "
                             f"{row_bytes}")
        return launched.with_masks({s: rows[i * row_bytes:(i + 1) * row_bytes]
                                    for i, s in enumerate(slots)})
    except Exception as e:  # noqa: BLE001
        log.exception("picking a step with its grammar masks failed")
        return e


class OwnMasks:
    """The executor's copies of its constrained requests' matchers (``GrammarMirror``), fed
    by its plans and answers; fills a step's masks right after launching it when none of its
    rows follows a token in flight (``picked``), else a deferred step's as soon as the step
    before it is answered (``fill``)."""

    def __init__(self, threads: int | None = None, tkey: str = "", tev: str = "dx"):
        """``tkey``: this rank's trace key (``disagg.trace``; "": no marks): ``<tev>.fill``
        (valued the step the masks follow and the rows) and ``<tev>.masks_in`` around each
        fill (``bench/grammar_gaps.py``)."""
        self.mirror = GrammarMirror(threads)
        self._tkey, self._tev = tkey, tev

    def warm(self) -> concurrent.futures.Future[Any]:
        """Import xgrammar off the step loop once the executor is ready: the first
        constrained request's masks would otherwise wait for it (``GrammarMirror.warm``)."""
        return self.mirror.warm()

    def define(self, grammar: GrammarDef) -> None:
        try:
            self.mirror.define(grammar)
        except Exception:  # noqa: BLE001 (its requests' rows are then picked unconstrained)
            log.exception("grammar %d: not defined", grammar.key)

    def launched(self, plan: StepPlan) -> None:
        self.mirror.track(plan)

    def answered(self, step_id: int, launched: Launched | Exception) -> None:
        tokens = None if isinstance(launched, Exception) else launched.tokens
        self.mirror.record(step_id, tokens if isinstance(tokens, list) else None)

    def picked(self, step_id: int, launched: Launched | Exception) -> Launched | Exception:
        """A step just launched, picked at once when its masks can be filled now (none of
        its rows follows a token in flight): the fill overlaps its forward pass."""
        if self.mirror.ready_at_launch(step_id) and awaits_masks(launched):
            return self._pick(step_id, -1)(launched)
        return launched

    def fill(self, order: StepOrder[Launched | Exception]) -> None:
        """Fill and pick the deferred step's late masks when they are this executor's to
        fill (the step before it answered)."""
        if order.deferred is None:
            return
        sid, launched = order.deferred
        if self.mirror.owns(sid) and awaits_masks(launched):
            order.masks(sid, self._pick(sid, sid - 1))

    def _pick(self, sid: int, after: int) -> Callable[[Launched | Exception],
                                                      Launched | Exception]:
        """Step ``sid``'s masks filled now (``after``: the step whose tokens they follow, -1
        at launch): what picks its tokens with them."""
        if self._tkey:
            trace.mark(f"{self._tev}.fill", self._tkey, sid, value=f"{after} "
                       f"{self.mirror.late_rows(sid)}")
        try:
            block = self.mirror.fill(sid)
            pick = functools.partial(finish, slots=block.slots, row_bytes=block.row_bytes,
                                     rows=memoryview(block.words))
        except Exception as e:  # noqa: BLE001 (the step fails, the executor serves on)
            log.exception("filling step %d's grammar masks failed", sid)
            pick = functools.partial(lambda _launched, error: error, error=e)
        if self._tkey:
            trace.mark(f"{self._tev}.masks_in", self._tkey, sid)
        return pick

    def close(self) -> None:
        self.mirror.close()
