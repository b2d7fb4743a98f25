"""Weighted immediates: the low bits carry how many units one write counts for."""

from __future__ import annotations

from disagg.fabric.counter import ImmCounter


def test_weighted_arrivals_sum_units_per_key():
    c = ImmCounter(weight_bits=16)
    key = 0xABC
    assert not c.expect(key, 10)
    assert not c.arrive(*c.split((key << 16) | 3))
    assert not c.arrive(*c.split((key << 16) | 4))
    assert c.progress(key) == (7, 10)
    assert c.arrive(*c.split((key << 16) | 3))
    assert c.progress(key) is None


def test_weighted_early_arrivals_and_other_keys_do_not_mix():
    c = ImmCounter(weight_bits=16)
    c.arrive(*c.split((1 << 16) | 5))
    c.arrive(*c.split((2 << 16) | 5, n=2))  # two writes of weight 5
    assert c.expect(1, 5)  # already met by the early arrival
    assert c.expect(2, 10)
    assert c.split((9 << 16) | 2, n=3) == (9, 6)
    assert ImmCounter().split(0x12345, 3) == (0x12345, 3)
