"""Load a local Hugging Face directory (single or sharded safetensors) into ``Transformer``.

Fused parameters: q/k/v projections become one ``qkv`` matrix and gate/up one ``gate_up``;
MoE experts' per-expert tensors (``mlp.experts.E.gate_proj``, ...) are stacked into
``[E, ...]`` parameters (the fused ``mlp.experts.gate_up_proj`` form is read too). Layers past
``num_hidden_layers`` (DeepSeek's multi-token-prediction layers) are skipped.
``random_weights`` fills the same parameters from a seed, so a model shape needs no files.
FP8 checkpoints (``disagg.model.fp8``: block-scaled, per-tensor, per-channel) are dequantized
tensor by tensor as they are read (weight-only), before TP sharding; a shard that would split
a scale block is refused.
"""

from __future__ import annotations

import json
import logging
import re
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch

from disagg.kernels.kv_quant import checkpoint_scale, scales_identity
from disagg.model.config import ModelArch
from disagg.model.ep import EP_NO_FP8, draw_experts, held_expert
from disagg.model.fp8 import (
    FP8_DTYPES,
    Fp8Error,
    Fp8Format,
    check_block_shard,
    check_scale,
    dequantize,
    quantizable,
    quantize_blocks,
    round_to_fp8,
    scale_names,
)
from disagg.model.fp8_weights import (
    Fp8Parts,
    allocate,
    fp8_gemm_device,
    install,
    materialize,
    packable,
    quantize_params,
    shard_fp8,
)
from disagg.model.tp import TensorParallel
from disagg.model.transformer import Transformer

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
# FP8 KV scales as vLLM-style checkpoints ship them (a scalar or one per kv head)
_KV_SCALE = re.compile(r"^model\.layers\.(\d+)\.self_attn\.(?:attn\.|k_proj\.|v_proj\.)?"
                       r"([kv])_scale$")
_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")
# HF name (inside a layer) -> (our parameter, slice index for fused params or None)
_LAYER_MAP = {
    "input_layernorm.weight": ("input_norm", None),
    "post_attention_layernorm.weight": ("post_norm", None),
    "self_attn.q_proj.weight": ("qkv_weight", 0),
    "self_attn.k_proj.weight": ("qkv_weight", 1),
    "self_attn.v_proj.weight": ("qkv_weight", 2),
    "self_attn.q_proj.bias": ("qkv_bias", 0),
    "self_attn.k_proj.bias": ("qkv_bias", 1),
    "self_attn.v_proj.bias": ("qkv_bias", 2),
    "self_attn.o_proj.weight": ("o_weight", None),
    "self_attn.q_norm.weight": ("q_norm", None),
    "self_attn.k_norm.weight": ("k_norm", None),
    "mlp.gate_proj.weight": ("gate_up_weight", 0),
    "mlp.up_proj.weight": ("gate_up_weight", 1),
    "mlp.down_proj.weight": ("down_weight", None),
}
# MLA attention and MoE MLP names -> (our parameter, fused part or None, TP split)
_MLA_MAP: dict[str, tuple[str, int | None, str]] = {
    "self_attn.q_proj.weight": ("mla.q_proj", None, "rows"),
    "self_attn.q_a_proj.weight": ("mla.q_a", None, "replicated"),
    "self_attn.q_a_layernorm.weight": ("mla.q_a_norm", None, "replicated"),
    "self_attn.q_b_proj.weight": ("mla.q_b", None, "rows"),
    "self_attn.kv_a_proj_with_mqa.weight": ("mla.kv_a", None, "replicated"),
    "self_attn.kv_a_layernorm.weight": ("mla.kv_a_norm", None, "replicated"),
    "self_attn.kv_b_proj.weight": ("mla.kv_b", None, "rows"),
    "self_attn.o_proj.weight": ("mla.o", None, "cols"),
}
_MOE_MAP: dict[str, tuple[str, int | None, str]] = {
    "mlp.gate.weight": ("moe.router", None, "replicated"),
    "mlp.gate.e_score_correction_bias": ("moe.correction_bias", None, "replicated"),
    "mlp.shared_expert_gate.weight": ("moe.shared_gate", None, "replicated"),
    "mlp.experts.gate_up_proj": ("moe.gate_up", None, "experts_gate_up"),
    "mlp.experts.down_proj": ("moe.down", None, "experts_down"),
}
for _prefix in ("mlp.shared_expert.", "mlp.shared_experts."):
    _MOE_MAP[_prefix + "gate_proj.weight"] = ("moe.shared_gate_up", 0, "rows")
    _MOE_MAP[_prefix + "up_proj.weight"] = ("moe.shared_gate_up", 1, "rows")
    _MOE_MAP[_prefix + "down_proj.weight"] = ("moe.shared_down", None, "cols")


