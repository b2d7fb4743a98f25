"""Node topology from sysfs: pair each GPU with its nearest NICs and CPUs (SEED 20).

Reads only files under ``root`` (``/`` normally; a fake tree in tests):
``sys/bus/pci/devices/*/{class,vendor,numa_node,local_cpulist}`` for GPUs and NICs,
``sys/class/infiniband/*/device`` and ``sys/class/net/*/device`` for NIC names, and
``sys/devices/system/node/node*/cpulist`` for NUMA nodes. Distance follows the PCIe tree:
same switch < same root complex < same NUMA node < across nodes (nvidia-smi's PIX/PXB/NODE/SYS).
"""

from __future__ import annotations

import hashlib
import heapq
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

GPU_VENDORS = {"0x10de", "0x1002"}  # NVIDIA, AMD
DISPLAY_CLASSES = ("0x0300", "0x0302")  # VGA, 3D controller
NET_CLASSES = ("0x0200", "0x0207")  # Ethernet, InfiniBand


def parse_cpulist(text: str) -> list[int]:
    """'0-3,8,10-11' -> [0, 1, 2, 3, 8, 10, 11]."""
    cpus: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        if "-" in part:
            a, b = part.split("-", 1)
            cpus.extend(range(int(a), int(b) + 1))
        else:
            cpus.append(int(part))
    return cpus


@dataclass(frozen=True)
class PciDevice:
    bdf: str  # "0000:1b:00.0"
    path: tuple[str, ...]  # PCIe ancestry from the root complex, ending with bdf
    numa: int  # -1 when the platform does not say
    cpus: tuple[int, ...]  # local_cpulist
    names: tuple[str, ...] = ()  # "mlx5_0", "eth0", ... (NICs)


@dataclass
class Topology:
    gpus: list[PciDevice] = field(default_factory=list)
    nics: list[PciDevice] = field(default_factory=list)
    numa_cpus: dict[int, list[int]] = field(default_factory=dict)


@dataclass(frozen=True)
class Affinity:
    gpu: str
    nics: tuple[str, ...]  # nearest NIC names (RDMA name where present), best first
    cpus: tuple[int, ...]
    numa: int


def _read(p: Path, default: str = "") -> str:
    try:
        return p.read_text().strip()
    except OSError:
        return default


def _pci_device(root: Path, dev: Path, names: tuple[str, ...] = ()) -> PciDevice:
    real = Path(os.path.realpath(dev))
    parts = real.parts
    # Ancestry: every path component that looks like a PCI address, from the root complex.
    path = tuple(p for p in parts if p.startswith("pci") or (p.count(":") == 2 and "." in p))
    numa = int(_read(dev / "numa_node", "-1") or -1)
    cpus = tuple(parse_cpulist(_read(dev / "local_cpulist")))
    return PciDevice(real.name, path, numa, cpus, names)


def read_topology(root: str | Path = "/") -> Topology:
    root = Path(root)
    topo = Topology()
    pci = root / "sys/bus/pci/devices"
    for dev in sorted(pci.glob("*")) if pci.is_dir() else []:
        cls = _read(dev / "class")
        if _read(dev / "vendor") in GPU_VENDORS and cls.startswith(DISPLAY_CLASSES):
            topo.gpus.append(_pci_device(root, dev))
    nic_names: dict[str, list[str]] = {}
    nic_dev: dict[str, Path] = {}
    for cls_dir in ("infiniband", "net"):
        base = root / "sys/class" / cls_dir
        for entry in sorted(base.glob("*")) if base.is_dir() else []:
            dev = entry / "device"
            if not dev.exists():
                continue  # virtual interface (lo, bridges)
            bdf = Path(os.path.realpath(dev)).name
            nic_names.setdefault(bdf, []).append(entry.name)
            nic_dev.setdefault(bdf, dev)
    for bdf, dev in nic_dev.items():
        topo.nics.append(_pci_device(root, dev, tuple(nic_names[bdf])))
    nodes = root / "sys/devices/system/node"
    for node in sorted(nodes.glob("node[0-9]*")) if nodes.is_dir() else []:
        topo.numa_cpus[int(node.name[4:])] = parse_cpulist(_read(node / "cpulist"))
    return topo


