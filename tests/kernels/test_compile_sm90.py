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


@pytest.mark.parametrize("bias, pro, delta", [(False, 0, False), (True, 0, False),
                                               (True, 1, True), (False, 1, False),
                                               (False, 2, False)])
def test_gemv_compiles_for_sm90(bias: bool, pro: int, delta: bool) -> None:
    from disagg.kernels import gemv

    types = {p: "*bf16" for p in ("w_ptr", "x_ptr", "b_ptr", "out_ptr", "d_ptr", "nw_ptr",
                                  "xo_ptr")}
    types.update(N="i32", K="i32", eps="fp32")
    bn, bk = gemv.tiles(4096, 12288)
    compile_sm90(gemv._gemv_kernel, types, dict(HAS_BIAS=bias, BN=bn, BK=bk, PRO=pro,
                                                HAS_DELTA=delta))


@pytest.mark.parametrize("kv_heads, fp8", [(8, False), (3, False), (8, True), (3, True)])
def test_append_kv_compiles_for_sm90(kv_heads: int, fp8: bool) -> None:
    from disagg.kernels import append

    cache = "*fp8e4nv" if fp8 else "*bf16"
    types = {"k_ptr": "*bf16", "v_ptr": "*bf16", "k_cache_ptr": cache, "v_cache_ptr": cache}
    types.update(slot_ptr="*i64", stride_kt="i64", stride_kh="i64", stride_vt="i64",
                 stride_vh="i64", stride_kp="i64", stride_vp="i64", k_scale_ptr="*fp32",
                 v_scale_ptr="*fp32")
    asm = compile_sm90(append._append_kv_kernel, types, dict(
        NUM_KV_HEADS=kv_heads, HEADS_PAD=triton.next_power_of_2(kv_heads), PAGE=16,
        HEAD_DIM=128, FP8=fp8))
    assert "cubin" in asm


# FP8 KV pages (--kv-cache-dtype fp8_e4m3) read by bf16 queries: the attention kernels
@pytest.mark.parametrize("splits", [1, 4])
def test_fp8_decode_compiles_for_sm90(splits: int) -> None:
    from disagg.kernels import decode

    types = {"q_ptr": "*bf16", "k_ptr": "*fp8e4nv", "v_ptr": "*fp8e4nv", "bt_ptr": "*i32",
             "seq_lens_ptr": "*i32", "out_ptr": "*bf16" if splits == 1 else "*fp32",
             "lse_ptr": "*fp32", "scale_log2": "fp32", "stride_qb": "i64", "stride_qh": "i64",
             "stride_kp": "i64", "stride_vp": "i64", "stride_bt": "i64", "stride_ob": "i64",
             "stride_oh": "i64", "k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32"}
    asm = compile_sm90(decode._decode_split_kernel, types, dict(
        NUM_SPLITS=splits, GROUP=4, GROUP_PAD=16, PAGE=16, HEAD_DIM=128, BLOCK_N=64,
        F32_DOT=False, STAGES=2, FP8=True))
    assert "cubin" in asm


def test_fp8_prefill_compiles_for_sm90() -> None:
    from disagg.kernels import prefill

    types = {"q_ptr": "*bf16", "k_ptr": "*fp8e4nv", "v_ptr": "*fp8e4nv", "out_ptr": "*bf16",
             "bt_ptr": "*i32", "seq_lens_ptr": "*i32", "cu_ptr": "*i32", "scale_log2": "fp32",
             "stride_qt": "i64", "stride_qh": "i64", "stride_ot": "i64", "stride_oh": "i64",
             "stride_kp": "i64", "stride_vp": "i64", "stride_bt": "i64", "seq_base": "i32",
             "k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32"}
    asm = compile_sm90(prefill._prefill_kernel, types, dict(
        GROUP=4, PAGE=16, HEAD_DIM=128, BLOCK_M=128, BLOCK_N=128, F32_DOT=False, STAGES=3,
        FP8=True))
    assert "cubin" in asm


def test_fp8_mla_kernels_compile_for_sm90() -> None:
    from disagg.kernels import mla

    lat = dict(LAT=512, LAT_PAD=512, ROPE=64, ROPE_PAD=64)
    types = {"q_ptr": "*bf16", "cache_ptr": "*fp8e4nv", "bt_ptr": "*i32",
             "seq_lens_ptr": "*i32", "out_ptr": "*bf16", "part_ptr": "*fp32",
             "lse_ptr": "*fp32", "scale_log2": "fp32", "num_splits": "i32", "stride_qb": "i64",
             "stride_qh": "i64", "stride_cp": "i64", "stride_bt": "i64", "stride_ob": "i64",
             "stride_oh": "i64", "scale_ptr": "*fp32"}
    bh, bn, stages, _ = mla.decode_tiles(16, 2)
    assert "cubin" in compile_sm90(mla._mla_decode_kernel, types, dict(
        HEADS=16, BLOCK_H=bh, PAGE=16, **lat, BLOCK_N=bn, F32_DOT=False, STAGES=stages,
        FP8=True))
    types = {"q_ptr": "*bf16", "cache_ptr": "*fp8e4nv", "out_ptr": "*bf16", "bt_ptr": "*i32",
             "seq_lens_ptr": "*i32", "cu_ptr": "*i32", "scale_log2": "fp32",
             "stride_qt": "i64", "stride_qh": "i64", "stride_ot": "i64", "stride_oh": "i64",
             "stride_cp": "i64", "stride_bt": "i64", "seq_base": "i32", "scale_ptr": "*fp32"}
    bm, bn, stages, _ = mla.prefill_tiles(2)
    assert "cubin" in compile_sm90(mla._mla_prefill_kernel, types, dict(
        HEADS=16, PAGE=16, **lat, BLOCK_M=bm, BLOCK_N=bn, F32_DOT=False, STAGES=stages,
        FP8=True))
    types = {"x_ptr": "*bf16", "cache_ptr": "*fp8e4nv", "slot_ptr": "*i64", "stride_xt": "i64",
             "stride_cp": "i64", "scale_ptr": "*fp32"}
    assert "cubin" in compile_sm90(mla._append_latent_kernel, types, dict(
        PAGE=16, WIDTH=576, WIDTH_PAD=1024, FP8=True))


