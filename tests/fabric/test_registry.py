"""The transfer seam: backends by name from one registry line each, the wrapper asking the
backend (never its name) what it can do, and the fabric's pure parts importable without the
libfabric build or anything else of disagg."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import numpy as np
import pytest
import torch

from disagg.fabric import registry
from disagg.fabric.descriptor import OutOfRange
from disagg.remote.transfer_plan import Runs, Write, make_key

BLOCK_LIBFABRIC = """
import sys

class NoLibfabric:
    def find_spec(self, name, path=None, target=None):
        if name == "disagg.fabric._libfabric_cffi":
            raise ImportError("the libfabric build is absent")

sys.meta_path.insert(0, NoLibfabric())
"""


def _run(code: str) -> str:
    r = subprocess.run([sys.executable, "-c", BLOCK_LIBFABRIC + code], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout


def test_ownership_imports_without_the_libfabric_build() -> None:
    out = _run("""
import disagg.remote.ownership as o
from disagg.fabric.descriptor import MemoryDescriptor
d = MemoryDescriptor("fabric", "tcp", b"a" * 16, 0, 1 << 20, 1)
assert o.endpoints([d], d, 1) == ([d], None)
try:
    import disagg.fabric.lib
except ImportError:
    print("blocked")
""")
    assert out.split() == ["blocked"]  # the blocker works, and ownership did not need it


def test_the_fabric_imports_nothing_else_of_disagg() -> None:
    out = _run("""
import disagg.fabric, disagg.fabric.backend, disagg.fabric.registry, disagg.fabric.lanes
import disagg.fabric.cuda_ipc, disagg.fabric.staging, disagg.fabric.expectations
print(sorted(m for m in sys.modules if m.startswith("disagg.")
             and not m.startswith("disagg.fabric")))
""")
    assert out.strip() == "[]"


def test_an_unknown_backend_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="'nope'; choose one of fabric, cuda-ipc"):
        registry.make_backend("nope")
    with pytest.raises(TypeError):
        registry.make_backend("fabric", lanez=2)  # a wrong option is never ignored


def test_a_backend_is_one_module_plus_one_registry_line(monkeypatch: pytest.MonkeyPatch) -> None:
    from disagg.transfer import TransferEngine

    monkeypatch.setitem(registry.BACKENDS, "memcopy", "memcopy_backend")  # the one line
    key = make_key(3, 12345)

    async def main() -> None:
        sender = TransferEngine("memcopy", timeout_s=5).start()
        receiver = TransferEngine("memcopy", timeout_s=5).start()
        src_t = torch.from_numpy(np.arange(8192, dtype=np.int64).astype(np.uint8))
        dst_t = torch.zeros(8192, dtype=torch.uint8)
        src = sender.register(src_t, access="source")
        dst = receiver.register(dst_t, access="target")
        # asked of the backend: no revocable windows, so a window is the regions' descriptors
        assert not receiver.windows and receiver.transport == "memcopy/memcopy"
        assert receiver.window([dst]).descriptors == [dst.descriptor]
        assert receiver.delivery_complete and receiver.context_buffer(2, 8).device.type == "cpu"
        exp = receiver.expect(key, 5, timeout=5)
        runs = Runs.of([Write(0, 4096, 1024, 2), Write(2048, 0, 512, 3)])
        await asyncio.gather(*sender.write(src, dst.descriptor, runs, key))
        await exp
        assert (dst_t[4096:5120] == src_t[:1024]).all() and (dst_t[:512] == src_t[2048:2560]).all()
        assert not dst_t[512:4096].any() and not dst_t[5120:].any()
        assert sender.writes_sent == 2 and sender.bytes_sent == 1536 and receiver.junk == 0
        with pytest.raises(OutOfRange):  # a region the backend did not make
            sender.write(dst, dst.descriptor, runs, key)
        await sender.close()
        await receiver.close()

    asyncio.run(main())


@pytest.mark.fabric
def test_the_fabric_backend_by_name() -> None:
    from disagg.fabric.engine import FabricEngine
    from disagg.fabric.striped import StripedEngine

    one = registry.make_backend("fabric", "tcp", max_inflight=8)
    two = registry.make_backend("fabric", "tcp", lanes=2, nearest=lambda: ("lo",))
    try:
        assert isinstance(one, FabricEngine) and one.capacity <= 8
        assert isinstance(two, StripedEngine) and len(two.lanes) == 2
        assert one.cheap_registration and two.cheap_registration
    finally:
        one.close_sync()
        two.close_sync()
