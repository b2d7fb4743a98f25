"""Peers that come and go: the pure half of DNS discovery (no sockets, no clock, no asyncio).

``--prefill-peer`` and ``--decode-peer`` take a ZeroMQ address (static, used as given) or
``dns:NAME:PORT``: every address NAME resolves to (a Kubernetes headless Service: one A/AAAA
record per ready pod), at PORT, re-resolved periodically. ``PeerSet`` holds the static
addresses and each name's last resolved set; fed a resolution (or a failure: the last known
set stays), it says which peer addresses appeared and which vanished. The resolving itself
is injected (``disagg.actors.peer_discovery``). What an entry may be (``DnsName``,
``parse_peer_spec``, ``split_specs``) is ``disagg.peer_specs``, re-exported here.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable

# the entries' syntax lives at the bottom layer, beside the config that validates them
from disagg.peer_specs import DNS_PREFIX, DnsName, parse_peer_spec, split_specs

__all__ = ["DNS_PREFIX", "DnsName", "PeerSet", "diff", "parse_peer_spec", "peer_address",
           "split_specs"]


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
