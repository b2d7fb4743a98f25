"""Stop strings matched over a text stream (the OpenAI gateway's ``stop``)."""

from __future__ import annotations


class StopMatcher:
    """Watches a text stream for stop strings; never releases text that may start one.

    ``push(delta)`` returns (text safe to emit, whether a stop string matched). On a match the
    returned text ends right before the stop string, which is not emitted (as OpenAI).
    ``flush()`` returns the held-back tail once the stream ends without a match."""

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.buf = ""
        self.matched: str | None = None

    def push(self, delta: str) -> tuple[str, bool]:
        if self.matched is not None:
            return "", True
        self.buf += delta
        if not self.stops:
            out, self.buf = self.buf, ""
            return out, False
        best = -1
        for s in self.stops:
            i = self.buf.find(s)
            if i >= 0 and (best < 0 or i < best):
                best, self.matched = i, s
        if best >= 0:
            out, self.buf = self.buf[:best], ""
            return out, True
        safe = max(0, len(self.buf) - self.hold)
        out, self.buf = self.buf[:safe], self.buf[safe:]
        return out, False

    def flush(self) -> str:
        out, self.buf = self.buf, ""
        return out
