"""The decode launch's tile by page dtype, and the experiments' override (pure: no launch)."""

import pytest
import torch

from disagg.kernels import decode


def test_every_page_dtype_has_a_valid_tile():
    for dtype, (block_n, warps, stages) in decode.DECODE_TILES.items():
        assert block_n >= 16 and block_n & (block_n - 1) == 0, dtype
        assert warps in (1, 2, 4, 8, 16) and stages >= 1, dtype
        assert decode.decode_tile(dtype) == (block_n, warps, stages)


def test_the_override_is_parsed_or_refused_by_name(monkeypatch):
    monkeypatch.setenv("DISAGG_DECODE_TILE", "128, 8,3")
    assert decode._tile_override() == (128, 8, 3)
    monkeypatch.setenv("DISAGG_DECODE_TILE", "")
    assert decode._tile_override() is None
    monkeypatch.setenv("DISAGG_DECODE_TILE", "128,8")
    with pytest.raises(ValueError, match="DISAGG_DECODE_TILE='128,8'"):
        decode._tile_override()
    monkeypatch.setattr(decode, "_OVERRIDE", (32, 2, 1))
    assert decode.decode_tile(torch.float8_e4m3fn) == (32, 2, 1)
