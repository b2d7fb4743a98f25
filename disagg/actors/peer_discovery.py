"""Re-resolves ``dns:NAME:PORT`` peer entries and reports the peers that came and went.

Owned by the decode messenger (``--prefill-peer``) and the router (``--decode-peer``): every
``interval`` seconds each name is resolved (``loop.getaddrinfo``, bounded by
``RESOLVE_TIMEOUT_S``) to all of its addresses; ``disagg.remote.discovery.PeerSet`` turns
them into peer addresses and a diff, handed to ``on_change(appeared, vanished)``. A failed
or timed-out resolution keeps the name's last known set and logs a warning (once per run of
failures); nothing here ever stops the loop.

Test hook (tests only): ``DISAGG_TEST_RESOLVER=FILE.json`` replaces DNS with a JSON object
mapping names to lists of IP addresses, read again at every resolution; a name missing
from it (or a file that does not parse) is a failed resolution.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
from collections.abc import Awaitable, Callable
from pathlib import Path

from disagg.config import env
from disagg.remote.discovery import DnsName, PeerSet

log = logging.getLogger(__name__)

RESOLVE_TIMEOUT_S = 5.0

Resolver = Callable[[str, int], Awaitable[list[str]]]  # (host, port) -> IP addresses
OnChange = Callable[[list[str], list[str]], Awaitable[None]]  # (appeared, vanished)


async def dns_resolver(host: str, port: int) -> list[str]:
    """Every address ``host`` resolves to (A and AAAA records)."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return [str(info[4][0]) for info in infos]


def file_resolver(path: str) -> Resolver:
    """Test hook: resolve from the JSON file at ``path`` (see the module docstring)."""

    async def resolve(host: str, port: int) -> list[str]:
        try:
            table = json.loads(Path(path).read_text())
        except ValueError as e:
            raise OSError(f"test resolver file {path}: {e}") from None
        if host not in table:
            raise socket.gaierror(socket.EAI_NONAME, f"{host} not in test resolver {path}")
        return [str(ip) for ip in table[host]]

    return resolve


def default_resolver() -> Resolver:
    path = env("TEST_RESOLVER")
    return file_resolver(path) if path else dns_resolver


class PeerDiscovery:
    """``names`` (with the ``static`` peers, never removed) resolved every ``interval``
    seconds; each change goes to ``on_change``."""

    def __init__(self, names: list[DnsName], static: list[str], on_change: OnChange,
                 interval: float = 10.0, resolver: Resolver | None = None,
                 timeout: float = RESOLVE_TIMEOUT_S):
        self.names = names
        self.peers = PeerSet(static, names)
        self.on_change = on_change
        self.interval = interval
        self.resolver = resolver or default_resolver()
        self.timeout = timeout
        self.failing: set[DnsName] = set()  # names whose last resolution failed

    async def run(self) -> None:
        """Loop: 1. resolve every name, report the changes; 2. sleep ``interval``."""
        while True:
            try:
                await self.resolve_once()
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug in a callback: logged, the next round tries again
                log.exception("peer discovery round failed")
            await asyncio.sleep(self.interval)

    async def resolve_once(self) -> None:
        for name in self.names:
            ips: list[str] | None
            try:
                ips = await asyncio.wait_for(self.resolver(name.host, name.port), self.timeout)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - gaierror, timeout, ...: keep the last set
                ips = None
                why = "timed out" if isinstance(e, asyncio.TimeoutError) else str(e)
                (log.debug if name in self.failing else log.warning)(
                    "could not resolve %s (%s); keeping its last %d peer(s)", name, why,
                    len(self.peers.resolved[name]))
                self.failing.add(name)
            if ips is not None and name in self.failing:
                self.failing.discard(name)
                log.info("%s resolves again", name)
            appeared, vanished = self.peers.update(name, ips)
            if appeared or vanished:
                log.info("%s: peers appeared %s, vanished %s", name, appeared, vanished)
                await self.on_change(appeared, vanished)
