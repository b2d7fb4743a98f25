"""Tensor parallelism: which slice of every weight a rank holds, and the all-reduces.

Attention heads and the MLP's intermediate dimension are split over the ranks (Megatron
style): q/k/v and gate/up are column-parallel, o_proj and down_proj row-parallel (their
partial outputs are summed with an all-reduce). Rank ``r`` holds query heads
``[r*Hq/tp, (r+1)*Hq/tp)`` and the kv heads those use; when kv heads < tp each kv head is
replicated on ``tp / Hkv`` consecutive ranks (``disagg.model.config.shard_kv_heads`` and
``KVLayoutDesc.rank_heads`` describe the same mapping). Embeddings, norms and the LM head are
replicated.

MoE: every expert's intermediate dimension (and the shared expert's) is split like a dense
MLP's; the router is replicated. MLA: the heads are split (``q_b``/``q_proj`` and ``kv_b`` rows,
``o_proj`` columns); the latent projection, its norm and so the latent cache are replicated
(one "kv head" on every rank).

With ``ep`` (``--expert-parallel``, ``disagg.model.ep``) the routed experts are not split but
spread whole over the EP group; the shared experts stay split as above.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from disagg.model.config import ModelArch, shard_kv_heads
from disagg.model.ep import ExpertParallel


class TPError(ValueError):
    """The model cannot be split over this many ranks."""


@dataclass(frozen=True)
class TensorParallel:
    rank: int = 0
    size: int = 1
    group: Any = None  # torch.distributed process group (None: the default group)
    ep: ExpertParallel | None = None  # --expert-parallel: the experts spread over its group

    def check(self, arch: ModelArch) -> None:
        if arch.num_heads % self.size:
            raise TPError(f"--tp {self.size} does not divide the {arch.num_heads} attention heads")
        if arch.intermediate_size % self.size:
            raise TPError(f"--tp {self.size} does not divide the MLP size {arch.intermediate_size}")
        moe = arch.moe
        if moe is not None and self.ep is not None:
            self.ep.check(moe.num_experts)
        routed = 1 if self.ep is not None else self.size  # EP: the experts stay whole
        if moe is not None and (moe.intermediate_size % routed
                                or moe.shared_intermediate_size % self.size):
            raise TPError(f"--tp {self.size} does not divide the expert MLP sizes "
                          f"{moe.intermediate_size} / {moe.shared_intermediate_size}")
        try:
            shard_kv_heads(arch.num_kv_heads, self.size)
        except ValueError as e:
            raise TPError(str(e)) from None

    def local_arch(self, arch: ModelArch) -> ModelArch:
        """The shapes this rank holds (heads, kv heads, intermediate size per rank)."""
        self.check(arch)
        kv, _ = shard_kv_heads(arch.num_kv_heads, self.size)
        moe = arch.moe and dataclasses.replace(
            arch.moe, intermediate_size=arch.moe.intermediate_size // (
                1 if self.ep is not None else self.size),
            shared_intermediate_size=arch.moe.shared_intermediate_size // self.size)
        return dataclasses.replace(arch, num_heads=arch.num_heads // self.size, num_kv_heads=kv,
                                   intermediate_size=arch.intermediate_size // self.size, moe=moe)

    def kv_heads(self, arch: ModelArch) -> range:
        """Global kv heads this rank holds (the mapping ``KVLayoutDesc.rank_heads`` describes)."""
        per, replicas = shard_kv_heads(arch.num_kv_heads, self.size)
        first = (self.rank // replicas) * per
        return range(first, first + per)

    def shard(self, kind: str, tensor: torch.Tensor, arch: ModelArch) -> torch.Tensor:
        """This rank's slice of a checkpoint tensor. ``kind``: q, k, v (weight or bias rows by
        head), o (columns by q head), gate, up (rows), down (columns), rows / cols (an even
        split of the rows / columns: experts, MLA heads), or anything else (replicated)."""
        if self.size == 1:
            return tensor
        if kind == "rows":
            return tensor.chunk(self.size, dim=0)[self.rank]
        if kind == "cols":
            return tensor.chunk(self.size, dim=1)[self.rank]
        d = arch.head_dim
        if kind == "q":
            n = arch.num_heads // self.size
            return tensor[self.rank * n * d:(self.rank + 1) * n * d]
        if kind in ("k", "v"):
            heads = self.kv_heads(arch)
            return tensor[heads.start * d:heads.stop * d]
        if kind == "o":
            n = arch.num_heads // self.size
            return tensor[:, self.rank * n * d:(self.rank + 1) * n * d]
        i = arch.intermediate_size // self.size
        if kind in ("gate", "up"):
            return tensor[self.rank * i:(self.rank + 1) * i]
        if kind == "down":
            return tensor[:, self.rank * i:(self.rank + 1) * i]
        return tensor

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum a row-parallel layer's partial outputs over the ranks (in place)."""
        if self.size > 1:
            import torch.distributed as dist

            dist.all_reduce(x, group=self.group)
        return x
