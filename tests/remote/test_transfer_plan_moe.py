"""MoE models between peers: expert placement never crosses a prefill/decode pair (only KV
pages and hidden rows do), so each side shards its experts as its own --tp / --dp /
--expert-parallel say; but two MoE models of the same attention shape make pages of the same
shape from different weights and routing, so the layouts carry the MoE
(``KVLayoutDesc.moe``, ``ModelArch.moe_shape``) and a pair whose MoE differs is refused by
name at first contact (the decoder's Pong check, the prefiller's request check)."""

from __future__ import annotations

from types import SimpleNamespace

import msgspec
import pytest

from disagg.model.config import ModelArch
from disagg.protocol.peer import KVLayoutDesc, PrefillRequest
from disagg.remote.prefillers import PrefillerTable
from disagg.remote.requests import request_problem
from disagg.remote.transfer_plan import incompatibility


def qwen3_moe(**overrides) -> ModelArch:
    cfg = dict(architectures=["Qwen3MoeForCausalLM"], vocab_size=320, hidden_size=64,
               intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
               moe_intermediate_size=32, norm_topk_prob=True)
    return ModelArch.from_hf_config({**cfg, **overrides})


def layout(arch: ModelArch, tp: int = 1, dp: int = 1) -> KVLayoutDesc:
    """The layout a node of ``arch`` advertises (``Node._layout``: one DP rank's)."""
    from disagg.node import Node

    node = object.__new__(Node)
    kv = SimpleNamespace(dtype="float32", model_dtype="", spec_shape=None, kv_scales="")
    node.executors = SimpleNamespace(ready=[SimpleNamespace(kv=kv)], num_pages=64)
    node.cfg = SimpleNamespace(devices=["cpu"] * tp * dp, executor=SimpleNamespace(dp=dp),
                               cache=SimpleNamespace(page_size=4),
                               scheduler=SimpleNamespace(speculative_method=None))
    return node._layout(arch)


def test_a_node_advertises_its_moe_and_not_where_its_experts_lie():
    arch = qwen3_moe()
    assert arch.moe_shape == ("8 experts top 2 (softmax, normalized), 32 wide, shared 0, "
                              "sparse layers 0-1")
    assert layout(arch).moe == arch.moe_shape
    # --tp 2 (the experts' MLPs split) or --dp 2 (with --expert-parallel: 4 experts a rank)
    # against TP 1: the same MoE, compatible
    assert layout(arch, tp=2).moe == layout(arch, dp=2).moe == arch.moe_shape
    for src, dst in ((layout(arch, tp=2), layout(arch, dp=2)),
                     (layout(arch, dp=2), layout(arch, tp=2))):
        assert incompatibility(src, dst) is None
    dense = ModelArch.from_hf_config(dict(
        architectures=["Qwen3ForCausalLM"], vocab_size=320, hidden_size=64,
        intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16))
    assert dense.moe_shape == "" and layout(dense).moe == ""


@pytest.mark.parametrize("change, what", [
    (dict(num_experts=16), "16 experts top 2"),
    (dict(num_experts_per_tok=4), "8 experts top 4"),
    (dict(moe_intermediate_size=48), "48 wide"),
    (dict(norm_topk_prob=False), "(softmax),"),
    (dict(mlp_only_layers=[0]), "sparse layers 1"),
])
def test_a_pair_of_other_moes_of_one_attention_shape_is_refused_by_name(change, what):
    ours, theirs = layout(qwen3_moe(), dp=2), layout(qwen3_moe(**change), tp=2)
    # every field of the pages' shape agrees: only the MoE tells the models apart
    assert msgspec.structs.replace(theirs, moe=ours.moe, tp_size=1, num_kv_heads=2) == ours
    why = incompatibility(theirs, ours)
    assert why == (f"MoE mismatch: the prefiller serves {theirs.moe} and the decoder "
                   f"{ours.moe} (only KV pages and hidden rows cross the pair, never experts: "
                   "both sides must serve the same model)")
    assert what in theirs.moe and what not in ours.moe
    # first contact, decoder side: its Pong is refused, the prefiller never counted alive
    table = PrefillerTable(ours, "fabric/tcp", peer_timeout_s=5.0)
    table.add("tcp://p:1")
    assert table.pong("tcp://p:1", 0.1, 0, theirs, "fabric/tcp") == why
    assert table.alive_count() == 0
    # and prefiller side: a request from such a decoder is refused before any write
    req = PrefillRequest("0.1", 1, [1, 2, 3], [0], ours, b"", b"", 0, 5.0)
    assert request_problem(theirs, 320, req) == incompatibility(theirs, ours)


def test_a_dense_model_and_a_moe_of_one_attention_shape_are_refused_by_name():
    dense = msgspec.structs.replace(layout(qwen3_moe()), moe="")
    why = incompatibility(dense, layout(qwen3_moe()))
    assert why is not None and why.startswith(
        "MoE mismatch: the prefiller serves a dense model and the decoder 8 experts top 2")


def test_a_layout_from_before_the_moe_field_decodes_as_dense():
    old = msgspec.json.encode(layout(qwen3_moe())).replace(
        b',"moe":"' + qwen3_moe().moe_shape.encode() + b'"', b"")
    assert b"moe" not in old
    assert msgspec.json.decode(old, type=KVLayoutDesc).moe == ""
