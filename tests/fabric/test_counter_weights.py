"""Weighted immediates: the low bits carry how many units one write counts for."""

from __future__ import annotations

from disagg.fabric.counter import ImmCounter


def test_weighted_arrivals_sum_units_per_key():
    c = ImmCounter(weight_bits=16)
    key = 0xABC
    c.expect(key, 10)
    assert not c.arrive(*c.split((key << 16) | 3))
    assert not c.arrive(*c.split((key << 16) | 4))
    assert c.progress(key) == (7, 10)
    assert c.arrive(*c.split((key << 16) | 3))
    assert c.progress(key) is None


def test_weighted_arrivals_of_other_keys_do_not_mix():
    c = ImmCounter(weight_bits=16)
    c.expect(1, 5)
    c.expect(2, 10)
    assert not c.arrive(2, 5, n=1)
    assert c.arrive(1, 5, n=1)
    assert c.arrive(2, 5, n=2) and c.junk == 1  # two writes of weight 5, room for one
    assert c.split((9 << 16) | 2, n=3) == (9, 6)
    assert ImmCounter().split(0x12345, 3) == (0x12345, 3)
