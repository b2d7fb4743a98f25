"""FP8 checkpoints: the formats read, block quantization and its inverse (torch only, no files).

Read (``quantization_config`` in ``config.json``):

- ``quant_method: fp8`` with ``weight_block_size: [bn, bk]`` (DeepSeek-V3/R1, the Qwen3 FP8
  releases): each quantized linear weight is ``float8_e4m3fn`` with a float32
  ``<name>_scale_inv`` of one scale per ``bn x bk`` block (edge blocks partial), and
  ``w = w_fp8 * scale`` block by block; activations are quantized dynamically at run time.
- ``quant_method: fp8`` without a block size, and ``fbgemm_fp8``: a ``<name>_scale`` (or
  ``_scale_inv``) per tensor (one value) or per output channel (``[rows]`` / ``[rows, 1]``).

Tensors the checkpoint left unquantized (embeddings, ``lm_head``, norms, router gates, anything
in ``modules_to_not_convert``) are not FP8 and load as stored. A method or element format not
listed here is refused by name rather than read as plain weights (which serves wrong tokens).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
E4M3_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448
METHODS = ("fp8", "fbgemm_fp8")


class Fp8Error(ValueError):
    """An FP8 checkpoint this loader cannot read as stored (named tensor, shape or setting)."""


@dataclass(frozen=True)
class Fp8Format:
    method: str  # one of METHODS
    block: tuple[int, int] | None  # (rows, cols) of a scale's block; None: tensor / channel
    not_converted: tuple[str, ...] = ()  # modules the checkpoint keeps unquantized

    @staticmethod
    def from_config(cfg: dict[str, Any]) -> Fp8Format | None:
        """The FP8 format of a ``config.json`` (None: not quantized); other quantization
        methods, element formats and block shapes are refused by name."""
        q = cfg.get("quantization_config")
        if q is None:
            return None
        if not isinstance(q, dict):
            raise Fp8Error(f"quantization_config must be an object, got {type(q).__name__}")
        method = str(q.get("quant_method", "")).lower()
        if method not in METHODS:
            raise Fp8Error(f"quantization_config.quant_method {method!r} is not supported "
                           f"(read: {', '.join(METHODS)}); dequantize the checkpoint first")
        fmt = str(q.get("fmt", "e4m3")).lower()
        if fmt != "e4m3":
            raise Fp8Error(f"quantization_config.fmt {fmt!r} is not supported (read: e4m3)")
        scale_fmt = str(q.get("scale_fmt") or "float").lower()
        if scale_fmt != "float":
            raise Fp8Error(f"quantization_config.scale_fmt {scale_fmt!r} is not supported "
                           "(read: float32 scales)")
        block = q.get("weight_block_size")
        if block is not None:
            if (not isinstance(block, (list, tuple)) or len(block) != 2
                    or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0
                               for b in block)):
                raise Fp8Error("quantization_config.weight_block_size must be two positive "
                               f"integers, got {block!r}")
            block = (int(block[0]), int(block[1]))
        skip = q.get("modules_to_not_convert") or q.get("ignored_layers") or []
        return Fp8Format(method, block, tuple(str(s) for s in skip))

    def config(self) -> dict[str, Any]:
        """The ``quantization_config`` that describes this format (as the quantizer writes)."""
        out: dict[str, Any] = {"quant_method": self.method, "fmt": "e4m3",
                               "activation_scheme": "dynamic"}
        if self.block is not None:
            out["weight_block_size"] = list(self.block)
        if self.not_converted:
            out["modules_to_not_convert"] = list(self.not_converted)
        return out


_FUSED_EXPERTS = (".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")


def quantizable(name: str, tensor: torch.Tensor, skip: tuple[str, ...] = ()) -> bool:
    """Whether the quantizer stores ``name`` as FP8: a linear weight of a decoder layer."""
    if not name.startswith("model.layers.") or tensor.dim() < 2:
        return False
    if not tensor.is_floating_point() or any(s in name for s in skip):
        return False
    return name.endswith(("proj.weight", "proj_with_mqa.weight", *_FUSED_EXPERTS))


def scale_names(name: str) -> tuple[str, str]:
    """Where a weight's scale is stored: ``x.weight`` -> ``x.weight_scale_inv`` (block
    format; fused experts ``x.gate_up_proj`` -> ``x.gate_up_proj_scale_inv``), then the
    per-tensor / per-channel ``..._scale``."""
    return f"{name}_scale_inv", f"{name}_scale"


def is_scale(name: str) -> bool:
    return name.endswith(("_scale_inv", "weight_scale", "proj_scale", "input_scale"))


def block_grid(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, ...]:
    """The scale tensor's shape for a weight of ``shape`` (blocks over its last two dims)."""
    *lead, r, c = shape
    return (*lead, -(-r // block[0]), -(-c // block[1]))


def check_scale(name: str, w: torch.Tensor, scale: torch.Tensor,
                block: tuple[int, int] | None) -> None:
    """Refuse by name a scale whose shape does not fit ``w`` in ``block``s (None: one per
    tensor or per output channel); what ``dequantize`` checks, without dequantizing."""
    if w.dim() < 2:
        raise Fp8Error(f"{name}: an FP8 weight must have at least 2 dims, got {tuple(w.shape)}")
    if scale.numel() == 1:
        return
    if block is not None:
        want = block_grid(tuple(w.shape), block)
        if tuple(scale.shape) != want:
            raise Fp8Error(f"{name}: its scale has shape {tuple(scale.shape)}, expected {want} "
                           f"for {tuple(w.shape)} in {block[0]}x{block[1]} blocks")
    elif tuple(scale.shape) not in ((w.shape[-2],), (w.shape[-2], 1)):
        raise Fp8Error(f"{name}: its scale has shape {tuple(scale.shape)}; expected one value, "
                       f"[{w.shape[-2]}] or [{w.shape[-2]}, 1] (per tensor or per channel)")
    if not torch.isfinite(scale.to(torch.float32)).all():
        raise Fp8Error(f"{name}: its scales are not finite")


def dequantize(name: str, w: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``w`` (FP8) times its scales, in ``dtype`` (computed in float32). ``block``: the
    checkpoint's block shape; None: one scale per tensor or per output channel (rows)."""
    if w.dtype not in FP8_DTYPES:
        raise Fp8Error(f"{name}: expected an FP8 tensor, got {w.dtype}")
    if w.dim() < 2:
        raise Fp8Error(f"{name}: an FP8 weight must have at least 2 dims, got {tuple(w.shape)}")
    s = scale.to(torch.float32)
    x = w.to(torch.float32)
    if block is not None and s.numel() != 1:
        want = block_grid(tuple(w.shape), block)
        if tuple(s.shape) != want:
            raise Fp8Error(f"{name}: its scale has shape {tuple(s.shape)}, expected {want} "
                           f"for {tuple(w.shape)} in {block[0]}x{block[1]} blocks")
        r, c = w.shape[-2:]
        s = s.repeat_interleave(block[0], dim=-2)[..., :r, :]
        s = s.repeat_interleave(block[1], dim=-1)[..., :c]
    elif s.numel() == 1:
        s = s.reshape(())
    elif tuple(s.shape) in ((w.shape[-2],), (w.shape[-2], 1)):
        s = s.reshape(w.shape[-2], 1)
    else:
        raise Fp8Error(f"{name}: its scale has shape {tuple(s.shape)}; expected one value, "
                       f"[{w.shape[-2]}] or [{w.shape[-2]}, 1] (per tensor or per channel)")
    out = x * s
    if not torch.isfinite(out).all():
        raise Fp8Error(f"{name}: dequantized weights are not finite (NaN in the FP8 data or "
                       "its scales)")
    return out.to(dtype)


def quantize_blocks(w: torch.Tensor, block: tuple[int, int]
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` as ``float8_e4m3fn`` and its float32 block scales (``w ~ q * scale``), each
    block's scale its largest magnitude over 448 (1 for an all-zero block)."""
    x = w.to(torch.float32)
    *lead, r, c = x.shape
    gr, gc = block_grid(tuple(x.shape), block)[-2:]
    padded = torch.zeros(*lead, gr * block[0], gc * block[1], dtype=torch.float32,
                         device=x.device)
    padded[..., :r, :c] = x
    tiles = padded.reshape(*lead, gr, block[0], gc, block[1])
    amax = tiles.abs().amax(dim=(-3, -1))  # [..., gr, gc]
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    q = (tiles / scale[..., :, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX)
    q = q.reshape(*lead, gr * block[0], gc * block[1])[..., :r, :c]
    return q.to(torch.float8_e4m3fn).contiguous(), scale.contiguous()


def round_to_fp8(w: torch.Tensor, block: tuple[int, int] | None) -> torch.Tensor:
    """``w`` as the block format stores it (quantized, then dequantized back to its dtype):
    ``--quantization fp8`` on unquantized weights. ``block`` None: one scale for the tensor."""
    b = block or tuple(w.shape[-2:])
    q, s = quantize_blocks(w, (b[0], b[1]))
    return dequantize("w", q, s, (b[0], b[1]), w.dtype)


def check_block_shard(name: str, kept: torch.Tensor, size: int, block: int, tp: int) -> None:
    """Refuse a TP shard that keeps part of a ``block``-wide run of a blocked dimension:
    ``kept`` are the indices (of ``size``) this rank takes along it, in order."""
    if kept.numel() == size:
        return
    idx = kept.tolist()
    start = prev = idx[0]
    for i in [*idx[1:], None]:
        if i is not None and i == prev + 1:
            prev = i
            continue
        end = prev + 1
        if start % block or (end % block and end != size):
            raise Fp8Error(f"{name}: --tp {tp} splits its {block}-wide FP8 scale blocks (a "
                           f"shard keeps {start}..{end - 1} of {size}); use a TP size whose "
                           "shards hold whole blocks")
        if i is not None:
            start = prev = i
