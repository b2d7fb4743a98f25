"""Peers that come and go: ``dns:NAME:PORT`` parsing, resolved sets and their diffs
(disagg.remote.discovery), and the resolving loop with an injected resolver
(disagg.actors.peer_discovery)."""

from __future__ import annotations

import asyncio
import json
import socket

import pytest

from disagg.actors.peer_discovery import PeerDiscovery, default_resolver, file_resolver
from disagg.remote.discovery import (
    DnsName,
    PeerSet,
    diff,
    parse_peer_spec,
    peer_address,
    split_specs,
)
from disagg.serving.routing import LoadBalancer

NAME = DnsName("prefill.my-ns.svc", 6000)


def test_static_addresses_pass_through_and_dns_entries_parse():
    assert parse_peer_spec("tcp://127.0.0.1:6000") == "tcp://127.0.0.1:6000"
    assert parse_peer_spec("dns:prefill.my-ns.svc:6000") == NAME
    assert parse_peer_spec("dns:prefill.my-ns.svc.:6000") == NAME  # absolute name
    assert parse_peer_spec("dns:localhost:1") == DnsName("localhost", 1)
    assert str(NAME) == "dns:prefill.my-ns.svc:6000"
    static, names = split_specs(["tcp://a:1", "dns:p.svc:6000", "ipc:///tmp/x", "dns:q:7"])
    assert static == ["tcp://a:1", "ipc:///tmp/x"]
    assert names == [DnsName("p.svc", 6000), DnsName("q", 7)]


@pytest.mark.parametrize("spec, why", [
    ("dns:", "expected dns:NAME:PORT"),
    ("dns:prefill.svc", "expected dns:NAME:PORT"),
    ("dns::6000", "expected dns:NAME:PORT"),
    ("dns:prefill.svc:", "port must be a number"),
    ("dns:prefill.svc:http", "port must be a number"),
    ("dns:prefill.svc:0", "port must be a number"),
    ("dns:prefill.svc:65536", "port must be a number"),
    ("dns:prefill..svc:6000", "is not a DNS name"),
    ("dns:pre fill:6000", "is not a DNS name"),
    ("dns:-prefill:6000", "is not a DNS name"),
    ("dns:[::1]:6000", "is not a DNS name"),
    ("dns:" + "a" * 64 + ":6000", "is not a DNS name"),
    ("", "empty address"),
])
def test_malformed_entries_are_refused_naming_the_flag(spec, why):
    with pytest.raises(ValueError, match=why) as e:
        parse_peer_spec(spec, "--decode-peer")
    assert "--decode-peer" in str(e.value)


def test_an_entry_given_twice_is_refused():
    with pytest.raises(ValueError, match="given twice"):
        split_specs(["dns:p:1", "dns:p:1"])
    with pytest.raises(ValueError, match="given twice"):
        split_specs(["tcp://a:1", "tcp://a:1"])


def test_resolved_addresses_become_tcp_peer_addresses():
    assert peer_address("10.1.2.3", 6000) == "tcp://10.1.2.3:6000"
    assert peer_address("fd00::5", 6000) == "tcp://[fd00::5]:6000"
    with pytest.raises(ValueError):
        peer_address("not-an-ip", 6000)


def test_diff():
    assert diff({"a", "b"}, {"b", "c", "d"}) == (["c", "d"], ["a"])
    assert diff([], []) == ([], [])


def test_peer_set_tracks_each_name_and_keeps_the_last_set_on_failure():
    other = DnsName("other", 7000)
    ps = PeerSet(["tcp://10.0.0.9:6000"], [NAME, other])
    assert ps.current() == {"tcp://10.0.0.9:6000"}
    assert ps.update(NAME, ["10.0.0.1", "10.0.0.2", "10.0.0.1"]) == (
        ["tcp://10.0.0.1:6000", "tcp://10.0.0.2:6000"], [])
    assert ps.update(NAME, None) == ([], [])  # failed: nothing vanishes
    assert len(ps.current()) == 3
    # one goes, one comes; a static address resolved too never vanishes with the name
    assert ps.update(NAME, ["10.0.0.2", "10.0.0.3", "10.0.0.9"]) == (
        ["tcp://10.0.0.3:6000"], ["tcp://10.0.0.1:6000"])
    assert ps.update(NAME, []) == ([], ["tcp://10.0.0.2:6000", "tcp://10.0.0.3:6000"])
    assert ps.current() == {"tcp://10.0.0.9:6000"}
    # another name with the same address at another port is another peer; junk is ignored
    assert ps.update(other, ["10.0.0.9", "garbage"]) == (["tcp://10.0.0.9:7000"], [])


