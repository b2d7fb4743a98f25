"""The receiver's expected-count table: immediate values counted regardless of order.

Plain logic, no threads or asyncio. Writes may land before their expectation is registered;
they are held as "early" counts (bounded, so a peer cannot grow the table without limit).
Cancelling an expectation frees its immediate value at once: a new ``expect`` on the same
value starts from zero plus whatever arrives after the cancel.

Weighted immediates (``weight_bits > 0``): the low ``weight_bits`` bits of an immediate are a
weight (for KV pages: how many pages one coalesced write carried) and the rest is the key that
expectations name. A write then counts ``weight`` units towards ``key``, so the receiver's
target does not depend on how the sender coalesced or chunked its writes.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ImmCounter:
    max_early: int = 1 << 16  # distinct unexpected immediate values held at most
    expected: dict[int, list[int]] = field(default_factory=dict)  # imm -> [count, target]
    early: dict[int, int] = field(default_factory=dict)  # imm -> arrivals before expect()
    dropped: int = 0  # arrivals discarded because the early table was full
    weight_bits: int = 0  # low bits of an immediate that carry its weight (0 = each counts 1)

    def split(self, imm: int, n: int = 1) -> tuple[int, int]:
        """(key, units) of ``n`` arrivals of the immediate ``imm``."""
        if self.weight_bits == 0:
            return imm, n
        return imm >> self.weight_bits, n * (imm & ((1 << self.weight_bits) - 1))

    def expect(self, imm: int, count: int) -> bool:
        """Register an expectation; True if it is already met by early arrivals."""
        if count <= 0:
            raise ValueError(f"expected count must be positive, got {count}")
        if imm in self.expected:
            raise KeyError(f"immediate {imm:#x} already has a pending expectation")
        got = self.early.pop(imm, 0)
        if got > count:
            raise ValueError(f"immediate {imm:#x}: {got} writes already landed, expected {count}")
        if got == count:
            return True
        self.expected[imm] = [got, count]
        return False

    def arrive(self, imm: int, n: int = 1) -> bool:
        """Count ``n`` arrivals of ``imm``; True if this met its expectation (now removed)."""
        slot = self.expected.get(imm)
        if slot is None:
            if imm in self.early or len(self.early) < self.max_early:
                self.early[imm] = self.early.get(imm, 0) + n
            else:
                self.dropped += n
            return False
        slot[0] += n
        if slot[0] >= slot[1]:
            del self.expected[imm]
            return True
        return False

    def cancel(self, imm: int) -> bool:
        """Forget an expectation; True if one was pending."""
        self.early.pop(imm, None)
        return self.expected.pop(imm, None) is not None

    def progress(self, imm: int) -> tuple[int, int] | None:
        slot = self.expected.get(imm)
        return None if slot is None else (slot[0], slot[1])
