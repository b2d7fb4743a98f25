"""A prefill node whose messenger takes each ``AbortPrefill`` ``DISAGG_TEST_ABORT_LATE_S``
seconds late (``python tests/procs/late_abort_prefiller.py NODE-ARGS``): the abort of a job
crosses the writes its prefiller keeps posting meanwhile, as an abort delayed on the control
path does. Everything else is the real node; only the abort's handling is deferred (the loop
keeps serving pings, requests and layers)."""

from __future__ import annotations

import asyncio
import os
from typing import Any

from disagg.actors.prefill_messenger.prefill_messenger import PrefillMessenger
from disagg.cli.node import main

LATE_S = float(os.environ.get("DISAGG_TEST_ABORT_LATE_S", "2.0"))
_abort = PrefillMessenger._abort


async def _late_abort(self: PrefillMessenger, *args: Any) -> None:
    asyncio.get_running_loop().call_later(LATE_S, lambda: self._spawn(_abort(self, *args)))


if __name__ == "__main__":
    PrefillMessenger._abort = _late_abort  # type: ignore[method-assign]
    main()
