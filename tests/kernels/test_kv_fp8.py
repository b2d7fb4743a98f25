"""FP8 KV pages on the torch path (CPU): what the append stores, what attention reads, the
checkpoint's scales and their identity, the flag."""

from __future__ import annotations

import pytest
import torch

from disagg.config import CacheConfig, ConfigError
from disagg.kernels import checks, kv_quant, reference

FP8 = torch.float8_e4m3fn
PAGE, HKV, D = 4, 2, 16


def caches(pages: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    kv = torch.zeros((pages, 2, HKV, PAGE, D), dtype=dtype)
    return kv[:, 0], kv[:, 1]  # strided layer views, as the runner passes them


def scales() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.tensor([0.5, 2.0]), torch.tensor([0.25, 1.5])


def test_append_stores_the_saturated_quotient_and_reads_back_within_e4m3():
    torch.manual_seed(0)
    k, v = torch.randn(6, HKV, D) * 3, torch.randn(6, HKV, D)
    k[0, 0, 0], v[1, 1, 3] = 1e4, -1e4  # far past 448 * scale: saturates, never inf / NaN
    kc, vc = caches(4, FP8)
    slots = torch.tensor([0, 1, 5, 6, -1, 9])
    ks, vs = scales()
    reference.append_kv(k, v, kc, vc, slots, (ks, vs))
    keep = slots >= 0
    for x, cache, s in ((k, kc, ks), (v, vc, vs)):
        got = cache[slots[keep] // PAGE, :, slots[keep] % PAGE]  # [T, H, D] e4m3
        want = (x[keep] / s.view(1, -1, 1)).clamp(-448, 448).to(FP8)
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
        back = kv_quant.dequantize(got, s, head_dim=1)
        assert torch.isfinite(back).all()
        clipped = torch.minimum(x[keep].abs(), 448 * s.view(1, -1, 1)) * x[keep].sign()
        # e4m3: 3 mantissa bits (relative 2^-4 at the worst rounding), subnormals below 2^-6
        bound = clipped.abs() / 16 + 2.0**-9 * s.view(1, -1, 1)
        assert ((back - clipped).abs() <= bound).all()
    assert kc[0, 0, 0, 0].float() * ks[0] == 448 * ks[0]
    assert (kc[2, :, 0] == 0).all().item()  # slot -1 (would be page 2's first row) untouched


def test_attention_over_fp8_pages_equals_attention_over_the_dequantized_pages():
    torch.manual_seed(1)
    lens = [7, 1, 9]
    total = sum(lens)
    k, v = torch.randn(total, HKV, D), torch.randn(total, HKV, D)
    kc, vc = caches(12, FP8)
    tables = torch.tensor([[0, 1, 2], [3, 0, 0], [4, 5, 6]], dtype=torch.int32)
    slots = torch.cat([tables[b, torch.arange(n) // PAGE].long() * PAGE + torch.arange(n) % PAGE
                       for b, n in enumerate(lens)])
    ks, vs = scales()
    reference.append_kv(k, v, kc, vc, slots, (ks, vs))
    # the same values as float32 pages: what the FP8 pages mean
    dk = kv_quant.dequantize(kc, ks, head_dim=1)
    dv = kv_quant.dequantize(vc, vs, head_dim=1)
    q = torch.randn(total, 2 * HKV, D)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    cu = torch.tensor([0, 7, 8, 17], dtype=torch.int32)
    got = reference.paged_attention(q, kc, vc, tables, seq_lens, cu, D**-0.5, (ks, vs))
    want = reference.paged_attention(q, dk, dv, tables, seq_lens, cu, D**-0.5)
    assert torch.equal(got, want)
    # and the quantization is visible: not the unquantized values' attention
    kf, vf = caches(12, torch.float32)
    reference.append_kv(k, v, kf, vf, slots)
    exact = reference.paged_attention(q, kf, vf, tables, seq_lens, cu, D**-0.5)
    assert not torch.equal(got, exact)
    assert (got - exact).abs().max() < 0.2


def test_checkpoint_scales_one_value_or_one_per_head_else_refused_by_name():
    assert torch.equal(kv_quant.checkpoint_scale("l.k_scale", torch.tensor(0.5), 3),
                       torch.full((3,), 0.5))
    assert torch.equal(kv_quant.checkpoint_scale("l.k_scale", torch.tensor([2.0, 3.0]), 2),
                       torch.tensor([2.0, 3.0]))
    with pytest.raises(ValueError, match=r"l\.v_scale has shape \(3,\).*one per kv head \(2\)"):
        kv_quant.checkpoint_scale("l.v_scale", torch.ones(3), 2)
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="l.k_scale must be finite and > 0"):
            kv_quant.checkpoint_scale("l.k_scale", torch.tensor(bad), 2)


def test_the_scales_identity_is_unit_or_a_digest_of_every_value():
    one = torch.ones(2)
    assert kv_quant.scales_identity([(one, one), (one, one)]) == kv_quant.UNIT_SCALES
    a = kv_quant.scales_identity([(one, one), (torch.tensor([1.0, 0.5]), one)])
    b = kv_quant.scales_identity([(one, one), (one, torch.tensor([1.0, 0.5]))])
    assert a.startswith("sha256:") and b.startswith("sha256:") and a != b
    assert a == kv_quant.scales_identity([(one, one), (torch.tensor([1.0, 0.5]), one)])


def test_launches_over_fp8_pages_need_float32_scales_per_head():
    kc, _ = caches(2, FP8)
    with pytest.raises(ValueError, match="FP8 KV pages need kv_scales"):
        checks.launch_scales(None, kc, HKV, kc)
    with pytest.raises(ValueError, match=r"v_scale must be a float32 \[2\] tensor"):
        checks.launch_scales((torch.ones(2), torch.ones(3)), kc, HKV, kc)
    q = torch.zeros(1, HKV, D, dtype=torch.bfloat16)
    checks.check_query_dtype(q, kc)  # any attention dtype reads FP8 pages
    with pytest.raises(ValueError, match="must equal the cache dtype"):
        checks.check_query_dtype(q, caches(2, torch.float32)[0])


def test_kv_cache_dtype_names():
    assert kv_quant.kv_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert kv_quant.kv_dtype("fp8_e4m3", torch.float32) == FP8
    with pytest.raises(ValueError, match="--kv-cache-dtype"):
        kv_quant.kv_dtype("fp8", torch.float32)
    CacheConfig(kv_cache_dtype="fp8_e4m3").validate()
    with pytest.raises(ConfigError, match="--kv-cache-dtype must be one of auto, fp8_e4m3, got 'int8'"):
        CacheConfig(kv_cache_dtype="int8").validate()


def test_the_flag_reaches_the_config_and_a_wrong_value_names_it(capsys):
    from disagg.cli.node import build_parser, config_from_args

    args = build_parser().parse_args(["--role", "mixed", "--kv-cache-dtype", "fp8_e4m3"])
    assert config_from_args(args).cache.kv_cache_dtype == "fp8_e4m3"
    assert build_parser().parse_args(["--role", "mixed"]).kv_cache_dtype == "auto"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--role", "mixed", "--kv-cache-dtype", "fp8_e5m2"])
    assert "argument --kv-cache-dtype: invalid choice: 'fp8_e5m2'" in capsys.readouterr().err
