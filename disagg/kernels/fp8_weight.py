"""A block-FP8 linear weight as the GPU path keeps it (no Triton here: the model layers hold
these on every device; ``disagg.model.ops.linear`` picks the kernel)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK = 128  # the weight block edge the FP8 kernels take (weight_block_size [128, 128])


@dataclass(frozen=True)
class Fp8Weight:
    """``w = q * scale_inv`` block by block: ``q [N, K]`` ``float8_e4m3fn`` and
    ``scale_inv [ceil(N/128), ceil(K/128)]`` float32 (edge blocks partial), the checkpoint's
    ``weight_scale_inv`` of this rank's shard; MoE experts stack them: ``q [E, N, K]``,
    ``scale_inv [E, ceil(N/128), ceil(K/128)]``."""

    q: torch.Tensor
    scale_inv: torch.Tensor

    def __post_init__(self) -> None:
        if self.q.dim() not in (2, 3) or self.q.dtype != torch.float8_e4m3fn:
            raise ValueError(f"Fp8Weight.q must be a 2-d (or [E, N, K] experts) float8_e4m3fn "
                             f"tensor, got {tuple(self.q.shape)} {self.q.dtype}")
        *lead, n, k = self.q.shape
        want = (*lead, -(-n // BLOCK), -(-k // BLOCK))
        if tuple(self.scale_inv.shape) != want or self.scale_inv.dtype != torch.float32:
            raise ValueError(f"Fp8Weight.scale_inv must be float32 {list(want)} for q "
                             f"{list(self.q.shape)}, got {tuple(self.scale_inv.shape)} "
                             f"{self.scale_inv.dtype}")

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    def dim(self) -> int:
        return self.q.dim()

    @property
    def device(self) -> torch.device:
        return self.q.device

    def nbytes(self) -> int:
        return self.q.numel() + 4 * self.scale_inv.numel()

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weights in ``dtype`` (computed in float32): the CPU path and the reference."""
        n, k = self.q.shape[-2:]
        s = self.scale_inv.repeat_interleave(BLOCK, -2)[..., :n, :]
        s = s.repeat_interleave(BLOCK, -1)[..., :k]
        return (self.q.to(torch.float32) * s).to(dtype)
