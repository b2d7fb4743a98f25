"""What every transfer backend hands out: registered regions, per-transfer windows, and the
errors and future settling they share. No libfabric needed to import this."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from disagg.fabric.descriptor import MemoryDescriptor


class EngineClosed(RuntimeError):
    """The engine stopped while the operation was pending."""


@dataclass(eq=False)
class LocalRegion:
    """A registered local buffer. ``descriptor`` is what peers need to write into it."""

    id: int
    addr: int
    length: int
    descriptor: MemoryDescriptor
    mr: Any  # fl.MemoryRegion, or a backend's own handle
    owner: Any = None  # the Python object keeping the memory alive

    def view(self) -> memoryview:
        """The region's bytes (host memory only)."""
        from disagg.fabric import lib as fl

        return memoryview(fl.ffi.buffer(fl.ffi.cast("char *", self.addr), self.length))


class Window:
    """Remote-write access to some regions for one transfer: the same memory under fresh
    registrations (new random keys). ``descriptors`` (one per region, in order) go to the one
    sender; ``close()`` revokes them: the provider then refuses every write carrying their keys,
    late or forged. Idempotent."""

    def __init__(self, descriptors: list[MemoryDescriptor],
                 revoke: Callable[[], None] | None = None) -> None:
        self.descriptors = descriptors
        self._revoke = revoke
        self.closed = False

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            if self._revoke is not None:
                self._revoke()


def settle_futures(events: list[tuple[asyncio.Future[None], BaseException | None]]) -> None:
    """Resolve futures from a batch of native events (in the event loop's thread)."""
    for fut, exc in events:
        if fut.done():
            continue
        if exc is None:
            fut.set_result(None)
        else:
            fut.set_exception(exc)


def buffer_address(buffer: Any) -> tuple[int, int]:
    """(address, byte length) of a contiguous host buffer."""
    if hasattr(buffer, "data_ptr") and hasattr(buffer, "element_size"):
        if getattr(buffer, "is_cuda", False):
            raise ValueError("GPU tensors need the cuda-ipc or staged backend")
        if not buffer.is_contiguous():
            raise ValueError("tensor must be contiguous")
        return int(buffer.data_ptr()), int(buffer.numel() * buffer.element_size())
    from disagg.fabric import lib as fl

    cdata = fl.ffi.from_buffer(buffer)
    return int(fl.ffi.cast("uintptr_t", cdata)), len(cdata)
