"""The layer counter: how far the model forward has got, readable by another process mid-step.

The counter is one int64 in a shared-memory page (a file under ``/dev/shm``), so the process
that runs the model (the executor) and the one that ships pages (the main process, via
``LayerCounter.attach(handle)``) see the same cell. The model calls ``bump(value)`` after each
layer's attention output projection; the cell then holds ``base + value``:

- ``base`` is a one-element int64 tensor on the model's device, set once per step by
  ``set_base`` (stream-ordered, outside any CUDA graph). ``value`` is a host int fixed at the call
  site (typically the layer index + 1), so a captured graph replays the same launches and still
  writes the current step's numbers. Choose bases so the cell only grows, e.g.
  ``base = step * (num_layers + 1)``: the reader waits for ``read() >= base + layer + 1``.
- On CUDA the page is registered with ``cudaHostRegister`` (mapped, portable) and ``bump`` is a
  one-program Triton kernel that loads ``base`` from device memory and stores ``base + value``
  into the page with a system-scope release exchange, so the store is visible to the host after
  every earlier write of the stream. It is capturable in a CUDA graph. ``read`` is a plain 8-byte
  load on the host: no stream sync.
- On CPU ``bump`` writes the cell directly (the forward is synchronous there).

Lifetime: the creator owns the file and removes it in ``close``; attached readers only unmap.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import uuid
from typing import Any

import torch

_SHM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else None
_CELL_BYTES = 4096  # one page; the counter is its first 8 bytes
_HOST_REGISTER_FLAGS = 0x01 | 0x02  # cudaHostRegisterPortable | cudaHostRegisterMapped


def _shm_path(name: str) -> str:
    import tempfile

    return os.path.join(_SHM_DIR or tempfile.gettempdir(), name)


_bump_kernel: Any = None


def _get_bump_kernel() -> Any:
    """Build the Triton bump kernel on first use (CPU-only code never imports Triton)."""
    global _bump_kernel
    if _bump_kernel is None:
        import triton
        import triton.language as tl

        @triton.jit(do_not_specialize=["value"])
        def bump_kernel(base_ptr, cell_ptr, value):
            new = tl.load(base_ptr) + value
            tl.atomic_xchg(cell_ptr, new, sem="release", scope="sys")

        _bump_kernel = bump_kernel
    return _bump_kernel


class LayerCounter:
    """One int64 cell in shared memory, bumped by the model and read by any process."""

    def __init__(
        self, name: str, mm: mmap.mmap, device: torch.device, owner: bool, registered: bool
    ) -> None:
        self._name = name
        self._mm = mm
        self._cell = ctypes.c_int64.from_buffer(mm)
        self._tensor = torch.frombuffer(mm, dtype=torch.int64, count=1)  # host view of the cell
        self._device = device
        self._owner = owner
        self._registered = registered
        self._base = torch.zeros(1, dtype=torch.int64, device=device)
        self._closed = False

    @classmethod
    def create(cls, device: torch.device | str) -> LayerCounter:
        """A fresh counter (value 0) for a model on ``device``; this process owns its file."""
        device = torch.device(device)
        name = f"disagg-layer-counter-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        fd = os.open(_shm_path(name), os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, _CELL_BYTES)
            mm = mmap.mmap(fd, _CELL_BYTES)
        finally:
            os.close(fd)
        registered = False
        if device.type == "cuda":
            _host_register(mm)
            registered = True
        return cls(name, mm, device, owner=True, registered=registered)

    @classmethod
    def attach(cls, handle: str) -> LayerCounter:
        """Map a counter another process created, for ``read`` (its ``bump`` is host-side)."""
        fd = os.open(_shm_path(handle), os.O_RDWR)
        try:
            mm = mmap.mmap(fd, _CELL_BYTES)
        finally:
            os.close(fd)
        return cls(handle, mm, torch.device("cpu"), owner=False, registered=False)

    def handle(self) -> str:
        """The name another process on this node passes to ``attach``."""
        return self._name

    @property
    def base(self) -> torch.Tensor:
        """The device scalar added to every bumped value (a static input for graph capture)."""
        return self._base

    def set_base(self, base: int) -> None:
        """Set the step's base (stream-ordered on CUDA; do it outside a captured region)."""
        self._base.fill_(base)

    def bump(self, value: int) -> None:
        """Store ``base + value`` in the cell once the stream's earlier work is done."""
        if self._registered:
            _get_bump_kernel()[(1,)](self._base, self._tensor, value, num_warps=1)
        else:
            self._cell.value = int(self._base.item()) + value

    def warm(self) -> None:
        """Compile the bump kernel now, on scratch cells (the shared cell keeps its value)."""
        if self._base.device.type == "cuda":
            base, cell = (torch.zeros(1, dtype=torch.int64, device=self._base.device)
                          for _ in range(2))
            _get_bump_kernel()[(1,)](base, cell, 0, num_warps=1)
            torch.cuda.synchronize(self._base.device)

    def read(self) -> int:
        """The cell's current value (a host load; never waits for the device)."""
        return int(self._cell.value)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._registered:
            torch.cuda.synchronize(self._device)
            err = torch.cuda.cudart().cudaHostUnregister(self._tensor.data_ptr())
            if int(err) != 0:
                raise RuntimeError(f"cudaHostUnregister failed: {err}")
        del self._cell
        del self._tensor
        self._mm.close()
        if self._owner:
            try:
                os.unlink(_shm_path(self._name))
            except FileNotFoundError:
                pass

    def __enter__(self) -> LayerCounter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _host_register(mm: mmap.mmap) -> None:
    """Page-lock and map the counter page into the CUDA address space (UVA: same address)."""
    ptr = ctypes.addressof(ctypes.c_char.from_buffer(mm))
    err = torch.cuda.cudart().cudaHostRegister(ptr, _CELL_BYTES, _HOST_REGISTER_FLAGS)
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister of the layer counter page failed: {err}")