def resolve_dtype(name: str, arch: ModelArch, device: torch.device) -> torch.dtype:
    """``auto`` = the checkpoint's dtype on CUDA, float32 on CPU."""
    if name == "auto":
        if device.type == "cpu":
            return torch.float32
        name = arch.torch_dtype if arch.torch_dtype in DTYPES else "bfloat16"
    return DTYPES[name]


def safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / n for n in names]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {path}")
    return files


def _fused_slices(arch: ModelArch) -> dict[str, list[tuple[int, int]]]:
    d = arch.head_dim
    q, kv = arch.num_heads * d, arch.num_kv_heads * d
    qkv = [(0, q), (q, q + kv), (q + kv, q + 2 * kv)]
    i = arch.intermediate_size
    out = {"qkv_weight": qkv, "qkv_bias": qkv, "gate_up_weight": [(0, i), (i, 2 * i)]}
    if arch.moe is not None:
        e, s = arch.moe.intermediate_size, arch.moe.shared_intermediate_size
        out["gate_up"] = [(0, e), (e, 2 * e)]
        out["shared_gate_up"] = [(0, s), (s, 2 * s)]
    return out


QUANTIZATIONS = ("auto", "fp8")  # --quantization
FP8_BLOCK = (128, 128)  # --quantization fp8 of unquantized weights


