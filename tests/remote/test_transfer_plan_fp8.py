"""FP8 KV layouts between peers: pages move as they are (1 byte an element, a quarter of
float32's and half of bf16's bytes for the same units), and a pair whose pages differ in dtype
or in their FP8 scales is refused by name, never converted."""

from __future__ import annotations

import msgspec
import pytest

from disagg.protocol.peer import KVLayoutDesc
from disagg.remote.transfer_plan import incompatibility, plan_layer_writes, shard_kv_heads

SIZES = {"float32": 4, "bfloat16": 2, "float8_e4m3fn": 1}


def gqa(tp: int, dtype: str, kv_scales: str = "", kind: str = "gqa") -> KVLayoutDesc:
    heads, replicas = shard_kv_heads(4 if kind == "gqa" else 1, tp)
    return KVLayoutDesc(num_layers=2, num_pages=16, num_kv_heads=heads, page_size=4,
                        head_dim=8, dtype=dtype, element_size=SIZES[dtype], hidden_size=8,
                        tp_size=tp, kv_replicas=replicas, kind=kind,
                        kv_parts=2 if kind == "gqa" else 1,
                        kv_scales=kv_scales if dtype == "float8_e4m3fn" else "")


@pytest.mark.parametrize("kind", ["gqa", "mla"])
@pytest.mark.parametrize("p_tp, d_tp", [(1, 1), (1, 2), (2, 1)])
def test_fp8_pages_move_a_quarter_of_float32_bytes_in_the_same_units(kind, p_tp, d_tp):
    pages = [3, 4, 9]
    moved = {}
    for dtype in SIZES:
        src, dst = gqa(p_tp, dtype, "unit", kind), gqa(d_tp, dtype, "unit", kind)
        assert incompatibility(src, dst) is None
        writes = plan_layer_writes(src, dst, pages, [0, 1, 2], 1)
        moved[dtype] = (sum(w.length for w in writes), sum(w.units for w in writes),
                        sorted((w.src_offset, w.dst_offset) for w in writes))
    assert moved["float8_e4m3fn"][0] * 4 == moved["float32"][0]
    assert moved["float8_e4m3fn"][0] * 2 == moved["bfloat16"][0]
    assert moved["float8_e4m3fn"][1] == moved["float32"][1] == moved["bfloat16"][1]


def test_mismatched_kv_dtypes_are_refused_by_name():
    why = incompatibility(gqa(1, "float8_e4m3fn", "unit"), gqa(1, "float32"))
    assert why == ("KV dtype mismatch: the prefiller's pages are float8_e4m3fn and the "
                   "decoder's float32 (pages are moved as they are, never converted: give both "
                   "the same --kv-cache-dtype and --dtype)")
    assert incompatibility(gqa(2, "bfloat16"), gqa(1, "float8_e4m3fn", "unit")).startswith(
        "KV dtype mismatch: the prefiller's pages are bfloat16 and the decoder's float8_e4m3fn")


def test_fp8_pages_under_other_scales_are_refused_by_name():
    why = incompatibility(gqa(1, "float8_e4m3fn", "sha256:00aa"), gqa(1, "float8_e4m3fn", "unit"))
    assert why == ("KV dtype mismatch: the prefiller's float8_e4m3fn pages have scales "
                   "sha256:00aa and the decoder's unit (the same checkpoint's k_scale / "
                   "v_scale on both sides)")


def test_a_layout_from_before_fp8_decodes_with_no_scales():
    old = msgspec.json.encode(gqa(1, "float32")).replace(b',"kv_scales":""', b"")
    assert b"kv_scales" not in old
    assert msgspec.json.decode(old, type=KVLayoutDesc).kv_scales == ""


def test_the_context_row_keeps_the_models_dtype_beside_fp8_pages():
    fp8 = msgspec.structs.replace(gqa(1, "float8_e4m3fn", "unit"), context_element_size=4)
    assert fp8.context_bytes == 8 * 4 and fp8.page_bytes == 2 * 4 * 4 * 8
    assert gqa(1, "float32").context_bytes == 8 * 4  # 0: the pages' element size
    other = msgspec.structs.replace(fp8, context_element_size=2)  # a bf16 model's FP8 pages
    assert incompatibility(fp8, other) == ("layout mismatch: prefiller context_element_size=4, "
                                           "decoder context_element_size=2")
