"""The fused layer kernels compiled for an H100/H200 (sm_90) on the CPU box: Triton's
interpreter (the other CPU tests) runs Python semantics and misses what only the compiler
checks (e.g. a name assigned in both branches of an ``if`` with tiles of different shapes)."""

from __future__ import annotations

import pytest

triton = pytest.importorskip("triton")


def compile_sm90(fn, types: dict[str, str], consts: dict[str, object]) -> dict:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = dict(types, **{k: "constexpr" for k in consts})
    names = list(sig)
    src = ASTSource(fn, sig, constexprs={(names.index(k),): v for k, v in consts.items()})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm


@pytest.mark.parametrize("heads, kv_heads, norm", [(32, 8, True), (4, 2, False), (12, 12, True)])
def test_qk_rope_append_compiles_for_sm90(heads: int, kv_heads: int, norm: bool) -> None:
    from disagg.model import fused

    ptrs = ["qkv_ptr", "qn_ptr", "kn_ptr", "cos_ptr", "sin_ptr", "q_ptr", "k_cache_ptr",
            "v_cache_ptr"]
    types = {p: "*bf16" for p in ptrs}
    types.update(slot_ptr="*i64", stride_t="i64", stride_ct="i64", stride_kp="i64",
                 stride_vp="i64", eps="fp32")
    asm = compile_sm90(fused._qk_rope_append_kernel, types, dict(
        HQ=heads, HKV=kv_heads, HQ_PAD=triton.next_power_of_2(heads),
        HKV_PAD=triton.next_power_of_2(kv_heads), HALF=64, PAGE=16, HAS_NORM=norm))
    assert "cubin" in asm


def test_norm_rope_and_rms_norm_compile_for_sm90() -> None:
    from disagg.model import fused

    types = {p: "*bf16" for p in ("x_ptr", "w_ptr", "cos_ptr", "sin_ptr", "out_ptr")}
    types.update(stride_xt="i64", stride_xh="i64", stride_ct="i64", heads="i32", eps="fp32")
    compile_sm90(fused._norm_rope_kernel, types,
                 dict(HAS_NORM=True, H_PAD=32, HALF=64, INTERLEAVE=False))
    types = {p: "*bf16" for p in ("x_ptr", "r_ptr", "w_ptr", "out_ptr", "xout_ptr")}
    types.update(stride_x="i64", stride_r="i64", stride_o="i64", stride_xo="i64", n="i32",
                 eps="fp32")
    compile_sm90(fused._rms_norm_kernel, types, dict(HAS_RES=True, BLOCK=4096))


@pytest.mark.parametrize("bias", [False, True])
def test_gemv_compiles_for_sm90(bias: bool) -> None:
    from disagg.kernels import gemv

    types = {p: "*bf16" for p in ("w_ptr", "x_ptr", "b_ptr", "out_ptr")}
    types.update(N="i32", K="i32")
    bn, bk = gemv.tiles(4096, 12288)
    compile_sm90(gemv._gemv_kernel, types, dict(HAS_BIAS=bias, BN=bn, BK=bk))


@pytest.mark.parametrize("kv_heads", [8, 3])
def test_append_kv_compiles_for_sm90(kv_heads: int) -> None:
    from disagg.kernels import append

    types = {p: "*bf16" for p in ("k_ptr", "v_ptr", "k_cache_ptr", "v_cache_ptr")}
    types.update(slot_ptr="*i64", stride_kt="i64", stride_kh="i64", stride_vt="i64",
                 stride_vh="i64", stride_kp="i64", stride_vp="i64")
    asm = compile_sm90(append._append_kv_kernel, types, dict(
        NUM_KV_HEADS=kv_heads, HEADS_PAD=triton.next_power_of_2(kv_heads), PAGE=16,
        HEAD_DIM=128))
    assert "cubin" in asm