async def test_discovery_reports_changes_and_survives_failures_and_timeouts():
    answers: list = [["10.0.0.1"], socket.gaierror(socket.EAI_AGAIN, "try again"), "hang",
                     ["10.0.0.2", "10.0.0.1"], []]
    changes: list[tuple[list[str], list[str]]] = []

    async def resolver(host: str, port: int) -> list[str]:
        assert (host, port) == ("prefill.my-ns.svc", 6000)
        a = answers.pop(0)
        if a == "hang":
            await asyncio.sleep(60)
        if isinstance(a, Exception):
            raise a
        return a

    async def on_change(appeared: list[str], vanished: list[str]) -> None:
        changes.append((appeared, vanished))

    d = PeerDiscovery([NAME], [], on_change, interval=0.01, resolver=resolver, timeout=0.05)
    for _ in range(5):
        await d.resolve_once()
    assert changes == [(["tcp://10.0.0.1:6000"], []), (["tcp://10.0.0.2:6000"], []),
                       ([], ["tcp://10.0.0.1:6000", "tcp://10.0.0.2:6000"])]


async def test_the_loop_keeps_going_when_a_callback_fails():
    calls = 0

    async def resolver(host: str, port: int) -> list[str]:
        return [f"10.0.0.{calls + 1}"]

    async def on_change(appeared: list[str], vanished: list[str]) -> None:
        nonlocal calls
        calls += 1
        raise RuntimeError("boom")

    d = PeerDiscovery([NAME], [], on_change, interval=0.01, resolver=resolver)
    task = asyncio.ensure_future(d.run())
    await asyncio.sleep(0.2)
    task.cancel()
    assert calls >= 2


async def test_the_test_resolver_file_is_read_at_every_resolution(tmp_path, monkeypatch):
    path = tmp_path / "dns.json"
    path.write_text(json.dumps({"prefill.test": ["127.0.0.2"]}))
    monkeypatch.setenv("DISAGG_TEST_RESOLVER", str(path))
    resolve = default_resolver()
    assert await resolve("prefill.test", 6000) == ["127.0.0.2"]
    path.write_text(json.dumps({"prefill.test": ["127.0.0.2", "127.0.0.3"]}))
    assert await resolve("prefill.test", 6000) == ["127.0.0.2", "127.0.0.3"]
    with pytest.raises(socket.gaierror):
        await resolve("decode.test", 6000)
    path.write_text("{not json")
    with pytest.raises(OSError):
        await file_resolver(str(path))("prefill.test", 6000)


async def test_the_real_resolver_finds_localhost():
    d = PeerDiscovery([DnsName("localhost", 6000)], [], _ignore)
    await d.resolve_once()  # loop.getaddrinfo; a failure would only log a warning
    assert d.peers.current() <= {"tcp://127.0.0.1:6000", "tcp://[::1]:6000"}


async def _ignore(appeared: list[str], vanished: list[str]) -> None:
    pass


def test_the_router_balancer_adds_and_removes_peers():
    with pytest.raises(ValueError):
        LoadBalancer([])
    lb = LoadBalancer([], dynamic=True)
    assert lb.pick() is None
    assert lb.add("a") and lb.add("b") and not lb.add("a")
    lb.on_stats("a", 0, 0, 0.0)
    lb.on_stats("b", 0, 0, 0.0)
    assert sorted(lb.pick() for _ in range(2)) == ["a", "b"]  # ties rotate
    lb.on_start("a")
    lb.remove("a")
    lb.on_end("a")  # a late end of a request on a forgotten peer is ignored
    assert lb.alive() == ["b"] and [lb.pick() for _ in range(3)] == ["b"] * 3


def test_the_flags_take_dns_entries_and_refuse_malformed_ones(monkeypatch, capsys):
    from disagg.cli import node as cli
    from disagg.config import ConfigError

    def cfg(*argv: str):
        return cli.config_from_args(cli.build_parser().parse_args(["--role", "decode", *argv]))

    c = cfg("--prefill-peer", "tcp://10.0.0.1:6000", "--prefill-peer", "dns:p.svc:6000",
            "--peer-resolve-interval", "2.5")
    assert c.disagg.prefill_peers == ["tcp://10.0.0.1:6000", "dns:p.svc:6000"]
    assert c.disagg.peer_resolve_interval_s == 2.5
    assert cfg("--prefill-peer", "dns:p.svc:6000").disagg.peer_resolve_interval_s == 10.0
    with pytest.raises(ConfigError, match="--prefill-peer 'dns:p.svc': expected dns:NAME:PORT"):
        cfg("--prefill-peer", "dns:p.svc")
    with pytest.raises(ConfigError, match="--peer-resolve-interval must be > 0"):
        cfg("--prefill-peer", "dns:p.svc:1", "--peer-resolve-interval", "0")
    monkeypatch.setattr("disagg.log.setup_logging", lambda *a, **k: None)
    with pytest.raises(SystemExit) as e:
        cli.main(["--role", "router", "--decode-peer", "dns:d.svc:http"])
    assert e.value.code == 2 and "--decode-peer 'dns:d.svc:http'" in capsys.readouterr().err
