"""Thin Python objects over the cffi libfabric module: one class per fid.

Every negative return becomes a :class:`FabricError` carrying ``fi_strerror`` text. Nothing
here starts threads or touches asyncio; :mod:`disagg.fabric.engine` builds on these.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
from dataclasses import dataclass
from typing import Any

# libfabric links libinfinipath (psm), whose constructor installs signal handlers that crash
# a process receiving SIGINT/SIGTERM while in epoll; this variable turns them off. Processes
# should still install their own signal handlers after loading libfabric.
os.environ.setdefault("IPATH_NO_BACKTRACE", "1")

try:
    from disagg.fabric._libfabric_cffi import ffi, lib
except ImportError as e:  # pragma: no cover - depends on the install
    raise ImportError(
        "the libfabric cffi module is not built: install libfabric-dev and run "
        "`python -m disagg.fabric.build`"
    ) from e

__all__ = [
    "ffi", "lib", "FabricError", "FabricInfo", "getinfo", "Fabric", "Domain", "CompletionQueue",
    "AddressVector", "Endpoint", "MemoryRegion",
]


class FabricError(RuntimeError):
    """A libfabric call failed; ``errno`` is the positive FI_* error number."""

    def __init__(self, what: str, rc: int, detail: str = "") -> None:
        self.errno = -rc if rc < 0 else rc
        text = ffi.string(lib.fi_strerror(self.errno)).decode(errors="replace")
        msg = f"{what}: {text} ({self.errno})"
        super().__init__(f"{msg}: {detail}" if detail else msg)


def check(what: str, rc: int) -> int:
    if rc < 0:
        raise FabricError(what, rc)
    return rc


def _str(p: Any) -> str:
    return "" if p == ffi.NULL else ffi.string(p).decode(errors="replace")


@dataclass(frozen=True)
class FabricInfo:
    """The parts of one ``fi_info`` the engine cares about (the raw info stays alive with it)."""

    provider: str
    fabric: str
    domain: str
    mr_mode: int
    cq_data_size: int
    mr_key_size: int
    tx_size: int
    max_msg_size: int
    threading: int
    data_progress: int
    caps: int
    raw: Any  # cdata struct fi_info * (owned by the list returned by fi_getinfo)
    delivery_complete: bool = False  # writes complete once placed at the target (tx op_flags)

    @property
    def virt_addr(self) -> bool:
        return bool(self.mr_mode & lib.FI_MR_VIRT_ADDR)

    @property
    def prov_key(self) -> bool:
        return bool(self.mr_mode & lib.FI_MR_PROV_KEY)

    @property
    def local_desc(self) -> bool:
        return bool(self.mr_mode & lib.FI_MR_LOCAL)

    @property
    def mr_endpoint(self) -> bool:
        return bool(self.mr_mode & lib.FI_MR_ENDPOINT)


class _InfoList:
    """Owner of an ``fi_info`` list; frees it when collected."""

    def __init__(self, head: Any) -> None:
        self.head = ffi.gc(head, lib.fi_freeinfo)


def getinfo(
    provider: str | None = None,
    node: str | None = "127.0.0.1",
    hmem: bool = False,
    domain: str | None = None,
    delivery_complete: bool = True,
    source: bool = False,
) -> list[FabricInfo]:
    """``fi_getinfo`` for RDM endpoints with RMA writes and 8-byte-capable remote CQ data.

    ``node`` defaults to loopback: the tcp provider binds a non-loopback interface otherwise.
    ``delivery_complete``: ask for FI_DELIVERY_COMPLETE as the endpoints' default (a write's
    completion then means its data was placed at the target); interfaces of a provider that
    cannot are returned without it (``FabricInfo.delivery_complete`` False: a completion then
    only means the source buffer may be reused). ``source``: ``node`` is the local address to
    bind (FI_SOURCE), not a destination hint.
    """
    if delivery_complete:
        try:
            return _getinfo(provider, node, hmem, domain, lib.FI_DELIVERY_COMPLETE, source)
        except FabricError as e:
            if e.errno != lib.FI_ENODATA:
                raise
    return _getinfo(provider, node, hmem, domain, 0, source)


def _getinfo(provider: str | None, node: str | None, hmem: bool, domain: str | None,
             op_flags: int, source: bool = False) -> list[FabricInfo]:
    hints = ffi.gc(lib.fi_allocinfo(), lib.fi_freeinfo)
    if hints == ffi.NULL:
        raise MemoryError("fi_allocinfo")
    hints.caps = lib.FI_RMA | lib.FI_WRITE | lib.FI_REMOTE_WRITE | (lib.FI_HMEM if hmem else 0)
    hints.mode = lib.FI_CONTEXT | lib.FI_CONTEXT2
    hints.ep_attr.type = lib.FI_EP_RDM
    hints.domain_attr.mr_mode = (
        lib.FI_MR_LOCAL | lib.FI_MR_VIRT_ADDR | lib.FI_MR_ALLOCATED | lib.FI_MR_PROV_KEY
        | lib.FI_MR_ENDPOINT | (lib.FI_MR_HMEM if hmem else 0)
    )
    hints.domain_attr.threading = lib.FI_THREAD_DOMAIN
    hints.tx_attr.op_flags = op_flags
    if provider:
        # fi_freeinfo frees prov_name, so it must come from malloc (strdup), not from cffi.
        p = _strdup(provider)
        hints.fabric_attr.prov_name = p
    if domain:
        hints.domain_attr.name = _strdup(domain)
    out = ffi.new("struct fi_info **")
    node_c = ffi.new("char[]", node.encode()) if node else ffi.NULL
    flags = lib.FI_SOURCE if source and node else 0
    rc = lib.fi_getinfo(lib.DG_VERSION, node_c, ffi.NULL, flags, hints, out)
    if rc < 0:
        raise FabricError(f"fi_getinfo(provider={provider!r})", rc)
    owner = _InfoList(out[0])
    infos: list[FabricInfo] = []
    cur = owner.head
    while cur != ffi.NULL:
        infos.append(
            FabricInfo(
                provider=_str(cur.fabric_attr.prov_name),
                fabric=_str(cur.fabric_attr.name),
                domain=_str(cur.domain_attr.name),
                mr_mode=int(cur.domain_attr.mr_mode),
                cq_data_size=int(cur.domain_attr.cq_data_size),
                mr_key_size=int(cur.domain_attr.mr_key_size),
                tx_size=int(cur.tx_attr.size),
                max_msg_size=int(cur.ep_attr.max_msg_size),
                threading=int(cur.domain_attr.threading),
                data_progress=int(cur.domain_attr.data_progress),
                caps=int(cur.caps),
                raw=_Pinned(cur, owner),
                delivery_complete=bool(cur.tx_attr.op_flags & lib.FI_DELIVERY_COMPLETE),
            )
        )
        cur = cur.next
    return infos


class _Pinned:
    """A cdata pointer that keeps the list owning it alive."""

    def __init__(self, ptr: Any, owner: _InfoList) -> None:
        self.ptr = ptr
        self.owner = owner


def _strdup(s: str) -> Any:
    p = lib.strdup(s.encode())
    if p == ffi.NULL:
        raise MemoryError("strdup")
    return p


class _Fid:
    _ptr: Any = ffi.NULL

    def _fid(self) -> Any:
        return ffi.cast("struct fid *", self._ptr)

    def close(self) -> None:
        if self._ptr != ffi.NULL:
            ptr, self._ptr = self._ptr, ffi.NULL
            lib.fi_close(ffi.cast("struct fid *", ptr))


class Fabric(_Fid):
    def __init__(self, info: FabricInfo) -> None:
        self.info = info
        out = ffi.new("struct fid_fabric **")
        check("fi_fabric", lib.fi_fabric(info.raw.ptr.fabric_attr, out, ffi.NULL))
        self._ptr = out[0]

    @property
    def ptr(self) -> Any:
        return self._ptr


class Domain(_Fid):
    def __init__(self, fabric: Fabric) -> None:
        self.fabric = fabric
        self.info = fabric.info
        out = ffi.new("struct fid_domain **")
        check("fi_domain", lib.fi_domain(fabric.ptr, self.info.raw.ptr, out, ffi.NULL))
        self._ptr = out[0]

    @property
    def ptr(self) -> Any:
        return self._ptr

    def new_key(self) -> int:
        """A key for a registration: 0 where the provider chooses (FI_MR_PROV_KEY), else a
        random nonzero one of ``mr_key_size`` bytes (at most 8): a peer that was not given a
        descriptor cannot guess it. Unique per domain: a clash is retried by the caller."""
        if self.info.prov_key:
            return 0
        bits = 8 * max(1, min(self.info.mr_key_size or 8, 8))
        return secrets.randbits(bits) or 1


class CompletionQueue(_Fid):
    def __init__(self, domain: Domain, size: int = 0, wait_fd: bool = True) -> None:
        attr = ffi.new("struct fi_cq_attr *")
        attr.size = size
        attr.format = lib.FI_CQ_FORMAT_DATA
        attr.wait_cond = lib.FI_CQ_COND_NONE
        out = ffi.new("struct fid_cq **")
        self.fd = -1
        if wait_fd:
            attr.wait_obj = lib.FI_WAIT_FD
            rc = lib.fi_cq_open(domain.ptr, attr, out, ffi.NULL)
            if rc == 0:
                self._ptr = out[0]
                fd = lib.dg_cq_wait_fd(self._ptr)
                self.fd = fd if fd >= 0 else -1
                return
        attr.wait_obj = lib.FI_WAIT_NONE
        check("fi_cq_open", lib.fi_cq_open(domain.ptr, attr, out, ffi.NULL))
        self._ptr = out[0]

    @property
    def ptr(self) -> Any:
        return self._ptr

    def readerr(self) -> tuple[int, int, int, str]:
        """Pop one error entry: (op_context as int, errno, flags, provider text)."""
        e = ffi.new("struct fi_cq_err_entry *")
        rc = lib.fi_cq_readerr(self._ptr, e, 0)
        if rc < 0:
            raise FabricError("fi_cq_readerr", rc)
        buf = ffi.new("char[256]")
        txt = lib.fi_cq_strerror(self._ptr, e.prov_errno, e.err_data, buf, 256)
        return int(ffi.cast("uintptr_t", e.op_context)), int(e.err), int(e.flags), _str(txt)


class AddressVector(_Fid):
    def __init__(self, domain: Domain) -> None:
        attr = ffi.new("struct fi_av_attr *")
        attr.type = lib.FI_AV_TABLE
        out = ffi.new("struct fid_av **")
        check("fi_av_open", lib.fi_av_open(domain.ptr, attr, out, ffi.NULL))
        self._ptr = out[0]
        self._cache: dict[bytes, int] = {}

    @property
    def ptr(self) -> Any:
        return self._ptr

    def insert(self, addr: bytes) -> int:
        """Insert a peer's raw endpoint name; cached, so repeated peers cost nothing."""
        got = self._cache.get(addr)
        if got is not None:
            return got
        out = ffi.new("fi_addr_t *")
        rc = lib.fi_av_insert(self._ptr, addr, 1, out, 0, ffi.NULL)
        if rc != 1:
            raise FabricError("fi_av_insert", rc if rc < 0 else -lib.FI_EAVAIL)
        self._cache[addr] = int(out[0])
        return int(out[0])


