"""DeepSeek-V3 multi-token prediction (MTP) layer, used as a draft model.

A checkpoint with ``num_nextn_predict_layers`` = 1 stores one more layer after the last
decoder layer (``model.layers.{L}``): ``enorm``, ``hnorm``, ``eh_proj``, a full decoder layer
(MLA attention and an MoE MLP, as the layers after ``first_k_dense_replace``) and
``shared_head.norm`` (its embedding and head are the main model's). As in Hugging Face's
``MtpLayer`` and vLLM, position ``p`` takes the embedding of token ``p`` and the main model's
final (normed) hidden state at ``p - 1``:

    x = eh_proj([enorm(embed(token_p)), hnorm(h_{p-1})]);  x = block(x);  y = head_norm(x)

and ``lm_head(y)`` predicts token ``p + 1``. Drafting further reuses the layer on its own
output ``y`` in place of ``h`` (one checkpoint layer, K drafts). The layer has its own paged
KV cache over the main cache's page ids. At position 0 there is no previous token: the
embedding is zeroed there (as vLLM does) and the hidden state is zero.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from disagg.kernels.interface import AttentionBackend, AttentionMetadata
from disagg.model.config import ModelArch
from disagg.model.layer import DecoderLayer
from disagg.model.ops import add_norm
from disagg.model.rotary import rms_norm
from disagg.model.tp import TensorParallel


def mtp_arch(arch: ModelArch) -> ModelArch:
    """``arch`` with the MTP layer's index (``num_layers``) sparse like the layers before it
    (DeepSeek's MTP layer is an MoE layer)."""
    if arch.moe is None:
        return arch
    sparse = arch.moe.sparse_layers + (arch.moe.sparse_layers[-1],)
    return dataclasses.replace(arch, moe=dataclasses.replace(arch.moe, sparse_layers=sparse))


class MTPLayer(nn.Module):
    def __init__(self, arch: ModelArch, dtype: torch.dtype, device: torch.device,
                 tp: TensorParallel | None = None):
        super().__init__()
        h = arch.hidden_size
        self.eps = arch.rms_norm_eps

        def p(*shape: int) -> nn.Parameter:
            return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)

        self.enorm = p(h)
        self.hnorm = p(h)
        self.eh_proj = p(h, 2 * h)
        self.block = DecoderLayer(mtp_arch(arch), dtype, device, tp, arch.num_layers)
        self.head_norm = p(h)

    def forward(self, token_ids: torch.Tensor, previous: torch.Tensor, positions: torch.Tensor,
                embed: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: torch.Tensor, meta: AttentionMetadata,
                backend: AttentionBackend) -> torch.Tensor:
        """``token_ids [T]`` at ``positions [T]`` with the hidden states ``previous [T, H]`` of
        the positions before them -> the normed output ``[T, H]`` (``lm_head`` of it predicts
        the next tokens; as ``previous`` it drafts further). ``cache``: ``[1, P, parts, ...]``."""
        e = F.embedding(token_ids, embed)
        e = torch.where((positions == 0)[:, None], torch.zeros_like(e), e)
        x = F.linear(torch.cat((rms_norm(e, self.enorm, self.eps),
                                rms_norm(previous, self.hnorm, self.eps)), dim=-1), self.eh_proj)
        x, delta = self.block(x, cos, sin, cache[0, :, 0], cache[0, :, -1], meta, backend, None)
        return add_norm(x, delta, self.head_norm, self.eps)[0]
