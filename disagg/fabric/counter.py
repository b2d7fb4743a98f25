"""The receiver's expected-count table: immediate values counted regardless of order.

Plain logic, no threads or asyncio. Immediates come from peers and are never trusted: an
arrival counts only towards an expectation registered before it (the receiver always calls
``expect`` before it tells a sender where to write), and only up to that expectation's target.
Anything else -- a key nobody expects (unknown, finished, cancelled), a zero weight, or units
past the target -- is counted in ``junk`` and otherwise ignored: it can neither raise, grow a
table, nor complete a transfer. Cancelling an expectation frees its key at once.

Weighted immediates (``weight_bits > 0``): the low ``weight_bits`` bits of an immediate are a
weight (for KV pages: how many pages one coalesced write carried) and the rest is the key that
expectations name. A write then counts ``weight`` units towards ``key``, so the receiver's
target does not depend on how the sender coalesced or chunked its writes.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ImmCounter:
    expected: dict[int, list[int]] = field(default_factory=dict)  # key -> [units, target]
    weight_bits: int = 0  # low bits of an immediate that carry its weight (0 = each counts 1)
    junk: int = 0  # arrivals refused: unknown key, zero weight, or past the target
    last_junk: int | None = None  # the key of the last one (for logs)

    def split(self, imm: int, n: int = 1) -> tuple[int, int]:
        """(key, units) of ``n`` arrivals of the immediate ``imm``."""
        if self.weight_bits == 0:
            return imm, n
        return imm >> self.weight_bits, n * (imm & ((1 << self.weight_bits) - 1))

    def expect(self, key: int, count: int) -> None:
        """Register an expectation of ``count`` units of ``key``. Raises only for the caller's
        own mistakes (a non-positive count, a key it already expects), never for arrivals."""
        if count <= 0:
            raise ValueError(f"expected count must be positive, got {count}")
        if key in self.expected:
            raise KeyError(f"key {key:#x} already has a pending expectation")
        self.expected[key] = [0, count]

    def arrive(self, key: int, weight: int = 1, n: int = 1) -> bool:
        """Count ``n`` arrivals of ``weight`` units each for ``key``; True if this met its
        expectation (now removed). Arrivals that do not fit are junk."""
        slot = self.expected.get(key)
        fit = 0
        if slot is not None and weight > 0:
            fit = min(n, (slot[1] - slot[0]) // weight)
            slot[0] += fit * weight
        if fit < n:
            self.junk += n - fit
            self.last_junk = key
        if slot is not None and slot[0] >= slot[1]:
            del self.expected[key]
            return True
        return False

    def cancel(self, key: int) -> bool:
        """Forget an expectation; True if one was pending."""
        return self.expected.pop(key, None) is not None

    def progress(self, key: int) -> tuple[int, int] | None:
        slot = self.expected.get(key)
        return None if slot is None else (slot[0], slot[1])
