"""The GPU path of block-FP8 checkpoints: the dense layers' linear weights kept as FP8 with
their 128x128 block scales (``Fp8Weight``) instead of dequantized, so that they take half
bf16's memory and run the FP8 kernels (``disagg.kernels.fp8_gemm``).

Kept as FP8: each decoder layer's ``qkv_weight``, ``o_weight``, ``gate_up_weight`` and
``down_weight`` (``PACKED``) whose every part the checkpoint stores in 128x128 blocks (the fused
q/k/v and gate/up parts are stacked by rows, so every part but the last must hold whole blocks
of rows). Everything else (embeddings, ``lm_head``, norms, MLA projections, MoE experts and
routers) stays dequantized in the model's dtype. ``fp8_gemm_device`` says where this applies:
CUDA with FP8 tensor cores (compute capability 8.9+); elsewhere the checkpoint is dequantized at
load as before, and a GPU without them says so once in the log.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from disagg.kernels.fp8_weight import BLOCK, Fp8Weight
from disagg.model.fp8 import quantize_blocks

log = logging.getLogger(__name__)

PACKED = ("qkv_weight", "o_weight", "gate_up_weight", "down_weight")
# MLA's projections (not kv_b: its halves are absorbed into the attention) and shared experts
PACKED_MLA_MOE = ("mla.q_a", "mla.q_b", "mla.q_proj", "mla.kv_a", "mla.o",
                  "moe.shared_gate_up", "moe.shared_down")
EXPERTS = ("moe.gate_up", "moe.down")  # [E, 2I, H] / [E, H, I]: the fused MoE kernel's
Shard = Callable[[str, torch.Tensor], torch.Tensor]  # (TP kind, tensor) -> this rank's slice


def fp8_gemm_device(device: torch.device) -> bool:
    """Whether block-FP8 weights stay FP8 on ``device``: CUDA with compute capability 8.9+."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    cap = torch.cuda.get_device_capability(device)
    if cap < (8, 9):
        log.warning("FP8 weights dequantized at load: this GPU (compute capability %d.%d) has "
                    "no FP8 tensor cores (8.9+)", *cap)
        return False
    return True


def packable(param_name: str, expert: int | None) -> bool:
    """Whether the loader keeps this parameter's FP8 parts (a dense layer's linear weight)."""
    if not param_name.startswith("layers."):
        return False
    if param_name.endswith(EXPERTS):
        return True
    return expert is None and (param_name.rsplit(".", 1)[-1] in PACKED
                               or param_name.endswith(PACKED_MLA_MOE))


