"""The layer poller: a dedicated thread following the layer counter of the running step.
It reads the counter the lead executor bumps after each layer's attention output
projection, and enters asyncio in one place (``call_soon_threadsafe``) when layers finished.
It blocks on an event while no step runs; it never spins idle."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

from disagg import trace

POLL_S = 0.0002  # counter poll period while a step runs


class LayerPoller:
    """A dedicated thread that follows the layer counter of the running step."""

    def __init__(self, counter: Any, num_layers: int, loop: asyncio.AbstractEventLoop,
                 on_layers: Any):
        self.counter = counter
        self.num_layers = num_layers
        self.loop = loop
        self.on_layers = on_layers  # called in the loop with (step_id, layers_done, seen_at)
        self._step: tuple[int, int] | None = None  # (step_id, counter base)
        self._event = threading.Event()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="layer-poller", daemon=True)
        self._thread.start()

    def follow(self, step_id: int, base: int) -> None:
        self._step = (step_id, base)
        self._event.set()

    def stop(self) -> None:
        self._stop = True
        self._event.set()
        self._thread.join(timeout=2)

    def _run(self) -> None:
        seen: tuple[int, int] = (-1, 0)
        while not self._stop:
            step = self._step
            if step is None or seen == (step[0], self.num_layers):
                self._event.wait(0.5)  # idle: block, never spin
                self._event.clear()
                continue
            step_id, base = step
            done = max(0, min(self.num_layers, self.counter.read() - base))
            if done != seen[1] or step_id != seen[0]:
                if done == self.num_layers:
                    trace.mark("lp.last_layer_seen", "s", step_id)
                if done > 0:
                    self.loop.call_soon_threadsafe(self.on_layers, step_id, done,
                                                   time.monotonic())
                seen = (step_id, done)
            time.sleep(POLL_S)


class LeastCounter:
    """The layer counters of a ``--dp`` prefill node's ranks (each rank's lead executor bumps
    its own) read as one: the least advanced, so a step's layer goes out once every rank has
    computed it."""

    def __init__(self, counters: list[Any]):
        self.counters = counters

    def read(self) -> int:
        return min(c.read() for c in self.counters)

    def close(self) -> None:
        for c in self.counters:
            c.close()