# Block-FP8 linear layers (disagg.kernels.fp8_gemm): every tile of the table, fp8 wgmma dots
@pytest.mark.parametrize("entry", range(4))
def test_fp8_gemm_compiles_for_sm90(entry: int) -> None:
    from disagg.kernels import fp8_gemm

    tile = fp8_gemm.TILE_TABLE[entry][1]
    types = {"a_ptr": "*fp8e4nv", "as_ptr": "*fp32", "b_ptr": "*fp8e4nv", "bs_ptr": "*fp32",
             "c_ptr": "*bf16", "M": "i32", "N": "i32", "K": "i32", "stride_am": "i32",
             "stride_asm": "i32", "stride_bn": "i32", "stride_bsn": "i32", "stride_cm": "i32"}
    asm = compile_sm90(fp8_gemm._fp8_gemm_kernel, types, dict(
        EVEN_K=entry != 1, F32_DOT=False, GROUP=fp8_gemm.GROUP, BLOCK_M=tile.block_m,
        BLOCK_N=tile.block_n, GROUP_M=tile.group_m))
    assert "cubin" in asm
    if tile.block_m >= 64:  # Hopper's FP8 tensor-core instruction, not an upcast
        assert "wgmma" in asm["ptx"] and "e4m3" in asm["ptx"]


def test_fp8_quantize_groups_compiles_for_sm90() -> None:
    from disagg.kernels import fp8_gemm

    types = {"x_ptr": "*bf16", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32", "M": "i32", "K": "i32",
             "stride_xm": "i32", "stride_qm": "i32", "stride_sm": "i32", "stride_sg": "i32"}
    asm = compile_sm90(fp8_gemm._quantize_groups_kernel, types,
                       dict(ROWS=16, GROUP=fp8_gemm.GROUP))
    assert "cubin" in asm and "div.rn.f32" in asm["ptx"]


@pytest.mark.parametrize("pro, delta, split", [(0, False, 1), (1, True, 1), (1, False, 4),
                                               (2, False, 1), (2, False, 3)])
def test_fp8_gemv_compiles_for_sm90(pro: int, delta: bool, split: int) -> None:
    from disagg.kernels import fp8_gemv

    t = fp8_gemv.GEMV_TILE
    types = {"w_ptr": "*fp8e4nv", "s_ptr": "*fp32", "x_ptr": "*bf16", "out_ptr": "*bf16",
             "d_ptr": "*bf16", "nw_ptr": "*bf16", "xo_ptr": "*bf16", "ws_ptr": "*fp32",
             "cnt_ptr": "*i32", "N": "i32", "K": "i32", "stride_sn": "i32", "eps": "fp32"}
    asm = compile_sm90(fp8_gemv._fp8_gemv_kernel, types, dict(
        GROUP=fp8_gemv.GROUP, BN=t.bn, SUB=t.sub, STAGES=t.stages, SPLIT=split,
        EVEN=split == 1, PRO=pro, HAS_DELTA=delta))
    assert "cubin" in asm
    assert ("atom.global" in asm["ptx"]) == (split > 1)


# FP8 experts in the fused MoE kernel (weight-only): every tile of its table, gate_up and down
@pytest.mark.parametrize("entry", range(4))
@pytest.mark.parametrize("gated", [True, False])
def test_fp8_moe_gemm_compiles_for_sm90(entry: int, gated: bool) -> None:
    from disagg.kernels import fused_moe

    tiles = fused_moe.TILE_TABLE[entry][1]
    tile = tiles.up if gated else tiles.down
    types = {"a_ptr": "*bf16", "w_ptr": "*fp8e4nv", "ws_ptr": "*fp32", "out_ptr": "*bf16",
             "topk_w_ptr": "*bf16", "sorted_ids_ptr": "*i32", "expert_ids_ptr": "*i32",
             "num_post_ptr": "*i32", "num_pairs": "i32", "num_rows_cap": "i32", "N": "i32",
             "K": "i32", "a_div": "i32", "stride_am": "i32", "stride_we": "i32",
             "stride_wn": "i32", "stride_om": "i32", "stride_se": "i32", "stride_sn": "i32"}
    asm = compile_sm90(fused_moe._moe_gemm_kernel, types, dict(
        GATED=gated, ROUTED=not gated, EVEN=True, F32_DOT=False, FP8_W=True,
        BLOCK_M=tiles.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k,
        GROUP_M=tile.group_m))
    assert "cubin" in asm