def shard_fp8(q: torch.Tensor, scale: torch.Tensor, kind: str, split_dim: int | None,
              shard: Shard) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's slice of an FP8 weight ``q [N, K]`` and of its block scales: ``shard``
    slices ``q`` (as bytes) and a per-element expansion of the scales along ``split_dim``
    (None: replicated), whose every 128th entry is then the shard's block scale (the loader
    has already refused a shard that splits a block)."""
    qs = shard(kind, q.view(torch.uint8)).contiguous().view(torch.float8_e4m3fn)
    if split_dim is None or qs.shape == q.shape:
        return qs, scale.contiguous()
    full = scale.repeat_interleave(BLOCK, dim=split_dim).narrow(split_dim, 0, q.shape[split_dim])
    part = shard(kind, full)
    keep = torch.arange(0, part.shape[split_dim], BLOCK)
    return qs, part.index_select(split_dim, keep).contiguous()


class Fp8Parts:
    """The FP8 parts of the packed parameters as the loader reads them: ``add`` each
    checkpoint tensor's (sharded) FP8 data and scales, ``weights`` assembles the parameters
    whose every part arrived in whole blocks."""

    def __init__(self) -> None:
        # param -> (expert or -1, part) -> (q, scale)
        self._parts: dict[str, dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]]] = {}

    def add(self, param_name: str, part: int | None, q: torch.Tensor, scale: torch.Tensor,
            expert: int | None = None) -> None:
        key = (-1 if expert is None else expert, 0 if part is None else part)
        self._parts.setdefault(param_name, {})[key] = (q, scale)

    def weights(self, parts_of: Callable[[str], int],
                experts_of: Callable[[str], int | None] = lambda _n: None
                ) -> dict[str, Fp8Weight]:
        """``param name -> Fp8Weight`` for each parameter with all ``parts_of(name)`` parts
        (stacked by rows; experts, ``experts_of(name)`` of them, stacked in front, or one
        ``[E, ...]`` tensor as the fused checkpoint form stores them); a parameter with a part
        missing (stored unquantized) or a part before the last that ends inside a block of
        rows stays dequantized."""
        out: dict[str, Fp8Weight] = {}
        for name, parts in self._parts.items():
            n, e = parts_of(name), experts_of(name)
            if e is not None and list(parts) == [(-1, 0)]:  # [E, rows, K] as stored
                out[name] = Fp8Weight(*(t.contiguous() for t in parts[(-1, 0)]))
                continue
            maybe = [self._stacked(name, parts, x, n) for x in ([-1] if e is None else range(e))]
            rows = [r for r in maybe if r is not None]
            if len(rows) < len(maybe):
                continue
            if e is None:
                out[name] = rows[0]
            else:
                out[name] = Fp8Weight(
                    torch.stack([r.q.view(torch.uint8) for r in rows]).view(torch.float8_e4m3fn),
                    torch.stack([r.scale_inv for r in rows]))
        return out

    def items(self) -> list[tuple[str, dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]]]]:
        """``(param name, {(expert or -1, part): (q, scale)})`` as added."""
        return list(self._parts.items())

    @staticmethod
    def _stacked(name: str, parts: dict, expert: int, n: int) -> Fp8Weight | None:
        if any((expert, i) not in parts for i in range(n)):
            log.info("%s: not every part is FP8; kept dequantized", name)
            return None
        ordered: list[tuple[torch.Tensor, torch.Tensor]] = [parts[(expert, i)]
                                                            for i in range(n)]
        if any(q.shape[-2] % BLOCK for q, _ in ordered[:-1]):
            log.info("%s: a fused part ends inside a %d-row block; kept dequantized",
                     name, BLOCK)
            return None
        q = torch.cat([q.view(torch.uint8) for q, _ in ordered]).view(torch.float8_e4m3fn)
        s = torch.cat([s.to(torch.float32) for _, s in ordered])
        return Fp8Weight(q.contiguous(), s.contiguous())


def allocate(model: torch.nn.Module, name: str, device: torch.device) -> torch.nn.Parameter:
    """Parameter ``name`` (on the meta device) replaced by an uninitialized one on ``device``
    of its shape and dtype; returns it."""
    owner_name, _, attr = name.rpartition(".")
    owner = model.get_submodule(owner_name)
    old = getattr(owner, attr)
    new = torch.nn.Parameter(torch.empty(old.shape, dtype=old.dtype, device=device),
                             requires_grad=False)
    setattr(owner, attr, new)
    return new


def materialize(model: torch.nn.Module, device: torch.device,
                keep_meta: Callable[[str], bool]) -> None:
    """A model built on the meta device, allocated on ``device`` but for the parameters
    ``keep_meta`` names (they become ``Fp8Weight`` or are allocated when first loaded): every
    other parameter allocated (uninitialized, the loader fills it), the FP8 KV scales 1, the
    RoPE tables computed again."""
    from disagg.model.rotary import Rotary
    from disagg.model.transformer import Transformer

    for name, _ in list(model.named_parameters()):
        if not keep_meta(name):
            allocate(model, name, device)
    for mod in model.modules():
        for name, buf in list(mod._buffers.items()):
            if buf is None or not buf.is_meta:
                continue
            if name in ("k_scale", "v_scale"):
                mod._buffers[name] = torch.ones(buf.shape, dtype=buf.dtype, device=device)
            elif not isinstance(mod, Rotary):
                raise ValueError(f"materialize: no rule for buffer {name} of "
                                 f"{type(mod).__name__}")
    if isinstance(model, Transformer):
        model.rotary = Rotary(model.arch, device)
        model.device = device
    left = [n for n, b in model.named_buffers() if b.is_meta]
    if left:
        raise ValueError(f"materialize: buffers left on the meta device: {left[:4]}")


def install(model: torch.nn.Module, weights: dict[str, Fp8Weight],
            device: torch.device) -> int:
    """Replace each named parameter by its ``Fp8Weight`` (moved to ``device``), freeing the
    dequantized copy; returns the bytes the weights take now less than before."""
    saved = 0
    for name, w in weights.items():
        owner_name, attr = name.rsplit(".", 1)
        owner = model.get_submodule(owner_name)
        old = getattr(owner, attr)
        if tuple(old.shape) != tuple(w.shape):
            raise ValueError(f"{name}: FP8 weight {tuple(w.shape)} for a parameter of "
                             f"{tuple(old.shape)}")
        saved += old.numel() * old.element_size() - w.nbytes()
        delattr(owner, attr)
        setattr(owner, attr, Fp8Weight(w.q.to(device), w.scale_inv.to(device)))
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return saved


def quantize_params(model: torch.nn.Module) -> dict[str, Fp8Weight]:
    """The packed parameters of ``model`` quantized to 128x128 blocks (random weights drawn
    already rounded to that format, so the blocks come back as drawn)."""
    out = {}
    for name, param in model.named_parameters():
        if packable(name, None):
            q, s = quantize_blocks(param.data, (BLOCK, BLOCK))
            out[name] = Fp8Weight(q, s)
    return out


def kept(model: torch.nn.Module) -> dict[str, Fp8Weight]:
    """``name -> Fp8Weight`` of every weight ``model`` keeps as FP8."""
    return {f"{mod_name}.{attr}" if mod_name else attr: v
            for mod_name, mod in model.named_modules() for attr, v in vars(mod).items()
            if isinstance(v, Fp8Weight)}


def weight_bytes(model: torch.nn.Module, skip: tuple[str, ...] = ("embed",)) -> int:
    """Bytes of the weights a forward reads (FP8 ones with their scales), less ``skip``."""
    plain = sum(p.numel() * p.element_size() for n, p in model.named_parameters()
                if n not in skip)
    return plain + sum(w.nbytes() for w in kept(model).values())
