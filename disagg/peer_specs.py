"""What a ``--prefill-peer`` / ``--decode-peer`` entry may be (pure: no sockets, no DNS lookup).

A static ZeroMQ address (used as given) or ``dns:NAME:PORT``: every address NAME resolves to,
at PORT (``disagg.remote.discovery`` keeps the resolved sets). The config validates its peer
lists with ``split_specs``; it sits at the bottom of the layers, beside ``disagg.config``.
"""

from __future__ import annotations

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