_SHM_CLEARED_FOR = 0  # the pid whose stale shm regions were cleared (once per process)


def clear_stale_shm(shm_dir: str = "/dev/shm") -> list[str]:
    """Remove shared-memory regions left under this process's pid by a killed process.

    The shm provider names an endpoint's region ``<pid>:<n>:<m>`` and ``fi_enable`` fails with
    EBUSY when one of that name exists: a process killed with its endpoints open leaves them,
    and a later process given the same pid (a restarted node on a busy host) could not open
    its endpoint. Before this process's first shm endpoint every such name is stale. Returns
    the names removed."""
    global _SHM_CLEARED_FOR
    me = os.getpid()
    if _SHM_CLEARED_FOR == me:
        return []
    _SHM_CLEARED_FOR = me
    removed = []
    with contextlib.suppress(OSError):
        for name in os.listdir(shm_dir):
            if re.fullmatch(rf"{me}:\d+:\d+", name):
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(shm_dir, name))
                    removed.append(name)
    return removed


class Endpoint(_Fid):
    def __init__(self, domain: Domain, cq: CompletionQueue, av: AddressVector) -> None:
        if domain.info.provider.startswith("shm"):
            clear_stale_shm()
        out = ffi.new("struct fid_ep **")
        check("fi_endpoint", lib.fi_endpoint(domain.ptr, domain.info.raw.ptr, out, ffi.NULL))
        self._ptr = out[0]
        check("fi_ep_bind(av)", lib.fi_ep_bind(self._ptr, av._fid(), 0))
        check("fi_ep_bind(cq)",
              lib.fi_ep_bind(self._ptr, cq._fid(), lib.FI_TRANSMIT | lib.FI_RECV))
        check("fi_enable", lib.fi_enable(self._ptr))

    @property
    def ptr(self) -> Any:
        return self._ptr

    def name(self) -> bytes:
        n = ffi.new("size_t *", 256)
        buf = ffi.new("char[256]")
        check("fi_getname", lib.fi_getname(self._fid(), buf, n))
        return bytes(ffi.buffer(buf, n[0]))