def load_model(
    path: str | Path, dtype: str = "auto", device: str | torch.device = "cpu",
    tp: TensorParallel | None = None, mtp: bool = False, quantization: str = "auto",
    fp8_gemm: bool | None = None,
) -> Transformer:
    """Load a checkpoint; under ``tp`` only this rank's slices (``disagg.model.tp``); with
    ``mtp`` its multi-token-prediction layer too (``disagg.model.mtp``). ``quantization``:
    ``auto`` reads the checkpoint as stored (FP8 ones dequantized); ``fp8`` also rounds an
    unquantized checkpoint's linear weights to the block format (128x128), as
    ``disagg-quantize`` would store them. ``fp8_gemm``: keep the dense layers' 128x128-block
    FP8 weights as FP8 (``disagg.model.fp8_weights``); None = where the device has FP8 tensor
    cores."""
    from safetensors import safe_open  # only here: random weights need no safetensors

    path = Path(path)
    tp = tp or TensorParallel()
    full = ModelArch.from_dir(path)
    arch = tp.local_arch(full)
    dev = torch.device(device)
    fp8 = Fp8Format.from_config(json.loads((path / "config.json").read_text()))
    online = fp8 is None and quantization == "fp8"
    if online:
        fp8 = Fp8Format("fp8", FP8_BLOCK)
    if fp8_gemm is None:
        fp8_gemm = fp8 is not None and fp8_gemm_device(dev)
        if fp8_gemm and fp8 is not None and fp8.block != FP8_BLOCK:
            log.warning("FP8 weights dequantized at load: the FP8 kernels take 128x128 blocks, "
                        "this checkpoint has %s", f"{fp8.block[0]}x{fp8.block[1]} blocks"
                        if fp8.block else "per-tensor / per-channel scales")
    keep = bool(fp8_gemm) and fp8 is not None and fp8.block == FP8_BLOCK
    if fp8 is not None and tp.ep is not None and tp.ep.size > 1:
        raise Fp8Error(EP_NO_FP8)
    # kept FP8: the packed parameters are never allocated in the model's dtype (a checkpoint
    # larger than its dequantized size fits loads), the rest is allocated on ``dev``
    model = Transformer(arch, resolve_dtype(dtype, arch, dev),
                        torch.device("meta") if keep else dev, tp, mtp=mtp)
    if keep:
        materialize(model, dev, lambda n: packable(n, None))
    slices = _fused_slices(arch)
    expected = {name for name, _ in model.named_parameters()}
    seen: set[str] = set()
    fused_parts: dict[str, int] = {}
    kv_scales: dict[tuple[int, str], torch.Tensor] = {}  # (layer, k|v) -> global [heads]
    dequantized = kept = 0
    parts = Fp8Parts() if keep else None

    def keep_fp8(target: Target, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """Keep this rank's shard of FP8 ``q`` and its scales; returns the shard."""
        assert parts is not None
        param_name, expert, part, kind = target
        split = (q.dim() - 2 if kind in _ROW_KINDS else q.dim() - 1 if kind in _COL_KINDS
                 else None)
        qs, ss = shard_fp8(q, scale, kind, split, lambda k, t: _shard(tp, k, t, full))
        parts.add(param_name, part, qs, ss, expert)
        return qs

    with ExitStack() as stack:
        files = {file: stack.enter_context(safe_open(str(file), framework="pt", device="cpu"))
                 for file in safetensors_files(path)}
        where = {name: f for f in files.values() for name in f.keys()}  # noqa: SIM118
        for file, f in files.items():
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                if _read_kv_scale(name, f, full, kv_scales):
                    continue
                target = held_expert(tp.ep, full, _target(name, arch, mtp))  # EP: this rank's
                if target is None:
                    log.debug("skipping tensor %s", name)
                    continue
                param_name, expert, part, kind = target
                param = model.get_parameter(param_name)
                raw = f.get_tensor(name)
                if param.is_meta and raw.dtype == torch.float8_e4m3fn:  # kept as stored
                    scale = _fp8_scale(name, raw, where, fp8, tp, kind, full)
                    tensor = keep_fp8(target, raw, scale)
                    kept += 1
                elif param.is_meta and online and quantizable(name, raw):
                    _check_blocks(name, raw, FP8_BLOCK, tp, kind, full)
                    tensor = keep_fp8(target, *quantize_blocks(raw.to(torch.float32), FP8_BLOCK))
                    kept += 1
                else:
                    if param.is_meta:  # a part stored unquantized: this one is dequantized
                        param = allocate(model, param_name, dev)
                    if raw.dtype in FP8_DTYPES:
                        raw = _dequantized(name, raw, where, fp8, tp, kind, full)
                        dequantized += 1
                    elif online and quantizable(name, raw):
                        _check_blocks(name, raw, FP8_BLOCK, tp, kind, full)
                        raw = round_to_fp8(raw.to(torch.float32), FP8_BLOCK)
                        dequantized += 1
                    tensor = _shard(tp, kind, raw, full)
                dst = param.data if expert is None else param.data[expert]
                if part is not None:
                    lo, hi = slices[param_name.rsplit(".", 1)[-1]][part]
                    dst = dst[lo:hi]
                    fused_parts[param_name] = fused_parts.get(param_name, 0) + 1
                if tuple(dst.shape) != tuple(tensor.shape):
                    raise ValueError(
                        f"{file.name}:{name} has shape {tuple(tensor.shape)}, expected {tuple(dst.shape)}"
                    )
                if not dst.is_meta:
                    dst.copy_(tensor.to(dst.dtype))
                seen.add(param_name)
    if kv_scales:
        _set_kv_scales(model, kv_scales, full, tp)
    if model.lm_head is None:
        expected.discard("lm_head")
    missing = sorted(expected - seen)
    if missing:
        raise ValueError(f"checkpoint in {path} lacks tensors for: {', '.join(missing[:8])}")
    for param_name, count in fused_parts.items():
        want = len(slices[param_name.rsplit(".", 1)[-1]])
        if param_name.endswith(".gate_up"):  # every expert's gate and up
            want *= model.get_parameter(param_name).shape[0]
        if count != want:
            raise ValueError(f"checkpoint in {path}: {param_name} got {count} of {want} parts")
    if fp8 is not None:
        blocks = f"{fp8.block[0]}x{fp8.block[1]} blocks" if fp8.block else "tensor/channel scales"
        if parts is not None:
            packed = parts.weights(
                lambda n: len(slices.get(n.rsplit(".", 1)[-1], [(0, 0)])),
                lambda n: (model.get_parameter(n).shape[0] if model.get_parameter(n).dim() == 3
                           else None))
            unpacked = _fill_unpacked(model, parts, packed, slices, dev)
            saved = install(model, packed, dev)
            log.info("FP8 checkpoint (%s, %s): %d weights kept as FP8 for the FP8 kernels "
                     "(%.2f GiB less than %s), %d dequantized", fp8.method, blocks, len(packed),
                     saved / 2**30, str(model.dtype).removeprefix("torch."),
                     dequantized + unpacked)
        else:
            log.info("FP8 checkpoint (%s, %s): %d weights dequantized to %s at load "
                     "(weight-only)", fp8.method, blocks, dequantized,
                     str(model.dtype).removeprefix("torch."))
    still = [n for n, p in model.named_parameters() if p.is_meta]
    if still:
        raise ValueError(f"checkpoint in {path}: nothing loaded {', '.join(still[:8])}")
    return model


def _fill_unpacked(model: Transformer, parts: Fp8Parts, packed: dict, slices: dict,
                   dev: torch.device) -> int:
    """Dequantize into their parameters the kept FP8 parts of parameters that could not be
    assembled (a part stored unquantized, a fused part ending inside a block); returns how
    many parts."""
    count = 0
    for name, entries in parts.items():
        if name in packed:
            continue
        param = model.get_parameter(name)
        if param.is_meta:
            param = allocate(model, name, dev)
        short = name.rsplit(".", 1)[-1]
        for (expert, part), (q, s) in entries.items():
            dst = param.data if expert < 0 else param.data[expert]
            if short in slices and dst.dim() == 2:  # a fused part's rows
                lo, hi = slices[short][part]
                dst = dst[lo:hi]
            dst.copy_(dequantize(name, q, s, FP8_BLOCK).to(dst.dtype))
            count += 1
    return count


def _read_kv_scale(name: str, f: Any, arch: ModelArch,
                   out: dict[tuple[int, str], torch.Tensor]) -> bool:
    """Whether ``name`` is a layer's ``k_scale`` / ``v_scale`` (read into ``out``, refused by
    name when mis-shaped); those of layers past the model's (MTP) are skipped."""
    m = _KV_SCALE.match(name)
    if m is None:
        return False
    layer = int(m.group(1))
    if layer < arch.num_layers:
        heads = 1 if arch.mla is not None else arch.num_kv_heads
        out[(layer, m.group(2))] = checkpoint_scale(name, f.get_tensor(name), heads)
    return True


def _set_kv_scales(model: Transformer, scales: dict[tuple[int, str], torch.Tensor],
                   arch: ModelArch, tp: TensorParallel) -> None:
    """Give each layer its FP8 KV scales (this rank's kv heads; MLA: the latent's, from
    ``k_scale``) and the model their identity over every layer and head."""
    pairs = []
    heads = 1 if arch.mla is not None else arch.num_kv_heads
    local = range(1) if arch.mla is not None else tp.kv_heads(arch)
    for i, layer in enumerate(model.layers):
        assert isinstance(layer.k_scale, torch.Tensor) and isinstance(layer.v_scale, torch.Tensor)
        k = scales.get((i, "k"), torch.ones(heads))
        v = k if arch.mla is not None else scales.get((i, "v"), torch.ones(heads))
        pairs.append((k, v))
        layer.k_scale.copy_(k[local.start:local.stop])
        layer.v_scale.copy_(v[local.start:local.stop])
    model.kv_scales_id = scales_identity(pairs)
    log.info("FP8 KV scales from the checkpoint (%d tensors): %s", len(scales),
             model.kv_scales_id)


_ROW_KINDS = ("q", "k", "v", "gate", "up", "rows", "experts_gate_up")  # split the output dim
_COL_KINDS = ("o", "down", "cols", "experts_down")  # split the input dim


def _dequantized(name: str, w: torch.Tensor, where: dict, fp8: Fp8Format | None,
                 tp: TensorParallel, kind: str, arch: ModelArch) -> torch.Tensor:
    """The float32 weights of FP8 tensor ``name``."""
    scale = _fp8_scale(name, w, where, fp8, tp, kind, arch)
    assert fp8 is not None
    return dequantize(name, w, scale, fp8.block)


def _fp8_scale(name: str, w: torch.Tensor, where: dict, fp8: Fp8Format | None,
               tp: TensorParallel, kind: str, arch: ModelArch) -> torch.Tensor:
    """The scales of FP8 tensor ``name`` (read from whichever file holds them), checked
    against its shape; under TP, first refuse a shard that would split one of its blocks."""
    if fp8 is None:
        raise Fp8Error(f"{name} is {str(w.dtype).removeprefix('torch.')} but config.json has "
                       "no quantization_config: its scales cannot be interpreted")
    scale_name = next((n for n in scale_names(name) if n in where), None)
    if scale_name is None:
        raise Fp8Error(f"{name} is FP8 but the checkpoint has no {scale_names(name)[0]} "
                       f"(or {scale_names(name)[1]})")
    if fp8.block is not None:
        _check_blocks(name, w, fp8.block, tp, kind, arch)
    scale = where[scale_name].get_tensor(scale_name)
    check_scale(name, w, scale, fp8.block)
    return scale


def _check_blocks(name: str, w: torch.Tensor, block: tuple[int, int], tp: TensorParallel,
                  kind: str, arch: ModelArch) -> None:
    """Refuse a TP shard of ``name`` that would keep part of one of its scale blocks."""
    if tp.size > 1 and kind in _ROW_KINDS + _COL_KINDS:
        dim = w.dim() - (2 if kind in _ROW_KINDS else 1)
        shape = [1] * w.dim()
        shape[dim] = w.shape[dim]
        kept = _shard(tp, kind, torch.arange(w.shape[dim]).reshape(shape), arch).flatten()
        check_block_shard(name, kept, w.shape[dim], block[dim - w.dim() + 2], tp.size)


_SHARD_KINDS = {"q_proj": "q", "k_proj": "k", "v_proj": "v", "o_proj": "o", "gate_proj": "gate",
                "up_proj": "up", "down_proj": "down"}


def _shard_kind(name: str) -> str:
    """How a checkpoint tensor is split under TP (see ``TensorParallel.shard``)."""
    parts = name.split(".")
    return _SHARD_KINDS.get(parts[-2], "replicated") if len(parts) >= 2 else "replicated"


def _shard(tp: TensorParallel, kind: str, tensor: torch.Tensor, arch: ModelArch) -> torch.Tensor:
    """This rank's slice; fused ``[E, ...]`` expert tensors split each expert's intermediate
    dimension (gate and up halves alike), or under expert parallelism keep this rank's
    experts whole (``ep_experts``)."""
    if kind == "ep_experts":
        assert tp.ep is not None and arch.moe is not None
        return tp.ep.held(tensor, arch.moe.num_experts)
    if tp.size == 1 or kind not in ("experts_gate_up", "experts_down"):
        return tp.shard(kind, tensor, arch)
    if kind == "experts_down":
        return tensor.chunk(tp.size, dim=2)[tp.rank]
    e, two_i, h = tensor.shape
    halves = tensor.view(e, 2, two_i // 2, h).chunk(tp.size, dim=2)[tp.rank]
    return halves.reshape(e, -1, h)


Target = tuple[str, int | None, int | None, str]  # parameter, expert, fused part, TP split


_MTP_MAP = {"enorm.weight": "mtp.enorm", "hnorm.weight": "mtp.hnorm",
            "eh_proj.weight": "mtp.eh_proj", "shared_head.norm.weight": "mtp.head_norm"}


def _target(name: str, arch: ModelArch, mtp: bool = False) -> Target | None:
    if name == "model.embed_tokens.weight":
        return ("embed", None, None, "replicated")
    if name == "model.norm.weight":
        return ("norm", None, None, "replicated")
    if name == "lm_head.weight":
        return None if arch.tie_word_embeddings else ("lm_head", None, None, "replicated")
    m = _LAYER.match(name)
    if m is None:
        return None
    index, rest = int(m.group(1)), m.group(2)
    layer = f"layers.{index}"
    if index == arch.num_layers and mtp:  # the multi-token-prediction layer
        if rest in _MTP_MAP:
            return (_MTP_MAP[rest], None, None, "replicated")
        if rest.startswith(("shared_head.", "embed_tokens.")):
            return None  # copies of the main model's head and embedding
        layer, index = "mtp.block", index - 1  # a layer like the last one
    elif index >= arch.num_layers:
        return None
    sparse = arch.moe is not None and arch.moe.sparse_layers[index]
    if arch.mla is not None and rest in _MLA_MAP:
        param, part, kind = _MLA_MAP[rest]
        return (f"{layer}.{param}", None, part, kind)
    if sparse:
        e = _EXPERT.match(rest)
        if e is not None:
            which = e.group(2)
            return (f"{layer}.moe.{'down' if which == 'down' else 'gate_up'}", int(e.group(1)),
                    None if which == "down" else (0 if which == "gate" else 1),
                    "cols" if which == "down" else "rows")
        if rest in _MOE_MAP:
            param, part, kind = _MOE_MAP[rest]
            return (f"{layer}.{param}", None, part, kind)
    entry = _LAYER_MAP.get(rest)
    if entry is None:
        return None
    return (f"{layer}.{entry[0]}", None, entry[1], _shard_kind(name))


def random_model(
    arch: ModelArch, dtype: str = "auto", device: str | torch.device = "cpu", seed: int = 0,
    tp: TensorParallel | None = None, mtp: bool = False, fp8: Fp8Format | None = None,
    fp8_gemm: bool | None = None,
) -> Transformer:
    """A model with weights drawn from ``seed`` directly on ``device`` (no files needed);
    under ``tp`` each rank draws its own shard (shapes and speed, not a given function).
    ``fp8``: its linear weights rounded to that FP8 format (blocks of each local parameter;
    per tensor without a block size), as an FP8 checkpoint of the shape would hold them;
    ``fp8_gemm`` as ``load_model``'s (128x128 blocks kept as FP8)."""
    dev = torch.device(device)
    tp = tp or TensorParallel()
    local = tp.local_arch(arch)
    model = Transformer(local, resolve_dtype(dtype, local, dev), dev, tp, mtp=mtp)
    gen = torch.Generator(device=dev).manual_seed(seed)
    for name, param in model.named_parameters():
        if name.endswith("norm") or name == "norm":
            param.data.fill_(1.0)
        elif name.endswith("correction_bias"):
            param.data.zero_()
        else:
            if name.endswith((".moe.gate_up", ".moe.down")):  # as EP ranks draw them
                draw_experts(param.data, name, seed, tp.ep, local.moe)
            else:
                param.data.normal_(0.0, 0.02, generator=gen)
            if fp8 is not None and _fp8_param(name, param):
                param.data.copy_(round_to_fp8(param.data, fp8.block))
    if fp8 is not None and fp8.block == FP8_BLOCK:
        if fp8_gemm is None:
            fp8_gemm = fp8_gemm_device(dev)
        if fp8_gemm:
            saved = install(model, quantize_params(model), dev)
            log.info("random FP8 weights: dense layers kept as FP8 (%.2f GiB less)",
                     saved / 2**30)
    return model


def _fp8_param(name: str, param: torch.Tensor) -> bool:
    """A parameter an FP8 checkpoint stores as FP8: a linear weight of a layer (not a router
    or a shared expert's gate, which stay as stored)."""
    return (name.startswith(("layers.", "mtp.")) and param.dim() >= 2
            and not name.endswith(("router", "shared_gate")))
