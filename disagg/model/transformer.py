"""One decoder-only transformer over the paged HND KV cache.

Covers Llama, Qwen2 (qkv bias) and Qwen3 (q/k norm); with ``arch.moe`` the sparse layers' MLP
is a mixture of experts (``disagg.model.moe``), with ``arch.mla`` attention is DeepSeek's latent
attention over a latent cache (``disagg.model.mla``). Tokens of all sequences in a step are
flattened into one ``[T]`` batch; attention goes through an ``AttentionBackend``; after each
layer's attention output projection the optional ``layer_hook(layer)`` runs (the layer counter
bump that lets KV transfers start layer by layer). The layers are ``disagg.model.layer``'s.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from disagg.kernels.interface import AttentionBackend, AttentionMetadata
from disagg.kernels.kv_quant import UNIT_SCALES
from disagg.model.config import ModelArch
from disagg.model.layer import DecoderLayer
from disagg.model.moe import MoEMLP
from disagg.model.mtp import MTPLayer
from disagg.model.ops import add_norm, linear
from disagg.model.rotary import Rotary
from disagg.model.tp import TensorParallel


class Transformer(nn.Module):
    def __init__(self, arch: ModelArch, dtype: torch.dtype, device: torch.device,
                 tp: TensorParallel | None = None, mtp: bool = False):
        """``arch`` holds this rank's shapes (``TensorParallel.local_arch``) under TP;
        ``mtp``: also hold the checkpoint's multi-token-prediction layer (a draft)."""
        super().__init__()
        self.arch = arch
        self.tp = tp or TensorParallel()
        self.dtype = dtype
        self.device = device
        h = arch.hidden_size
        self.embed = nn.Parameter(
            torch.empty(arch.vocab_size, h, dtype=dtype, device=device), requires_grad=False
        )
        self.layers = nn.ModuleList(DecoderLayer(arch, dtype, device, self.tp, i)
                                    for i in range(arch.num_layers))
        self.norm = nn.Parameter(torch.empty(h, dtype=dtype, device=device), requires_grad=False)
        self.lm_head: nn.Parameter | None = None
        if not arch.tie_word_embeddings:
            self.lm_head = nn.Parameter(
                torch.empty(arch.vocab_size, h, dtype=dtype, device=device), requires_grad=False
            )
        self.rotary = Rotary(arch, device)
        # the identity of the layers' FP8 KV scales (kv_quant.scales_identity; the loader sets
        # it when the checkpoint ships k_scale / v_scale)
        self.kv_scales_id = UNIT_SCALES
        self.mtp: MTPLayer | None = None
        if mtp:
            if arch.mtp_layers < 1:
                raise ValueError(f"{arch.architecture} has no multi-token-prediction layer "
                                 "(num_nextn_predict_layers)")
            self.mtp = MTPLayer(arch, dtype, device, self.tp)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv: torch.Tensor,
        meta: AttentionMetadata,
        backend: AttentionBackend,
        layer_hook: Callable[[int], None] | None = None,
        layer_wait: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        """Run ``input_ids [T]`` at ``positions [T]``; returns final-normed hidden ``[T, H]``.

        ``kv`` is the executor's whole cache ``[L, P, 2, Hkv, S, D]`` (MLA: ``[L, P, 1, 1, S,
        D]``, the latent passed as both K and V). ``layer_wait(i)`` runs before layer ``i``
        (a host-tier reload issued layer by layer: ``disagg.engine.tier_reload``)."""
        x = F.embedding(input_ids, self.embed)
        cos, sin = self.rotary.cos_sin(positions, self.dtype)
        delta = None  # the last MLP's output, added by the next norm's kernel (CUDA)
        for i, layer in enumerate(self.layers):
            hook = None if layer_hook is None else (lambda i=i: layer_hook(i))
            if layer_wait is not None:
                layer_wait(i)
            x, delta = layer(x, cos, sin, kv[i, :, 0], kv[i, :, -1], meta, backend, hook, delta)
        return add_norm(x, delta, self.norm, self.arch.rms_norm_eps)[0]

    @torch.inference_mode()
    def idle(self) -> None:
        """A step without tokens on this rank (``--dp``): under expert parallelism every MoE
        layer still joins its all-to-all, with zero rows (a dummy batch), so that every rank
        runs the same collectives; nothing else runs."""
        empty = torch.empty((0, self.arch.hidden_size), dtype=self.dtype, device=self.device)
        for layer in self.layers:
            moe = layer.moe
            if isinstance(moe, MoEMLP) and moe.ep is not None:
                moe(empty)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.embed if self.lm_head is None else self.lm_head
        return linear(hidden, weight).float()