FI_ENOKEY = 266  # rdma/fi_errno.h: a requested key is in use (not in the cffi module)

# What a registration allows (``MemoryRegion(access=...)``). Never FI_READ/FI_REMOTE_READ:
# nothing here reads remote memory, so no peer may read ours.
ACCESS = {
    "source": "FI_WRITE",  # what this side writes from: no remote access at all
    "target": "FI_REMOTE_WRITE",  # what peers write into
    "both": "FI_WRITE|FI_REMOTE_WRITE",
}


def access_flags(access: str) -> int:
    if access not in ACCESS:
        raise ValueError(f"registration access must be one of {', '.join(ACCESS)}, got {access!r}")
    flags = 0
    for name in ACCESS[access].split("|"):
        flags |= int(getattr(lib, name))
    return flags


class MemoryRegion(_Fid):
    """A registered range [addr, addr + length). ``key`` is read back from the provider:
    the provider's, or a random one (``Domain.new_key``); ``access`` is a key of ``ACCESS``."""

    def __init__(
        self, domain: Domain, addr: int, length: int, ep: Endpoint | None = None,
        iface: int = 0, device: int = 0, access: str = "both",
    ) -> None:
        info = domain.info
        flags = access_flags(access)
        out = ffi.new("struct fid_mr **")
        for _ in range(8):  # a random key may clash with one of this domain (-FI_ENOKEY)
            rc = lib.dg_mr_regattr(domain.ptr, ffi.cast("void *", addr), length, flags,
                                   domain.new_key(), iface, device, out)
            if rc != -FI_ENOKEY or info.prov_key:
                break
        check("fi_mr_regattr", rc)
        self._ptr = out[0]
        self.access = access
        if info.mr_endpoint and ep is not None:
            check("fi_mr_bind", lib.fi_mr_bind(self._ptr, ep._fid(), 0))
            check("fi_mr_enable", lib.fi_mr_enable(self._ptr))
        self.addr = addr
        self.length = length
        self.key = int(lib.fi_mr_key(self._ptr))
        self.desc = lib.fi_mr_desc(self._ptr)
        # Where remote addresses start: the virtual address, or 0 when the provider uses offsets.
        self.remote_base = addr if info.virt_addr else 0

    @property
    def ptr(self) -> Any:
        return self._ptr


def pid() -> int:
    return os.getpid()


def discover(provider: str | None = "tcp", node: str | None = "127.0.0.1",
             source: bool = False) -> FabricInfo:
    """The first RDM/RMA-capable interface of ``provider`` ("tcp", "shm", "net", "verbs", ...);
    with ``source``, bound to the local address ``node``."""
    infos = getinfo(provider, node, source=source)
    if not infos:
        raise FabricError(f"fi_getinfo(provider={provider!r})", -lib.FI_ENODATA)
    usable = [i for i in infos if i.cq_data_size >= 4]
    if not usable:
        raise FabricError(f"{provider}: no interface carries remote CQ data", -lib.FI_ENOSYS)
    return usable[0]
