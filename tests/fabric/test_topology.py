"""Topology against a fake sysfs tree: two NUMA nodes, a GPU and a NIC behind each switch."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from disagg.fabric.topology import (
    first_lane,
    lane_domains,
    nearest_nic_names,
    pair_gpus,
    parse_cpulist,
    pci_distance,
    read_topology,
    stripe,
)


def make_dev(root: Path, chain: list[str], cls: str, vendor: str, numa: int, cpus: str) -> Path:
    d = root / "sys/devices" / Path(*chain)
    d.mkdir(parents=True)
    (d / "class").write_text(cls + "\n")
    (d / "vendor").write_text(vendor + "\n")
    (d / "numa_node").write_text(f"{numa}\n")
    (d / "local_cpulist").write_text(cpus + "\n")
    link = root / "sys/bus/pci/devices" / chain[-1]
    link.parent.mkdir(parents=True, exist_ok=True)
    os.symlink(d, link)
    return d


def link_class(root: Path, cls: str, name: str, dev: Path) -> None:
    e = root / "sys/class" / cls / name
    e.mkdir(parents=True)
    os.symlink(dev, e / "device")


def fake_tree(root: Path) -> None:
    # Node 0: root complex pci0000:00, switch 0000:00:01.0 with GPU 01:00.0 and NIC 02:00.0.
    # Node 1: root complex pci0000:80, switch 0000:80:01.0 with GPU 81:00.0 and NICs 82:00.0,
    # 82:00.1; plus an Ethernet NIC on node 1's other root port.
    sw0 = ["pci0000:00", "0000:00:01.0", "0000:01:00.0"]
    g0 = make_dev(root, sw0, "0x030200", "0x10de", 0, "0-7")
    assert g0
    n0 = make_dev(root, ["pci0000:00", "0000:00:01.0", "0000:02:00.0"], "0x020700", "0x15b3", 0, "0-7")
    make_dev(root, ["pci0000:80", "0000:80:01.0", "0000:81:00.0"], "0x030200", "0x10de", 1, "8-15")
    n1 = make_dev(root, ["pci0000:80", "0000:80:01.0", "0000:82:00.0"], "0x020700", "0x15b3", 1, "8-15")
    n2 = make_dev(root, ["pci0000:80", "0000:80:01.0", "0000:82:00.1"], "0x020700", "0x15b3", 1, "8-15")
    eth = make_dev(root, ["pci0000:80", "0000:80:03.0", "0000:85:00.0"], "0x020000", "0x8086", 1, "8-15")
    link_class(root, "infiniband", "mlx5_0", n0)
    link_class(root, "infiniband", "mlx5_1", n1)
    link_class(root, "infiniband", "mlx5_2", n2)
    link_class(root, "net", "ib0", n0)
    link_class(root, "net", "eth0", eth)
    (root / "sys/class/net/lo").mkdir(parents=True)  # virtual: no device link
    for node, cpus in ((0, "0-7"), (1, "8-15")):
        d = root / f"sys/devices/system/node/node{node}"
        d.mkdir(parents=True)
        (d / "cpulist").write_text(cpus + "\n")


def test_pairs_gpus_with_nearest_nics_and_cpus(tmp_path: Path) -> None:
    fake_tree(tmp_path)
    topo = read_topology(tmp_path)
    assert [g.bdf for g in topo.gpus] == ["0000:01:00.0", "0000:81:00.0"]
    assert sorted(n.names[0] for n in topo.nics) == ["eth0", "mlx5_0", "mlx5_1", "mlx5_2"]
    assert topo.numa_cpus == {0: list(range(8)), 1: list(range(8, 16))}
    aff = {a.gpu: a for a in pair_gpus(topo)}
    assert aff["0000:01:00.0"].nics == ("mlx5_0",)
    assert aff["0000:81:00.0"].nics == ("mlx5_1", "mlx5_2")  # both behind its switch
    g0, g1 = topo.gpus
    by = {n.names[0]: n for n in topo.nics}
    assert [pci_distance(g1, by[k]) for k in ("mlx5_1", "eth0", "mlx5_0")] == [0, 1, 3]
    assert aff["0000:01:00.0"].cpus == tuple(range(8)) and aff["0000:81:00.0"].numa == 1


def test_empty_tree(tmp_path: Path) -> None:
    topo = read_topology(tmp_path)
    assert topo.gpus == [] and topo.nics == [] and pair_gpus(topo) == []


def test_cpulist_and_stripe() -> None:
    assert parse_cpulist("0-3,8,10-11\n") == [0, 1, 2, 3, 8, 10, 11]
    assert parse_cpulist("") == []
    assert stripe([4, 4, 4, 4], 2) == [0, 1, 0, 1]
    assert stripe([8, 1, 1, 1], 2) == [0, 1, 1, 1]
    assert stripe([4, 4, 4], 3, first=2) == [2, 0, 1]  # round robin from the first lane
    assert stripe([8, 1, 1, 1], 2, first=1) == [1, 0, 0, 0]


def test_first_lane_spreads_batches_over_lanes() -> None:
    """A batch's first lane is drawn from its immediate and first offset (SEED.md 29): batches
    of one write, which all left on lane 0, spread over every lane, each on exactly one."""
    key = (3 << 16) | 1
    for lanes in (2, 3, 4):
        got = [first_lane(key, off * 4096, lanes) for off in range(400)]
        assert set(got) == set(range(lanes))
        assert min(got.count(i) for i in range(lanes)) > 400 / lanes / 2  # none starved
        assert got == [first_lane(key, off * 4096, lanes) for off in range(400)]  # seeded
        # a batch striped from its first lane: every write on one lane, lanes even
        lengths = [4096] * 5
        lane_of = stripe(lengths, lanes, first_lane(key, 0, lanes))
        assert len(lane_of) == 5 and set(lane_of) <= set(range(lanes))
        assert max(lane_of.count(i) for i in range(lanes)) - min(
            lane_of.count(i) for i in range(lanes)) <= 1
    assert first_lane(key, 123, 1) == 0


def test_nearest_nic_names_take_cuda_bus_ids(tmp_path: Path) -> None:
    fake_tree(tmp_path)
    topo = read_topology(tmp_path)
    assert nearest_nic_names(topo, "00000000:01:00.0") == ("mlx5_0", "ib0")  # CUDA's form
    assert nearest_nic_names(topo, "0000:81:00.0") == ("mlx5_1", "mlx5_2")
    assert nearest_nic_names(topo, "0000:99:00.0") == ()


def test_lanes_spread_over_interfaces_nearest_first() -> None:
    domains = ["eth0", "mlx5_0", "mlx5_0", "mlx5_1"]  # fi_getinfo order, one domain repeated
    assert lane_domains(domains, 3) == [0, 1, 3]
    assert lane_domains(domains, 2, nearest=("mlx5_1", "mlx5_0")) == [3, 1]
    assert lane_domains(domains, 5, nearest=("mlx5_1",)) == [3, 0, 1, 3, 0]
    assert lane_domains(["lo"], 3) == [0, 0, 0]  # one interface: several endpoints on it
    for bad in (0, 17):
        with pytest.raises(ValueError):
            lane_domains(domains, bad)


def test_lane_flags_validated() -> None:
    from disagg.config import ConfigError, DisaggConfig

    DisaggConfig(fabric_lanes=4).validate()
    for bad, match in ((dict(fabric_lanes=0), "--fabric-lanes"),
                       (dict(fabric_lanes=17), "--fabric-lanes"),
                       (dict(fabric_lanes=2, transfer_backend="cuda-ipc"), "fabric only"),
                       (dict(fabric_stripe_bytes=0), "--fabric-stripe-bytes")):
        with pytest.raises(ConfigError, match=match):
            DisaggConfig(**bad).validate()


def test_stripe_is_greedy_least_loaded_lowest_lane_first() -> None:
    import random

    def greedy(lengths: list[int], lanes: int) -> list[int]:
        load, out = [0] * lanes, []
        for n in lengths:
            lane = min(range(lanes), key=lambda i: (load[i], i))
            load[lane] += n
            out.append(lane)
        return out

    rng = random.Random(0)
    for _ in range(2000):
        lengths = [rng.choice([1, 2, 3, 8, 100]) for _ in range(rng.randint(0, 30))]
        lanes = rng.randint(1, 5)
        assert stripe(lengths, lanes) == greedy(lengths, lanes), (lengths, lanes)