def pci_distance(a: PciDevice, b: PciDevice) -> int:
    """0: same switch (PIX), 1: same root complex (PXB), 2: same NUMA node, 3: across nodes."""
    common = 0
    for x, y in zip(a.path[:-1], b.path[:-1], strict=False):
        if x != y:
            break
        common += 1
    if common >= 2:  # root complex + a shared bridge/switch
        return 0
    if common == 1:  # same root complex only
        return 1
    if a.numa == b.numa:
        return 2
    return 3


def pair_gpus(topo: Topology) -> list[Affinity]:
    """For each GPU, its nearest NICs (ties kept, in name order) and its local CPUs."""
    out = []
    for g in topo.gpus:
        ranked = sorted(topo.nics, key=lambda n: (pci_distance(g, n), n.bdf))
        best = [n for n in ranked if pci_distance(g, n) == pci_distance(g, ranked[0])] if ranked else []
        cpus = g.cpus or tuple(topo.numa_cpus.get(g.numa, []))
        out.append(Affinity(g.bdf, tuple(n.names[0] for n in best), tuple(cpus), g.numa))
    return out


def stripe(lengths: list[int], lanes: int, first: int = 0) -> list[int]:
    """Assign writes to ``lanes`` NICs/endpoints, greedy least-loaded by bytes, ties to the
    lane soonest from ``first`` on (pure, stable). Equal lengths (the usual page runs) make
    it round robin from ``first``."""
    if lanes <= 0:
        raise ValueError("need at least one lane")
    if not lengths or min(lengths) == max(lengths):
        return [(first + i) % lanes for i in range(len(lengths))]
    heap = [(0, i) for i in range(lanes)]  # (bytes so far, lanes after first): a valid heap
    out = []
    for n in lengths:
        load, k = heap[0]
        heapq.heapreplace(heap, (load + n, k))
        out.append((first + k) % lanes)
    return out


def first_lane(imm: int, offset: int, lanes: int) -> int:
    """The lane a batch of writes starts on (``stripe``'s ``first``): drawn from its immediate
    (the request's key) and its first destination offset, so that batches of one write, or
    of fewer writes than lanes, do not all leave on lane 0 (SEED.md 29: a random NIC per
    transfer); deterministic, so tests can check it."""
    if lanes <= 1:
        return 0
    h = hashlib.blake2b(f"{imm}:{offset}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") % lanes


def _bdf_key(bdf: str) -> str:
    """'00000000:1B:00.0' (nvidia-smi, CUDA) and '0000:1b:00.0' (sysfs) name one device."""
    parts = bdf.lower().split(":")
    if len(parts) != 3:
        return bdf.lower()
    dom, bus, devfn = parts
    return f"{int(dom, 16):04x}:{bus}:{devfn}"


def nearest_nic_names(topo: Topology, gpu_bdf: str) -> tuple[str, ...]:
    """Every name (RDMA device and netdev) of the NICs nearest the GPU at ``gpu_bdf``, nearest
    first; empty if the GPU or the NICs are unknown."""
    key = _bdf_key(gpu_bdf)
    gpu = next((g for g in topo.gpus if _bdf_key(g.bdf) == key), None)
    if gpu is None or not topo.nics:
        return ()
    ranked = sorted(topo.nics, key=lambda n: (pci_distance(gpu, n), n.bdf))
    best = pci_distance(gpu, ranked[0])
    return tuple(name for n in ranked if pci_distance(gpu, n) == best for name in n.names)


MAX_LANES = 16


def lane_domains(domains: Sequence[str], lanes: int, nearest: Sequence[str] = ()) -> list[int]:
    """Which of the interfaces (``fi_info`` domain names, in discovery order) each lane uses:
    distinct domains first, those named in ``nearest`` (best first) ahead of the rest, then
    round robin when there are more lanes than domains. Pure."""
    if lanes < 1 or lanes > MAX_LANES:
        raise ValueError(f"lanes must be 1..{MAX_LANES}, got {lanes}")
    if not domains:
        raise ValueError("no interface to put lanes on")
    first: dict[str, int] = {}
    for i, d in enumerate(domains):
        first.setdefault(d, i)
    rank = {name: r for r, name in enumerate(nearest)}
    order = sorted(first, key=lambda d: (rank.get(d, len(rank)), first[d]))
    return [first[order[i % len(order)]] for i in range(lanes)]
