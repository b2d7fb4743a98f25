"""Peers that come and go: the pure half of DNS discovery (no sockets, no clock, no asyncio).

``--prefill-peer`` and ``--decode-peer`` take a ZeroMQ address (static, used as given) or
``dns:NAME:PORT``: every address NAME resolves to (a Kubernetes headless Service: one A/AAAA
record per ready pod), at PORT, re-resolved periodically. ``PeerSet`` holds the static
addresses and each name's last resolved set; fed a resolution (or a failure: the last known
set stays), it says which peer addresses appeared and which vanished. The resolving itself
is injected (``disagg.actors.peer_discovery``).
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable
from dataclasses import dataclass

DNS_PREFIX = "dns:"
_LABEL = re.compile(r"^[A-Za-z0-9_]([A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?$")


@dataclass(frozen=True)
class DnsName:
    """``dns:NAME:PORT``: every address of ``host``, at ``port``."""

    host: str
    port: int

    def __str__(self) -> str:
        return f"{DNS_PREFIX}{self.host}:{self.port}"


def parse_peer_spec(spec: str, flag: str = "--prefill-peer") -> str | DnsName:
    """A static ZeroMQ address (returned as given) or a ``DnsName``; ValueError naming
    ``flag`` for a malformed ``dns:`` entry."""
    if not spec.startswith(DNS_PREFIX):
        if not spec:
            raise ValueError(f"{flag}: empty address")
        return spec
    usage = f"{flag} {spec!r}: expected dns:NAME:PORT (e.g. dns:prefill.my-ns.svc:6000)"
    host, sep, port_text = spec[len(DNS_PREFIX):].rpartition(":")
    if not sep or not host:
        raise ValueError(usage)
    if not port_text.isdigit() or not 1 <= int(port_text) <= 65535:
        raise ValueError(f"{usage}; the port must be a number in 1..65535, got {port_text!r}")
    name = host[:-1] if host.endswith(".") else host
    if len(name) > 253 or not all(_LABEL.match(label) for label in name.split(".")):
        raise ValueError(f"{usage}; {host!r} is not a DNS name (an address goes as "
                         "tcp://HOST:PORT)")
    return DnsName(name, int(port_text))


def split_specs(specs: Iterable[str], flag: str = "--prefill-peer") -> tuple[list[str],
                                                                           list[DnsName]]:
    """(static addresses, DNS names) of a repeatable peer flag; ValueError for a malformed
    entry or one given twice."""
    static: list[str] = []
    names: list[DnsName] = []
    for spec in specs:
        parsed = parse_peer_spec(spec, flag)
        if parsed in static or parsed in names:
            raise ValueError(f"{flag} {spec!r} given twice")
        if isinstance(parsed, DnsName):
            names.append(parsed)
        else:
            static.append(parsed)
    return static, names


def peer_address(ip: str, port: int) -> str:
    """The ZeroMQ address of a resolved ``ip`` (IPv6 in brackets); ValueError if ``ip`` is
    not an IP address."""
    addr = ipaddress.ip_address(ip.split("%", 1)[0])
    host = f"[{ip}]" if addr.version == 6 else ip
    return f"tcp://{host}:{port}"


def diff(old: Iterable[str], new: Iterable[str]) -> tuple[list[str], list[str]]:
    """(appeared, vanished) going from ``old`` to ``new``, each sorted."""
    before, after = set(old), set(new)
    return sorted(after - before), sorted(before - after)


class PeerSet:
    """The static peers plus each name's last resolved addresses; a peer is in the set while
    any source names it."""

    def __init__(self, static: Iterable[str], names: Iterable[DnsName]):
        self.static = list(static)
        self.resolved: dict[DnsName, set[str]] = {n: set() for n in names}

    def current(self) -> set[str]:
        return set(self.static).union(*self.resolved.values())

    def update(self, name: DnsName, ips: Iterable[str] | None) -> tuple[list[str], list[str]]:
        """``name`` resolved to ``ips`` (None: the resolution failed, its last known set
        stays). Returns (appeared, vanished) for the whole set. Entries that are not IP
        addresses are ignored."""
        if ips is None:
            return [], []
        before = self.current()
        found = set()
        for ip in ips:
            try:
                found.add(peer_address(ip, name.port))
            except ValueError:
                continue
        self.resolved[name] = found
        return diff(before, self.current())
