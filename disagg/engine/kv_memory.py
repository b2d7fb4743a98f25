"""The executor's KV cache allocation, mappable by the node's main process.

One allocation per executor holds every layer, so it is registered with the fabric once:
``[num_layers, num_pages, kv_parts, num_kv_heads_local, page_size, head_dim]`` (HND), the third
dim K and V (``kv_parts`` 2, GQA) or MLA's one latent row per token (1, with one "head" and
``head_dim`` the latent width). The parts of one page of one layer are adjacent, so that page
is one contiguous run of ``kv_parts * num_kv_heads * page_size * head_dim`` elements.

- CPU: a memfd; the executor passes the fd to the main process (SCM_RIGHTS), which mmaps it.
- CUDA: cuMem with a POSIX-fd exportable handle; the main process imports it with
  cuMemImportFromShareableHandle and maps it into its own address space.
"""

from __future__ import annotations

import mmap
import os
from dataclasses import dataclass
from typing import Any

import torch

from disagg.protocol.executor import KVMemoryInfo


@dataclass(frozen=True)
class KVLayout:
    num_layers: int
    num_pages: int
    num_kv_heads: int
    page_size: int
    head_dim: int
    dtype: torch.dtype
    kv_parts: int = 2  # third dim: K and V (2), or the MLA latent (1); ModelArch.kv_parts

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.num_layers, self.num_pages, self.kv_parts, self.num_kv_heads, self.page_size,
                self.head_dim)

    @property
    def element_size(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def page_bytes(self) -> int:
        """Bytes of one page of one layer (K and V, or the MLA latent)."""
        return self.kv_parts * self.num_kv_heads * self.page_size * self.head_dim * self.element_size

    @property
    def nbytes(self) -> int:
        return self.num_layers * self.num_pages * self.page_bytes

    @staticmethod
    def pages_for_budget(budget_bytes: int, num_layers: int, num_kv_heads: int, page_size: int,
                         head_dim: int, dtype: torch.dtype, *, kv_parts: int = 2) -> int:
        """Pages (of every layer) that fit in ``budget_bytes``; ``kv_parts`` as the field."""
        per_page = num_layers * kv_parts * num_kv_heads * page_size * head_dim * torch.empty(
            (), dtype=dtype).element_size()
        return budget_bytes // per_page


class KVAllocation:
    """An executor-side KV tensor plus what another process needs to map it.

    With ``spec`` (a draft model's or the MTP layers' KV, which a prefiller ships beside the
    model's: ``KVLayoutDesc.spec``) the one allocation holds that region right after the
    main one, as ``spec_tensor``, so it is registered (and written) with it."""

    def __init__(self, tensor: torch.Tensor, info: KVMemoryInfo, fd: int | None, keepalive: Any,
                 spec_tensor: torch.Tensor | None = None):
        self.tensor = tensor
        self.spec_tensor = spec_tensor
        self.info = info
        self.fd = fd
        self._keepalive = keepalive

    @classmethod
    def create(cls, layout: KVLayout, device: torch.device,
               spec: KVLayout | None = None, kv_scales: str = "",
               model_dtype: torch.dtype | None = None) -> KVAllocation:
        """``kv_scales``, ``model_dtype``: FP8 pages' scales identity and the model's dtype
        (``KVMemoryInfo``)."""
        model_name = "" if model_dtype in (None, layout.dtype) else str(model_dtype)
        model_name = model_name.removeprefix("torch.")
        dtype_name = str(layout.dtype).removeprefix("torch.")
        nbytes = layout.nbytes + (spec.nbytes if spec is not None else 0)
        spec_shape = list(spec.shape) if spec is not None else []
        if device.type == "cpu":
            fd = os.memfd_create("disagg-kv", 0)
            os.ftruncate(fd, nbytes)
            mm = mmap.mmap(fd, nbytes)
            raw = torch.frombuffer(mm, dtype=torch.uint8)
            info = KVMemoryInfo("memfd", nbytes, dtype_name, list(layout.shape), "cpu",
                                spec_shape, kv_scales, model_name)
            main, extra = _views(raw, layout, spec)
            return cls(main, info, fd, mm, extra)
        if device.type == "cuda":
            from disagg.fabric.cuda_mem import CuMemAllocation

            alloc = CuMemAllocation.create(nbytes, device)
            raw = alloc.as_tensor(torch.uint8, (nbytes,))
            info = KVMemoryInfo("cuda", nbytes, dtype_name, list(layout.shape), str(device),
                                spec_shape, kv_scales, model_name)
            main, extra = _views(raw, layout, spec)
            return cls(main, info, alloc.export_fd(), alloc, extra)
        raise ValueError(f"unsupported KV device {device}")


def _views(raw: torch.Tensor, layout: KVLayout, spec: KVLayout | None
           ) -> tuple[torch.Tensor, torch.Tensor | None]:
    main = raw[:layout.nbytes].view(layout.dtype).view(layout.shape)
    if spec is None:
        return main, None
    return main, raw[layout.nbytes:layout.nbytes + spec.nbytes].view(spec.dtype).view(spec.shape)


def map_kv(info: KVMemoryInfo, fd: int) -> tuple[torch.Tensor, Any]:
    """Main-process view of an executor's KV memory, all ``info.nbytes`` of it as bytes (the
    main process only registers and moves it); returns (tensor, keepalive)."""
    if info.kind == "memfd":
        mm = mmap.mmap(fd, info.nbytes)
        return torch.frombuffer(mm, dtype=torch.uint8), mm
    if info.kind == "cuda":
        from disagg.fabric.cuda_mem import CuMemAllocation

        alloc = CuMemAllocation.import_fd(fd, info.nbytes, torch.device(info.device))
        return alloc.as_tensor(torch.uint8, (info.nbytes,)), alloc
    raise ValueError(f"cannot map KV memory of kind {info.kind!r}")
